"""ModelRunner: executes one scheduled step on the device: drafting, one ragged verification forward,
acceptance, and the commit of exactly the accepted tokens.

It owns the model, its state storage, the drafter and each request's sampling generator (so a seed reproduces a
stream wherever the request runs). The engine talks to it through plain data (StepRequest / StepResult).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from scheduler.types import StepRequest, StepResult
from workers.acceptance import accept
from workers.batch import ForwardBatch
from workers.cache import ModelCache, StepScratch
from workers.graphs import BATCH_BUCKETS, StepGraphs, token_buckets
from workers.config import ModelConfig
from workers.drafters import Drafter, DraftRequest, unkeyed_sampling
from workers.model import HybridModel, MoEContext
from workers.policy import EXTRA_FROM, DeviceReadback, LengthPolicy, StepObservation
from workers.sampling import make_generator

def timing_events(device: torch.device) -> tuple | None:
    """A (begin, end) pair of timing CUDA events for a timer that is read before it is started again (the
    runner's, one pair per timer kept for its life: creating an event cost ~25 us of host time on the H200 host, two
    a timer a step on the critical path); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class _ForwardTimer:
    """Times the target forward for the latency model without a host sync of its own: CUDA events, read after
    acceptance has synchronized anyway (host clock on CPU). `events`: the pair to record (timing_events; re-recorded
    by the next timer, so this one is read first)."""

    def __init__(self, device: torch.device, events: tuple | None):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = events
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


# CUDA: a step's learning (latency model, calibration, routing statistics) runs while the next step's forward is
# on the device, off the host's critical path (the runner's defer_learning; never under expert parallelism, where
# the learning is a collective)
DEFER_LEARNING = True
MAX_GRAPH_SETS = 3  # graph sets kept (each holds its buckets' graphs and a shared [max tokens, V] output)
POLICY_STATS_EVERY = 16  # steps between reports of the latency model's and the calibration's errors
DRAFT_SEED_SALT = 0x5DEECE66D  # a request's draft stream is seeded from its seed, apart from its sampling stream


class _DraftTimer:
    """Times the drafter's propose(): CUDA events where it reads its drafts back (so the end event, recorded
    after it returns, follows only its own work and reading it waits for nothing else; the begin event fires when
    the device reaches the drafting, after the previous step's tail), the host clock otherwise (a host-only
    drafter such as ngram, or CPU)."""

    def __init__(self, device: torch.device, reads_back: bool, events: tuple | None):
        self.cuda = device.type == "cuda" and reads_back
        if self.cuda:
            self.begin, self.end = events
            self.begin.record()
        self.t0 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return (time.perf_counter() - self.t0) * 1e3


