"""Verification-length policies, run by the worker each step (DESIGN.md steps 3-4).

- `ar`: never verify drafts.   - `fixed`: verify min(K, cap_i) drafts.
- `budget`: vLLM-style adaptive verification: one batch-wide token budget from survival scores and a cost table
  indexed by token count only.
- `hybridspec`: lengths chosen jointly for the goodput of the whole step (its expected tokens over its ms; the
  `rate` variant: expected tokens - R x ms at the goodput R its recent plans expect, scheduler.planner.check_rate,
  not yet measured on a GPU): forward costs measured per batch-size
  bucket and token count (the batch latency model, with tokens, distinct experts, requests and context, where
  none are measured) plus the measured rest of a drafted step and the drafting its longest length implies (the
  drafter's ms by rows, measured: width_plan); one extra token per request up to the first
  MoE router where its measured keep rate pays, kept only where its experts are already covered (router
  correction, workers/model.py MoEContext; ExtraGate, workers/extra_gate.py); a speculation gate
  (SpeculationGate, workers/speculation_gate.py).
Survival comes from the drafter's confidences through the online calibrator. Until the latency model has
seen enough steps it explores with `fixed` lengths (an online start-up profile).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from scheduler.calibration import CALIBRATION_PRIORS, AcceptanceCalibrator
from scheduler.latency_model import (DraftCost, ExpertEstimator, LatencyModel, ModelTokenCost, StepComposition,
                                      TokenCostTable)
from scheduler.planner import Plan, budget_plan, fixed_lengths, survival_from_acceptance, width_plan
from scheduler.planner_torch import distinct_by_tokens_device
from workers.config import ModelConfig
from workers.extra_gate import ExtraGate
from workers.graphs import token_buckets
from workers.speculation_gate import SpeculationGate, nearest_bucket  # noqa: F401 (re-exported)


def width_from() -> int:
    """WIDTH_FROM's value: HYBRIDSPEC_WIDTH_FROM (a batch-size bucket: a power of two >= 1), 8 by default."""
    raw = os.environ.get("HYBRIDSPEC_WIDTH_FROM", "8")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"HYBRIDSPEC_WIDTH_FROM must be a power of two >= 1 (a batch-size bucket), got {raw!r}")
    return n


POLICIES = ("ar", "fixed", "budget", "hybridspec")
# hybridspec's parts that benchmarks can switch off (LengthPolicy.ablate): variant -> parts
ABLATIONS = {"noextra": ("extra",), "nocounts": ("counts",), "lean": ("extra", "counts"), "nogate": ("gate",),
             "nowidth": ("width",), "plain": ("plain",), "ungatedextra": ("extragate",), "margin1": ("margin",),
             "noquiet": ("quiet",), "nocap": ("cap",), "rate": ("rate",), "padfloor": ("padfloor",),
             "bucketprofile": ("bucketprofile",), "padprofile": ("padfloor", "bucketprofile")}
# hybridspec-padfloor (an A/B variant, off by default): the measured cost's floor a token counts the rows a graph step
# pads to (the graphs' token buckets), not the step's tokens: inside one bucket the dense rows are paid whatever the
# plan, and the floor there made filling the 384-row bucket at c=64 look 0.7 ms dearer than the table's own points
# (L=3 chosen where L=5 wins on the same table: bench/NOTES.md 2026-12-07 17:59 item 3; predicted +1.5% at
# c=64 / 0.7; measured on an H200 +0.4%, inside the runs' spread, as bucketprofile's: NOTES 2026-12-07 19:53)
# hybridspec-bucketprofile (an A/B variant, off by default): the start-up profile also times, at each batch size it
# profiles, the uniform blocks that fill a graph token bucket exactly (at 64 requests 3, 6, 12 and 16 tokens a request:
# 192, 384, 768, 1024 rows), so the cost table has a measured point at the top of every bucket a plan may fill, not
# only what served (ragged, wide-drafting) steps left there (bench/NOTES.md 2026-12-07 17:59 item 3: at c=64 the
# 257-384 stretch came from served steps that cost more than fixed4's uniform 320-token step); padprofile: both
PAD_ROWS = tuple(token_buckets(1 << 16)[:-1])  # the graphs' token buckets (the last one, clipped to a limit, left out)


WARMUP_STEPS = 8  # steps of `fixed` exploration before the learned policies take over
# routing statistics change slowly: a fold (host read, the estimator's counts, a new touch table for the planner)
# every 8 steps cost ~0.5 ms a step on the H200 at 40 x 256 (bench/NOTES.md, e2e at 69faaf2); it now comes every
# COUNTS_FOLD_EVERY samples, a sample every COUNTS_SAMPLE_EVERY-th step that carries counts (verification steps)
COUNTS_FOLD_EVERY = 32
COUNTS_SAMPLE_EVERY = 4  # popularity is a sample: one step in four feeds it (a stack and an add on the device)
OVERHEAD_ALPHA = 0.1  # EWMA weight of a drafted step's measured overhead beyond the forward
PROFILE_SCALE_ALPHA = 0.1  # EWMA weight of a served step's ms over the profile's at its token count
EXTRA_KEEP_PRIOR = (2.0, 2.0)  # (kept, sent): the router correction keeps extra tokens until measured otherwise
EXTRA_KEEP_DECAY = 0.98  # per observed step: the keep rate follows the load
# the router correction's extra token only from this batch-size bucket on: below, the batch's other tokens rarely
# cover a token's experts (kept 5-40% at c=1) and sending it cost 3-5% end to end at c=1 (hybridspec vs
# hybridspec-noextra, bench/NOTES.md, ablations at ba5e735 / 58c133e); c=4 was mixed, c>=16 kept 74-88%. Under
# expert parallelism it applies to each rank's own batch (the coverage is the deployment's): a rank with a few
# requests sends none even where the deployment would cover them.
EXTRA_FROM = 8
# ... and only as many as fit in the graph token bucket the plan's step runs in (they take padding rows, whose dense
# work the graph does anyway): at c=16/0.7 (c59f101) extras carried the steps from the 96-token bucket into the
# 128 one, where the whole step cost ~1 ms more than the forward's table said (its jump at 96 was 0.4 ms), and
# hybridspec ran 1.40x ar against 1.46 without the router correction and the served statistics
EXTRA_WITHIN_BUCKET = True
_TOKEN_BUCKETS = token_buckets(1 << 20)  # the graphs' token buckets (below any runner's limit they are these)
# hybridspec drafts only what it may verify: the drafter's block per request at a batch-size bucket is the
# DRAFT_QUANTILE of the longest lengths its last DRAFT_WINDOW plans there chose, plus DRAFT_MARGIN (plans that use
# the margin widen it). It was the longest of the last 32 plans: one long plan then kept every request drafting
# 16 for 32 steps (at c=64 ~7.5 ms of drafting a step against ~3.3 for blocks of 5, e2e at 82e980b,
# bench/NOTES.md). A DFlash-shaped drafter's forward, an autoregressive drafter's steps and the LM head all scale
# with the block: drafting 16 to verify 3 cost budget/hybridspec 0.2-3 ms a step more than fixed4 (e2e at
# fd90476). A margin of 1 (the least that lets plans grow) was no better end to end: hybridspec x ar at c=16/64,
# acceptance 0.7/0.95, margin 1 vs 2: 1.35 / 3.65 / 1.19 / 2.49 vs 1.43 / 3.64 / 1.19 / 2.46 (f46aef2, one run
# each, bench/NOTES.md).
DRAFT_WINDOW, DRAFT_QUANTILE, DRAFT_MARGIN = 16, 0.75, 2
# width_plan's choice of the longest length is a steady-state one: made every WIDTH_EVERY plans per bucket (its
# [C, B K] search cost ~0.15-0.3 ms of host a step on this CPU, ~5x budget_plan's at c=1), the plans in between
# search within it at its overhead
WIDTH_EVERY = 8
# ... and only from this batch-size bucket on. Below it the drafter's forward is latency-bound: its measured ms
# hardly depend on the block (H200 at 32420cd: bucket 1 0.72-0.95 ms over 3-16 rows, scattered, bucket 4 0.92-1.12
# over 20-64 rows, against 0.96-1.52 over 80-256 at bucket 16 and 1.8-5.3 over 240-1024 at 64), so the width's price
# was the drafting table's noise: at c=1 / 0.85 width_plan chose 14 (a 16-row drafting once measured 0.95 ms against
# 0.75 at 14) and plans of ~12, 2.27x ar against 2.35x for hybridspec-nowidth and budget's 2.37 (one call, two runs
# each, bench/NOTES.md 2026-12-02 16:15 session); from c=16 on width pricing gained up to 7-11% (c=16 / 0.85,
# c=64 / 0.7). Buckets below price the measured drafting and the rest of the step as sunk (budget_plan's overhead).
# HYBRIDSPEC_WIDTH_FROM (a power of two >= 1; 1: width_plan at every bucket, as before 3a915b1) for A/B measurement
WIDTH_FROM = width_from()
REST_ALPHA = 0.1  # EWMA weight of a drafted step's ms beyond its forward and its drafting (per batch-size bucket)
# hybridspec-rate plans at the goodput its own recent plans expect (planner.check_rate): per batch size, the EWMAs
# of the decode-only plans' expected tokens and of their predicted ms, this weight a plan; a batch size's first plans
# take the nearest planned batch size's rate scaled to theirs, the very first one maximizes its own ratio. Off by
# default until an end-to-end A/B (bench/length_bound.py predicts +1% at c=1/0.85 with informative confidences, 0
# with uninformative ones; bench/NOTES.md 2026-12-07)
RATE_ALPHA = 0.1
# the calibration maps are rebuilt at most every CALIBRATION_STALE_READS + 1 reads (two a step: the plan's and the
# observation's scoring): rebuilding them before every plan was ~0.25 ms of a learned policy's ~0.3 ms of host plan
# time a step at c=1 on a CPU core (bench/NOTES.md)
CALIBRATION_STALE_READS = 7

