"""Calibration: a drafter's raw confidence -> observed acceptance probability, per drafter and draft position.

The planner needs acc_ij = P(draft j of request i is accepted | drafts 0..j-1 were), but drafters report a
confidence of their own (an n-gram prior, a draft model's token probability) that is often over-confident.
Per (drafter, position) we keep binned acceptance counts over the confidence axis, shrunk by a small prior,
made monotone non-decreasing in confidence (weighted pool-adjacent-violators: binned isotonic regression), and
read by linear interpolation between bin centres. The prior (prior="pooled", the default) is the drafter's map
over all positions together (its counts summed, themselves shrunk towards the identity map: with no data at all
the raw confidence is trusted): a deep position sees few observations (it is verified only when every draft
before it was accepted), and shrinking it towards the identity map pulled its estimate towards the raw
confidence instead of towards what the drafter's other positions show. In a simulation of c=1 replay
verification (190 steps of 14 drafts, noise confidences) the expected tokens of a 16-draft plan were estimated
2.5% / 4.0% low at acceptance 0.85 / 0.95 with the identity prior, within 0.4% with the pooled one, and an
over-confident drafter's 10-14% high against 2-3% (bench/NOTES.md, 2026-12-02 second session); e2e's hybridspec
counted 6% more tokens than its plans expected at c=1/0.85. prior="identity" keeps the earlier behaviour.
Online: every verification adds observations; ECE is reported before (raw) and after (calibrated, scored
prequentially: each observation against the map as last built before it; with max_stale_reads > 0 that map may
be a few reads older than the counts).

The map is also exported as a table [positions][bins] for planner_torch.calibrate_device. Host numpy: a step's
calibrations and observations run vectorized (with the arithmetic of the per-draft loops, so equal bit for bit),
small ones in plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Sequence

import numpy as np


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

    def add_many(self, p: np.ndarray, accepted: np.ndarray) -> None:
        """add() for each of p [N] (in [0, 1]) and accepted [N] (bool), in order."""
        b = np.minimum(np.maximum((p * 10).astype(np.intp), 0), 9)  # [N] min(9, max(0, int(p * 10)))
        pred = np.array(self.pred)
        np.add.at(pred, b, p)  # one by one in order: the same sums as add()
        self.pred[:] = pred.tolist()
        # hit and n hold whole numbers: adding the counts at once is exact
        self.hit[:] = [h + c for h, c in zip(self.hit, np.bincount(b[accepted], minlength=10).tolist())]
        self.n[:] = [n + c for n, c in zip(self.n, np.bincount(b, minlength=10).tolist())]

    def ece(self) -> float:
        tot = sum(self.n)
        return sum(abs(p - h) for p, h in zip(self.pred, self.hit)) / tot if tot else float("nan")


# a plan's reads (stale_ok) may serve maps this many times max_stale_reads reads old: the rebuild then falls to the
# observation's read (off the critical path on CUDA), which comes every drafted step
STALE_OK_FACTOR = 4


class _DrafterMaps:
    """One drafter's binned isotonic maps, one per draft position (counts and calibrated values [positions,
    bins], the values rebuilt lazily for the positions that saw data) and its ECE bins."""

    def __init__(self, positions: int, num_bins: int, prior_weight: float, max_count_per_bin: float,
                 max_stale_reads: int = 0, pooled: bool = True):
        self.num_bins, self.prior_weight, self.max_count = num_bins, prior_weight, max_count_per_bin
        # the prior of each position's map: the map of all positions' counts together (one position: the identity)
        self.pooled = pooled and positions > 1
        self.max_stale_reads = max_stale_reads  # reads served from values older than the counts (see table)
        self._stale_reads = 0
        self._built = np.zeros(positions, dtype=bool)  # [P] values built at least once
        self.accepted = np.zeros((positions, num_bins))  # [P, nb] (decayed) accepted observations per bin
        self.total = np.zeros((positions, num_bins))  # [P, nb] (decayed) observations per bin
        self._values = np.zeros((positions, num_bins))  # [P, nb] value at each bin centre (where not dirty)
        self._dirty = np.ones(positions, dtype=bool)  # [P] counts changed since the values were built
        self._rows: list[list[float]] | None = None  # _values as lists; None: maybe dirty
        self._stale_rows: list[list[float]] | None = None  # _values as lists while served stale
        self._slopes: np.ndarray | None = None  # [P, nb] values[b + 1] - values[b] (0 at the last bin); None: stale
        self._centre = (np.arange(num_bins) + 0.5) / num_bins  # [nb] bin centres
        self.raw, self.cal = _EceBins(), _EceBins()

    def table(self, stale_ok: bool = False) -> np.ndarray:
        """[P, nb] calibrated acceptance probability at each bin centre (non-decreasing along bins). With
        max_stale_reads > 0, up to that many reads after new counts are served the values as last built (a
        position never built is always built): the maps move slowly, and rebuilding them before every plan
        was most of a learned policy's host time a step at c=1 (~0.2 ms on a CPU core, bench/NOTES.md).
        `stale_ok` (a plan's read, on the step's critical path): stale values are served up to STALE_OK_FACTOR x
        max_stale_reads reads, so the rebuild falls to a read that is not (the observation's scoring, which runs
        while the next forward is on the device)."""
        if self._rows is None:
            dirty = np.flatnonzero(self._dirty)
            if len(dirty):
                limit = self.max_stale_reads * (STALE_OK_FACTOR if stale_ok else 1)
                if self._stale_reads < limit and self._built[dirty].all():
                    self._stale_reads += 1
                    return self._values
                self._rebuild(dirty)
                self._built[dirty] = True
                self._stale_reads, self._stale_rows = 0, None
        return self._values

    def rows(self, stale_ok: bool = False) -> list[list[float]]:
        """table() as lists (per-draft lookups; one read of the maps)."""
        if self._rows is None:
            values = self.table(stale_ok)
            if self._dirty.any():  # served stale: kept as lists until the next rebuild
                if self._stale_rows is None:
                    self._stale_rows = values.tolist()
                return self._stale_rows
            self._rows = values.tolist()
        return self._rows

    def interpolate(self, rows: np.ndarray, confidences: np.ndarray, stale_ok: bool = False) -> np.ndarray:
        """_interpolate for many drafts at once: rows (map of each draft) and confidences broadcastable to one
        shape S -> [S], with the same arithmetic (the slope vals[lo + 1] - vals[lo] is stored per bin)."""
        nb = self.num_bins
        x = confidences * nb - 0.5  # continuous bin coordinate
        x = np.fmin(np.fmax(x, 0.0), nb - 1.0)  # clamped to the outer centres (NaN: fmax gives 0)
        lo = x.astype(np.intp)  # int(x)
        idx = rows * nb + lo
        values = self.table(stale_ok)
        if self._slopes is None:
            self._slopes = np.zeros_like(values)
            self._slopes[:, :-1] = values[:, 1:] - values[:, :-1]
        return values.take(idx) + (x - lo) * self._slopes.take(idx)  # (at the clamps x - lo = 0: vals[lo] + 0)

    def prior_values(self) -> list[float] | None:
        """The pooled prior at the bin centres [nb]: the isotonic map of the counts summed over positions (in
        position order), shrunk towards the identity map; None where the prior is the identity map itself."""
        if not self.pooled:
            return None
        # [nb] each, the rows added in position order as the reference sums them (a cumulative sum is sequential;
        # sum(axis=0) is pairwise where the rows are one bin wide)
        acc, tot = self.accepted.cumsum(axis=0)[-1], self.total.cumsum(axis=0)[-1]
        return _isotonic(acc.tolist(), tot.tolist(), self.prior_weight, self.num_bins)

    def _rebuild(self, dirty: np.ndarray) -> None:
        """Weighted pool-adjacent-violators per dirty position, the counts shrunk towards the prior (the pooled
        map, or the identity): for many positions the per-bin rates in numpy and the pooling (where a bin is
        below its predecessor) in Python; for a few, all in Python."""
        nb, w = self.num_bins, self.prior_weight
        prior = self.prior_values()
        if len(dirty) <= _REBUILD_LOOP_MAX:
            self._values[dirty] = [_isotonic(a, t, w, nb, prior) for a, t in
                                   zip(self.accepted[dirty].tolist(), self.total[dirty].tolist())]
            self._dirty[dirty] = False
            self._slopes = None
            return
        centre = self._centre if prior is None else np.array(prior)  # [nb] what each bin is shrunk towards
        weight = self.total[dirty] + w  # [D, nb]
        if w >= 1e-9 and self.max_count >= 1.0:  # (totals >= 0: every weight >= 1e-9)
            rate = (self.accepted[dirty] + w * centre) / weight
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                rate = np.where(weight > 0, (self.accepted[dirty] + w * centre) / weight, centre)
            weight = np.maximum(weight, 1e-9)  # an empty bin with no prior: the identity, pooled away by any data
        sums = rate * weight  # [D, nb]
        vals = sums / weight  # [D, nb] every bin a block of its own
        drops = vals[:, :-1] > vals[:, 1:]  # [D, nb - 1]
        pool = np.flatnonzero(drops.any(axis=1))
        if len(pool) == len(dirty):
            vals = np.array([_pool_adjacent(s, wt, start) for s, wt, start in
                             zip(sums.tolist(), weight.tolist(), (drops.argmax(axis=1) + 1).tolist())])
        elif len(pool):
            vals[pool] = [_pool_adjacent(s, wt, start) for s, wt, start in
                          zip(sums[pool].tolist(), weight[pool].tolist(), (drops[pool].argmax(axis=1) + 1).tolist())]
        self._values[dirty] = vals
        self._dirty[dirty] = False
        self._slopes = None

    def add(self, positions: np.ndarray, confidences: np.ndarray, accepted: np.ndarray) -> None:
        """Counts observations (positions [N] in 0..P-1, finite confidences [N], accepted [N] bool) in order. A
        bin at max_count forgets old data slowly (drifting acceptance): each new observation first scales it
        to max_count - 1. Bins that cannot reach max_count in this call count in numpy, the others in order."""
        nb, cap = self.num_bins, self.max_count
        bins = np.fmin(np.fmax(confidences * nb, 0.0), nb - 1.0).astype(np.intp)  # min(nb-1, max(0, int(c nb)))
        cells = positions * nb + bins  # [N] into the flattened [P * nb] counts
        acc, tot = self.accepted.reshape(-1), self.total.reshape(-1)  # [P * nb] views
        easy = (tot + np.bincount(cells, minlength=tot.size) <= cap - 1.0)[cells]  # [N]
        if easy.all():
            np.add.at(acc, cells[accepted], 1.0)  # one by one in order: the sums of add_one
            np.add.at(tot, cells, 1.0)
        else:
            np.add.at(acc, cells[easy & accepted], 1.0)
            np.add.at(tot, cells[easy], 1.0)
            hard = ~easy
            a_list, t_list, keep_to = acc.tolist(), tot.tolist(), cap - 1.0
            for c, a in zip(cells[hard].tolist(), np.where(accepted[hard], 1.0, 0.0).tolist()):
                t = t_list[c]
                if t >= cap:
                    keep = keep_to / t
                    a_list[c] = a_list[c] * keep + a
                    t_list[c] = t * keep + 1.0
                else:
                    a_list[c] += a
                    t_list[c] = t + 1.0
            acc[:] = a_list
            tot[:] = t_list
        if self.pooled and len(positions):  # every position's prior moved
            self._dirty[:] = True
        self._dirty[positions] = True
        self._rows = None

    def add_one(self, position: int, confidence: float, accepted: bool) -> None:
        """add() for one observation."""
        b = min(self.num_bins - 1, max(0, int(confidence * self.num_bins)))
        cell = (position, b)
        a, t = self.accepted[cell], self.total[cell]  # (float64 scalars: Python's float arithmetic)
        if t >= self.max_count:
            keep = (self.max_count - 1.0) / t
            a, t = a * keep, t * keep
        self.accepted[cell] = a + (1.0 if accepted else 0.0)
        self.total[cell] = t + 1.0
        if self.pooled:
            self._dirty[:] = True
        self._dirty[position] = True
        self._rows = None


def _isotonic(accepted: list[float], total: list[float], prior_weight: float, nb: int,
              prior: list[float] | None = None) -> list[float]:
    """One map's values at the bin centres: rates shrunk towards the prior (default: the identity map, each bin's
    centre), pooled (_DrafterMaps._rebuild)."""
    sums, weights = [], []
    for b, (a, t) in enumerate(zip(accepted, total)):
        centre = (b + 0.5) / nb if prior is None else prior[b]
        weight = t + prior_weight
        rate = (a + prior_weight * centre) / weight if weight > 0 else centre
        weight = max(weight, 1e-9)  # an empty bin with no prior: the identity, pooled away by any data
        sums.append(rate * weight)
        weights.append(weight)
    return _pool_adjacent(sums, weights)


def _pool_adjacent(sums: list[float], weights: list[float], start: int = 1) -> list[float]:
    """Weighted pool-adjacent-violators over bins (block means sum / weight made non-decreasing), one value per
    bin; bins before `start` are known to be non-decreasing (blocks of their own)."""
    bs, bw, bn = sums[:start], weights[:start], [1] * start
    for s, w in zip(sums[start:], weights[start:]):
        n = 1
        while bs and bs[-1] / bw[-1] > s / w:
            s += bs.pop()
            w += bw.pop()
            n += bn.pop()
        bs.append(s)
        bw.append(w)
        bn.append(n)
    out: list[float] = []
    for s, w, n in zip(bs, bw, bn):
        out += [s / w] * n
    return out


def _interpolate(vals: list[float], nb: int, confidence: float) -> float:
    """The map's value at `confidence`: linear between bin centres, clamped at the outer centres."""
    x = confidence * nb - 0.5  # continuous bin coordinate (comparisons, not min/max: this runs per draft)
    if not x >= 0.0:  # (NaN too)
        return vals[0]
    if x >= nb - 1.0:
        return vals[nb - 1]
    lo = int(x)
    return vals[lo] + (x - lo) * (vals[lo + 1] - vals[lo])


