"""Calibration: a drafter's raw confidence -> observed acceptance probability, per drafter and draft position.

The planner needs acc_ij = P(draft j of request i is accepted | drafts 0..j-1 were), but drafters report a
confidence of their own (an n-gram prior, a draft model's token probability) that is often over-confident.
Per (drafter, position) we keep binned acceptance counts over the confidence axis, shrunk towards the identity
map by a small prior (trust the raw confidence until data says otherwise), made monotone non-decreasing in
confidence (weighted pool-adjacent-violators: binned isotonic regression), and read by linear interpolation
between bin centres. Online: every verification adds observations; ECE is reported before (raw) and after
(calibrated, scored prequentially: each observation against the map as it was before it).

The map is also exported as a table [positions][bins] for planner_torch.calibrate_device. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class CalibrationStats:
    """Expected calibration error (10 equal-width bins of the predicted probability), in probability units."""

    n: int
    ece_raw: float  # of the drafter's own confidence
    ece_calibrated: float  # of the calibrated probability (prequential)
    mean_accept: float  # observed acceptance rate


@dataclass
class _EceBins:
    pred: list[float] = field(default_factory=lambda: [0.0] * 10)
    hit: list[float] = field(default_factory=lambda: [0.0] * 10)
    n: list[float] = field(default_factory=lambda: [0.0] * 10)

    def add(self, p: float, accepted: bool) -> None:
        b = min(9, max(0, int(p * 10)))
        self.pred[b] += p
        self.hit[b] += 1.0 if accepted else 0.0
        self.n[b] += 1.0

    def ece(self) -> float:
        tot = sum(self.n)
        return sum(abs(p - h) for p, h in zip(self.pred, self.hit)) / tot if tot else float("nan")


class _PositionMap:
    """Binned isotonic map for one (drafter, position)."""

    def __init__(self, num_bins: int, prior_weight: float, max_count_per_bin: float):
        self.num_bins, self.prior_weight, self.max_count = num_bins, prior_weight, max_count_per_bin
        self.accepted = [0.0] * num_bins
        self.total = [0.0] * num_bins
        self._values: list[float] | None = None

    def add(self, confidence: float, accepted: bool) -> None:
        b = min(self.num_bins - 1, max(0, int(confidence * self.num_bins)))
        if self.total[b] >= self.max_count:  # forget old data slowly (drifting acceptance)
            keep = (self.max_count - 1.0) / self.total[b]
            self.accepted[b] *= keep
            self.total[b] *= keep
        self.accepted[b] += 1.0 if accepted else 0.0
        self.total[b] += 1.0
        self._values = None

    def values(self) -> list[float]:
        """Calibrated acceptance probability at each bin centre (non-decreasing)."""
        if self._values is None:
            nb, w = self.num_bins, self.prior_weight
            blocks: list[list[float]] = []  # [weighted sum, weight, bins]
            for b in range(nb):
                centre = (b + 0.5) / nb
                weight = self.total[b] + w
                rate = (self.accepted[b] + w * centre) / weight if weight > 0 else centre
                weight = max(weight, 1e-9)  # an empty bin with no prior: the identity, pooled away by any data
                blocks.append([rate * weight, weight, 1])
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    s, wt, n = blocks.pop()
                    blocks[-1][0] += s
                    blocks[-1][1] += wt
                    blocks[-1][2] += n
            self._values = [blk[0] / blk[1] for blk in blocks for _ in range(int(blk[2]))]
        return self._values

    def __call__(self, confidence: float) -> float:
        return _interpolate(self.values(), self.num_bins, confidence)


def _interpolate(vals: list[float], nb: int, confidence: float) -> float:
    """The map's value at `confidence`: linear between bin centres, clamped at the outer centres."""
    x = confidence * nb - 0.5  # continuous bin coordinate (comparisons, not min/max: this runs per draft)
    if not x >= 0.0:  # (NaN too)
        return vals[0]
    if x >= nb - 1.0:
        return vals[nb - 1]
    lo = int(x)
    return vals[lo] + (x - lo) * (vals[lo + 1] - vals[lo])