class _StepEnds:
    """hybridspec's gate samples a decode step's whole cycle: from where the step before it handed over (after its
    routing-statistics fold) to the end of everything the step launched. The host's step time is not that: the
    commit is queued after acceptance has read back, so its device time lands in the next step (at c=64 / 0.5 on the
    H200, ddebf45: plain steps after drafted ones took ~2 ms longer than AR's, and the gate drafted on 46% of the
    steps where plain decoding was faster). A step's end is marked after its last launch and before its learning's
    routing-statistics fold (no cost of the step's kind); on CUDA the rest of a step's learning runs inside the next
    step while its forward is on the device (DEFER_LEARNING: hidden unless it outlasts the forward); the next cycle
    starts where the step returns (`resumed`). CUDA: events, each cycle read at a later step's end, once the device
    has passed it (never waited for; unread cycles are tried again at later steps, the newest MAX_PENDING kept);
    CPU: the host clock (all of a step's work is done when it returns: the cycle is known at once). A step that
    starts more than max(GAP_MS, its own host time up to its end mark) after the last one returned (the engine had
    no work for a while) gives no sample."""

    GAP_MS = 5.0
    MAX_PENDING = 4
    RING = 32
    THIN: bool | None = None  # None: thin on CUDA only (tests set True to run the thinning on the host clock)

    def __init__(self, device: torch.device, clock=time.perf_counter, new_event=None):
        self.cuda, self.clock = device.type == "cuda" or new_event is not None, clock
        self.new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self.ring: list = []  # CUDA events, re-recorded in turn
        self.next = 0  # marks made
        self.stamp: dict[int, int] = {}  # id(event) -> the mark that last recorded it
        self.dropped = 0  # cycles whose events were re-recorded before the device passed them (never read)
        # steps the gate does not sample make no marks (on CUDA; the host clock's marks cost nothing)
        self.thin = self.cuda if self.THIN is None else self.THIN
        self.resume: tuple | None = None  # (marker, host time) where the last step returned
        self.last_end: tuple | None = None  # (end marker, drafted or None) of the last step
        # (start marker, end marker, sample, (previous end marker, its drafted), the markers' stamps) of cycles not
        # read yet, oldest first
        self.pending: list[tuple] = []
        # a diagnostic: device ms between a step's end mark and where the next cycle starts (no cycle holds them),
        # by whether that step drafted: [sum ms, count]
        self.between: dict[bool, list[float]] = {}

    def mark(self):
        """A point in the step's stream of work: a CUDA event recorded now, or the host clock. The events are a ring
        of RING, re-recorded in turn (creating one cost ~25 us of host time a mark on the H200 host; a marker is
        read within a few steps; a pending cycle whose events were re-recorded meanwhile is dropped, never misread)."""
        if not self.cuda:
            return self.clock()
        if len(self.ring) < self.RING:
            self.ring.append(self.new_event())
        event = self.ring[self.next % self.RING]
        self.next += 1
        self.stamp[id(event)] = self.next
        event.record()
        return event

    def take_dropped(self) -> int:
        """Cycles dropped since the last call (their events re-recorded before the device passed them)."""
        n, self.dropped = self.dropped, 0
        return n

    def _stamps(self, *markers) -> tuple:
        return tuple(self.stamp.get(id(m)) for m in markers)

    @staticmethod
    def _on_host(marker) -> bool:
        """A host-clock marker (a number: CPU, or on CUDA a cycle's end where the device idles, see resumed)."""
        return isinstance(marker, (int, float))

    def _elapsed_ms(self, begin, end) -> float | None:
        """ms from begin to end: host-clock markers subtract, events once the device has passed end; None while it
        has not, and for a host marker against an event (two clocks: no time between them)."""
        if not self.cuda:
            return (end - begin) * 1e3
        if self._on_host(begin) or self._on_host(end):
            return (end - begin) * 1e3 if self._on_host(begin) and self._on_host(end) else None
        return begin.elapsed_time(end) if end.query() else None

    def _resolve(self) -> list[tuple]:
        """The pending samples whose ends have been reached, as (batch size, drafted, tokens, cycle ms); the
        others stay pending (the newest MAX_PENDING)."""
        done, left = [], []
        for begin, end, sample, before, stamps in self.pending:
            if self.cuda and self._stamps(begin, end, before[0]) != stamps:
                self.dropped += 1  # an event re-recorded by a later mark: its time is not this cycle's
                continue
            ms = self._elapsed_ms(begin, end)
            if ms is None:
                left.append((begin, end, sample, before, stamps))
                continue
            if ms > 0:
                done.append((*sample, ms))
            prev_end, prev_drafted = before
            if prev_end is not None and prev_drafted is not None:
                gap = self._elapsed_ms(prev_end, begin)  # reached: begin precedes end
                if gap is not None:
                    tally = self.between.setdefault(prev_drafted, [0.0, 0])
                    tally[0] += gap
                    tally[1] += 1
        self.pending = left[-self.MAX_PENDING:]
        return done

    def step_ended(self, started: float, ended: float, end, sample: tuple | None) -> list[tuple]:
        """After a step's learning. `started` / `ended`: the host times the step began and its end was marked;
        `end`: its mark() after its last launch; `sample`: what the gate counts for it, (batch size, drafted,
        tokens), or None (no gate sample). Returns the samples whose cycles are known now, as (batch size,
        drafted, tokens, cycle ms)."""
        prev_end, prev_drafted = self.last_end if self.last_end is not None else (None, None)
        if sample is not None and self.resume is not None:
            begin, returned = self.resume
            # (a host-clock begin with an event end: a cycle on two clocks, not timed; end_mark makes none)
            if self._on_host(begin) == self._on_host(end) and \
                    started - returned <= max(self.GAP_MS / 1e3, ended - started):
                self.pending.append((begin, end, sample, (prev_end, prev_drafted),
                                     self._stamps(begin, end, prev_end)))
        self.last_end = (end, sample[1] if sample is not None else None)
        self.resume = None
        return self._resolve()

    @property
    def sampling(self) -> bool:
        """Whether the current step's cycle is timed: where the last step marked its return (on CUDA, see
        resumed), always on the host clock."""
        return not self.thin or self.resume is not None

    def resumed(self, sample_next: bool = True, host: bool = False) -> None:
        """At the very end of a step: the next step's cycle starts here. On CUDA (`thin`) a next step the gate
        does not sample gets no marks at all (SpeculationGate.SAMPLE_EVERY). `host`: the next cycle is timed on the
        host clock, CUDA too (the runner: this step launched nothing after its read-back and the next one decodes
        plainly, by its draft-cap hint of 0: the device is idle at both ends of that cycle, so the host's clock
        times it as its events would, but for the few us of the learning's small copies launched after the end
        mark, which the host clock counts in the next cycle). A CUDA event there cost ~0.03-0.04 ms of host time a
        mark on the step's critical path, two a timed plain step (H200, bench/host_phases.py at 9aa5dee: a
        forced-plain step's time after its read-back 0.232 ms median against ar's 0.069). The `between` diagnostic
        has no gap where a host-clock end meets an event start (two clocks)."""
        if not self.samples(sample_next):
            self.resume = None
            return
        now = self.clock()
        self.resume = (now if host or not self.cuda else self.mark(), now)

    def quiet_end(self) -> None:
        """step_ended of a quiet plain step (untimed, no gate sample; a streak starts with nothing pending)."""
        self.last_end = (None, False)
        self.resume = None

    def end_mark(self, launched_after_readback: bool):
        """The marker of a step's end (after its last launch): the host clock where its cycle began on the host
        clock and the step launched nothing after its read-back (the device idles from there), else mark()."""
        if self.resume is not None and self._on_host(self.resume[0]) and not launched_after_readback:
            return self.clock()
        return self.mark()

    def samples(self, sample_next: bool) -> bool:
        """Whether the next step's cycle is timed (its `sampling`) once resumed(sample_next) has run."""
        return sample_next or not self.thin


