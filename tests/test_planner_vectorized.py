"""The numpy paths of the host planning (calibration, survival, the budget search, the token-cost table) equal
the per-draft Python loops they replace, bit for bit. The references below are the loops as they were before
vectorization (the specification); random cases cover ragged and empty rows, caps of 0 and beyond the rows,
ties, NaN and out-of-range confidences, saturated calibration bins and cost tables of 0, 1, 2 and many points.
CPU, fast."""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from scheduler.calibration import AcceptanceCalibrator
from scheduler.latency_model import ModelTokenCost, TokenCostTable
from scheduler.planner import Plan, budget_plan, survival_from_acceptance

# ---------------------------------------------------------------------------------------------------------
# references: the loops before vectorization


def ref_survival(acceptance):
    out = []
    for row in acceptance:
        s, r = 1.0, []
        for a in row:
            s *= min(1.0, max(0.0, a))
            r.append(s)
        out.append(r)
    return out


def ref_budget_plan(survival, caps, table, base_tokens, base_gain=None, draft_ms=0.0):
    caps = [max(0, min(int(c), len(row))) for c, row in zip(caps, survival)]
    items = sorted((-float(survival[i][j]), i, j) for i, cap in enumerate(caps) for j in range(cap))
    gain0 = float(len(survival)) if base_gain is None else float(base_gain)
    costs = table.costs_ms(base_tokens, base_tokens + len(items))
    best_b, best_r, gain = 0, gain0 / (draft_ms + costs[0]), gain0
    for b, (neg_s, _, _) in enumerate(items, start=1):
        gain -= neg_s
        r = gain / (draft_ms + costs[b])
        if r > best_r:
            best_b, best_r = b, r
    lengths = [0] * len(survival)
    gain = gain0
    for neg_s, i, j in items[:best_b]:
        lengths[i] = max(lengths[i], j + 1)
        gain -= neg_s
    return Plan(lengths, gain, draft_ms + costs[best_b])