# hybridspec's measured step cost rises by at least min(the latency model's ms_per_token, this fraction of the cost
# table's mean rise a token over its span) a token (step_cost)
SLOPE_FLOOR_CHORD = 0.5
SLOPE_MEMO_MAX = 8  # token-count origins (lo) a SlopeFloor keeps its costs for
SLOPE_FLOOR_MIN = 0.25  # ... but at least this fraction of the model's ms_per_token


def calibration_prior() -> str:
    """What each draft position's calibration map is shrunk towards (scheduler/calibration.py): "pooled" (the
    drafter's map over all positions; the default) or "identity" (the raw confidence, as before 2026-12-02);
    HYBRIDSPEC_CALIBRATION_PRIOR chooses, for A/B measurement."""
    prior = os.environ.get("HYBRIDSPEC_CALIBRATION_PRIOR", "pooled")
    if prior not in CALIBRATION_PRIORS:
        raise ValueError(f"HYBRIDSPEC_CALIBRATION_PRIOR must be one of {CALIBRATION_PRIORS}, got {prior!r}")
    return prior


@dataclass
class WidthChoice:
    """hybridspec's choice of its longest length at one batch-size bucket (width_plan): c, the overhead it was
    priced at, plans made since, and whether c was the drafts' limit (censored: a wider block was not on offer)."""

    c: int
    overhead_ms: float
    plans: int = 1
    censored: bool = False


@dataclass(frozen=True)
class SlopeFloor:
    """A token-count cost whose increments are at least `floor` ms a token (cost_ms / costs_ms as TokenCostTable);
    with `rows` (ascending token buckets), at least `floor` ms a padded row: a step of n tokens counts the first bucket
    >= n (n itself past the last), so the floor adds nothing inside a bucket (hybridspec-padfloor)."""

    table: TokenCostTable
    floor: float
    rows: tuple[int, ...] | None = None
    # lo -> the longest costs_ms(lo, hi) computed so far: a shorter hi is its prefix, bit for bit (the table's
    # costs are pointwise and the running max goes left to right), so a plan reads a slice of what the learning
    # computed in advance (LengthPolicy.prime_step_cost) instead of building it on the step's critical path
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def costs_ms(self, lo: int, hi: int) -> np.ndarray:
        """[cost(n) for n in lo..hi]: out[i] = max over j <= i of table[j] + (i - j) floor (a running max; equal to
        the sequential out[i] = max(out[i], out[i-1] + floor) up to the last bits of a float); with rows, (pad(i) -
        pad(j)) floor. A copy: the caller may change it."""
        known = self._memo.get(lo)
        if known is not None and known.shape[0] > hi - lo >= 0:
            return known[:hi - lo + 1].copy()
        out = np.asarray(self.table.costs_ms(lo, hi), dtype=np.float64)
        if self.rows:
            n = np.arange(lo, lo + out.shape[0])  # [hi - lo + 1]
            buckets = np.asarray(self.rows)
            at = np.searchsorted(buckets, n)  # the first bucket >= n
            padded = np.where(at < len(buckets), buckets[np.minimum(at, len(buckets) - 1)], n)
            step = self.floor * padded.astype(np.float64)
        else:
            step = self.floor * np.arange(out.shape[0], dtype=np.float64)
        out = np.maximum.accumulate(out - step) + step
        if len(self._memo) < SLOPE_MEMO_MAX or lo in self._memo:
            self._memo[lo] = out
        return out.copy()

    def cost_ms(self, num_tokens: float) -> float:
        n = int(num_tokens)
        lo = min(self.table.tokens[0], n) if self.table.tokens else n
        return float(self.costs_ms(lo, n)[-1])


class DeviceReadback:
    """Device values on their way to the host without a sync: an async copy into pinned memory and the event after
    it. values() waits for the event; the policy calls it once ready() (runner: after the next step's forward launch,
    where learning is deferred), else at the next step's plan (after that step's drafter has read its tokens back)
    or observation (after its forward), when the copy is done. The pinned buffer and the event come from a free
    list per (dtype, size) and go back to it once values() has read them (a new pinned tensor and a new event were
    ~0.05 ms of host a read-back on the H200 host); one never read (dropped) is simply not reused."""

    _free: dict[tuple, list[tuple[torch.Tensor, "torch.cuda.Event"]]] = {}
    _lock = threading.Lock()  # the free list is the process's (one engine thread today; a lock costs ~0.1 us)
    FREE_MAX = 8  # buffers kept per (dtype, size)

    def __init__(self, values: torch.Tensor):
        flat = values.reshape(-1)
        self._key = (flat.dtype, flat.numel(), flat.device)
        with self._lock:
            free = self._free.get(self._key)
            reused = free.pop() if free else None
        if reused is not None:
            self.host, self.event = reused
        else:
            self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=values.is_cuda)
            self.event = torch.cuda.Event() if values.is_cuda else None
        self.host.copy_(flat, non_blocking=values.is_cuda)
        if self.event is not None:
            self.event.record()
        self._read: list[int] | None = None

    def ready(self) -> bool:
        """Whether values() would not wait."""
        event = self.event  # (read once: values() in another thread may give it back meanwhile)
        return self._read is not None or event is None or event.query()

    def values(self) -> list[int]:
        if self._read is None:
            event = self.event
            if event is not None:  # (waited for outside the lock)
                event.synchronize()
            with self._lock:  # (two readers of one read-back must not both give its buffer back)
                if self._read is None:
                    self._read = [int(x) for x in self.host.tolist()]
                    free = self._free.setdefault(self._key, [])  # read: its buffer and event carry the next one
                    if len(free) < self.FREE_MAX:
                        free.append((self.host, self.event))
                    self.host = self.event = None  # type: ignore[assignment]
        return self._read