def clip_unit(a: np.ndarray) -> np.ndarray:
    """min(1, max(0, a)) elementwise, as Python evaluates it (NaN -> 0)."""
    return np.where(a > 0.0, np.minimum(a, 1.0), 0.0)


def pad_rows(rows: Sequence[Sequence[float]], fill: float = 0.0) -> tuple[np.ndarray, list[int]]:
    """Ragged rows as a float64 array [len(rows), longest] (`fill` past each row's end) and the row lengths."""
    lens = [len(r) for r in rows]
    width, total = max(lens, default=0), sum(lens)
    flat = np.fromiter(chain.from_iterable(rows), np.float64, count=total)  # [total]
    if total == width * len(rows):
        return flat.reshape(len(rows), width), lens
    out = np.full((len(rows), width), fill)
    out[np.arange(width) < np.array(lens)[:, None]] = flat
    return out, lens


# calibrations / observations of at least this many drafts in one call run in numpy (below: the loops, faster).
# Calibration on this repo's CPU, loop / numpy: 6.5 / 9.9 us at 16 drafts, ~10.5 / 10.4 at 32, 15-16 / 11-12 at 48
_CALIBRATE_NUMPY_MIN, _OBSERVE_NUMPY_MIN = 32, 40
_REBUILD_LOOP_MAX = 6  # maps of at most this many positions rebuild in plain Python