class RefCosts:
    """TokenCostTable.cost_ms / costs_ms over a table's fitted points, as the loops computed them."""

    def __init__(self, table: TokenCostTable):
        self.ts, self.ys = list(table.tokens), list(table._fitted_ms)

    def cost_ms(self, num_tokens):
        ts, ys = self.ts, self.ys
        if not ts:
            raise RuntimeError("token cost table is empty: fit it from a profile first")
        if len(ts) == 1:
            return ys[0]
        if num_tokens <= ts[0]:
            return ys[0]
        for i in range(1, len(ts)):
            if num_tokens <= ts[i]:
                f = (num_tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        return ys[-1] + self._tail_slope() * (num_tokens - ts[-1])

    def costs_ms(self, lo, hi):
        ts, ys = self.ts, self.ys
        if len(ts) <= 1:
            return [self.cost_ms(n) for n in range(lo, hi + 1)]
        slope = self._tail_slope()
        out, i = [], bisect.bisect_left(ts, lo)
        for n in range(lo, hi + 1):
            while i < len(ts) and ts[i] < n:
                i += 1
            if n <= ts[0]:
                out.append(ys[0])
            elif i == len(ts):
                out.append(ys[-1] + slope * (n - ts[-1]))
            else:
                out.append(ys[i - 1] + (n - ts[i - 1]) / (ts[i] - ts[i - 1]) * (ys[i] - ys[i - 1]))
        return out

    def _tail_slope(self):
        ts, ys = self.ts, self.ys
        mt = sum(ts) / len(ts)
        my = sum(ys) / len(ys)
        var = sum((t - mt) ** 2 for t in ts)
        return max(0.0, sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var) if var else 0.0


@dataclass
class RefEceBins:
    pred: list = field(default_factory=lambda: [0.0] * 10)
    hit: list = field(default_factory=lambda: [0.0] * 10)
    n: list = field(default_factory=lambda: [0.0] * 10)

    def add(self, p, accepted):
        b = min(9, max(0, int(p * 10)))
        self.pred[b] += p
        self.hit[b] += 1.0 if accepted else 0.0
        self.n[b] += 1.0

    def ece(self):
        tot = sum(self.n)
        return sum(abs(p - h) for p, h in zip(self.pred, self.hit)) / tot if tot else float("nan")


class RefPositionMap:
    def __init__(self, num_bins, prior_weight, max_count_per_bin):
        self.num_bins, self.prior_weight, self.max_count = num_bins, prior_weight, max_count_per_bin
        self.accepted = [0.0] * num_bins
        self.total = [0.0] * num_bins
        self._values = None
        self._version = None

    def add(self, confidence, accepted):
        b = min(self.num_bins - 1, max(0, int(confidence * self.num_bins)))
        if self.total[b] >= self.max_count:
            keep = (self.max_count - 1.0) / self.total[b]
            self.accepted[b] *= keep
            self.total[b] *= keep
        self.accepted[b] += 1.0 if accepted else 0.0
        self.total[b] += 1.0
        self._values = None

    def values(self, prior=None, version=None):
        """The map at the bin centres, shrunk towards `prior` (None: the identity map); cached per `version`
        (the calibrator's count of observations, which moves the pooled prior)."""
        if self._values is None or self._version != version:
            self._values = ref_isotonic(self.accepted, self.total, self.prior_weight, self.num_bins, prior)
            self._version = version
        return self._values


def ref_isotonic(accepted, total, w, nb, prior=None):
    blocks = []
    for b in range(nb):
        centre = (b + 0.5) / nb if prior is None else prior[b]
        weight = total[b] + w
        rate = (accepted[b] + w * centre) / weight if weight > 0 else centre
        weight = max(weight, 1e-9)
        blocks.append([rate * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, wt, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += wt
            blocks[-1][2] += n
    return [blk[0] / blk[1] for blk in blocks for _ in range(int(blk[2]))]


def ref_interpolate(vals, nb, confidence):
    x = confidence * nb - 0.5
    if not x >= 0.0:
        return vals[0]
    if x >= nb - 1.0:
        return vals[nb - 1]
    lo = int(x)
    return vals[lo] + (x - lo) * (vals[lo + 1] - vals[lo])


class RefCalibrator:
    """One map per position as plain Python lists; prior "pooled": each position's map is shrunk towards the
    map of all positions' counts summed (position by position), itself shrunk towards the identity."""

    def __init__(self, num_bins=10, max_positions=16, prior_weight=2.0, max_count_per_bin=2000.0, prior="pooled"):
        self.num_bins, self.max_positions = num_bins, max_positions
        self.prior_weight, self.max_count_per_bin = prior_weight, max_count_per_bin
        self.prior = prior
        self._maps, self._ece_raw, self._ece_cal = {}, {}, {}
        self._version = {}  # drafter -> observations counted (the pooled prior's cache key)
        self._priors = {}  # drafter -> (version, pooled prior at that version)

    def _values(self, drafter, m):
        maps = self._maps[drafter]
        if self.prior == "identity" or len(maps) == 1:
            return m.values()
        version = self._version.get(drafter, 0)
        cached = self._priors.get(drafter)
        if cached is None or cached[0] != version:  # the pooled prior, once per version (not per map read)
            acc, tot = list(maps[0].accepted), list(maps[0].total)
            for other in maps[1:]:
                acc = [a + b for a, b in zip(acc, other.accepted)]
                tot = [a + b for a, b in zip(tot, other.total)]
            cached = self._priors[drafter] = (version, ref_isotonic(acc, tot, self.prior_weight, self.num_bins))
        return m.values(cached[1], version)

    def _map(self, drafter, position):
        maps = self._maps.get(drafter)
        if maps is None:
            maps = [RefPositionMap(self.num_bins, self.prior_weight, self.max_count_per_bin)
                    for _ in range(self.max_positions)]
            self._maps[drafter] = maps
            self._ece_raw[drafter], self._ece_cal[drafter] = RefEceBins(), RefEceBins()
        return maps[min(max(position, 0), self.max_positions - 1)]

    def calibrate(self, drafter, position, confidence):
        m = self._map(drafter, position)
        return ref_interpolate(self._values(drafter, m), m.num_bins, confidence)

    def calibrate_row(self, drafter, confidences):
        self._map(drafter, 0)
        maps, last, nb = self._maps[drafter], self.max_positions - 1, self.num_bins
        return [ref_interpolate(self._values(drafter, maps[j if j < last else last]), nb, c)
                for j, c in enumerate(confidences)]

    def observe_many(self, drafter, observations):
        self._map(drafter, 0)
        raw, cal = self._ece_raw[drafter], self._ece_cal[drafter]
        maps, last, nb = self._maps[drafter], self.max_positions - 1, self.num_bins
        scored = []
        for pos, conf, acc in observations:
            m = maps[min(max(pos, 0), last)]
            scored.append((m, conf, acc, ref_interpolate(self._values(drafter, m), nb, conf)))
        for m, conf, acc, pred in scored:
            raw.add(min(1.0, max(0.0, conf)), acc)
            cal.add(pred, acc)
            m.add(conf, acc)
            self._version[drafter] = self._version.get(drafter, 0) + 1

    def observe_step(self, drafter, outcomes):
        obs = []
        for confidences, num_verified, num_accepted in outcomes:
            for j in range(min(num_verified, len(confidences), num_accepted + 1)):
                obs.append((j, confidences[j], j < num_accepted))
        self.observe_many(drafter, obs)

    def table(self, drafter):
        self._map(drafter, 0)
        return [list(self._values(drafter, m)) for m in self._maps[drafter]]


# ---------------------------------------------------------------------------------------------------------
# helpers


def same(a, b) -> bool:
    """Equal bit for bit as floats (NaN equals NaN), recursively over lists."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


def same_plan(got: Plan, want: Plan) -> bool:
    return (got.lengths == want.lengths and all(type(x) is int for x in got.lengths)
            and same(got.expected_tokens, want.expected_tokens) and same(got.step_ms, want.step_ms))


def rand_conf(rng: random.Random, kind: str) -> float:
    if kind == "quantized":  # many equal values: ties everywhere downstream
        return rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
    if kind == "wild":  # out of range, NaN and infinities too
        return rng.choice([rng.uniform(-0.5, 1.5), float("nan"), float("inf"), -float("inf"), 0.05, 0.95, 1.0])
    return min(1.0, max(0.0, rng.gauss(0.8, 0.15)))


def rand_rows(rng: random.Random, b: int, k: int, kind: str, ragged: bool) -> list[list[float]]:
    return [[rand_conf(rng, kind) for _ in range(rng.randint(0, k) if ragged else k)] for _ in range(b)]


def rand_table(rng: random.Random, points: int) -> TokenCostTable:
    if rng.random() < 0.5:
        samples = [(rng.randint(0, 600), rng.uniform(2.0, 12.0)) for _ in range(points)]
        return TokenCostTable.fit(samples)  # repeated token counts pooled, non-monotone costs pooled flat
    table = TokenCostTable()
    for _ in range(points):
        table.observe(rng.randint(1, 300), rng.uniform(2.0, 12.0))
    return table


# ---------------------------------------------------------------------------------------------------------
# token-cost table


@pytest.mark.parametrize("points", [1, 2, 3, 7, 40])
def test_token_cost_table_ranges_equal_the_loop(points):
    rng = random.Random(points)
    for _ in range(30):
        table = rand_table(rng, points)
        ref = RefCosts(table)
        first, last = table.tokens[0], table.tokens[-1]
        for lo, hi in [(0, 10), (0, 300), (first - 5, last + 5), (first, first), (last, last + 60),
                       (last + 3, last + 200), (-7, 2), (rng.randint(0, 400), rng.randint(400, 1500)), (5, 4)]:
            want = ref.costs_ms(lo, hi)
            got = table.costs_ms(lo, hi)
            assert isinstance(got, list) and same(got, want), (lo, hi, table)
            arr = table.costs_array(lo, hi)
            assert arr.dtype == np.float64 and same(arr.tolist(), want)
        assert same(table.dense_ms(700), [ref.cost_ms(t) for t in range(701)])


def test_token_cost_table_empty_raises():
    table = TokenCostTable()
    for lo, hi in [(0, 3), (0, 400)]:
        with pytest.raises(RuntimeError):
            table.costs_ms(lo, hi)
        with pytest.raises(RuntimeError):
            table.costs_array(lo, hi)
    with pytest.raises(RuntimeError):
        budget_plan([[0.5] * 8] * 8, [8] * 8, table, 8)


def test_costs_ms_result_is_a_mutable_list():
    """costs_ms keeps returning a fresh list on both of its paths (callers may index, slice or write into it)."""
    table = TokenCostTable.fit([(1, 3.0), (64, 4.0), (256, 9.0)])
    for hi in (10, 500):
        out = table.costs_ms(0, hi)
        out[-1] = 0.0
        assert isinstance(out, list) and len(out) == hi + 1


# ---------------------------------------------------------------------------------------------------------
# survival


@pytest.mark.parametrize("kind", ["smooth", "quantized", "wild"])
def test_survival_equals_the_loop(kind):
    rng = random.Random(hash(kind) % 1000)
    for _ in range(60):
        b, k, ragged = rng.randint(0, 40), rng.randint(0, 20), rng.random() < 0.6
        acc = rand_rows(rng, b, k, kind, ragged)
        want = ref_survival(acc)
        got = survival_from_acceptance(acc)
        assert isinstance(got, list) and same(got, want)
        if not ragged and b:
            arr = survival_from_acceptance(np.array(acc, dtype=np.float64).reshape(b, k))
            assert isinstance(arr, np.ndarray) and same(arr.tolist(), want)


# ---------------------------------------------------------------------------------------------------------
# budget search


def rand_survival(rng: random.Random, b: int, k: int, kind: str, ragged: bool) -> list[list[float]]:
    if kind == "monotone-ties":  # survival of quantized acceptance: equal values across requests
        return ref_survival(rand_rows(rng, b, k, "quantized", ragged))
    if kind == "raw":  # not non-increasing, zeros and ones
        return [[rng.choice([0.0, 1.0, rng.random()]) for _ in range(rng.randint(0, k) if ragged else k)]
                for _ in range(b)]
    return ref_survival(rand_rows(rng, b, k, "smooth", ragged))


@pytest.mark.parametrize("kind", ["smooth", "monotone-ties", "raw"])
def test_budget_plan_equals_the_loop(kind):
    rng = random.Random(len(kind))
    for case in range(150):
        b, k, ragged = rng.randint(0, 70), rng.randint(0, 18), rng.random() < 0.5
        survival = rand_survival(rng, b, k, kind, ragged)
        caps = [rng.choice([0, rng.randint(0, k + 3), k + 5, len(row)]) for row in survival]
        points = rng.choice([1, 2, 5, 30])
        table = rand_table(rng, points)
        if rng.random() < 0.2:  # flat costs: ratios tie wherever scores are 0
            table = TokenCostTable([8], [5.0])
        base_tokens = rng.randint(0, 80)
        base_gain = rng.choice([None, 0.0, 3.5, float(b)])
        draft_ms = rng.choice([0.0, 0.0, 0.7])
        want = ref_budget_plan(survival, caps, RefCosts(table), base_tokens, base_gain, draft_ms)
        got = budget_plan(survival, caps, table, base_tokens, base_gain, draft_ms)
        assert same_plan(got, want), (case, got, want)
        if not ragged and b:  # as an array [B, K]
            arr = budget_plan(np.array(survival).reshape(b, k), caps, table, base_tokens, base_gain, draft_ms)
            assert same_plan(arr, want), (case, arr, want)


def test_budget_plan_ties_pick_smallest_budget_and_first_requests():
    """Equal scores rank by request then position; equal ratios keep the smallest budget."""
    table = TokenCostTable([4], [5.0])  # one point: every budget costs the same
    survival = [[1.0, 0.5, 0.0, 0.0]] * 20
    for caps in ([4] * 20, [2] * 10 + [4] * 10):
        want = ref_budget_plan(survival, caps, RefCosts(table), 20)
        got = budget_plan(survival, caps, table, 20)
        assert same_plan(got, want) and got.lengths == [2] * 20  # the zeros add nothing: not taken
    survival = [[0.5] * 6 for _ in range(12)]  # every score equal
    linear = ModelTokenCost(0.0, 1.0, 0.0, [0.0] * 200)  # cost = tokens: the ratio never moves
    want = ref_budget_plan(survival, [6] * 12, linear, 12, base_gain=6.0)
    got = budget_plan(survival, [6] * 12, linear, 12, base_gain=6.0)
    assert same_plan(got, want)


def test_budget_plan_model_token_cost_and_nan():
    rng = random.Random(3)
    for _ in range(40):
        b, k = rng.randint(4, 40), rng.randint(2, 16)
        survival = rand_survival(rng, b, k, "smooth", True)
        caps = [len(r) for r in survival]
        cost = ModelTokenCost(rng.uniform(1, 5), rng.uniform(0.01, 0.1), rng.uniform(0.0, 0.05),
                              [math.sqrt(n) for n in range(b * k + 200)])
        base = rng.randint(b, 2 * b)
        want = ref_budget_plan(survival, caps, cost, base, draft_ms=0.3)
        assert same_plan(budget_plan(survival, caps, cost, base, draft_ms=0.3), want)
    # NaN scores: the loop decides (whatever its sort makes of them), so the result is the loop's
    survival = [[0.9, float("nan"), 0.2] * 6 for _ in range(8)]
    table = TokenCostTable.fit([(1, 3.0), (200, 9.0)])
    want = ref_budget_plan(survival, [18] * 8, RefCosts(table), 8)
    assert same_plan(budget_plan(survival, [18] * 8, table, 8), want)


def test_budget_plan_errors_as_the_loop():
    zero = TokenCostTable([4], [0.0])  # a step of 0 ms
    survival = [[0.5] * 8 for _ in range(8)]
    with pytest.raises(ZeroDivisionError):
        ref_budget_plan(survival, [8] * 8, RefCosts(zero), 8)
    with pytest.raises(ZeroDivisionError):
        budget_plan(survival, [8] * 8, zero, 8)
    with pytest.raises(ValueError):
        budget_plan(survival, [8] * 7, TokenCostTable([4], [1.0]), 8)
    short = ModelTokenCost(1.0, 0.1, 0.0, [0.0] * 20)  # shorter than the budgets searched
    with pytest.raises(ValueError):
        budget_plan(survival, [8] * 8, short, 8)


# ---------------------------------------------------------------------------------------------------------
# calibration


def check_same_state(cal: AcceptanceCalibrator, ref: RefCalibrator, drafter: str) -> None:
    assert same(cal.table(drafter), ref.table(drafter))
    maps = cal._maps[drafter]
    rmaps = ref._maps[drafter]
    assert same(maps.accepted.tolist(), [m.accepted for m in rmaps])
    assert same(maps.total.tolist(), [m.total for m in rmaps])
    for got, want in ((maps.raw, ref._ece_raw[drafter]), (maps.cal, ref._ece_cal[drafter])):
        assert same(got.pred, want.pred) and same(got.hit, want.hit) and same(got.n, want.n)
    st = cal.stats(drafter)
    raw, rc = ref._ece_raw[drafter], ref._ece_cal[drafter]
    n = sum(raw.n)
    assert st.n == int(n) and same(st.ece_raw, raw.ece()) and same(st.ece_calibrated, rc.ece())


def outcomes(rng: random.Random, b: int, k: int, kind: str):
    out = []
    for _ in range(b):
        conf = [rand_conf(rng, kind) for _ in range(rng.randint(0, k))]
        out.append((conf, rng.randint(0, len(conf) + 1), rng.randint(-1, len(conf) + 1)))
    return out


@pytest.mark.parametrize("prior", ["pooled", "identity"])
@pytest.mark.parametrize("num_bins", [1, 10])
def test_calibrator_pooled_prior_sums_positions_in_order(prior, num_bins):
    """The pooled prior's per-bin sums over 17 positions of decayed (fractional) counts: added in position order
    as the reference does (numpy's sum over one-bin-wide rows is pairwise and rounds differently)."""
    rng = random.Random(num_bins)
    kw = dict(num_bins=num_bins, max_positions=17, max_count_per_bin=3.0, prior=prior)
    cal, ref = AcceptanceCalibrator(**kw), RefCalibrator(**kw)
    for _ in range(60):
        outs = outcomes(rng, rng.choice([1, 3, 64]), 20, "smooth")
        cal.observe_step("d", outs)
        ref.observe_step("d", outs)
        check_same_state(cal, ref, "d")


@pytest.mark.parametrize("max_count", [2000.0, 12.0, 3.0, 1.0])
@pytest.mark.parametrize("kind", ["smooth", "quantized"])
def test_calibrator_equals_the_loop(max_count, kind):
    """Steps large (numpy) and small (loops), saturated bins (max_count reached: the decay runs in order),
    positions past max_positions, drafters side by side."""
    rng = random.Random(int(max_count) * 7 + len(kind))
    positions = rng.choice([1, 4, 17])
    kw = dict(num_bins=rng.choice([1, 2, 10]), max_positions=positions, prior_weight=rng.choice([2.0, 0.0]),
              max_count_per_bin=max_count)
    cal, ref = AcceptanceCalibrator(**kw), RefCalibrator(**kw)
    for step in range(80):
        drafter = rng.choice(["a", "b"])
        b = rng.choice([1, 3, 64])
        if rng.random() < 0.7:
            outs = outcomes(rng, b, 20, kind)
            cal.observe_step(drafter, outs)
            ref.observe_step(drafter, outs)
        else:
            obs = [(rng.randint(-2, positions + 3), rand_conf(rng, kind), rng.choice([True, False, 0, 1]))
                   for _ in range(rng.choice([0, 1, 5, 40, 200]))]
            cal.observe_many(drafter, obs)
            ref.observe_many(drafter, obs)
        check_same_state(cal, ref, drafter)
        rows = rand_rows(rng, rng.choice([1, 2, 64]), 24, rng.choice([kind, "wild"]), rng.random() < 0.5)
        want = [ref.calibrate_row(drafter, r) for r in rows]
        assert same(cal.calibrate_rows(drafter, rows), want)
        assert same([cal.calibrate_row(drafter, r) for r in rows], want)
        arr = cal.calibrate_array(drafter, rows)
        width = max((len(r) for r in rows), default=0)
        assert arr.shape == (len(rows), width)
        assert same(arr.tolist(), [w + [0.0] * (width - len(w)) for w in want])
        if all(len(r) == width for r in rows):
            assert same(cal.calibrate_array(drafter, np.array(rows).reshape(len(rows), width)).tolist(), want)
        for c in (0.0, 0.3, 0.999, 1.0, 1.7, -1.0, float("nan")):
            p = rng.randint(-1, positions + 2)
            assert same(cal.calibrate(drafter, p, c), ref.calibrate(drafter, p, c))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # (1e308 * num_bins)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e308])
@pytest.mark.parametrize("size", [5, 100])
def test_calibrator_non_finite_confidence_raises_as_the_loop(bad, size):
    """The loop raised at the bad observation's map update, after scoring it: the state is the same after."""
    rng = random.Random(size)
    cal, ref = AcceptanceCalibrator(max_count_per_bin=20.0), RefCalibrator(max_count_per_bin=20.0)
    for _ in range(5):
        outs = outcomes(rng, 40, 16, "smooth")
        cal.observe_step("d", outs)
        ref.observe_step("d", outs)
    obs = [(rng.randint(0, 15), rng.random(), rng.random() < 0.5) for _ in range(size)]
    obs[size // 2] = (3, bad, True)
    errors = []
    for c in (cal, ref):
        with pytest.raises((ValueError, OverflowError)) as err:
            c.observe_many("d", obs)
        errors.append(err.type)
    assert errors[0] is errors[1]
    check_same_state(cal, ref, "d")


def test_calibrator_empty_inputs():
    cal, ref = AcceptanceCalibrator(), RefCalibrator()
    assert cal.calibrate_rows("d", []) == [] and cal.calibrate_rows("d", [[], []]) == [[], []]
    assert cal.calibrate_array("d", []).shape == (0, 0) and cal.calibrate_array("d", [[], []]).shape == (2, 0)
    cal.observe_step("e", [])
    ref.observe_step("e", [])
    cal.observe_many("f", [])
    assert cal.drafters == ["d", "e", "f"]
    check_same_state(cal, ref, "e")


def test_budget_plan_at_a_rate_equals_brute_force_in_both_searches():
    """With a rate, budget_plan maximizes gain - rate x ms over the budgets b (the first maximum: the smallest b),
    the b highest scores taken; the loop (few drafts) and numpy (many, or an array) searches agree with a brute
    force over b, ties included, and a zero cost raises nothing there (no division)."""
    import scheduler.planner as planner

    rng = random.Random(11)
    for case in range(300):
        b, k, ragged = rng.randint(0, 40), rng.randint(0, 18), rng.random() < 0.5
        survival = rand_survival(rng, b, k, rng.choice(["smooth", "monotone-ties"]), ragged)
        caps = [rng.choice([0, rng.randint(0, k + 3), len(row)]) for row in survival]
        table = rand_table(rng, rng.choice([1, 2, 5, 30]))
        base_tokens, draft_ms = rng.randint(0, 80), rng.choice([0.0, 0.7])
        rate = rng.choice([0.05, 0.3, 1.0, 4.0])
        items = sorted((-float(survival[i][j]), i, j) for i, c in enumerate(caps)
                       for j in range(min(c, len(survival[i]))))
        gains = [float(b)] + [float(b) - sum(s for s, _, _ in items[:n]) for n in range(1, len(items) + 1)]
        costs = table.costs_ms(base_tokens, base_tokens + len(items))
        scores = [g - rate * (draft_ms + c) for g, c in zip(gains, costs)]
        best = scores.index(max(scores))
        want = [0] * b
        for _, i, j in items[:best]:
            want[i] = max(want[i], j + 1)
        got = budget_plan(survival, caps, table, base_tokens, draft_ms=draft_ms, rate=rate)
        assert got.lengths == want, (case, got, want)
        assert got.step_ms == pytest.approx(draft_ms + costs[best])
        numpy_plan = planner._budget_plan_numpy(survival, caps, table, base_tokens, None, draft_ms, rate)
        assert numpy_plan.lengths == want, (case, numpy_plan, want)
    zero = TokenCostTable([1, 8], [0.0, 1.0])
    assert budget_plan([[0.9] * 60], [60], zero, 0, rate=1.0).lengths == \
        planner._budget_plan_numpy([[0.9] * 60], [60], zero, 0, None, 0.0, 1.0).lengths
