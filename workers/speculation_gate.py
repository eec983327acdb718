"""SpeculationGate: hybridspec drafts only where whole speculative step cycles beat plain decoding at that batch size
(measured per batch-size bucket, the loser probed; the runner's _StepEnds times the cycles). Pure bookkeeping on
host floats: no device work, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


def nearest_bucket(buckets, b: int) -> int:
    """Of the batch-size buckets (powers of two) given, the one closest to b (in doublings; ties: the smaller)."""
    return min(buckets, key=lambda x: (abs(x.bit_length() - b.bit_length()), x))


class SpeculationGate:
    """hybridspec speculates only where it pays, measured on whole step cycles (the runner's _StepEnds: drafting,
    verification, acceptance, the commit's device time and the loop between steps, which the latency model's
    forward times leave out): per batch-size bucket the output tokens per ms per request of decode steps with
    drafts and of plain decode steps (a ratio of EWMAs: tokens over ms). It drafts unless the speculative side is
    measured slower, and probe_spacing steps after its last probe it tries the losing side so that a change of
    acceptance or load is seen (PROBE steps apart, more the farther the loser is behind). Each side is measured
    MIN_SAMPLES times first (speculative first). A drafted step's tokens are the plan's expected tokens
    (LengthPolicy.observe_outcome), which vary far less from step to step than accepted lengths.

    Two rules keep the exploration cheap (bench/NOTES.md: short runs and the buckets met as requests finish paid
    three plain steps each, and a plain probe every 16 steps cost ~3% where speculation wins 3x):
    - plain decoding is not explored where the speculative rate beats `plain_hint` (the latency model's
      forward-only prediction of a plain step: an optimistic plain rate) by HINT_MARGIN, and once both sides are
      measured such a bucket probes plain only every MAX_SPACING x PROBE-th step (the speculative rate counts
      expected tokens, so the probes stay: they catch an optimistic calibration);
    - a bucket met for the first time starts from an adjacent measured bucket's verdict (its two rates, counted
      as measured); its first own sample of either side rescales the other side by the same factor, so the
      ratio between the sides carries over, not the neighbour's per-request scale. Wider probe spacing waits
      until the bucket has measured both sides itself. From a larger neighbour the verdict is speculation's at least
      (the rates tie where plain decoding led): a step's cost rises less per token at smaller batches, so
      speculation's lead does not shrink as the batch does. The buckets a closed batch's tail meets (requests
      leaving one by one, a few steps each) took the full batch's plain verdict and never probed speculation:
      at c=16 / 0.5 (8c8e258) buckets 1-8 decoded plain while c=1 and c=4 measure speculation 1.14x ar.
    The first drafted step after plain ones pays the drafter's catch-up on the tokens it did not draft (c=64 / 0.5,
    dce2f83); the ratio of EWMAs weighs that slow cycle by its time (an EWMA of the rates hardly saw it). A 10%
    margin before a bucket on plain decoding went back to speculation was measured (c7dea79, 06d7c05) and removed:
    no gain at c=64/0.5, and at c=1/0.5 it held plain for 25% of the steps where speculation led by 16%
    (bench/NOTES.md)."""

    PROBE, ALPHA, MIN_SAMPLES, HINT_MARGIN, GAP_UNIT, MAX_SPACING = 16, 0.25, 3, 1.2, 0.05, 4
    # cycles sampled on a measured bucket's winning side: every SAMPLE_EVERY-th step (probes and unmeasured buckets
    # always). The runner marks no CUDA event on an unsampled step (the marks, the cycle's read and the next step's
    # start cost ~0.09 ms of a 13 ms plain step at c=64). A/B on the H200 (90cd570, 3 runs a cell): 4 against 1
    # gave c=64/0.5 0.973 vs 0.958x ar, c=16/0.5 1.006 vs 0.997, c=1/0.85 2.895 vs 2.882 (bench/NOTES.md)
    SAMPLE_EVERY = 4
    # speculation wins a measured bucket only when its rate beats plain decoding's by this fraction (ties would go
    # to plain decoding). A/B at 0 / 0.03 / 0.06 (90cd570, 2 runs a cell): c=64/0.5 0.937 / 0.955 / 0.974x ar,
    # c=64/0.7 1.251 / 1.259 / 1.291, c=16/0.5 0.989 / 0.978 / 0.982, c=16/0.7 1.364 / 1.364 / 1.340: within the
    # runs' spread (c=64/0.7, where the margin cannot bind, moved 3%), so 0
    SPEC_MARGIN = 0.0

    def __init__(self) -> None:
        # (bucket, drafted) -> output tokens per ms per request, the EWMA of its tokens over the EWMA of its ms (per
        # request: a bucket holds several batch sizes, and the losing side's rate is refreshed only by its probes)
        self.rate: dict[tuple[int, bool], float] = {}
        self.ms: dict[tuple[int, bool], float] = {}  # EWMA of the side's cycle ms (its rate x this: tokens)
        self.samples: dict[tuple[int, bool], int] = {}
        self.asked: dict[int, int] = {}  # per bucket: steps decided since its last probe
        self.ticks: dict[int, int] = {}  # per bucket: wants_sample calls (SAMPLE_EVERY's count)
        self.inherited: set[int] = set()  # buckets whose rates are a neighbour's, not yet sampled themselves
        self.own: dict[tuple[int, bool], int] = {}  # samples measured in the bucket itself (not inherited)
        self.decisions = [0, 0]  # steps decided plain, speculative
        # a diagnostic: per (bucket, drafted) the sums of output tokens per request and of cycle ms of every sample
        # (their ratio: the side's pooled rate, beside the EWMA the gate decides on)
        self.pooled: dict[tuple[int, bool], list[float]] = {}
        self.cycles: deque[tuple[int, bool, float, float]] = deque(maxlen=1024)  # recent (b, drafted, tok/req, ms)
        self.force_plain = False  # LengthPolicy.ablate("plain"), benchmarks: every verdict is plain decoding
        # per bucket: whether its last verdict left plain decoding unexplored (too few plain samples, speculation
        # ahead of the optimistic plain hint): its speculative cycles are then timed every SAMPLE_EVERY-th step
        self.plain_unexplored: dict[int, bool] = {}
        self._peek: tuple | None = None  # would_draft's (batch size, sampled, _verdict) for the next should_draft
        self._spacings: dict[tuple[int, bool], int] = {}  # (bucket, ahead) -> probe_spacing until the next sample

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def _measured(self, b: int) -> bool:
        return all(self.samples.get((b, side), 0) >= self.MIN_SAMPLES for side in (True, False))

    def _inherit(self, b: int) -> None:
        if (b, True) in self.samples or (b, False) in self.samples:
            return
        known = [x for x in {k for k, _ in self.samples}
                 if self._measured(x) and abs(x.bit_length() - b.bit_length()) <= 1]  # adjacent buckets only
        if not known:
            return
        near = nearest_bucket(known, b)
        for side in (True, False):
            self.rate[(b, side)] = self.rate[(near, side)]
            self.samples[(b, side)] = self.MIN_SAMPLES
        if near > b:  # a smaller batch than the neighbour's: speculation's lead is at least the neighbour's
            self.rate[(b, True)] = max(self.rate[(b, True)], self.rate[(b, False)] * (1.0 + self.SPEC_MARGIN))
        self.inherited.add(b)
        self._spacings.clear()

    def wants_sample(self, batch_size: int) -> bool:
        """Whether the next step after one at this batch size should be sampled (its cycle timed): always while a
        side of this bucket is unmeasured or inherited, and where a probe is due (a probe is the losing side's
        only measurement); else every SAMPLE_EVERY-th call. (The next step may land in another bucket, as
        requests finish or arrive: a bucket's first step can go untimed, its next ones are timed until it is
        measured. Asking for the buckets a request more or less would meet kept every step timed at c=64,
        whose 65-request bucket is never met.)"""
        if self.SAMPLE_EVERY <= 1:
            return True
        b = self.bucket(batch_size)
        own, least = self.own, self.MIN_SAMPLES
        if b in self.inherited or own.get((b, True), 0) < least:
            return True
        if own.get((b, False), 0) < least:
            # plain decoding unmeasured: timed, but where its last verdict left plain unexplored (speculation
            # ahead of the optimistic hint, c=1 at high acceptance) nothing is to be probed, and the speculative
            # rate is refreshed every SAMPLE_EVERY-th step (every drafted step was timed there: two CUDA events and
            # the cycle's read, ~0.12 ms of a 7.4 ms step on the H200 host)
            if not (self.plain_unexplored.get(b) and self.samples.get((b, False), 0) < least):
                return True
        elif self.asked.get(b, 0) + 1 >= self._spacing(b, False):
            return True  # a probe is due (without the hint: sooner)
        self.ticks[b] = self.ticks.get(b, 0) + 1
        return self.ticks[b] % self.SAMPLE_EVERY == 0

    def should_draft(self, batch_size: int, plain_hint: float | None | Callable[[], float | None] = None,
                     sampled: bool = True, only_plain: bool = False) -> bool:
        """plain_hint: an optimistic estimate of plain decoding's output tokens per ms per request (or a function
        returning it, called only where the verdict needs it). `sampled`:
        whether this step's cycle is timed (wants_sample); an untimed step never probes (a due probe waits for
        the next timed step). `only_plain`: the step decodes plainly whatever the verdict (the runner's hint
        reserved no drafts): a verdict to draft is not counted (a due probe stays due) and answers True."""
        b = self.bucket(batch_size)
        peek, self._peek = self._peek, None
        if peek is not None and peek[0] == batch_size and peek[1] == sampled:
            draft, measured, probe = peek[2]  # would_draft's verdict for this step: nothing was learned since
        else:
            self._inherit(b)
            draft, measured, probe = self._verdict(b, plain_hint, sampled)
        if draft and only_plain:
            return True
        if measured:
            self.asked[b] = 0 if probe else self.asked.get(b, 0) + 1  # steps since the last probe
        self.decisions[draft] += 1
        return draft

    def would_draft(self, batch_size: int, plain_hint: float | None | Callable[[], float | None] = None,
                    sampled: bool = True) -> bool:
        """should_draft's answer for the next step at this batch size, counting nothing (the runner's draft-cap
        hint: the scheduler reserves draft pages only for a step that will draft; it does record, as every
        verdict, whether the bucket leaves plain decoding unexplored). A bucket met for the first time answers
        True (its inherited verdict is settled when the step comes). The verdict is kept for should_draft of the
        next step of this batch size and sampling, which then only counts it (the gate learns nothing in between: a
        step's samples arrive at its end, before the runner peeks; observe drops a kept verdict, and so does a
        step that peeks at nothing, LengthPolicy.wants_cycle): one verdict a step, not two."""
        b = self.bucket(batch_size)
        if (b, True) not in self.samples and (b, False) not in self.samples:
            self._peek = None
            return True
        verdict = self._verdict(b, plain_hint, sampled)
        self._peek = (batch_size, sampled, verdict)
        return verdict[0]

    def _verdict(self, b: int, plain_hint: float | None | Callable[[], float | None],
                 sampled: bool) -> tuple[bool, bool, bool]:
        """(draft, measured: both sides measured, probe: this step probes the losing side) for the next step of
        bucket b. `plain_hint` may be a function: it is called only where the verdict needs it (not while plain
        decoding wins a measured bucket: most plain steps skip the latency model's prediction)."""
        if self.force_plain:  # (every verdict plain: nothing is left unexplored, plain steps are timed)
            self.plain_unexplored[b] = False
            return False, False, False
        spec_n, plain_n = self.samples.get((b, True), 0), self.samples.get((b, False), 0)

        def ahead() -> bool:  # clearly ahead of even an optimistic plain step
            hint = plain_hint() if callable(plain_hint) else plain_hint
            return hint is not None and spec_n > 0 and self.rate[(b, True)] > self.HINT_MARGIN * hint

        if spec_n < self.MIN_SAMPLES:
            return True, False, False
        if plain_n < self.MIN_SAMPLES:
            lead = ahead()  # plain decoding is not explored where speculation is clearly ahead
            if not lead and not sampled and self.plain_unexplored.get(b):
                return True, False, False  # an untimed step (thinned) does not explore: its sample would be lost
            self.plain_unexplored[b] = lead
            return lead, False, False
        spec_wins = self._spec_wins(b)
        probe = sampled and self.asked.get(b, 0) + 1 >= self._spacing(b, spec_wins and ahead())
        return spec_wins != probe, True, probe

    def _spec_wins(self, b: int) -> bool:
        """Speculation leads measured bucket b (by SPEC_MARGIN: ties go to plain decoding)."""
        return self.rate[(b, True)] >= self.rate[(b, False)] * (1.0 + self.SPEC_MARGIN)

    def quiet_streak(self, batch_size: int) -> int:
        """Right after would_draft answered plain for the next step of this batch size, untimed and no probe: how
        many steps after that one are plain, untimed and no probe too, as long as the gate learns nothing new (the
        runner's quiet plain steps: they count their verdict with quiet_step instead of asking for it). -1 where the
        answer depends on more than the bucket's counters: a bucket not measured by itself, speculation leading,
        forced plain decoding, every step timed. The runner's next_step at a step's end increments the bucket's
        ticks (a timed step every SAMPLE_EVERY-th) unless a probe is due (asked + 1 >= the spacing), and the next
        step's start counts asked (+1); step j after the peeked one is the first that is timed or probes:
        (ticks + j) % SAMPLE_EVERY == 0 or asked + j + 1 >= spacing."""
        b = self.bucket(batch_size)
        own, least = self.own, self.MIN_SAMPLES
        if self.force_plain or self.SAMPLE_EVERY <= 1 or b in self.inherited or \
                own.get((b, True), 0) < least or own.get((b, False), 0) < least:
            return -1
        if self._spec_wins(b):
            return -1
        ticks, every = self.ticks.get(b, 0), self.SAMPLE_EVERY
        return max(0, min(self._spacing(b, False) - self.asked.get(b, 0) - 2, every - ticks % every - 1))

    def quiet_step(self, batch_size: int, start: bool) -> None:
        """A quiet plain step's counting (quiet_streak): at its start the plain verdict it was given (should_draft's
        count: asked + 1, one more plain decision; no verdict is kept), at its end next_step's tick of the step
        after it (wants_sample's count: that step is untimed)."""
        b = self.bucket(batch_size)
        if start:
            self._peek = None
            self.asked[b] = self.asked.get(b, 0) + 1
            self.decisions[0] += 1
        else:
            self.ticks[b] = self.ticks.get(b, 0) + 1

    def _spacing(self, b: int, ahead: bool) -> int:
        """probe_spacing at bucket b's rates, kept until the gate learns a sample (two calls a step otherwise)."""
        n = self._spacings.get((b, ahead))
        if n is None:
            n = self._spacings[(b, ahead)] = self.probe_spacing(b, self.rate[(b, True)], self.rate[(b, False)], ahead)
        return n

    def probe_spacing(self, b: int, spec: float, plain: float, ahead: bool) -> int:
        """Steps between probes of the losing side: PROBE, times the loser's gap to the winner in GAP_UNITs (a
        probe costs the step that gap, so a far loser is probed less often: a probe's cost per step stays about
        GAP_UNIT / PROBE), MAX_SPACING where speculation is ahead of the optimistic plain hint; plain PROBE until
        the bucket has measured both sides itself (an inherited verdict is checked soon)."""
        if not self.own.get((b, True), 0) or not self.own.get((b, False), 0):
            return self.PROBE
        gap = 1.0 - min(spec, plain) / max(spec, plain) if max(spec, plain) > 0 else 0.0
        factor = self.MAX_SPACING if ahead else min(self.MAX_SPACING, max(1.0, gap / self.GAP_UNIT))
        return int(round(self.PROBE * factor))

    def observe(self, batch_size: int, drafted: bool, tokens: float, step_ms: float) -> None:
        if step_ms <= 0 or tokens <= 0:  # (no decode step yields no token)
            return
        self._peek = None  # (a verdict peeked before this sample is stale, and so are the probe spacings)
        self._spacings.clear()
        b = self.bucket(batch_size)
        key = (b, drafted)
        tok = tokens / max(1, batch_size)
        r = tok / step_ms
        self.cycles.append((b, drafted, tok, step_ms))
        if b in self.inherited:  # the first own sample: keep the neighbour's ratio, take this bucket's scale
            self.inherited.discard(b)
            other = (b, not drafted)
            self.rate[other] *= r / self.rate[key] if self.rate[key] > 0 else 1.0
            self.rate[key] = r
            self.ms[key] = step_ms
        elif key not in self.rate or key not in self.ms:
            self.rate[key], self.ms[key] = r, step_ms
        else:
            # a ratio of EWMAs: of the tokens per request (rate x ms) and of the cycle's ms, so that a side's rate is
            # its tokens over its time, as a cell's throughput is; an EWMA of the rates themselves is led by the
            # fast steps (at c=64/0.5, efebc90: 0.087 against a pooled 0.072 for speculation, 0.076 against 0.069
            # for plain)
            ms = (1 - self.ALPHA) * self.ms[key] + self.ALPHA * step_ms
            self.rate[key] = ((1 - self.ALPHA) * self.rate[key] * self.ms[key] + self.ALPHA * tok) / ms
            self.ms[key] = ms
        self.samples[key] = self.samples.get(key, 0) + 1
        self.own[key] = self.own.get(key, 0) + 1
        pooled = self.pooled.setdefault(key, [0.0, 0.0])  # the diagnostic's pooled rate: sums, not an EWMA
        pooled[0] += tok
        pooled[1] += step_ms

    def speculative_share(self) -> float:
        return self.decisions[1] / max(1, sum(self.decisions))