CALIBRATION_PRIORS = ("pooled", "identity")  # what a position's map is shrunk towards (module docstring)


class AcceptanceCalibrator:
    """Per drafter name and draft position (0-based; positions >= max_positions share the last map)."""

    def __init__(self, num_bins: int = 10, max_positions: int = 16, prior_weight: float = 2.0,
                 max_count_per_bin: float = 2000.0, max_stale_reads: int = 0, prior: str = "pooled"):
        if num_bins < 1 or max_positions < 1:
            raise ValueError("num_bins and max_positions must be >= 1")
        if prior not in CALIBRATION_PRIORS:
            raise ValueError(f"prior must be one of {CALIBRATION_PRIORS}, got {prior!r}")
        self.prior = prior
        if max_stale_reads < 0:
            raise ValueError(f"max_stale_reads must be >= 0, got {max_stale_reads}")
        self.num_bins, self.max_positions, self.max_stale_reads = num_bins, max_positions, max_stale_reads
        self.prior_weight, self.max_count_per_bin = prior_weight, max_count_per_bin
        self._maps: dict[str, _DrafterMaps] = {}

    def _drafter(self, drafter: str) -> _DrafterMaps:
        maps = self._maps.get(drafter)
        if maps is None:
            maps = _DrafterMaps(self.max_positions, self.num_bins, self.prior_weight, self.max_count_per_bin,
                                self.max_stale_reads, pooled=self.prior == "pooled")
            self._maps[drafter] = maps
        return maps

    def calibrate(self, drafter: str, position: int, confidence: float) -> float:
        """Calibrated P(accepted | earlier drafts accepted) for one draft."""
        rows = self._drafter(drafter).rows()
        return _interpolate(rows[min(max(position, 0), self.max_positions - 1)], self.num_bins, confidence)

    def calibrate_row(self, drafter: str, confidences: Sequence[float]) -> list[float]:
        """Calibrated acceptance of one request's drafts (positions 0..len-1)."""
        if len(confidences) >= _CALIBRATE_NUMPY_MIN:
            return self.calibrate_rows(drafter, [confidences])[0]
        return self._calibrate_row(self._drafter(drafter).rows(), confidences)

    def _calibrate_row(self, table: list[list[float]], confidences: Sequence[float]) -> list[float]:
        last, nb = self.max_positions - 1, self.num_bins
        return [_interpolate(table[j if j < last else last], nb, c) for j, c in enumerate(confidences)]

    def calibrate_rows(self, drafter: str, confidences: Sequence[Sequence[float]],
                       stale_ok: bool = False) -> list[list[float]]:
        """calibrate_row for every request of a step (rows may differ in length, empty ones too). Runs for every
        draft of every request before each step's plan: in numpy from _CALIBRATE_NUMPY_MIN drafts on."""
        lens = [len(row) for row in confidences]
        if sum(lens) >= _CALIBRATE_NUMPY_MIN:
            rows = self.calibrate_array(drafter, confidences, stale_ok).tolist()
            return rows if min(lens) == max(lens) else [r[:n] for r, n in zip(rows, lens)]
        table = self._drafter(drafter).rows(stale_ok)  # one read of the maps for the whole step
        return [self._calibrate_row(table, row) for row in confidences]

    def calibrate_for_plan(self, drafter: str, confidences: Sequence[Sequence[float]]) -> "list[list[float]] | np.ndarray":
        """A plan's read (stale_ok): calibrate_rows' lists below _CALIBRATE_NUMPY_MIN drafts (the survival and the
        budget search then run their loops too: numpy's per-call overhead was most of a B=1 plan), else
        calibrate_array's [B, K] array. The same values either way (0.0 past a row's end in the array)."""
        if sum(len(row) for row in confidences) < _CALIBRATE_NUMPY_MIN:
            return self.calibrate_rows(drafter, confidences, stale_ok=True)
        return self.calibrate_array(drafter, confidences, stale_ok=True)

    def calibrate_array(self, drafter: str, confidences: Sequence[Sequence[float]] | np.ndarray,
                        stale_ok: bool = False) -> np.ndarray:
        """calibrate_rows as a float64 array [B, K] (K: the longest row; 0.0 past each row's end). A float array
        [B, K] of confidences is B rows of K drafts. `stale_ok`: a plan's read (_DrafterMaps.table)."""
        if isinstance(confidences, np.ndarray):
            conf, lens = confidences.astype(np.float64, copy=False), None
        elif sum(len(row) for row in confidences) < _CALIBRATE_NUMPY_MIN:  # (a few drafts: the loop, padded)
            return pad_rows(self.calibrate_rows(drafter, confidences, stale_ok))[0]
        else:
            conf, lens = pad_rows(confidences)  # [B, K]
        K = conf.shape[1]
        out = self._drafter(drafter).interpolate(np.minimum(np.arange(K), self.max_positions - 1), conf, stale_ok)
        if lens is not None and min(lens, default=K) < K:
            out[np.arange(K) >= np.array(lens)[:, None]] = 0.0
        return out

    def observe(self, drafter: str, position: int, confidence: float, accepted: bool) -> None:
        self.observe_many(drafter, [(position, confidence, accepted)])

    def observe_many(self, drafter: str, observations: Sequence[tuple[int, float, bool]]) -> None:
        """(position, confidence, accepted) observations of one step: all scored (ECE) against the maps as last
        built before the step, then added (one map rebuild per position per step at most, not per observation)."""
        maps, last = self._drafter(drafter), self.max_positions - 1
        if len(observations) < _OBSERVE_NUMPY_MIN:
            self._observe_loop(maps, [(min(max(p, 0), last), c, a) for p, c, a in observations])
            return
        pos, conf, acc = zip(*observations)
        pos = np.minimum(np.maximum(np.array(pos, dtype=np.intp), 0), last)
        self._observe_arrays(maps, pos, np.array(conf, dtype=np.float64), np.array([bool(a) for a in acc]))

    def observe_verification(self, drafter: str, confidences: Sequence[float], num_verified: int,
                             num_accepted: int) -> None:
        """One request's verification outcome: drafts 0..num_accepted-1 accepted, draft num_accepted rejected
        (if it was verified), later ones unobserved (their conditional acceptance is not defined)."""
        self.observe_step(drafter, [(confidences, num_verified, num_accepted)])

    def observe_step(self, drafter: str, outcomes: Sequence[tuple[Sequence[float], int, int]]) -> None:
        """observe_verification for every request of a step: (confidences, num_verified, num_accepted) each."""
        maps, last = self._drafter(drafter), self.max_positions - 1
        counts = [max(0, min(v, len(c), a + 1)) for c, v, a in outcomes]  # drafts observed per request
        n = sum(counts)
        if n < _OBSERVE_NUMPY_MIN:
            self._observe_loop(maps, [(min(j, last), c[j], j < a) for (c, _, a), k in zip(outcomes, counts)
                                      for j in range(k)])
            return
        conf = np.fromiter(chain.from_iterable(c[:k] for (c, _, _), k in zip(outcomes, counts)), np.float64,
                           count=n)  # [n]
        cnt = np.array(counts)
        pos = np.arange(n) - (cnt.cumsum() - cnt).repeat(cnt)  # [n] draft position in its request
        acc = pos < np.array([a for _, _, a in outcomes]).repeat(cnt)
        self._observe_arrays(maps, np.minimum(pos, last), conf, acc)

    def _observe_loop(self, maps: _DrafterMaps, observations: list[tuple[int, float, bool]]) -> None:
        """observe_many one observation at a time (few of them); positions clamped to the maps."""
        rows, nb = maps.rows(), self.num_bins
        scored = [(p, c, a, _interpolate(rows[p], nb, c)) for p, c, a in observations]
        for p, c, a, pred in scored:
            maps.raw.add(min(1.0, max(0.0, c)), a)
            maps.cal.add(pred, a)
            maps.add_one(p, c, a)

    def _observe_arrays(self, maps: _DrafterMaps, pos: np.ndarray, conf: np.ndarray, acc: np.ndarray) -> None:
        """_observe_loop vectorized: positions [N] clamped to the maps, confidences [N], accepted [N] bool."""
        pred = maps.interpolate(pos, conf)  # [N] against the maps before the step
        bad = np.flatnonzero(~np.isfinite(conf * self.num_bins))  # no bin: the loop's int() raises there
        end = int(bad[0]) if len(bad) else len(conf)
        maps.raw.add_many(clip_unit(conf[:end + 1]), acc[:end + 1])  # (the failing one is scored first)
        maps.cal.add_many(pred[:end + 1], acc[:end + 1])
        maps.add(pos[:end], conf[:end], acc[:end])
        if len(bad):
            maps.add_one(int(pos[end]), float(conf[end]), bool(acc[end]))  # raises as the loop does

    def table(self, drafter: str) -> list[list[float]]:
        """[max_positions][num_bins] calibrated values at bin centres (planner_torch.calibrate_device)."""
        return [list(r) for r in self._drafter(drafter).rows()]

    def stats(self, drafter: str) -> CalibrationStats:
        maps = self._maps.get(drafter)
        if maps is None:
            return CalibrationStats(0, float("nan"), float("nan"), float("nan"))
        raw, cal = maps.raw, maps.cal
        n = sum(raw.n)
        return CalibrationStats(int(n), raw.ece(), cal.ece(), sum(raw.hit) / n if n else float("nan"))

    @property
    def drafters(self) -> list[str]:
        return list(self._maps)