@dataclass
class StepObservation:
    tokens_per_request: list[int]
    context_lens: list[int]
    forward_ms: float | None  # None: not a measurement (the step captured a CUDA graph first)
    # per MoE layer (None: not observed; the estimator stands in); a DeviceReadback: still on its way to the
    # host, the step's latency sample is learned when it has arrived (LengthPolicy._settle)
    distinct_experts: list[int] | DeviceReadback | None
    verified: list[tuple[list[float], int, int]] = field(default_factory=list)  # (confidences, verified, accepted)


class LengthPolicy:
    def __init__(self, name: str, config: ModelConfig, max_verify_len: int = 16,
                 device: torch.device | str = "cpu"):
        """`device`: the model's (unused since the policy's tables moved to the host; kept for its callers)."""
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name, self.max_verify_len = name, max_verify_len
        self.num_moe_layers = sum(config.moe_layers)
        self.estimator = ExpertEstimator(max(self.num_moe_layers, 1), max(config.num_experts, 1),
                                         max(config.num_experts_per_tok, 1))
        self.latency = LatencyModel(estimator=self.estimator)
        self.token_costs = TokenCostTable()
        # hybridspec: forward ms by token count per batch-size bucket (SpeculationGate.bucket): measured on
        # served verification steps, and on the start-up profile's synthetic steps (their level rescaled by what
        # served steps measure against them: cost_table)
        self.bucket_costs: dict[int, TokenCostTable] = {}
        self.profile_costs: dict[int, TokenCostTable] = {}
        self.profile_scale: dict[int, float] = {}  # per bucket: EWMA of served ms / profile ms at its token count
        self._cost_tables: dict[int, TokenCostTable | None] = {}  # cost_table's cache (rebuilt on a new sample)
        self._slope_floors: dict[int, SlopeFloor] = {}  # step_cost's measured cost per bucket (_slope_floor)
        self.expected_tokens: float | None = None  # the last hybridspec plan's expected output tokens
        self._last_plan: tuple | None = None  # (survival, cost, plan, base tokens) of this step's plan
        self.extra_keep: dict[int, tuple[float, float]] = {}  # bucket -> decayed (kept, sent) extra tokens
        self.calibrator = AcceptanceCalibrator(max_positions=max(max_verify_len + 1, 16),
                                               max_stale_reads=CALIBRATION_STALE_READS, prior=calibration_prior())
        self.steps = 0
        self.profiled = False  # a start-up profile fitted the latency model (no exploration steps needed)
        self._pending_counts: torch.Tensor | None = None  # [MoE layers, E] routed tokens since the last fold
        self._folding: tuple[DeviceReadback, int] | None = None  # summed counts on their way to the host, E
        self._pending_steps = 0
        self._counted_steps = 0
        self._distinct: list[float] | None = None  # expected distinct experts of n globally routed tokens
        self.gate = SpeculationGate() if name == "hybridspec" else None
        self.router_correction = True  # hybridspec: the extra token up to the first MoE router
        # hybridspec: the router correction's rule applies only where its steps measurably deliver more (ExtraGate)
        self.extra_gate = ExtraGate() if name == "hybridspec" else None
        self._extra_verdict: tuple[int, bool] | None = None  # this step's (bucket, ExtraGate verdict)
        self.routing_stats = True  # hybridspec: served steps collect routing statistics (ExpertEstimator)
        # per batch-size bucket: EWMA of a drafted step's ms beyond the forward (hybridspec plans for whole steps)
        self.draft_overhead_ms: dict[int, float] = {}
        # per batch-size bucket: [output tokens, the plans' expected tokens] of drafted steps the gate counted (a
        # diagnostic of the gate's speculative side: it counts expected tokens, the cell gets the output ones)
        self.gate_tokens: dict[int, list[float]] = {}
        # a diagnostic of the gate's cycles (the runner's _StepEnds): device ms between a step's end mark and where
        # the next cycle starts, which no cycle holds, by whether that step drafted: [sum ms, count]
        self.gate_between: dict[bool, list[float]] = {}
        self.gate_dropped = 0  # the gate's cycles never read: their CUDA events were re-recorded first (_StepEnds)
        # steps the gate chose to draft after the runner's draft-cap hint had said it would not (no drafts were
        # reserved: they decode plainly; a verdict that changed between the peek and the step)
        self.gate_hint_misses = 0
        # hybridspec plans the drafter's block (width_plan): per batch-size bucket, the drafter's measured ms by
        # rows drafted, and the rest of a drafted step beyond its forward and its drafting (EWMA); kept by every
        # drafting policy (the others only report them)
        self.draft_costs: dict[int, DraftCost] = {}
        self.rest_overhead_ms: dict[int, float] = {}
        self.plans_width = True  # hybridspec: its plans choose their longest length with the block it implies
        # hybridspec-rate: plans maximize expected tokens - R x ms at the goodput R its recent plans expect (per
        # batch size: [EWMA of expected tokens, EWMA of predicted ms] of decode-only plans); by default each plan
        # maximizes its step's own ratio, as budget's does
        self.plans_at_rate = False
        self.plan_rate: dict[int, list[float]] = {}
        self._rate_now: float | None = None  # the rate this step's plan was made at (its extra tokens' too)
        self.draft_margin = DRAFT_MARGIN  # hybridspec: drafts beyond its recent plans' longest (draft_cap)
        self.pad_floor = False  # hybridspec-padfloor: the measured cost's floor by padded rows (SlopeFloor.rows)
        self.bucket_profile = False  # hybridspec-bucketprofile: the start-up profile times bucket-filling blocks
        # hybridspec: the runner's quiet plain streaks (quiet_streak); the noquiet ablation asks the gate every step
        self.quiet_plain = True
        self._draft_now: float | None = None  # this step's drafting ms (observe_draft)
        self._width_choice: dict[int, WidthChoice] = {}  # per batch-size bucket
        # (plan's predicted ms, measured ms) of drafted decode steps: how well the plan knows what a step costs
        # (budget's prediction is its forward-only table; hybridspec's includes the step's overhead)
        self._predicted_ms: float | None = None
        self.plan_errors: deque[tuple[float, float]] = deque(maxlen=512)
        # a step whose distinct experts are still being copied to the host: its latency sample waits for them until
        # the next plan or observation (reading them at once would wait for the GPU to finish the step's commit:
        # ~1 ms a step at c=1, e2e at ba5e735)
        self._unsettled: StepObservation | None = None
        self.planned_max: dict[int, deque[int]] = {}  # per batch-size bucket: longest length of recent plans
        # draft_cap's per bucket, with the window it was read from; dropped when a plan there is made
        self._draft_caps: dict[int, tuple] = {}
        self._peek_contexts: list[int] | None = None  # the contexts whose plain hint next_step's kept verdict read

    @property
    def uses_extra_token(self) -> bool:
        return self.name == "hybridspec" and self.router_correction

    @property
    def collects_routing(self) -> bool:
        """Whether verification steps collect routing statistics (distinct experts, per-expert counts) for it."""
        return self.name == "hybridspec" and self.routing_stats

    def ablate(self, variant: str) -> None:
        """hybridspec with parts switched off, for benchmarks that measure what each part brings (`hybridspec-X`):
        noextra: no router-correction extra token; nocounts: no routing statistics collected in served steps
        (the start-up profile's stand in); lean: both; nogate: speculates every step; ungatedextra: the router
        correction's rule sends extras at every step, not only where ExtraGate measures them paying; margin1: drafts
        its recent plans' longest + 1, not + DRAFT_MARGIN (at c=64/0.7 the bucket-filling plans drafted 7 a request
        to verify <= 5, bench/NOTES.md 2026-12-04); nowidth: plans price the
        step's drafting as sunk (budget_plan with the measured overhead), not the block they imply; plain: the gate
        decodes every measured step plainly (its plain steps against ar's in one cell: what hybridspec's own plain
        path costs); noquiet: no quiet plain streaks (the runner asks the gate at every plain step); nocap: drafts
        max_verify_len at every drafted step (no cap from its recent plans, as budget drafts; bench/NOTES.md 2026-12-06
        23:28 item 2); from the WIDTH_FROM bucket on, width_plan then prices every longest length at that drafting,
        which is what it drafts; rate (a variant, not a part off): each plan maximizes expected tokens - R x ms at
        its recent plans' goodput R (planner.check_rate), not its step's expected tokens over its ms; padfloor (a
        variant): the measured cost's floor counts the rows a graph step pads to (SlopeFloor.rows); bucketprofile (a
        variant): the start-up profile also times the uniform blocks that fill each graph token bucket (ModelRunner.
        profile); padprofile: padfloor and bucketprofile. (thinplain,
        the learning of plain steps thinned 8x, was measured and removed: no effect, bench/NOTES.md 2026-12-06
        02:45.)"""
        if self.name != "hybridspec" or variant not in ABLATIONS:
            raise ValueError(f"ablation must be one of {sorted(ABLATIONS)} of hybridspec, got {self.name}-{variant}")
        parts = ABLATIONS[variant]
        if "extra" in parts:
            self.router_correction = False
        if "counts" in parts:
            self.routing_stats = False
        if "gate" in parts:
            self.gate = None
        if "extragate" in parts:
            self.extra_gate = None
        if "width" in parts:
            self.plans_width = False
        if "margin" in parts:
            self.draft_margin = 1
        if "cap" in parts:
            self.draft_margin = self.max_verify_len
        if "plain" in parts:
            self.gate.force_plain = True
        if "quiet" in parts:
            self.quiet_plain = False
        if "rate" in parts:
            self.plans_at_rate = True
        if "padfloor" in parts:
            self.pad_floor = True
        if "bucketprofile" in parts:
            self.bucket_profile = True

    def draft_cap(self, batch_size: int) -> int | None:
        """hybridspec: drafts per request worth drafting at this batch size (the longest length of its recent
        plans at this bucket (their DRAFT_QUANTILE) + DRAFT_MARGIN, at most max_verify_len); None: no cap of its
        own (other policies, before DRAFT_WINDOW // 4 plans at this bucket)."""
        if self.name != "hybridspec":
            return None
        b = SpeculationGate.bucket(batch_size)
        recent = self.planned_max.get(b)
        cached = self._draft_caps.get(b)
        if cached is not None and cached[0] is recent:  # (asked twice a step; a plan at b drops it)
            return cached[1]
        if not recent or len(recent) < DRAFT_WINDOW // 4:
            cap = None
        else:
            longest = sorted(recent)[min(len(recent) - 1, int(DRAFT_QUANTILE * len(recent)))]
            cap = min(self.max_verify_len, longest + self.draft_margin)
        self._draft_caps[b] = (recent, cap)
        return cap

    def warm(self) -> bool:
        """Whether the learned plan has what it prices with: a fitted latency model, and for `budget` its
        token-count table (it learns only decode and verification steps: a model fitted on prefill chunks alone
        leaves it empty, and `budget` explores until one is timed)."""
        ready = (self.profiled or self.steps >= WARMUP_STEPS) and self.latency.fitted
        return ready and (self.name != "budget" or bool(self.token_costs.tokens))

    def wants_cycle(self, batch_size: int) -> bool:
        """Whether hybridspec's gate wants the next step's cycle timed (SpeculationGate.wants_sample), after a step
        that peeks at no next verdict (the runner: one with a prefill chunk; a decode step asks next_step): a
        verdict kept from before it is dropped (the next decode step decides afresh, on its own contexts)."""
        if self.gate is None:
            return False
        self.gate._peek, self._peek_contexts = None, None
        return self.gate.wants_sample(batch_size)

    def should_draft(self, contexts: list[int], sampled: bool = True, only_plain: bool = False) -> bool:
        """Whether a decode step of len(contexts) requests drafts at all (hybridspec's gate; others always);
        `sampled`: whether the step's cycle is timed; `only_plain`: the step cannot draft (SpeculationGate.
        should_draft: True is then a verdict the step misses, not counted)."""
        if self.gate is None or not self.warm():  # (the last step's sample may still be on its way: not waited for)
            return True
        if self._peek_contexts is not None:  # a kept verdict read the hint of other contexts: decided afresh
            if self._peek_contexts != contexts:
                self.gate._peek = None
            self._peek_contexts = None
        return self.gate.should_draft(len(contexts), lambda: self._plain_hint(contexts), sampled, only_plain)

    def next_step(self, batch_size: int, contexts: Callable[[], list[int]], thin: bool = True) -> tuple[bool, bool]:
        """The runner's end of a decode step, for the next step of batch_size requests (`contexts`: a function
        returning their context lengths, called only where a verdict needs the plain hint): (wants_cycle: time its
        cycle, and should_draft's answer for it at the sampling it will have: timed, or every step where the runner
        does not thin its cycles; SpeculationGate.would_draft) in one call. The verdict is kept for that step's
        should_draft; where it read the plain hint, only for a step of the same contexts (the hint is all of the
        verdict that depends on them: a step of the same size can hold other requests)."""
        gate = self.gate
        self._peek_contexts = None
        if gate is None:
            return False, True
        sample = gate.wants_sample(batch_size)
        if not self.warm():
            return sample, True

        def hint() -> float | None:
            self._peek_contexts = contexts()
            return self._plain_hint(self._peek_contexts)
        return sample, gate.would_draft(batch_size, hint, sample or not thin)

    def quiet_streak(self, batch_size: int) -> int:
        """After next_step answered (untimed, plain) for the next step: SpeculationGate.quiet_streak (-1: none)."""
        if self.gate is None or not self.quiet_plain or not self.warm():
            return -1
        return self.gate.quiet_streak(batch_size)

    def _plain_hint(self, contexts: list[int]) -> float | None:
        """The latency model's plain step of len(contexts) tokens as output tokens per ms per request (the gate's
        optimistic plain rate), its expected distinct experts from the cached table (the estimator's own sum over
        layers x experts is ~0.3 ms of Python, every step)."""
        b = len(contexts)
        experts = self._distinct_upto(b)[b] if self.num_moe_layers else 0.0
        plain_ms = self.latency.predict_features([1.0, float(b), experts, float(b), float(sum(contexts))])
        return 1.0 / plain_ms if plain_ms > 0 else None

    def observe_outcome(self, batch_size: int, drafted: bool, tokens: int, step_ms: float,
                        forward_ms: float | None = None) -> float | None:
        """A whole decode step (no prefill, no graph capture): `tokens` output tokens, `step_ms` on the host clock
        until it returned, of which the target's forward took `forward_ms` (None: not measured). Returns the
        tokens the step counts for in hybridspec's gate (None: the gate does not learn from it); the gate's sample
        is the step's whole cycle, known once the device has passed its end (observe_cycle)."""
        gate_tokens = None
        if self.gate is not None and self.warm():
            # a drafted step counts the plan's expected tokens (calibrated survival), not the realized ones: the
            # accepted length of one step is very noisy (0 or many), and a few unlucky samples would keep the gate
            # on plain decoding for many probes
            gate_tokens = self.expected_tokens if drafted and self.expected_tokens is not None else float(tokens)
            if drafted and self.expected_tokens is not None:
                tally = self.gate_tokens.setdefault(SpeculationGate.bucket(batch_size), [0.0, 0.0])
                tally[0] += tokens
                tally[1] += self.expected_tokens
        self.expected_tokens = None
        verdict, self._extra_verdict = self._extra_verdict, None
        if drafted and verdict is not None and self.extra_gate is not None:  # realized tokens, not expected ones
            self.extra_gate.observe(verdict[0], verdict[1], tokens / max(1, batch_size), step_ms)
        if drafted and self._predicted_ms is not None:
            self.plan_errors.append((self._predicted_ms, step_ms))
        self._predicted_ms = None
        if drafted and forward_ms is not None and step_ms > forward_ms:
            b = SpeculationGate.bucket(batch_size)
            old = self.draft_overhead_ms.get(b)
            new = step_ms - forward_ms
            self.draft_overhead_ms[b] = new if old is None else old + OVERHEAD_ALPHA * (new - old)
            if self._draft_now is not None:
                rest = max(0.0, new - self._draft_now)
                old = self.rest_overhead_ms.get(b)
                self.rest_overhead_ms[b] = rest if old is None else old + REST_ALPHA * (rest - old)
        self._draft_now = None
        return gate_tokens

    def observe_cycle(self, batch_size: int, drafted: bool, tokens: float, cycle_ms: float) -> None:
        """hybridspec's gate learns a decode step's cycle: from where the step before it returned to the end of
        everything it launched (its commit included), with the tokens observe_outcome counted for it."""
        if self.gate is not None:
            self.gate.observe(batch_size, drafted, tokens, cycle_ms)

    def observe_draft(self, batch_size: int, rows: int, ms: float | None) -> None:
        """The drafter's time this step (`rows`: its drafts plus the pending token of each request that got drafts,
        as _width_overheads prices them; ms None: not measured, e.g. it captured a graph or drafted nothing).
        Learned per batch-size bucket (DraftCost) for hybridspec's width_plan, and by the other drafting policies
        too: only a diagnostic there (e2e reports every policy's drafting and the rest of its drafted steps, so
        their overheads beyond the forward compare with hybridspec's measured, not through its drafting costs)."""
        self._draft_now = ms
        if ms is not None:
            b = SpeculationGate.bucket(batch_size)
            cost = self.draft_costs.get(b)
            if cost is None:  # (not setdefault: a throwaway DraftCost a step cost a table's construction)
                cost = self.draft_costs[b] = DraftCost()
            cost.observe(rows, ms)

    def step_overhead_ms(self, batch_size: int) -> float:
        """Measured ms of a drafted step beyond the target's forward (drafting, planning, acceptance, commit) at
        this batch size's bucket, or the nearest bucket measured; 0 before any."""
        if not self.draft_overhead_ms:
            return 0.0
        return self.draft_overhead_ms[nearest_bucket(self.draft_overhead_ms, SpeculationGate.bucket(batch_size))]

    def observe_profile(self, obs: StepObservation, expert_counts: list[torch.Tensor] | None) -> None:
        """One synthetic step of the start-up profile (ModelRunner.profile): latency model, token costs and
        routing statistics learn from it; calibration does not (no drafts were verified)."""
        self._learn_step_time(obs, anchor=True)
        if expert_counts:
            self.estimator.observe_counts(torch.stack(expert_counts).float().cpu().tolist())
            self._distinct = None

    def finish_profile(self) -> bool:
        """Fits the latency model on all the profile's samples; from then on the learned policies plan without
        exploring."""
        if self.latency.num_samples >= self.latency.min_samples:
            self.latency.fit()
        self.profiled = self.latency.fitted
        return self.profiled

    def lengths(self, drafter: str, caps: list[int], confidences: list[list[float]], tokens: list[int],
                contexts: list[int]) -> list[int]:
        """caps/confidences per request of the step (prefill rows: cap 0, no confidences)."""
        self._settle(prime=False)  # (on the plan's critical path: no priming here, the plan computes what it needs)
        self._last_plan = self._rate_now = None
        if self.name == "ar":
            return [0] * len(caps)
        caps = [min(c, len(conf)) for c, conf in zip(caps, confidences)]
        if self.name == "fixed" or not self.warm():
            return fixed_lengths(caps, self.max_verify_len)
        # [B, K] calibrated acceptance (0 past each request's drafts: caps are clipped to them) -> survival
        # (stale_ok: the maps' rebuild is left to the observation, off the critical path on CUDA). A few drafts go
        # through the lists' loops (calibration, survival and the budget search all run their loops below their
        # numpy thresholds; numpy's per-call overhead was most of a B=1 plan), the others as a [B, K] array
        survival = survival_from_acceptance(self.calibrator.calibrate_for_plan(drafter, confidences))
        if self.name == "budget":
            plan = budget_plan(survival, caps, self.token_costs, sum(tokens))
            self._predicted_ms = plan.step_ms
            return plan.lengths
        return self._plan_hybridspec(survival, caps, tokens, contexts)

    def step_cost(self, tokens: list[int], contexts: list[int], max_tokens: int) -> "SlopeFloor | ModelTokenCost":
        """hybridspec's forward cost of this batch as a function of the step's token count: what it measured at
        this batch-size bucket (start-up profile and served steps) where it has two token counts or more, else
        the latency model (tokens, distinct experts, requests, context). The linear model misses the steps of
        the graphs' token buckets and kernel variants: planning on it alone chose 30-60% shorter or longer blocks
        than the measured costs justify (bench/NOTES.md, e2e runs 3-4 of 2026-11-30). A measured table's cost
        rises by at least a floor a token (SlopeFloor): points that are no longer refreshed can flatten it, and a
        flat cost would make every draft look free. The floor is the model's ms_per_token, but no more than
        SLOPE_FLOOR_CHORD of the table's own mean rise and no less than SLOPE_FLOOR_MIN of the model's."""
        measured = self._slope_floor(SpeculationGate.bucket(len(tokens)))
        if measured is not None:
            return measured
        base = StepComposition(tokens, contexts, self.num_moe_layers)
        return self.latency.token_cost(base, self._distinct_upto(max_tokens))

    def _slope_floor(self, b: int) -> "SlopeFloor | None":
        """step_cost's measured cost at bucket b (None: fewer than two token counts there), one object while its
        table and floor stay the same (its costs_ms keeps what was computed, prime_step_cost's included)."""
        table = self.cost_table(b)
        if table is None or len(table.tokens) < 2:
            return None
        floor = self.latency.coefs.ms_per_token if self.latency.coefs is not None else 0.0
        # at most a fraction of the table's own mean rise a token: the model's ms_per_token is one slope for
        # every batch size, and at c=1 it held the measured table's 0.08 ms a token at ~0.15-0.2 (plans of
        # 10-12 drafts where 15 paid: bench/NOTES.md, 30f35fb)
        # (and at least SLOPE_FLOOR_MIN of the model's: a flat or falling table keeps a floor)
        chord = (table.step_ms[-1] - table.step_ms[0]) / (table.tokens[-1] - table.tokens[0])
        floor = min(floor, max(SLOPE_FLOOR_CHORD * chord, SLOPE_FLOOR_MIN * floor))
        cached = self._slope_floors.get(b)
        if cached is not None and cached.table is table and cached.floor == floor:
            return cached
        self._slope_floors[b] = made = SlopeFloor(table, floor, PAD_ROWS if self.pad_floor else None)
        return made

    def prime_step_cost(self, batch_size: int) -> None:
        """Computes, ahead of the next plan at this batch size, its measured cost of a decode step's every token
        count (batch_size .. batch_size x (max_verify_len + 2)): called by the learning, which runs inside the next
        forward on CUDA, right after the table was rebuilt there; the plan then reads a slice (SlopeFloor). A
        pure cache: the plan's costs are the same."""
        cost = self._slope_floor(SpeculationGate.bucket(batch_size))
        if cost is not None:
            cost.costs_ms(batch_size, batch_size * (self.max_verify_len + 2))

    def cost_table(self, batch_size: int) -> TokenCostTable | None:
        """The forward ms by token count at this batch size's bucket: every token count a served step measured,
        and the start-up profile's others scaled by profile_scale. The profile's synthetic steps run at a short
        context on the spare page (narrow page tables, other graph buckets) and differ from served steps by a
        factor: unscaled, a profile point the plan never visits stays off, and can lure the plan to it (or keep
        it away) for good."""
        b = SpeculationGate.bucket(batch_size)
        if b not in self._cost_tables:
            self._cost_tables[b] = self._build_cost_table(b)
        return self._cost_tables[b]

    def _build_cost_table(self, b: int) -> TokenCostTable | None:
        """cost_table's table at bucket b from what was measured there (a pure function of bucket_costs,
        profile_costs and profile_scale at b)."""
        served, prof = self.bucket_costs.get(b), self.profile_costs.get(b)
        points = dict(zip(served.tokens, zip(served.step_ms, served._counts))) if served else {}
        if prof:
            scale = self.profile_scale.get(b, 1.0)
            for t, ms in zip(prof.tokens, prof.step_ms):
                points.setdefault(t, (ms * scale, 1.0))
        ts = sorted(points)
        return TokenCostTable(ts, [points[t][0] for t in ts], [points[t][1] for t in ts]) if ts else None

    def _plan_hybridspec(self, survival: list[list[float]], caps: list[int], tokens: list[int],
                         contexts: list[int]) -> list[int]:
        """The joint plan. Every request's tokens route by global popularity (the worker keeps no per-request
        expert footprints), so a step's cost depends on its token count only (step_cost) and the best plan for
        each token count is the highest survival scores: the search of budget_plan over that cost is exact,
        O(B K log(B K)) on the host with no device round trip; it maximizes the step's expected tokens over its ms
        (the rate variant: expected tokens - R x ms at the goodput R its recent plans expect, _plan_rate).
        (planner.plan_with_experts /
        planner_torch.plan_with_experts_device solve the footprint-aware problem, where it is not.) Where the
        bucket has measured its drafting and the rest of its steps, the longest length c is chosen with the drafting
        it implies (width_plan, every WIDTH_EVERY plans) and the plans between search within it; else the measured
        overhead is priced as sunk (so too below the WIDTH_FROM bucket)."""
        cost = self.step_cost(tokens, contexts, sum(tokens) + sum(caps) + len(caps))
        b = SpeculationGate.bucket(len(tokens))
        rate = self._rate_now = self._plan_rate(sum(1 for t in tokens if t == 1))  # (its decode rows)
        choice = self._width_choice.get(b)
        width_ms = None
        # a choice is made again after WIDTH_EVERY plans, or at once where the last one took every draft there
        # was (its c was the drafts' limit, not its own) and more are drafted now
        if choice is None or choice.plans >= WIDTH_EVERY or (choice.censored and max(caps, default=0) > choice.c):
            width_ms = self._width_overheads(b, caps)
        if width_ms is not None:  # the longest length chosen with the drafting it implies (width_plan)
            plan, c = width_plan(survival, caps, cost, sum(tokens), width_ms, rate=rate)
            self._width_choice[b] = WidthChoice(c, width_ms[c], censored=c >= max(caps))
        elif choice is not None and self.plans_width and self._draft_now is not None and b in self.rest_overhead_ms:
            # between choices: budget_plan's search within the chosen longest length, at its overhead (priced with
            # the batch size and rest of the step that chose it: the next choice re-prices both)
            c = choice.c
            choice.plans += 1
            plan = budget_plan(survival, [min(x, c) for x in caps], cost, sum(tokens), draft_ms=choice.overhead_ms,
                               rate=rate)
        else:
            c = None
            # the whole step: its drafting and the rest are paid whatever the lengths; they make long blocks worth
            # more than the forward alone says in the step's ratio, and lower the goodput R a plan at a rate aims at
            plan = budget_plan(survival, caps, cost, sum(tokens), draft_ms=self.step_overhead_ms(len(tokens)),
                               rate=rate)
            predicted = plan.step_ms
        self._learn_plan_rate(tokens, plan)
        if c is not None:
            # this step drafted what it drafted: its prediction has the measured drafting, not the chosen width's
            predicted = plan.step_ms - self._width_choice[b].overhead_ms + self.rest_overhead_ms[b] + self._draft_now
            plan = Plan(plan.lengths, plan.expected_tokens, predicted)
        self.expected_tokens = plan.expected_tokens
        self._predicted_ms = predicted
        self._last_plan = (survival, cost, plan, sum(tokens))
        self.planned_max.setdefault(b, deque(maxlen=DRAFT_WINDOW)).append(max(plan.lengths, default=0))
        self._draft_caps.pop(b, None)
        return plan.lengths

    def _plan_rate(self, batch_size: int) -> float | None:
        """The goodput (tokens per ms) a plan at this batch size aims at: what its recent plans there expect; where
        none were made, the nearest planned batch size's (in doublings, then the larger) scaled by the batch sizes'
        ratio; None: no plan yet, or not the rate variant. (A step's ms grows with its batch less than in proportion,
        so the scaled rate is low from a larger batch and high from a smaller one, until this size's own plans
        correct it: plans at a rate converge to their own goodput.)"""
        if not self.plans_at_rate or not self.plan_rate or batch_size < 1:
            return None
        ewma = self.plan_rate.get(batch_size)
        if ewma is None:
            near = min(self.plan_rate, key=lambda n: (abs(n.bit_length() - batch_size.bit_length()), -n))
            tok, ms = self.plan_rate[near]
            rate = tok * batch_size / near / ms
        else:
            rate = ewma[0] / ewma[1]
        return rate if 0.0 < rate < float("inf") else None

    def _learn_plan_rate(self, tokens: list[int], plan: Plan) -> None:
        """A decode-only plan's expected tokens and ms under its search's own costs (the whole step's, as the search
        priced it) into its batch size's EWMAs (_plan_rate). A step that carries a prefill chunk is left out: its
        chunk's rows and forward are paid whatever the lengths, and would lower the decode goodput the plans aim
        at (B=2 with a 128-token chunk one step in four: R 1.15 -> 0.85, plans 6 -> 8 drafts)."""
        if not self.plans_at_rate or any(t != 1 for t in tokens):
            return
        tok, ms = float(plan.expected_tokens), float(plan.step_ms)
        if not (0.0 < tok < float("inf") and 0.0 < ms < float("inf")):
            return  # (a non-finite or empty prediction teaches nothing)
        ewma = self.plan_rate.get(len(tokens))
        if ewma is None:
            self.plan_rate[len(tokens)] = [tok, ms]
        else:
            ewma[0] += RATE_ALPHA * (tok - ewma[0])
            ewma[1] += RATE_ALPHA * (ms - ewma[1])

    def _width_overheads(self, bucket: int, caps: list[int]) -> list[float] | None:
        """[C + 1] for width_plan (C: the longest cap of the step): the overhead of a drafted step whose plans
        stay <= c, c = 1..C: the rest of the step (measured) + the drafter's ms for blocks of c + DRAFT_MARGIN
        (at most max_verify_len) plus the pending token per drafting request (DraftCost); None below the
        WIDTH_FROM bucket, where this bucket has not measured both, or where this step's drafting was not timed
        (plans then price the measured overhead as sunk)."""
        draft = self.draft_costs.get(bucket)
        if not self.plans_width or bucket < WIDTH_FROM or draft is None or not draft.measured \
                or bucket not in self.rest_overhead_ms or self._draft_now is None:
            return None
        n = sum(1 for c in caps if c > 0)
        C = max(caps, default=0)
        if n == 0 or C == 0:
            return None
        blocks = np.minimum(np.arange(1, C + 1) + self.draft_margin, self.max_verify_len) + 1.0  # [C]
        return [0.0] + (self.rest_overhead_ms[bucket] + draft.ms_array(n * blocks)).tolist()

    def extra_tokens(self, lengths: list[int], caps: list[int]) -> set[int]:
        """Requests that get the router correction's extra token (the draft after their L_i, sent to the first
        MoE router and kept only if the batch covers its experts). The rule: send the m best candidates (by
        expected gain, P(kept) x survival of that draft) for the m that maximizes the step's goodput
        (expected tokens + their gains) / (predicted step ms + what m more tokens add to the cost without new
        experts: the cost curve at this step less the latency model's expert part of it, at least ms_per_token a
        token). A dropped token costs no expert work, a kept one touches only covered experts. The cost curve is
        the measured one, step-shaped by the graphs' token buckets (a plan made at a rate R sends the m maximizing
        their gains - R x their added ms instead, as its drafts were chosen): extra tokens that would carry a step
        past a bucket's top pay that bucket's jump together (before, each was priced alone at the slope where the plan
        ended: a plan a few tokens under a bucket's top could send more extras than fit under it, and the step
        ran in the next bucket; at c=64, 64 x 5 tokens took 15.0 ms in the 384-token bucket against 13.3 for
        64 x 4 in the 256 one, bench/NOTES.md). P(kept) is measured per batch-size bucket (optimistic
        at first, so it gets measured). At most as many as fit in the graph token bucket the plan's step runs in
        (EXTRA_WITHIN_BUCKET). Small batches rarely cover a token's experts: below the EXTRA_FROM
        batch-size bucket no extra token is sent (measured 3-5% end to end at c=1), and those buckets' graphs run
        no router correction. Without a plan of this step: every request with L_i < cap_i. Where ExtraGate
        measures the rule's steps delivering less than steps without extras at this batch-size bucket, none is sent
        (but for its probes)."""
        self._extra_verdict = None
        b = SpeculationGate.bucket(len(lengths))
        if b < EXTRA_FROM:
            self._last_plan = None
            return set()
        candidates = [i for i, (n, c) in enumerate(zip(lengths, caps)) if n < c]
        if self._last_plan is None or not candidates:
            return set(candidates)
        survival, cost, plan, base_tokens = self._last_plan
        candidates = [i for i in candidates if lengths[i] < len(survival[i])]  # a draft the plan could price
        self._last_plan = None
        if not candidates:
            return set()
        if self.extra_gate is not None:  # the rule itself on trial: a step counts for the verdict it ran under
            sends = self.extra_gate.sends(b)
            self._extra_verdict = (b, sends)
            if not sends:
                return set()
        total = base_tokens + sum(lengths)
        kept, sent = self.extra_keep.get(b, EXTRA_KEEP_PRIOR)
        p_keep = kept / sent
        gains = np.array([p_keep * survival[i][lengths[i]] for i in candidates], dtype=np.float64)  # [k]
        order = np.argsort(-gains, kind="stable")  # best first (ties: the request order)
        added = self._dense_tokens_ms(cost, total, len(candidates))  # [k + 1] ms of m more tokens, m = 0..k
        gain_m = np.concatenate(([0.0], np.cumsum(gains[order])))  # [k + 1]
        rate, self._rate_now = self._rate_now, None
        goodput = (plan.expected_tokens + gain_m) / (plan.step_ms + added) if rate is None else gain_m - rate * added
        if EXTRA_WITHIN_BUCKET:  # no more than the plan's graph bucket holds
            room = next((t for t in _TOKEN_BUCKETS if t >= total), total) - total
            goodput = goodput[:room + 1]
        m = int(np.argmax(goodput))  # the first of equal goodputs: the fewest tokens
        if self._predicted_ms is not None:  # the step's prediction includes its extra rows' dense work
            self._predicted_ms += float(added[m])
        return {candidates[j] for j in order[:m]}

    def _dense_tokens_ms(self, cost: "SlopeFloor | ModelTokenCost", total: int, k: int) -> np.ndarray:
        """[k + 1]: ms that m = 0..k more tokens without new experts add to a step of `total` tokens: the cost
        curve's rise less the latency model's expert part of it, at least the model's ms_per_token a token (a
        token is never free)."""
        costs = np.asarray(cost.costs_ms(total, total + k), dtype=np.float64)  # [k + 1]
        rise = costs - costs[0]
        m = np.arange(k + 1, dtype=np.float64)
        coefs = self.latency.coefs
        if coefs is None:
            return np.maximum(rise, 1e-9 * m)
        d = np.asarray(self._distinct_upto(total + k)[total:total + k + 1], dtype=np.float64)  # [k + 1]
        return np.maximum(rise - coefs.ms_per_expert * (d - d[0]), np.maximum(coefs.ms_per_token, 1e-9) * m)

    def observe_extra(self, batch_size: int, kept: int, sent: int) -> None:
        """The router correction kept `kept` of the `sent` extra tokens of a step (decayed counts per bucket)."""
        b = SpeculationGate.bucket(batch_size)
        k, n = self.extra_keep.get(b, EXTRA_KEEP_PRIOR)
        self.extra_keep[b] = (EXTRA_KEEP_DECAY * k + kept, EXTRA_KEEP_DECAY * n + sent)

    def _distinct_upto(self, n: int) -> list[float]:
        """Expected distinct experts (summed over MoE layers) of 0..>= n globally routed tokens, recomputed when
        the routing statistics fold in or a longer step needs it. On the host (~2 ms, every COUNTS_FOLD_EVERY x
        COUNTS_SAMPLE_EVERY steps): on the GPU its torch.unique waited for the device's queued work."""
        if self._distinct is None or len(self._distinct) <= n:
            size = max(n, 2 * len(self._distinct) if self._distinct else 32)
            touch = torch.tensor(self.estimator.touch_prob_table(), dtype=torch.float64)
            self._distinct = distinct_by_tokens_device(touch, size).cpu().tolist()
        return self._distinct

    def keep_counts(self, expert_counts: "list[torch.Tensor] | torch.Tensor | None") -> torch.Tensor | None:
        """A step's per-expert counts (per MoE layer, [E] each, or a graph's static [MoE layers, E] output; a
        verification step's), kept as one [MoE layers, E] copy where routing statistics sample this step (every
        COUNTS_SAMPLE_EVERY-th step that carries counts), else None. Called at the step: graph outputs are
        overwritten by the next replay."""
        if expert_counts is None or len(expert_counts) == 0:
            return None
        self._counted_steps += 1  # steps that carry counts (verification steps; plain graphs collect none)
        if self._counted_steps % COUNTS_SAMPLE_EVERY != 1:
            return None
        return expert_counts.clone() if isinstance(expert_counts, torch.Tensor) else torch.stack(expert_counts)

    def observe(self, drafter: str | None, obs: StepObservation,
                expert_counts: list[torch.Tensor] | torch.Tensor | None, fold: bool = True) -> None:
        """A step's forward time, verified drafts and routing counts (a list per MoE layer, or what keep_counts
        kept of them at the step). `fold=False`: a due fold of the summed counts into the routing statistics (an
        async copy to the host, then pure Python over layers x E once it has arrived) waits for fold_counts()."""
        self._settle()
        self.steps += 1
        if isinstance(obs.distinct_experts, DeviceReadback):
            self._unsettled = obs  # learned at the next plan or observation, when its values are on the host
        else:
            self._learn_step_time(obs)
        if drafter is not None and obs.verified:
            self.calibrator.observe_step(drafter, obs.verified)
        # routing popularity, sampled every COUNTS_SAMPLE_EVERY-th step: summed on the device, folded in every
        # COUNTS_FOLD_EVERY samples
        stacked = expert_counts if isinstance(expert_counts, torch.Tensor) else self.keep_counts(expert_counts)
        if stacked is not None:  # [MoE layers, E]
            if self._pending_counts is None:
                self._pending_counts, self._pending_steps = stacked, 0
            else:
                self._pending_counts.add_(stacked)
            self._pending_steps += 1
        if fold:
            self.fold_counts()

    def fold_counts(self) -> None:
        """Folds the summed routing counts into the statistics once COUNTS_FOLD_EVERY samples are in: an async copy
        to the host (DeviceReadback), folded in (pure Python over layers x E) by a later call once it has arrived,
        at once on CPU. A synchronous read waited for the device's queued work (the step's commit)."""
        if self._folding is not None and self._folding[0].ready():
            (readback, experts), self._folding = self._folding, None
            flat = readback.values()
            self.estimator.observe_counts([flat[i:i + experts] for i in range(0, len(flat), experts)])
            self._distinct = None  # recomputed from the new routing statistics at the next plan
        if self._pending_counts is not None and self._pending_steps >= COUNTS_FOLD_EVERY and self._folding is None:
            self._folding = (DeviceReadback(self._pending_counts), self._pending_counts.shape[-1])
            self._pending_counts = None
            if self._folding[0].ready():
                self.fold_counts()

    def settle_ready(self) -> None:
        """Learns the step time still on its way to the host if it has arrived (never waits)."""
        if self._unsettled is not None and self._unsettled.distinct_experts.ready():
            self._settle()

    def _settle(self, prime: bool = True) -> None:
        """Learns the step time whose distinct experts were still on their way to the host (`prime=False`: from
        the plan, which computes its own costs: no prime_step_cost on its critical path)."""
        obs, self._unsettled = self._unsettled, None
        if obs is not None:
            obs.distinct_experts = obs.distinct_experts.values()
            self._learn_step_time(obs, prime=prime)

    def _learn_step_time(self, obs: StepObservation, anchor: bool = False, prime: bool = True) -> None:
        """The latency model and the token-cost table learn a measured step (forward_ms None: not a measurement);
        `anchor`: a start-up profile step, kept in every later fit of the latency model."""
        if obs.forward_ms is None:
            return
        comp = StepComposition(obs.tokens_per_request, obs.context_lens, self.num_moe_layers,
                               obs.distinct_experts if self.num_moe_layers and obs.distinct_experts else None)
        if anchor:
            self.latency.anchor(comp, obs.forward_ms)
        else:
            self.latency.observe(comp, obs.forward_ms)
        if not self.latency.fitted and self.latency.num_samples >= self.latency.min_samples:
            self.latency.fit()
        # the token-cost tables price the steps the plans are for: a prefill chunk (eager when graphs are off:
        # CPU, EP) is another kind of step
        if anchor or (all(c > 0 for c in obs.context_lens) and
                      all(t <= self.max_verify_len + 2 for t in obs.tokens_per_request)):
            self.token_costs.observe(comp.num_tokens, obs.forward_ms)
            if self.name == "hybridspec":  # its measured cost per batch-size bucket (step_cost)
                b, n = SpeculationGate.bucket(comp.num_requests), comp.num_tokens
                if not anchor and self.profile_costs.get(b) and self.profile_costs[b].tokens:
                    ratio = obs.forward_ms / max(self.profile_costs[b].cost_ms(n), 1e-9)
                    old = self.profile_scale.get(b)
                    self.profile_scale[b] = ratio if old is None else old + PROFILE_SCALE_ALPHA * (ratio - old)
                tables = self.profile_costs if anchor else self.bucket_costs
                if b not in tables:
                    tables[b] = TokenCostTable()
                tables[b].observe(n, obs.forward_ms)
                # rebuilt here, in the learning (on CUDA while the next forward is on the device), not by the next
                # plan on the step's critical path: the table is a pure function of what changed just above, so
                # the plan reads the same one (~0.05 ms of a c=1 hybridspec step's plan on this CPU, /tmp probe
                # at 44cd073; rebuilt after every served sample of the bucket, plain ones too)
                self._cost_tables[b] = self._build_cost_table(b)
                if prime and not anchor:  # the next plan's costs at this batch size, off its critical path
                    self.prime_step_cost(comp.num_requests)

    def stats(self, drafter: str | None = None) -> dict[str, float]:
        """Prediction errors: the latency model's (prequential, % of the measured step) and, for `drafter`, the
        calibration's expected calibration error before and after the map (a step whose latency sample is still on
        its way is not in them yet: settling it here would wait for the GPU)."""
        err = self.latency.error_stats()
        out = {"latency_samples": float(err.n), "latency_mean_abs_pct": err.mean_abs_pct,
               "latency_p90_abs_pct": err.p90_abs_pct}
        if self.gate is not None:
            out["speculative_step_share"] = self.gate.speculative_share()
        if self.extra_gate is not None and sum(self.extra_gate.decisions):
            out["extra_verdict_share"] = self.extra_gate.share()
        if self.plan_errors:  # signed: > 0 where the plan predicted steps longer than they were
            out["plan_step_bias_pct"] = 100.0 * sum((p - m) / m for p, m in self.plan_errors) / len(self.plan_errors)
            out["plan_step_abs_pct"] = 100.0 * sum(abs(p - m) / m for p, m in self.plan_errors) / len(self.plan_errors)
        if drafter is not None and drafter in self.calibrator.drafters:
            cal = self.calibrator.stats(drafter)
            out.update(calibration_samples=float(cal.n), calibration_ece_raw=cal.ece_raw,
                       calibration_ece=cal.ece_calibrated)
        return out