class AcceptanceCalibrator:
    """Per drafter name and draft position (0-based; positions >= max_positions share the last map)."""

    def __init__(self, num_bins: int = 10, max_positions: int = 16, prior_weight: float = 2.0,
                 max_count_per_bin: float = 2000.0):
        if num_bins < 1 or max_positions < 1:
            raise ValueError("num_bins and max_positions must be >= 1")
        self.num_bins, self.max_positions = num_bins, max_positions
        self.prior_weight, self.max_count_per_bin = prior_weight, max_count_per_bin
        self._maps: dict[str, list[_PositionMap]] = {}
        self._ece_raw: dict[str, _EceBins] = {}
        self._ece_cal: dict[str, _EceBins] = {}

    def _map(self, drafter: str, position: int) -> _PositionMap:
        maps = self._maps.get(drafter)
        if maps is None:
            maps = [_PositionMap(self.num_bins, self.prior_weight, self.max_count_per_bin)
                    for _ in range(self.max_positions)]
            self._maps[drafter] = maps
            self._ece_raw[drafter], self._ece_cal[drafter] = _EceBins(), _EceBins()
        return maps[min(max(position, 0), self.max_positions - 1)]

    def calibrate(self, drafter: str, position: int, confidence: float) -> float:
        """Calibrated P(accepted | earlier drafts accepted) for one draft."""
        return self._map(drafter, position)(confidence)

    def calibrate_row(self, drafter: str, confidences: Sequence[float]) -> list[float]:
        """Calibrated acceptance of one request's drafts (positions 0..len-1). (Runs for every draft of every
        request before each step's plan: the maps are looked up once, not per draft.)"""
        self._map(drafter, 0)
        maps, last, nb = self._maps[drafter], self.max_positions - 1, self.num_bins
        return [_interpolate(maps[j if j < last else last].values(), nb, c) for j, c in enumerate(confidences)]

    def observe(self, drafter: str, position: int, confidence: float, accepted: bool) -> None:
        self.observe_many(drafter, [(position, confidence, accepted)])

    def observe_many(self, drafter: str, observations: Sequence[tuple[int, float, bool]]) -> None:
        """(position, confidence, accepted) observations of one step: all scored (ECE) against the maps as they
        were before the step, then added (one map rebuild per position per step, not per observation)."""
        self._map(drafter, 0)
        raw, cal = self._ece_raw[drafter], self._ece_cal[drafter]
        maps, last, nb = self._maps[drafter], self.max_positions - 1, self.num_bins
        scored = []
        for pos, conf, acc in observations:
            m = maps[min(max(pos, 0), last)]
            scored.append((m, conf, acc, _interpolate(m.values(), nb, conf)))
        for m, conf, acc, pred in scored:
            raw.add(min(1.0, max(0.0, conf)), acc)
            cal.add(pred, acc)
            m.add(conf, acc)

    def observe_verification(self, drafter: str, confidences: Sequence[float], num_verified: int,
                             num_accepted: int) -> None:
        """One request's verification outcome: drafts 0..num_accepted-1 accepted, draft num_accepted rejected
        (if it was verified), later ones unobserved (their conditional acceptance is not defined)."""
        self.observe_step(drafter, [(confidences, num_verified, num_accepted)])

    def observe_step(self, drafter: str, outcomes: Sequence[tuple[Sequence[float], int, int]]) -> None:
        """observe_verification for every request of a step: (confidences, num_verified, num_accepted) each."""
        obs = []
        for confidences, num_verified, num_accepted in outcomes:
            for j in range(min(num_verified, len(confidences), num_accepted + 1)):
                obs.append((j, confidences[j], j < num_accepted))
        self.observe_many(drafter, obs)

    def table(self, drafter: str) -> list[list[float]]:
        """[max_positions][num_bins] calibrated values at bin centres (planner_torch.calibrate_device)."""
        self._map(drafter, 0)
        return [list(m.values()) for m in self._maps[drafter]]

    def stats(self, drafter: str) -> CalibrationStats:
        raw, cal = self._ece_raw.get(drafter), self._ece_cal.get(drafter)
        if raw is None:
            return CalibrationStats(0, float("nan"), float("nan"), float("nan"))
        n = sum(raw.n)
        return CalibrationStats(int(n), raw.ece(), cal.ece(), sum(raw.hit) / n if n else float("nan"))

    @property
    def drafters(self) -> list[str]:
        return list(self._maps)
