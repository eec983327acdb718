"""Verification-length policies, run by the worker each step (DESIGN.md steps 3-4).

- `ar`: never verify drafts.   - `fixed`: verify min(K, cap_i) drafts.
- `budget`: vLLM-style adaptive verification: one batch-wide token budget from survival scores and a cost table
  indexed by token count only.
- `hybridspec`: lengths chosen jointly under the batch latency model (tokens, distinct experts, requests,
  context), plus one extra token per request up to the first MoE router, kept only where its experts are
  already covered (router correction, workers/model.py MoEContext).
Survival comes from the drafter's confidences through the online calibrator. Until the latency model has
seen enough steps it explores with `fixed` lengths (an online start-up profile).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.calibration import AcceptanceCalibrator
from scheduler.latency_model import ExpertEstimator, LatencyModel, StepComposition, TokenCostTable
from scheduler.planner import budget_plan, fixed_lengths, survival_from_acceptance
from scheduler.planner_torch import plan_with_experts_device
from workers.config import ModelConfig

POLICIES = ("ar", "fixed", "budget", "hybridspec")
PLAN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DevicePlanner:
    """plan_with_experts_device over a padded batch: B rounded up to a bucket and K to max_verify_len, padding
    requests with no drafts, no tokens and no gain (so the plan of the real ones is unchanged). On CUDA each
    bucket is captured once in a CUDA graph: the planner is ~1500 small tensor ops, which cost ~8 ms of launches
    per step eagerly on the H200 (bench/NOTES.md) and one replay in a graph. Elsewhere (and if a capture fails)
    the same padded call runs eagerly."""

    # serving runs one linearization step from each start (L = 0 and L = caps; the uniform candidates are
    # always considered): half the full search's kernels, >= 99% of its goodput in tests/test_planner.py's
    # world. The search is hybridspec's own cost per step (~1-1.5 ms on the H200 in graphs at 1b59fc2).
    ITERATIONS, FROM_ZERO = 1, True

    def __init__(self, device: torch.device, max_drafts: int):
        self.device, self.k = device, max_drafts
        self.capture = device.type == "cuda"  # the runner turns it off when its own graphs are off
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        # its own stream: reading the plan back then waits for the plan only, not for the drafter's kernels
        # queued before it on the main stream (the host builds the verification step meanwhile)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._touch_src: dict[int, tuple] = {}  # bucket -> (its inputs, the touch table they hold)

    def _inputs(self, b: int, layers_experts: tuple[int, int]) -> dict[str, torch.Tensor]:
        f64, dev = torch.float64, self.device
        return {"survival": torch.zeros(b, self.k, dtype=f64, device=dev),
                "caps": torch.zeros(b, dtype=torch.long, device=dev),
                "tokens": torch.zeros(b, dtype=torch.long, device=dev),
                "touch": torch.zeros(*layers_experts, dtype=f64, device=dev),
                "fixed": torch.zeros((), dtype=f64, device=dev), "tok": torch.zeros((), dtype=f64, device=dev),
                "ex": torch.zeros((), dtype=f64, device=dev), "gain": torch.zeros((), dtype=f64, device=dev)}

    @classmethod
    def _run(cls, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return plan_with_experts_device(x["survival"], x["caps"], x["fixed"], x["tok"], x["ex"], x["touch"],
                                        x["tokens"], base_gain=x["gain"], iterations=cls.ITERATIONS,
                                        from_zero=cls.FROM_ZERO)

    def plan(self, survival: list[list[float]], caps: list[int], tokens: list[int], fixed_ms: float,
             ms_per_token: float, ms_per_expert: float, touch: torch.Tensor) -> list[int]:
        if self.stream is None:
            return self._plan(survival, caps, tokens, fixed_ms, ms_per_token, ms_per_expert, touch)
        with torch.cuda.stream(self.stream):
            return self._plan(survival, caps, tokens, fixed_ms, ms_per_token, ms_per_expert, touch)

    def _plan(self, survival: list[list[float]], caps: list[int], tokens: list[int], fixed_ms: float,
              ms_per_token: float, ms_per_expert: float, touch: torch.Tensor) -> list[int]:
        n = len(survival)
        b = next((x for x in PLAN_BUCKETS if x >= n), n)
        entry = self.graphs.get(b)
        x = entry[1] if entry is not None else self._inputs(b, tuple(touch.shape))
        surv = torch.zeros(b, self.k, dtype=torch.float64)
        for i, row in enumerate(survival):
            surv[i, :min(len(row), self.k)] = torch.tensor(row[:self.k], dtype=torch.float64)
        x["survival"].copy_(surv, non_blocking=True)
        x["caps"].copy_(torch.tensor([min(c, self.k) for c in caps] + [0] * (b - n)), non_blocking=True)
        x["tokens"].copy_(torch.tensor(tokens + [0] * (b - n)), non_blocking=True)
        held = self._touch_src.get(b)
        if held is None or held[0] is not x or held[1] is not touch:  # new only when routing statistics fold in
            x["touch"].copy_(touch)  # (touch was made by a synchronous host-to-device copy: complete)
            self._touch_src[b] = (x, touch)
        for name, v in (("fixed", fixed_ms), ("tok", ms_per_token), ("ex", ms_per_expert), ("gain", float(n))):
            x[name].fill_(v)
        if entry is None and self.capture:
            entry = self._capture(b, x)
        out = entry[0] if entry is not None else None
        if out is None:
            lengths = self._run(x)
        else:
            entry[2].replay()
            lengths = out
        return [int(v) for v in lengths[:n].tolist()]

    def _capture(self, b: int, x: dict[str, torch.Tensor]) -> tuple | None:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._run(x)
            self.pool = graph.pool()
        except Exception:  # noqa: BLE001 - the eager call computes the same plan
            self.capture = False
            return None
        self.graphs[b] = (out, x, graph)
        return self.graphs[b]
WARMUP_STEPS = 8  # steps of `fixed` exploration before the learned policies take over
# routing statistics change slowly: a fold (host read, Python over layers x E, a new touch table for the planner)
# every 8 steps cost ~0.5 ms a step on the H200 at 40 x 256 (bench/NOTES.md, e2e at 69faaf2)
COUNTS_FOLD_EVERY = 32


class SpeculationGate:
    """hybridspec speculates only where it pays, measured on whole steps (drafting, planning, verification,
    acceptance and commit included, which the latency model's forward times leave out): per batch-size bucket
    an EWMA of output tokens per ms of decode steps with drafts and of plain decode steps. It drafts unless the
    speculative side is measured slower, and every PROBE-th step it tries the losing side so that a change of
    acceptance or load is seen. Each side is measured MIN_SAMPLES times first (speculative first), except that
    plain decoding is not explored where the speculative side already beats `plain_hint` (the latency model's
    forward-only prediction of a plain step: an optimistic plain rate) by HINT_MARGIN: short runs and the
    batch-size buckets met as requests finish paid three plain steps each (bench/NOTES.md, e2e at 69c5b6d)."""

    PROBE, ALPHA, MIN_SAMPLES, HINT_MARGIN = 16, 0.25, 3, 1.2

    def __init__(self) -> None:
        # (bucket, drafted) -> EWMA of output tokens per ms per request (per request: a bucket holds several batch
        # sizes, and the losing side's rate is refreshed only by its probes)
        self.rate: dict[tuple[int, bool], float] = {}
        self.samples: dict[tuple[int, bool], int] = {}
        self.asked: dict[int, int] = {}
        self.decisions = [0, 0]  # steps decided plain, speculative

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def should_draft(self, batch_size: int, plain_hint: float | None = None) -> bool:
        """plain_hint: an optimistic estimate of plain decoding's output tokens per ms per request."""
        b = self.bucket(batch_size)
        spec_n, plain_n = self.samples.get((b, True), 0), self.samples.get((b, False), 0)
        if spec_n < self.MIN_SAMPLES:
            draft = True
        elif plain_n < self.MIN_SAMPLES and plain_hint is not None and \
                self.rate[(b, True)] > self.HINT_MARGIN * plain_hint:
            draft = True  # clearly ahead of even an optimistic plain step: no need to try one
        elif plain_n < self.MIN_SAMPLES:
            draft = False
        else:
            self.asked[b] = self.asked.get(b, 0) + 1
            spec_wins = self.rate[(b, True)] >= self.rate[(b, False)]
            draft = spec_wins != (self.asked[b] % self.PROBE == 0)
        self.decisions[draft] += 1
        return draft

    def observe(self, batch_size: int, drafted: bool, tokens: int, step_ms: float) -> None:
        if step_ms <= 0:
            return
        key = (self.bucket(batch_size), drafted)
        r = tokens / step_ms / max(1, batch_size)
        self.rate[key] = r if key not in self.rate else (1 - self.ALPHA) * self.rate[key] + self.ALPHA * r
        self.samples[key] = self.samples.get(key, 0) + 1

    def speculative_share(self) -> float:
        return self.decisions[1] / max(1, sum(self.decisions))


@dataclass
class StepObservation:
    tokens_per_request: list[int]
    context_lens: list[int]
    forward_ms: float | None  # None: not a measurement (the step captured a CUDA graph first)
    distinct_experts: list[int] | None  # per MoE layer (None: not observed; the estimator stands in)
    verified: list[tuple[list[float], int, int]] = field(default_factory=list)  # (confidences, verified, accepted)


class LengthPolicy:
    def __init__(self, name: str, config: ModelConfig, max_verify_len: int = 16,
                 device: torch.device | str = "cpu"):
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name, self.max_verify_len = name, max_verify_len
        self.device = torch.device(device)  # where the joint planner's tensors live (the model's device)
        self.planner = DevicePlanner(self.device, max_verify_len + 1)  # + the router correction's extra token
        self.num_moe_layers = sum(config.moe_layers)
        self.estimator = ExpertEstimator(max(self.num_moe_layers, 1), max(config.num_experts, 1),
                                         max(config.num_experts_per_tok, 1))
        self.latency = LatencyModel(estimator=self.estimator)
        self.token_costs = TokenCostTable()
        self.calibrator = AcceptanceCalibrator(max_positions=max(max_verify_len + 1, 16))
        self.steps = 0
        self.profiled = False  # a start-up profile fitted the latency model (no exploration steps needed)
        self._pending_counts: torch.Tensor | None = None  # [MoE layers, E] routed tokens since the last fold
        self._pending_steps = 0
        self._touch: torch.Tensor | None = None  # [MoE layers, E] touch probabilities for the device planner
        self.gate = SpeculationGate() if name == "hybridspec" else None

    @property
    def uses_extra_token(self) -> bool:
        return self.name == "hybridspec"

    def warm(self) -> bool:
        return (self.profiled or self.steps >= WARMUP_STEPS) and self.latency.fitted

    def should_draft(self, contexts: list[int]) -> bool:
        """Whether a decode step of len(contexts) requests drafts at all (hybridspec's gate; others always)."""
        if self.gate is None or not self.warm():
            return True
        plain_ms = self.latency.predict(StepComposition([1] * len(contexts), contexts, self.num_moe_layers))
        return self.gate.should_draft(len(contexts), 1.0 / plain_ms if plain_ms > 0 else None)  # per request

    def observe_outcome(self, batch_size: int, drafted: bool, tokens: int, step_ms: float) -> None:
        """A whole decode step (no prefill, no graph capture): `tokens` output tokens in `step_ms`."""
        if self.gate is not None and self.warm():
            self.gate.observe(batch_size, drafted, tokens, step_ms)

    def observe_profile(self, obs: StepObservation, expert_counts: list[torch.Tensor] | None) -> None:
        """One synthetic step of the start-up profile (ModelRunner.profile): latency model, token costs and
        routing statistics learn from it; calibration does not (no drafts were verified)."""
        self._learn_step_time(obs)
        if expert_counts:
            self.estimator.observe_counts(torch.stack(expert_counts).float().cpu().tolist())
            self._touch = None

    def finish_profile(self) -> bool:
        """Fits the latency model on all the profile's samples; from then on the learned policies plan without
        exploring."""
        if len(self.latency.samples) >= self.latency.min_samples:
            self.latency.fit()
        self.profiled = self.latency.fitted
        return self.profiled

    def lengths(self, drafter: str, caps: list[int], confidences: list[list[float]], tokens: list[int],
                contexts: list[int]) -> list[int]:
        """caps/confidences per request of the step (prefill rows: cap 0, no confidences)."""
        if self.name == "ar":
            return [0] * len(caps)
        caps = [min(c, len(conf)) for c, conf in zip(caps, confidences)]
        if self.name == "fixed" or not self.warm():
            return fixed_lengths(caps, self.max_verify_len)
        acc = [self.calibrator.calibrate_row(drafter, conf) for conf in confidences]
        survival = survival_from_acceptance(acc)
        if self.name == "budget":
            return budget_plan(survival, caps, self.token_costs, sum(tokens)).lengths
        return self._plan_device(survival, caps, tokens, contexts)

    def _plan_device(self, survival: list[list[float]], caps: list[int], tokens: list[int],
                     contexts: list[int]) -> list[int]:
        """The joint plan on torch tensors (planner_torch): the host version walks layers x experts in Python,
        ~100 ms a step at 40 x 256; this one is a few small tensor ops (and one read of the result)."""
        coefs = self.latency.coefs
        width = max((len(r) for r in survival), default=0)
        if width == 0:
            return [0] * len(caps)
        if self._touch is None:  # [MoE layers, E]: the planner's work is B x K x layers x E, so on the device
            self._touch = torch.tensor(self.estimator.touch_prob_table(), dtype=torch.float64, device=self.device)
        fixed_ms = (coefs.const_ms + coefs.ms_per_token * sum(tokens) + coefs.ms_per_request * len(tokens)
                    + coefs.ms_per_context_token * sum(contexts))
        return self.planner.plan(survival, caps, tokens, fixed_ms, coefs.ms_per_token, coefs.ms_per_expert,
                                 self._touch)

    def observe(self, drafter: str | None, obs: StepObservation, expert_counts: list[torch.Tensor] | None) -> None:
        self.steps += 1
        self._learn_step_time(obs)
        if drafter is not None and obs.verified:
            self.calibrator.observe_step(drafter, obs.verified)
        if expert_counts:  # routing popularity: summed on the device, folded in every COUNTS_FOLD_EVERY steps
            stacked = torch.stack(expert_counts)  # [MoE layers, E] (a copy: graph outputs are overwritten)
            if self._pending_counts is None:
                self._pending_counts, self._pending_steps = stacked, 0
            else:
                self._pending_counts.add_(stacked)
            self._pending_steps += 1
            if self._pending_steps >= COUNTS_FOLD_EVERY:  # one host read + pure Python over layers x E
                self.estimator.observe_counts(self._pending_counts.float().cpu().tolist())
                self._pending_counts = None
                self._touch = None  # refreshed from the new routing statistics at the next plan

    def _learn_step_time(self, obs: StepObservation) -> None:
        """The latency model and the token-cost table learn a measured step (forward_ms None: not a measurement)."""
        if obs.forward_ms is None:
            return
        comp = StepComposition(obs.tokens_per_request, obs.context_lens, self.num_moe_layers,
                               obs.distinct_experts if self.num_moe_layers and obs.distinct_experts else None)
        self.latency.observe(comp, obs.forward_ms)
        if not self.latency.fitted and len(self.latency.samples) >= self.latency.min_samples:
            self.latency.fit()
        self.token_costs.observe(sum(obs.tokens_per_request), obs.forward_ms)

    def stats(self, drafter: str | None = None) -> dict[str, float]:
        """Prediction errors: the latency model's (prequential, % of the measured step) and, for `drafter`, the
        calibration's expected calibration error before and after the map."""
        err = self.latency.error_stats()
        out = {"latency_samples": float(err.n), "latency_mean_abs_pct": err.mean_abs_pct,
               "latency_p90_abs_pct": err.p90_abs_pct}
        if self.gate is not None:
            out["speculative_step_share"] = self.gate.speculative_share()
        if drafter is not None and drafter in self.calibrator.drafters:
            cal = self.calibrator.stats(drafter)
            out.update(calibration_samples=float(cal.n), calibration_ece_raw=cal.ece_raw,
                       calibration_ece=cal.ece_calibrated)
        return out