class ModelRunner:
    def __init__(self, model: HybridModel, cache: ModelCache, drafter: Drafter | None = None,
                 policy: str = "fixed", max_verify_len: int = 16):
        self.model, self.cache, self.drafter = model, cache, drafter
        self.device = model.device
        self.generators: dict[str, torch.Generator | None] = {}
        self.draft_generators: dict[str, torch.Generator | None] = {}
        self.graph_config: tuple[int, int] | None = None  # (max batch, page-table width) once enabled
        self._graph_capture = True
        self._steps = 0
        self._graphs: OrderedDict[tuple, StepGraphs] = OrderedDict()  # per (policy flags, drafter needs), LRU
        self._dropped_captures = 0  # captures of the sets dropped so far (captures_total never goes down)
        # a step's policy.observe waits for the next step's forward launch (see DEFER_LEARNING)
        self.defer_learning = DEFER_LEARNING and self.device.type == "cuda"
        self._learning: tuple | None = None  # (policy, drafter name, observation, kept counts) not learned yet
        # the last draft-cap hint reported was 0 (the gate's peeked verdict: plain); kept across steps with a
        # prefill and across policy swaps, as the scheduler keeps the hint
        self._hinted_plain = False
        # hybridspec's quiet plain steps ahead: (batch size, steps) whose gate verdicts are known to be plain, untimed
        # and no probe (SpeculationGate.quiet_streak; the last of them asks next_step again); None: none. A quiet
        # step counts its verdict instead of asking the gate (should_draft, observe_outcome, step_ended, next_step,
        # resumed: ~0.04 ms of a plain step's host time on the H200 host, bench/NOTES.md 2026-12-06)
        self._quiet: tuple[int, int] | None = None
        # CUDA: the policy's error report (POLICY_STATS_EVERY) is owed by the last step and made inside the next
        # one's forward (each report was ~0.3 ms of host time after a step's read-back on the H200 host, 9aa5dee)
        self._stats_due = False
        self._owed_stats: dict[str, float] | None = None
        # the forward's and the drafting's timers record these events, each read within its step
        self._forward_events, self._draft_events = timing_events(self.device), timing_events(self.device)
        self.set_policy(policy, max_verify_len)

    def set_policy(self, policy: str, max_verify_len: int = 16) -> None:
        self.use_policy(LengthPolicy(policy, self.model.config, max_verify_len, self.device))

    def use_policy(self, policy: LengthPolicy) -> None:
        """Runs the next steps under `policy` (a new one, or one kept from earlier runs); the gate's cycles start
        afresh (no cycle of the last policy's steps reaches this one's gate)."""
        self.flush_learning()
        if self._stats_due:  # the report the last policy's step owed: that policy's, delivered with the next result
            self._owed_stats, self._stats_due = self._policy_stats(), False
        self.policy = policy
        self._ends = _StepEnds(self.device)
        self._quiet = None
        self._ends.between = policy.gate_between  # the diagnostic accumulates over the policy's runs

    @classmethod
    def create(cls, model_config: ModelConfig, model_dir, dtype: torch.dtype, device: str, num_pages: int,
               page_size: int, num_slots: int, local_experts=None) -> "ModelRunner":
        """`local_experts` (an expert-parallel rank): one id list per MoE layer; only those experts are loaded
        onto the device (workers/expert_parallel.py shard_model_ then hooks the exchange in)."""
        from workers.weights import load_weights

        model = HybridModel(model_config, dtype, device, experts_device="meta" if local_experts is not None else None)
        load_weights(model, model_dir, local_experts=local_experts)
        # one spare page and slot past the allocator's range: padding rows of captured graphs write there
        return cls(model, ModelCache(model_config, num_pages + 1, page_size, num_slots + 1, dtype, device))

    def enable_graphs(self, max_batch: int, max_pages_per_request: int, warm: bool = True,
                      capture: bool = True) -> str | None:
        """CUDA graphs for decode and verification steps (CUDA only), captured per bucket on first use; `warm`
        captures the plain-decode buckets now. Returns None, or why steps stay eager. The cache must have a
        spare page and slot past the allocator's range (create() makes them). `capture=False` runs the graphs'
        padded static batches eagerly instead (any device: tests of the padding)."""
        if capture and self.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        self.graph_config = (max_batch, max_pages_per_request)
        self._graph_capture = capture
        self._drop_sets(keep=None)  # sets built for another configuration
        if warm:
            try:
                graphs = self.step_graphs()
                for b in [x for x in BATCH_BUCKETS if x < max_batch] + [max_batch]:
                    key = graphs.bucket(b, b, 1, 1)
                    if key is not None and key not in graphs.graphs:
                        graphs.run(key, [[0]] * b, [1] * b, [[graphs.spare_page]] * b, [graphs.spare_slot] * b,
                                   [False] * b, [])
            except Exception as e:  # noqa: BLE001 - eager still works; say why
                self.graph_config = None
                self._drop_sets(keep=None)
                return f"capture failed: {type(e).__name__}: {e}"
        return None

    def step_graphs(self) -> StepGraphs | None:
        """The graph set for the current policy and drafter (built on first use), or None if not enabled."""
        if self.graph_config is None:
            return None
        max_batch, width = self.graph_config
        block = self.policy.max_verify_len + 1
        hidden = bool(getattr(self.drafter, "needs_hidden", False))
        flags = (block, hidden, self.policy.uses_extra_token, self.policy.collects_routing)
        if flags in self._graphs:
            self._graphs.move_to_end(flags)
        else:
            while len(self._graphs) >= MAX_GRAPH_SETS:  # e.g. a benchmark sweeping K: keep the recent sets
                self._drop_set(next(iter(self._graphs)))
            graphs = self._graphs[flags] = StepGraphs(
                self.model, self.cache, max_block=block, spare_page=self.cache.num_pages - 1,
                spare_slot=self.cache.num_slots - 1, page_table_width=width, max_tokens=max_batch * block,
                return_hidden=hidden, extra_token=flags[2], collect_counts=flags[3], capture=self._graph_capture,
                extra_from=EXTRA_FROM)
            graphs.reclaim = lambda: self._drop_sets(keep=flags)
        return self._graphs[flags]

    def _drop_sets(self, keep: tuple | None) -> bool:
        """Drops every graph set but `keep`'s (another policy's or drafter's: a set is kept per configuration, and a
        benchmark or a policy swap leaves earlier ones behind), their private pools with them: a set whose capture
        runs out of memory asks for this first (StepGraphs.reclaim; on an H100 at c=16 the earlier policies' sets
        held memory the capture lacked). -> whether one was dropped."""
        others = [k for k in self._graphs if k != keep]
        if others and self._graph_capture and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the device is done with their graphs
        for k in others:
            self._drop_set(k)
        return bool(others)

    def _drop_set(self, key: tuple) -> None:
        self._dropped_captures += self._graphs.pop(key).captures  # (its captures still count: graph_captures)

    def graph_captures(self) -> int:
        """The target's step graphs captured so far, the dropped sets' included (never goes down)."""
        return sum(g.captures for g in self._graphs.values()) + self._dropped_captures

    def captures_total(self) -> int:
        """CUDA graphs captured so far by this runner and its drafter (a step that captured is no measurement of
        a step)."""
        n = self.graph_captures()
        drafter_graphs = getattr(self.drafter, "graphs", None) or getattr(
            getattr(self.drafter, "cost_model", None), "graphs", None)
        return n + (drafter_graphs.captures if drafter_graphs is not None else 0)

    def profile(self, max_batch: int, repeats: int = 2, seed: int = 0) -> dict:
        """Start-up profile: times synthetic verification steps of several shapes (requests x block length, on
        the spare page and slot: no request's state is touched) and fits the policy's latency model, token-cost
        table and routing statistics from them, so the learned policies plan from the first real step (and the
        graphs of those buckets are captured now, not while serving). Returns what was fitted."""
        self.flush_learning()  # a served step's learning is not the profile's
        spare_page, spare_slot = self.cache.num_pages - 1, self.cache.num_slots - 1
        page_size = self.cache.page_size
        block = self.policy.max_verify_len + 1
        sizes = sorted({1, max(1, max_batch // 4), max_batch})
        lengths = sorted({1, 2, max(2, block // 4), max(2, block // 2), max(2, 3 * block // 4), block})
        gen = torch.Generator().manual_seed(seed)
        stats = self.policy.routing_stats
        self.policy.routing_stats = True  # the profile measures routing statistics even where serving does not
        try:
            graphs = self.step_graphs()
        finally:
            self.policy.routing_stats = stats
        samples = 0
        for b in sizes:
            lengths_b = lengths
            if self.policy.bucket_profile:  # hybridspec-bucketprofile: + the uniform blocks that fill a token bucket
                buckets = set(graphs.tokens if graphs is not None else token_buckets(b * block))
                lengths_b = sorted(set(lengths) | {t for t in range(1, block + 1) if b * t in buckets})
            for t in lengths_b:
                blocks = [torch.randint(0, self.model.config.vocab_size, (t,), generator=gen).tolist()
                          for _ in range(b)]
                context = [page_size // 2] * b
                pages = [[spare_page] * (-(-(page_size // 2 + t) // page_size))] * b
                batch = ForwardBatch.build(blocks, context, pages, [spare_slot] * b, self.device)
                eager_stats: MoEContext | None = None  # this shape's statistics where its bucket collects none
                for rep in range(repeats + 1):  # the first run compiles / captures
                    moe = MoEContext(collect_counts=True)
                    timer = _ForwardTimer(self.device, self._forward_events)
                    key = graphs.bucket(b, b * t, t, len(pages[0])) if graphs is not None else None
                    out = graphs.run(key, blocks, context, pages, [spare_slot] * b, [False] * b, []) \
                        if key is not None else None
                    if out is not None:
                        moe = out.moe
                    else:
                        self.model(batch, self.cache, torch.arange(b * t, device=self.device), write=False,
                                   scratch=StepScratch({}), moe=moe)
                    timer.stop()
                    if rep == 0:
                        continue
                    if out is not None and graphs.collect_counts and not graphs.graphs[key].counts and t > 1:
                        # a small batch's verification bucket (graphs.py: extra_from) in a set that collects
                        # statistics: they come from one untimed eager forward of the same shape
                        if eager_stats is None:
                            eager_stats = MoEContext(collect_counts=True)
                            self.model(batch, self.cache, torch.arange(b * t, device=self.device), write=False,
                                       scratch=StepScratch({}), moe=eager_stats)
                        moe = eager_stats
                    distinct = [int(x) for x in moe.stacked_distinct().tolist()] \
                        if moe.distinct_experts else None
                    self.policy.observe_profile(StepObservation([t] * b, context, timer.elapsed_ms(), distinct),
                                                moe.expert_counts or None)
                    samples += 1
        fitted = self.policy.finish_profile()
        return {"samples": samples, "fitted": fitted}

    def execute(self, requests: list[StepRequest]) -> StepResult:
        """Runs every request's tokens as one ragged forward. Prefill chunks advance their state directly;
        decodes verify their drafts (if any) without writing GDN state, and the commit replays exactly the
        accepted tokens. A request with nothing cached starts from a zero GDN state."""
        start = time.perf_counter()
        captures_at_start = self.captures_total()  # the drafter's captures count too
        result = StepResult()
        if not requests:
            return result
        fresh = [r for r in requests if r.context_len == 0]
        self.cache.reset_slots([r.slot for r in fresh])
        if self.drafter is not None and fresh:
            self.drafter.release([r.request_id for r in fresh])  # (re)starting: forget stale draft state
        # 1. draft, 2. choose verification lengths (+ the router-correction extra token)
        drafts: dict[int, list[int]] = {}
        draft_probs: dict[int, torch.Tensor | None] = {}
        confidences: dict[int, list[float]] = {}
        extra: set[int] = set()
        draft_reqs: list[DraftRequest] = []
        spec = [i for i, r in enumerate(requests)
                if r.sample and len(r.tokens) == 1 and r.context_len > 0 and r.draft_cap > 0]
        decode_only = all(r.sample and len(r.tokens) == 1 and r.context_len > 0 for r in requests)
        # hybridspec's gate: plain decoding measured faster than speculation at this batch size. After a draft-cap
        # hint of 0 (the gate's verdict for this step, peeked: no draft pages reserved) the gate still decides plain
        # steps, so that its probes come due; where its verdict is to draft now (the batch moved to another bucket)
        # there are no drafts: a plain step that the gate does not count (a due probe stays due, and the next hint
        # announces it)
        # A quiet plain step (a streak's: its verdict, plain, untimed and no probe, known since the streak began,
        # _quiet) only counts it; a streak ends at any other step (another batch size, a prefill, a timed step)
        hinted_plain = self.drafter is not None and decode_only and not spec and self._hinted_plain and \
            self.policy.gate is not None
        quiet = hinted_plain and self._quiet is not None and self._quiet[0] == len(requests) and \
            not self._ends.sampling
        if not quiet:
            self._quiet = None
        if quiet:
            self.policy.gate.quiet_step(len(requests), start=True)
        elif hinted_plain:
            # plain: counted, its probe clock advances (one verdict: True is one the step misses, not counted)
            if self.policy.should_draft([r.context_len for r in requests], self._ends.sampling, only_plain=True):
                self.policy.gate_hint_misses += 1
        elif spec and self.drafter is not None and decode_only and \
                not self.policy.should_draft([r.context_len for r in requests], self._ends.sampling):
            spec = []
        if self.drafter is not None and self.policy.name != "ar" and spec:
            cap = self.policy.draft_cap(len(requests))  # hybridspec drafts only what it may verify
            draft_reqs = [self._draft_request(requests[i], cap) for i in spec]
            captures_before_draft = self.captures_total()
            draft_timer = _DraftTimer(self.device, self.drafter.reads_back, self._draft_events)
            proposal = self.drafter.propose(draft_reqs)
            # the drafter's time and the rows it drafted (drafts + the pending token of each request with drafts),
            # for hybridspec's width_plan; not timed where it drafted nothing (on CUDA reading the end event would
            # then wait for the previous step's queued work) or captured a graph
            rows = sum(len(t) + 1 for t in proposal.tokens if t)
            self.policy.observe_draft(len(requests), rows, draft_timer.elapsed_ms()
                                      if rows and self.captures_total() == captures_before_draft else None)
            caps = [0] * len(requests)
            confs: list[list[float]] = [[] for _ in requests]
            # unseeded sampled requests whose drafts were drawn at random (from q, or the replay drafter's draws)
            sampled = set()
            for i, toks, conf, probs in zip(spec, proposal.tokens, proposal.confidence, proposal.probs):
                caps[i], confs[i] = min(requests[i].draft_cap, len(toks)), conf
                if unkeyed_sampling(requests[i].params) and (probs is not None or self.drafter.draws_at_random):
                    sampled.add(i)
            lengths = self.policy.lengths(self.drafter.name, caps, confs, [len(r.tokens) for r in requests],
                                          [r.context_len for r in requests])
            # the router correction verifies an extra draft or not by that draft's own experts: for such a draft that
            # choice would depend on what was drawn, and the output would no longer follow the target's distribution
            # (drafters.draw_independent): their blocks get no extra token
            extra_caps = [lengths[i] if i in sampled else c for i, c in enumerate(caps)] if sampled else caps
            extra_ok = self.policy.extra_tokens(lengths, extra_caps) if self.policy.uses_extra_token else set()
            for i, toks, probs, conf in zip(spec, proposal.tokens, proposal.probs, proposal.confidence):
                n = lengths[i]
                if i in extra_ok:
                    n += 1  # one extra token, kept only if the router correction finds its experts covered
                    extra.add(i)
                if n > 0:  # L = 0 is plain decoding
                    drafts[i] = toks[:n]
                    draft_probs[i] = probs[:n] if probs is not None else None
                    confidences[i] = conf[:n]
        blocks = [r.tokens + drafts.get(i, []) for i, r in enumerate(requests)]
        starts = [0]  # host copy of cu_seqlens
        for b in blocks:
            starts.append(starts[-1] + len(b))
        # logits: every position of a verified block, the last position of other sampling requests
        rows, spans = [], {}
        for i, r in enumerate(requests):
            if r.sample:
                first = starts[i + 1] - 1 - len(drafts.get(i, []))
                spans[i] = (len(rows), len(rows) + starts[i + 1] - first)
                rows.extend(range(first, starts[i + 1]))
        moe, scratch, hidden, batch, key, captured = None, None, None, None, None, False
        learns_experts = self.policy.collects_routing  # only hybridspec's latency model uses expert counts
        graphs = self.step_graphs()
        if graphs is not None and decode_only:
            key = graphs.bucket(len(requests), starts[-1], max(len(b) for b in blocks),
                                max(len(r.pages) for r in requests))
        timer = _ForwardTimer(self.device, self._forward_events)
        out = None
        if key is not None:  # a captured graph: logits of every flat row, spans index them directly
            out = graphs.run(key, blocks, [r.context_len for r in requests], [r.pages for r in requests],
                             [r.slot for r in requests], [i not in drafts for i in range(len(requests))],
                             [starts[i + 1] - 1 for i in extra])
            if out is None:  # the bucket failed to capture: this step (and the bucket's next ones) run eagerly
                key = None
        if out is not None:
            logits, hidden, moe = out.logits, out.hidden, out.moe
            captured = out.captured
            spans = {i: (starts[i + 1] - 1 - len(drafts.get(i, [])), starts[i + 1]) for i in spans}
        else:
            batch = ForwardBatch.build(blocks, [r.context_len for r in requests], [r.pages for r in requests],
                                       [r.slot for r in requests], self.device)
            extra_rows = None
            if extra:
                extra_rows = torch.zeros(batch.num_tokens, dtype=torch.bool)
                extra_rows[[starts[i + 1] - 1 for i in extra]] = True
                extra_rows = extra_rows.to(self.device)
            if learns_experts or extra:
                moe = MoEContext(extra_rows=extra_rows, collect_counts=learns_experts, collect_distinct=learns_experts)
            write = torch.tensor([i not in drafts for i in range(len(requests))], device=self.device)
            scratch = StepScratch({}) if drafts else None
            out = self.model(batch, self.cache, torch.tensor(rows, dtype=torch.long, device=self.device),
                             write=True if scratch is None else write, scratch=scratch,
                             return_hidden=getattr(self.drafter, "needs_hidden", False), moe=moe)
            logits, hidden = out if isinstance(out, tuple) else (out, None)
        timer.stop()
        # the previous step's learning, deferred: the host learns while the device runs this forward (its policy is
        # this one: use_policy flushes before a swap; a due fold of its routing counts waits for the end mark)
        self.flush_learning(fold=False)
        if self._stats_due:  # the errors' report that the last step owed (~0.3 ms of host on the H200 host)
            result.policy_stats, self._stats_due = self._policy_stats(), False
        elif self._owed_stats is not None:  # owed by the policy before the last swap (use_policy)
            result.policy_stats, self._owed_stats = self._owed_stats, None
        # what the learning reads of the device is queued now, behind the forward and before its read-back (a
        # graph's static outputs are overwritten by the next replay): the distinct experts' async copy to the host
        # and the sampled counts' copy cost host time (~0.1 ms a drafted step on the H200 host, a copy and an event
        # record) that after the read-back was on the step's critical path, and is hidden under the forward here;
        # on the device they add a few us ahead of the read-back. A step that captured a graph or ran eagerly with
        # graphs on is no measurement of the step (forward_ms below): nothing is read for it
        timed = not captured and not (graphs is not None and key is None)
        distinct = self._read_distinct(moe) if timed and learns_experts and moe and moe.distinct_experts else None
        kept_counts = self.policy.keep_counts(moe.counts_view()) if learns_experts and moe is not None else None
        # the greedy rows' argmax (step 4) is launched before the router correction's verdict is read (step 3): it
        # queues behind the forward and one wait covers both. Launched after that read (hybridspec from the
        # EXTRA_FROM bucket on, where extra tokens are sent), it started only once the host had read the mask and
        # trimmed the drafts, on an idle device, and was waited for again: the host's work between the two reads, a
        # launch and a second wake-up added to every such step (its kernel's time is paid either way; estimated
        # tens of us, not measured on the GPU). The logits, and so the choices, are the same.
        greedy = logits.argmax(dim=-1) if any(requests[i].params.temperature == 0 for i in spans) else None
        # 3. the router correction's verdict on each extra token: a masked one is not verified
        if extra and moe is not None and moe.token_mask is not None:
            kept = moe.token_mask.tolist()
            self.policy.observe_extra(len(requests), sum(bool(kept[starts[i + 1] - 1]) for i in extra), len(extra))
            for i in extra:
                if not kept[starts[i + 1] - 1]:
                    drafts[i] = drafts[i][:-1]
                    confidences[i] = confidences[i][:-1]
                    if draft_probs.get(i) is not None:
                        draft_probs[i] = draft_probs[i][:-1]
                    lo, hi = spans[i]
                    spans[i] = (lo, hi - 1)
        # 4. acceptance (the greedy rows' argmax read back once) and commit of exactly the accepted tokens
        choices = greedy.tolist() if greedy is not None else None
        keep = [len(b) for b in blocks]
        accepted_counts, verified = {}, []
        for i, (lo, hi) in spans.items():
            r = requests[i]
            mine = drafts.get(i, [])
            a, new = accept(logits[lo:hi], choices[lo:hi] if choices is not None else None, mine,
                            draft_probs.get(i) if mine else None, r.params, self._generator(r),
                            r.context_len + len(r.tokens))  # (the sequence index the span's first row predicts)
            result.new_tokens[r.request_id] = new
            if i in drafts:
                keep[i] = len(r.tokens) + a
                if mine:
                    result.draft_tokens[r.request_id] = len(mine)
                    result.accepted_tokens[r.request_id] = a
                    verified.append((confidences[i], len(mine), a))
            accepted_counts[i] = a
        if key is not None and drafts:
            graphs.commit(key, [keep[i] if i in drafts else 0 for i in range(len(requests))])
        elif scratch is not None:
            self.model.commit(batch, self.cache, scratch, torch.tensor(keep, device=self.device), written=write)
        if draft_reqs:  # every drafter rolls back to what was accepted (0 where nothing was verified)
            self.drafter.commit(draft_reqs, [accepted_counts.get(i, 0) if i in drafts else 0 for i in spec])
        if hidden is not None:  # the MTP head pairs every committed token with the target's hidden state
            self.drafter.observe([(r.request_id, blocks[i][:keep[i]], hidden[starts[i]:starts[i] + keep[i]],
                                   r.context_len, r.pages, r.slot) for i, r in enumerate(requests)])
        # 5. what the latency model and the calibration learn from this step (a step that captured a graph
        # first is no measurement of the step: its time goes to the calibration only)
        # (the drafter's too, its propose's included: a drafter graph captured there is no served step's time)
        self.last_step_captured = captured or self.captures_total() > captures_at_start
        self.last_step_eager = graphs is not None and decode_only and key is None  # graphs on, this step eager
        self.last_draft_width = max((r.k for r in draft_reqs), default=0)  # drafts asked per request (0: none)
        self.last_step_key = key  # the graph bucket the step ran (None: eager), for benchmarks' per-bucket times
        # with graphs on, an eager step (prefill, mixed) is host-bound and of another kind: no sample of the
        # latency model, which plans the graphed decode/verify steps
        forward_ms = timer.elapsed_ms() if timed else None
        step_ms = (time.perf_counter() - start) * 1e3  # before the routing-statistics fold below (it must not
        # land in it); so does the end of the gate's cycle
        gated = self.policy.gate is not None
        # device work this step queued after its read-back (a commit, the drafter's roll-back, the MTP head's
        # pairs), or no read-back at all (a prefill chunk with nothing to sample leaves its forward running): its
        # cycle ends on an event, and so does the next one's start
        launched_after = bool(draft_reqs) or bool(drafts) or hidden is not None or not spans
        end, ended = (self._ends.end_mark(launched_after), self._ends.clock()) if gated and self._ends.sampling \
            else (None, 0.0)
        # (what it reads of the device was queued before the read-back); the learning itself waits for the next
        # step's forward launch where deferred
        learning = (self.policy, self.drafter.name if self.drafter is not None else None, StepObservation(
            [len(b) for b in blocks], [r.context_len for r in requests], forward_ms, distinct, verified), kept_counts)
        self.policy.fold_counts()  # (a no-op unless COUNTS_FOLD_EVERY samples are in)
        self._learning = learning
        if not self.defer_learning:
            self.flush_learning()
        sample = None
        if quiet:  # untimed and plain: no gate sample, nothing pending to read (a streak starts with none)
            self._ends.quiet_end()
        else:
            if decode_only and self.drafter is not None and self.captures_total() == captures_at_start:
                tokens = self.policy.observe_outcome(len(requests), bool(draft_reqs),
                                                     sum(len(v) for v in result.new_tokens.values()), step_ms,
                                                     forward_ms)
                sample = None if tokens is None else (len(requests), bool(draft_reqs), tokens)
            if gated:
                for cycle in self._ends.step_ended(start, ended, end, sample):
                    self.policy.observe_cycle(*cycle)
                self.policy.gate_dropped += self._ends.take_dropped()
        self._steps += 1
        if self._steps % POLICY_STATS_EVERY == 1:  # the first step, then every POLICY_STATS_EVERY
            if self.defer_learning:  # reported by the next step, from inside its forward (off the critical path)
                self._stats_due = True
            else:
                result.policy_stats = self._policy_stats()
        sample_next = False
        streak = quiet and self._quiet[1] > 1
        if decode_only and self.drafter is not None and self.policy.name != "ar":
            # the scheduler's next reservation: the drafts per request worth drafting at this batch size, none
            # where the gate will decode the next step plainly (its reserved pages would go back unused, and
            # longer page tables can move the step to a wider graph bucket). A step with a prefill reports no
            # hint: the scheduler keeps the last one, and so does _hinted_plain. The gate's two questions about
            # the next step (time its cycle? draft?) in one call, its verdict kept for that step
            if streak:  # the next step is quiet too: untimed, plain (its tick counted)
                self.policy.gate.quiet_step(len(requests), start=False)
                self._quiet = (self._quiet[0], self._quiet[1] - 1)
            elif gated:
                sample_next, drafts = self.policy.next_step(
                    len(requests), lambda: [r.context_len + keep[i] for i, r in enumerate(requests)], self._ends.thin)
                self._hinted_plain = not drafts
                # a quiet streak: the next step and the n after it are plain, untimed, no probe (SpeculationGate.
                # quiet_streak), while the gate learns nothing (no cycle pending; untimed steps give none)
                n = self.policy.quiet_streak(len(requests)) if not drafts and not sample_next and \
                    self._ends.thin and not self._ends.pending else -1
                self._quiet = (len(requests), n + 1) if n >= 0 else None
            else:
                self._hinted_plain = False
            if self._hinted_plain:
                result.draft_cap_hint = 0  # (the cap itself is not asked for: ~5 us of a plain step's host path)
            else:
                cap = self.policy.draft_cap(len(requests))
                result.draft_cap_hint = self.policy.max_verify_len if cap is None else cap
        elif gated:
            sample_next = self.policy.wants_cycle(len(requests))
        if gated and not streak:  # (after the hint: its host time is this step's, not the next cycle's)
            self._ends.resumed(sample_next, host=self._hinted_plain and not launched_after)
        result.step_ms = (time.perf_counter() - start) * 1e3
        return result

    def _policy_stats(self) -> dict[str, float]:
        return self.policy.stats(self.drafter.name if self.drafter is not None else None)

    def flush_learning(self, fold: bool = True) -> None:
        """Learns the last step now if its learning was deferred (before reading or replacing the policy).
        `fold=False` (inside a step, while its forward runs): a due fold of the routing counts waits for the
        step's end mark (its copy and its pure-Python fold are host time that belongs to no step's cycle)."""
        pending, self._learning = self._learning, None
        if pending is not None:
            policy, drafter, obs, counts = pending
            policy.observe(drafter, obs, counts, fold=fold)
            if self.defer_learning:  # its distinct experts too, if on the host already (else at the next plan)
                policy.settle_ready()

    def _read_distinct(self, moe: MoEContext) -> "list[int] | DeviceReadback":
        """The step's distinct experts per MoE layer for the latency model. On CUDA an async copy to the host that
        the policy reads once it has arrived (after the next forward launch) or at its next plan: the runner queues it
        right after the forward's launch, where a synchronous read would wait for the whole forward (after the
        read-back it waited for the commit the GPU was still running, ~1 ms a step at c=1, bench/NOTES.md). A
        captured graph's static output is copied to the host straight away: the copy is queued before the next
        replay overwrites it."""
        stacked = moe.stacked_distinct()  # [MoE layers]
        if self.device.type != "cuda":
            return [int(x) for x in stacked.tolist()]
        return DeviceReadback(stacked)

    def _draft_request(self, r: StepRequest, cap: int | None = None) -> DraftRequest:
        if r.request_id not in self.draft_generators:  # its own stream: a seed reproduces drafts too
            seed = None if r.params.seed is None else (r.params.seed ^ DRAFT_SEED_SALT) % (2**63)
            self.draft_generators[r.request_id] = make_generator(seed, self.device)
        return DraftRequest(r.request_id, r.all_tokens, r.context_len, r.pages, r.slot,
                            r.draft_cap if cap is None else min(r.draft_cap, cap), r.params,
                            self.draft_generators[r.request_id])

    def release(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests' sampling and drafting state."""
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.draft_generators.pop(rid, None)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    def _generator(self, request: StepRequest) -> torch.Generator | None:
        if request.request_id not in self.generators:
            self.generators[request.request_id] = make_generator(request.params.seed, self.device)
        return self.generators[request.request_id]
