"""ExtraGate: hybridspec's router correction sends extra tokens only where that measurably pays.

The extra token's rule (LengthPolicy.extra_tokens) prices each extra from a prediction: its keep rate times the
survival of its draft, against the cost curve's dense rise. On the bench model (Zipf routing, no per-request
locality) that prediction said the extras were nearly free, and the steps that sent them ran slower for what they
returned: at c=64 / 0.7 hybridspec ran 1.29x ar against 1.34x with no extra tokens (f16ef77, bench/NOTES.md), and
earlier ablations found no gain from them in any cell. So, as SpeculationGate does for drafting, the extras are
judged by what the steps deliver: per batch-size bucket, the output tokens per ms per request of drafted steps
under each verdict (extras sent where the rule picks them, or none), a ratio of EWMAs (tokens over ms). Each side is
measured MIN_SAMPLES times first (extras first: the rule's own verdict), then the leader decides, and the other side
is tried every spacing()-th decision so that a change of load or routing is seen: PROBE times the loser's gap in
GAP_UNITs, at most MAX_SPACING x PROBE (as SpeculationGate spaces its probes). Every switch of verdict perturbs
the plan's other learners (its cost by token count mixes steps with and without extras): with a fixed spacing of 16
the gated rule ran 5% under both pure rules at c=16 / 0.85 (47a8be1, bench/NOTES.md), so a far loser is tried
rarely. A due probe stays due until a step under it is measured (a drafted step that captures a graph or carries
a prefill chunk is decided but not observed). The step's ms is the runner's host clock to the end of its acceptance:
device work queued after the read-back (the commit, the drafter's roll-back) lands in the next step's, which
slightly favours the side that accepts more. A step counts for the verdict it ran
under, whether or not the rule then sent any extra (it is the rule that is on trial, not one token). Pure
bookkeeping: no device work, no torch.
"""

from __future__ import annotations


class ExtraGate:
    MIN_SAMPLES, PROBE, ALPHA, GAP_UNIT, MAX_SPACING = 6, 16, 0.15, 0.02, 4

    def __init__(self) -> None:
        # (bucket, sends) -> EWMA of output tokens per request, and of the step's ms
        self.tokens: dict[tuple[int, bool], float] = {}
        self.ms: dict[tuple[int, bool], float] = {}
        self.samples: dict[tuple[int, bool], int] = {}
        self.since_probe: dict[int, int] = {}  # per bucket: decisions since the last probe
        self.decisions = [0, 0]  # verdicts: no extras, extras

    def rate(self, bucket: int, sends: bool) -> float | None:
        """Output tokens per ms per request of the side's steps (None: not measured)."""
        key = (bucket, sends)
        return self.tokens[key] / self.ms[key] if key in self.ms and self.ms[key] > 0 else None

    def sends(self, bucket: int) -> bool:
        """The verdict for one drafted step at this bucket (counted: call once a step)."""
        on, off = self.samples.get((bucket, True), 0), self.samples.get((bucket, False), 0)
        if on < self.MIN_SAMPLES:
            verdict = True
        elif off < self.MIN_SAMPLES:
            verdict = False
        else:
            lead = self.rate(bucket, True) >= self.rate(bucket, False)
            n = self.since_probe[bucket] = self.since_probe.get(bucket, 0) + 1
            verdict = lead != (n >= self.spacing(bucket))  # (reset by the probe's measurement, observe)
        self.decisions[verdict] += 1
        return verdict

    def spacing(self, bucket: int) -> int:
        """Decisions between probes of the losing side once both are measured: PROBE x the loser's gap to the
        leader in GAP_UNITs, between 1 and MAX_SPACING."""
        on, off = self.rate(bucket, True), self.rate(bucket, False)
        gap = 1.0 - min(on, off) / max(on, off) if on and off else 0.0
        return int(round(self.PROBE * min(self.MAX_SPACING, max(1.0, gap / self.GAP_UNIT))))

    def observe(self, bucket: int, sends: bool, tokens_per_request: float, step_ms: float) -> None:
        """A drafted step that ran under verdict `sends`: its output tokens per request and its ms."""
        if step_ms <= 0 or tokens_per_request <= 0:
            return
        key = (bucket, sends)
        on, off = self.rate(bucket, True), self.rate(bucket, False)
        if self._measured(bucket) and (on >= off) != sends:  # the losing side measured: the probe is done
            self.since_probe[bucket] = 0
        if key not in self.ms:
            self.tokens[key], self.ms[key] = tokens_per_request, step_ms
        else:
            a = self.ALPHA
            self.tokens[key] += a * (tokens_per_request - self.tokens[key])
            self.ms[key] += a * (step_ms - self.ms[key])
        self.samples[key] = self.samples.get(key, 0) + 1

    def _measured(self, bucket: int) -> bool:
        return all(self.samples.get((bucket, side), 0) >= self.MIN_SAMPLES for side in (True, False))

    def share(self) -> float:
        """Fraction of verdicts that sent extras."""
        return self.decisions[1] / max(1, sum(self.decisions))
