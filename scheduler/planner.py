"""The verification-length planner (host implementation: lists, numpy for large batches) and the `budget` / fixed
baselines.

Problem. Request i has survival s_ij (j = 1..K, non-increasing: probability that its first j drafts are all
accepted) and a cap c_i. Choose L_i in [0, cap_i] for all requests jointly to maximize expected goodput

    R(L) = (G0 + sum_i sum_{j<=L_i} s_ij) / (D0 + sum_i sum_{j<=L_i} c_ij)

where G0 = tokens the step yields with every L_i = 0 (one per decode: E[accepted_i + 1] = 1 + sum_{j<=L_i} s_ij),
D0 = predicted step ms with every L_i = 0, and c_ij > 0 = marginal ms of request i's j-th draft token under the
linear latency model: ms_per_token + ms_per_expert * (expected new distinct experts of that token, summed over
MoE layers; ExpertEstimator.batch_increments). Expert increments shrink with j (sublinear growth) and are small
for requests whose footprint the batch already covers.

Algorithm (plan_host). Per request, pool adjacent violators on the ratios s_ij / c_ij so that block ratios are
non-increasing in j (blocks = segments of the upper concave hull of the points (C_i(L), S_i(L)), L = 0..cap_i,
with C, S the cumulative costs and gains); without pooling a cheap 2nd draft could hide behind a costly 1st.
With costs non-decreasing in j every block is a single token. Then greedily: keep a heap of each request's
next block keyed by its ratio (marginal goodput per marginal ms); pop the best; add it if its ratio exceeds the
current goodput R (exactly when adding it increases R: (N+s)/(D+c) > N/D iff s/c > N/D); stop at the first
block that does not.
O(B K log B) after O(B K) pooling.

Why it is optimal. Let R* be the optimum. By Dinkelbach's argument, max_L [G0 + S(L) - R*(D0 + C(L))] = 0 and
its maximizers are exactly the optimal L; that problem separates by request: maximize S_i(L_i) - R* C_i(L_i). A linear function of
(C_i, S_i) with negative weight on C_i is maximized at a vertex of the upper concave hull of request i's points,
where the hull's slopes (block ratios) cross R*: take every block with ratio > R* (ratio = R* is indifferent).
So the optimum is a threshold set {blocks with ratio > R*}, which is a prefix of all blocks sorted by ratio.
Along that order R rises while the next ratio exceeds R, and once a ratio r <= R the new R stays >= r >= every
later ratio, so it can never rise again; so the greedy stop lands on the best prefix, hence on R*. The device version
(planner_torch.plan_device) evaluates every prefix of the sorted order and takes the argmax, which is the same
set. Tested against brute force.

Expert overlap (plan_with_experts). The distinct-expert cost of a step is a coverage function of all its tokens,
not a sum over requests: request i's drafts are cheap if other requests' tokens touch the same experts. The
planner handles it by consistent linearization: at the current lengths L^t, give every request its exact
marginal expert counts given everybody else at L^t (ExpertEstimator.batch_increments), set
D0 = D(L^t) - sum_i C_i(L_i^t) so the linear model is exact at L^t and for any one request's deviation, solve
that exactly (plan_host), repeat a few times, and keep the best iterate under the full coverage model. Coverage
makes the cost non-separable and the problem non-convex: requests on rarely used experts share those experts'
cost only if several of them draft, and a best-response iteration from L = 0 can miss that (each one alone
finds drafting too costly). So it runs from two starts, L = 0 and L = caps, and the uniform plans
min(k, cap_i), k = 0..K, are candidates as well: under the model the plan is never below plain decoding
(k = 0) nor below any fixed K.

Baselines: fixed_lengths (every request min(K, cap)) and budget_plan (vLLM adaptive verification: one batch-wide
token budget maximizing (accepted + sampled) / cost(tokens) from a token-count-only cost table, spent on the
highest survival scores).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from scheduler.calibration import clip_unit, pad_rows
from scheduler.latency_model import (ExpertEstimator, Footprint, LatencyCoefs, ModelTokenCost, PlanCost,
                                     StepComposition, TokenCostTable)

__all__ = ["Plan", "PlanCost", "budget_plan", "check_rate", "expected_goodput", "fixed_lengths", "item_costs_ms",
           "plan_host", "plan_with_experts", "survival_from_acceptance"]

_MIN_ITEM_MS = 1e-9  # marginal costs are clamped to this so ratios are defined
# inputs with at least this many drafts run in numpy (below: the Python loops, faster there). The budget search's
# crossover on this repo's CPU (cost table of 48 points, draft_ms > 0): loop / numpy 29 / 35 us at 40 drafts, 35 / 34
# at 48, 42 / 34 at 64, 58 / 37 at 96 (it was 128: B=16 x 6 drafts ran the loop)
_SURVIVAL_NUMPY_MIN, _BUDGET_NUMPY_MIN = 48, 48


@dataclass(frozen=True)
class Plan:
    lengths: list[int]  # L_i per request
    expected_tokens: float  # G0 + sum of survivals taken = E[tokens committed by the step]
    step_ms: float  # predicted step time under the cost model used

    @property
    def goodput_tokens_per_ms(self) -> float:
        return self.expected_tokens / self.step_ms if self.step_ms > 0 else float("inf")


def survival_from_acceptance(acceptance: Sequence[Sequence[float]] | np.ndarray) -> list[list[float]] | np.ndarray:
    """s_ij = prod_{m<=j} acc_im from per-draft (calibrated, conditional) acceptance probabilities. Rows may
    differ in length; a float array [B, K] gives an array [B, K] (cumprod multiplies in the same order)."""
    if isinstance(acceptance, np.ndarray):
        return np.cumprod(clip_unit(acceptance), axis=-1)
    if sum(len(row) for row in acceptance) < _SURVIVAL_NUMPY_MIN:
        out = []
        for row in acceptance:
            s, r = 1.0, []
            for a in row:
                s *= min(1.0, max(0.0, a))
                r.append(s)
            out.append(r)
        return out
    acc, lens = pad_rows(acceptance, 1.0)  # [B, longest]
    surv = np.cumprod(clip_unit(acc), axis=1).tolist()
    return surv if min(lens) == max(lens) else [row[:n] for row, n in zip(surv, lens)]


def item_costs_ms(cost: PlanCost, num_items: int, expert_increments: Sequence[float] | None) -> list[float]:
    """Marginal ms of a request's drafts 1..num_items."""
    return [max(_MIN_ITEM_MS, cost.ms_per_token + cost.ms_per_expert *
                (expert_increments[j] if expert_increments is not None and j < len(expert_increments) else 0.0))
            for j in range(num_items)]


def _clip_caps(survival: Sequence[Sequence[float]], caps: Sequence[int]) -> list[int]:
    if len(caps) != len(survival):
        raise ValueError(f"caps ({len(caps)}) and survival ({len(survival)}) must have one entry per request")
    return [max(0, min(int(c), len(row))) for c, row in zip(caps, survival)]


def expected_goodput(survival: Sequence[Sequence[float]], lengths: Sequence[int], cost: PlanCost,
                     expert_increments: Sequence[Sequence[float]] | None = None,
                     base_gain: float | None = None) -> Plan:
    """Evaluates given lengths under the planner's cost model."""
    gain = float(len(survival)) if base_gain is None else float(base_gain)
    ms = cost.base_ms
    for i, (row, L) in enumerate(zip(survival, lengths)):
        gain += sum(row[:L])
        ms += sum(item_costs_ms(cost, L, expert_increments[i] if expert_increments is not None else None))
    return Plan(list(lengths), gain, ms)


def _pool(gains: list[float], costs: list[float]) -> list[tuple[float, float, int]]:
    """Pool adjacent violators: blocks (gain, cost, end index exclusive) with non-increasing gain/cost."""
    blocks: list[list[float]] = []
    for j, (g, c) in enumerate(zip(gains, costs)):
        blocks.append([g, c, j + 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
            g2, c2, end = blocks.pop()
            blocks[-1][0] += g2
            blocks[-1][1] += c2
            blocks[-1][2] = end
    return [(g, c, int(e)) for g, c, e in blocks]


def plan_host(survival: Sequence[Sequence[float]], caps: Sequence[int], cost: PlanCost,
              expert_increments: Sequence[Sequence[float]] | None = None,
              base_gain: float | None = None) -> Plan:
    """Joint verification lengths maximizing expected goodput (see the module docstring for the proof).

    survival: [B][K_i] non-increasing survival probabilities; caps: [B] max verification length per request;
    expert_increments: [B][K_i] expected new distinct experts per draft (None: token cost only);
    base_gain: tokens yielded with every L_i = 0 (default B: one per decode).
    """
    caps = _clip_caps(survival, caps)
    gain = float(len(survival)) if base_gain is None else float(base_gain)
    ms = cost.base_ms
    lengths = [0] * len(survival)
    heap: list[tuple[float, int, int]] = []
    blocks: list[list[tuple[float, float, int]]] = []
    for i, (row, cap) in enumerate(zip(survival, caps)):
        inc = expert_increments[i] if expert_increments is not None else None
        b = _pool([float(x) for x in row[:cap]], item_costs_ms(cost, cap, inc))
        blocks.append(b)
        if b:
            heapq.heappush(heap, (-b[0][0] / b[0][1], i, 0))
    while heap:
        neg_ratio, i, k = heapq.heappop(heap)
        g, c, end = blocks[i][k]
        if g * ms <= gain * c:  # ratio <= current goodput: no remaining block can raise it
            break
        gain += g
        ms += c
        lengths[i] = end
        if k + 1 < len(blocks[i]):
            g2, c2, _ = blocks[i][k + 1]
            heapq.heappush(heap, (-g2 / c2, i, k + 1))
    return Plan(lengths, gain, ms)


def _score(gain, den, rate: float | None):
    """What a plan search maximizes (floats or arrays): gain / den, or gain - rate x den at a rate."""
    return gain / den if rate is None else gain - rate * den


def check_rate(rate: float | None) -> None:
    """A plan at a long-run rate R (tokens per ms) maximizes expected tokens - R x step ms, not the step's own
    ratio. Steps of a stream are alike draws (renewal reward): the long-run goodput of a rule is E[tokens] /
    E[ms], and its best rule is the one maximizing E[tokens - R* ms] at the best goodput R* (Dinkelbach; a plan
    at the goodput its own plans reach converges to R*). The step's ratio instead adds drafts while they beat
    this step's average, which its sunk costs (drafting, the step's fixed forward) lower: it verifies too long
    in steps whose drafts look weak and too short in steps whose drafts look strong. bench/length_bound.py:
    with informative confidences at c=1/0.85 the ratio's plans verify ~12 drafts, the rate's ~11, +1% tokens/ms
    (+0.7% at 0.7; H100 and H200 step costs); with identical drafts both rules plan the same."""
    if rate is not None and not (rate > 0.0 and rate < float("inf")):
        raise ValueError(f"rate must be a finite goodput > 0 tokens per ms, got {rate!r}")


def fixed_lengths(caps: Sequence[int], k: int) -> list[int]:
    """The `fixed` policy: every request verifies min(k, cap_i)."""
    return [max(0, min(k, int(c))) for c in caps]


def budget_plan(survival: Sequence[Sequence[float]] | np.ndarray, caps: Sequence[int],
                table: TokenCostTable | ModelTokenCost, base_tokens: int, base_gain: float | None = None,
                draft_ms: float = 0.0, rate: float | None = None) -> Plan:
    """The `budget` baseline (vLLM adaptive verification): choose one batch-wide draft-token budget b
    maximizing (base_gain + sum of the b highest survival scores) / (draft_ms + cost(base_tokens + b)) with a
    token-count-only cost table, and give the b tokens to the highest survival scores (a prefix per request,
    since survival is non-increasing in j). step_ms in the result is the table's estimate.
    For any cost that depends on the step's token count only (a ModelTokenCost: the latency model when every
    request routes by global popularity) the b highest scores are the best b drafts, so this search is exact.
    rate (tokens per ms, > 0; hybridspec-rate's): b maximizes gain - rate x (draft_ms + cost) instead, the step's
    share of the long-run goodput at that rate (see check_rate); the ratio is then not what is maximized.

    survival: [B][K_i] lists or a float array [B, K]. Scores rank by (-s_ij, i, j); of equal ratios (scores) the
    smallest budget wins. From _BUDGET_NUMPY_MIN drafts on (or for an array) the search runs in numpy, with the
    loop's arithmetic (the costs from table.costs_array where the table has one, else table.costs_ms)."""
    check_rate(rate)
    if isinstance(survival, np.ndarray) and survival.size < _BUDGET_NUMPY_MIN:
        survival = survival.tolist()  # (a few drafts: the loop)
    if isinstance(survival, np.ndarray) or sum(len(row) for row in survival) >= _BUDGET_NUMPY_MIN:
        plan = _budget_plan_numpy(survival, caps, table, base_tokens, base_gain, draft_ms, rate)
        if plan is not None:
            return plan
    caps = _clip_caps(survival, caps)
    items = sorted((-float(survival[i][j]), i, j) for i, cap in enumerate(caps) for j in range(cap))  # best first
    gain0 = float(len(survival)) if base_gain is None else float(base_gain)
    costs = table.costs_ms(base_tokens, base_tokens + len(items))
    best_b, best_r, gain = 0, _score(gain0, draft_ms + costs[0], rate), gain0
    for b, (neg_s, _, _) in enumerate(items, start=1):
        gain -= neg_s
        r = _score(gain, draft_ms + costs[b], rate)
        if r > best_r:
            best_b, best_r = b, r
    lengths = [0] * len(survival)
    gain = gain0
    for neg_s, i, j in items[:best_b]:
        lengths[i] = max(lengths[i], j + 1)
        gain -= neg_s
    return Plan(lengths, gain, draft_ms + costs[best_b])


def _budget_plan_numpy(survival: Sequence[Sequence[float]] | np.ndarray, caps: Sequence[int],
                       table: TokenCostTable | ModelTokenCost, base_tokens: int, base_gain: float | None,
                       draft_ms: float, rate: float | None = None) -> Plan | None:
    """budget_plan's search vectorized; None where NaN ratios leave the choice to the loop."""
    B = len(survival)
    if len(caps) != B:
        raise ValueError(f"caps ({len(caps)}) and survival ({B}) must have one entry per request")
    if isinstance(survival, np.ndarray):
        S, lens = survival.astype(np.float64, copy=False), survival.shape[1]
    else:
        S, lens = pad_rows(survival)  # [B, K]
        lens = np.array(lens)
    K = S.shape[1]
    cap = np.minimum(np.maximum(np.array(caps).astype(np.intp), 0), lens)  # [B] _clip_caps
    full = bool((cap == K).all())
    idx = None if full else np.flatnonzero(np.arange(K) < cap[:, None])  # [N] flat index of each score
    s = S.reshape(-1) if full else S.reshape(-1)[idx]  # [N] in (i, j) order
    order = np.argsort(-s, kind="stable")  # [N] best first, ties in (i, j) order
    gains = np.empty(len(s) + 1)  # [N + 1] gain of the budgets b = 0..N: running sums as the loop's
    gains[0] = float(B) if base_gain is None else float(base_gain)
    gains[1:] = s[order]
    np.cumsum(gains, out=gains)
    costs_array = getattr(table, "costs_array", None)
    lo, hi = base_tokens, base_tokens + len(s)
    costs = costs_array(lo, hi) if costs_array is not None else np.array(table.costs_ms(lo, hi), np.float64)
    den = draft_ms + costs  # [N + 1]
    if rate is None and not den.all():
        raise ZeroDivisionError("float division by zero")
    ratio = _score(gains, den, rate)
    best = int(ratio.argmax())  # the first maximum: the loop's strict `r > best_r`
    if ratio[best] != ratio[best]:  # (argmax stops at a NaN)
        return None
    chosen = order[:best] if full else idx[order[:best]]  # flat indices i * K + j
    lengths = np.zeros(B, dtype=np.intp)
    np.maximum.at(lengths, chosen // K, chosen % K + 1)
    return Plan(lengths.tolist(), float(gains[best]), float(den[best]))


def width_plan(survival: Sequence[Sequence[float]] | np.ndarray, caps: Sequence[int],
               table: TokenCostTable | ModelTokenCost, base_tokens: int,
               width_ms: Sequence[float] | np.ndarray, base_gain: float | None = None,
               rate: float | None = None) -> tuple[Plan, int]:
    """budget_plan's search with one more choice: the step's longest verification length c = 1..C, where a plan
    whose lengths are all <= c pays width_ms[c] ms beyond the forward (C = len(width_ms) - 1). The drafter's
    block per request follows the longest lengths recent plans chose, and its forward scales with the block:
    a step's drafting is sunk once the drafts exist, but the plans decide what later steps draft. Pricing each
    plan at the overhead of the block it implies (width_ms[c]: the steady state if plans stay <= c) keeps one
    long length from making every request's drafting wide (bench/NOTES.md: at c=64, drafting 16 a request to
    verify ~6 cost ~4 ms a step more than drafting 4).

    For each c the best plan is budget_plan's over the drafts at positions j < c (the highest survival scores
    of those, a prefix per request), so the search is exact for a token-count-only cost: [C, N] running sums
    over the scores sorted once, O(C B K). Ties: the smallest c, then the fewest tokens. Returns the plan (its
    step_ms: width_ms[c] + the forward's cost) and c. rate: as budget_plan's (gain - rate x ms is maximized)."""
    check_rate(rate)
    B = len(survival)
    if len(caps) != B:
        raise ValueError(f"caps ({len(caps)}) and survival ({B}) must have one entry per request")
    widths = np.asarray(width_ms, dtype=np.float64)  # [C + 1] (index 0 unused)
    if widths.ndim != 1 or widths.shape[0] < 2:
        raise ValueError(f"width_ms must give the overhead of c = 1..C (C >= 1), got {widths.shape[0]} entries")
    if isinstance(survival, np.ndarray):
        S, lens = survival.astype(np.float64, copy=False), np.full(B, survival.shape[1] if B else 0)
    else:
        S, lens = pad_rows(survival)  # [B, K]
        lens = np.array(lens, dtype=np.intp)
    K = S.shape[1] if S.ndim == 2 else 0
    cap = np.minimum(np.maximum(np.array(caps, dtype=np.intp).reshape(-1), 0), lens) if B else np.zeros(0, np.intp)
    gain0 = float(B) if base_gain is None else float(base_gain)
    idx = np.flatnonzero(np.arange(K) < cap[:, None]) if B and K else np.zeros(0, np.intp)  # [N] flat (i, j)
    s = S.reshape(-1)[idx] if len(idx) else np.zeros(0)
    order = np.argsort(-s, kind="stable")  # [N] best first, ties in (i, j) order
    s_sorted, j_sorted = s[order], (idx[order] % K) if len(idx) else np.zeros(0, np.intp)
    C = widths.shape[0] - 1
    c_values = np.arange(1, C + 1)  # [C]
    taken = j_sorted[None, :] < c_values[:, None]  # [C, N] the score is a draft at a position j < c
    gains = gain0 + np.cumsum(np.where(taken, s_sorted[None, :], 0.0), axis=1)  # [C, N]
    counts = np.cumsum(taken, axis=1)  # [C, N] drafts taken up to this score
    costs_array = getattr(table, "costs_array", None)
    lo, hi = base_tokens, base_tokens + len(s)
    costs = costs_array(lo, hi) if costs_array is not None else np.array(table.costs_ms(lo, hi), np.float64)
    over = widths[1:, None]  # [C, 1]
    ratio = np.full((C, len(s) + 1), -np.inf)  # [C, N + 1]: column 0 takes nothing
    den0, den = over[:, 0] + costs[0], over + costs[counts]  # [C], [C, N]
    if rate is None and (not den0.all() or not den.all()):
        raise ZeroDivisionError("float division by zero")
    ratio[:, 0] = _score(gain0, den0, rate)
    ratio[:, 1:] = np.where(taken, _score(gains, den, rate), -np.inf)
    ratio[np.isnan(ratio)] = -np.inf  # (a NaN score or cost is never chosen; argmax would stop at it)
    best = int(np.argmax(ratio))  # row-major: the smallest c, then the fewest tokens
    ci, p = divmod(best, len(s) + 1)
    chosen = idx[order[:p][taken[ci, :p]]] if p else np.zeros(0, np.intp)  # flat indices i * K + j
    lengths = np.zeros(B, dtype=np.intp)
    if len(chosen):
        np.maximum.at(lengths, chosen // K, chosen % K + 1)
    n = int(counts[ci, p - 1]) if p else 0
    gain = float(gains[ci, p - 1]) if p else gain0
    return Plan(lengths.tolist(), gain, float(widths[ci + 1] + costs[n])), int(c_values[ci])


def plan_with_experts(survival: Sequence[Sequence[float]], caps: Sequence[int], coefs: LatencyCoefs,
                      base: StepComposition, estimator: ExpertEstimator,
                      footprints: Sequence[Footprint | None] | None = None, iterations: int = 2,
                      base_gain: float | None = None, draft_ms: float = 0.0) -> Plan:
    """Joint lengths under the latency model with the distinct-expert term estimated from routing statistics
    and per-request footprints (module docstring: consistent linearization from two starts, best candidate
    under the full coverage model kept; the uniform lengths min(k, cap_i), k = 0..K, are candidates too).

    base: the step with every L_i = 0 (tokens_per_request: 1 per decode, the chunk size per prefill; context
    lengths), one entry per row of survival/caps (prefill rows: cap 0). footprints: per request (None: global
    routing). step_ms in the result is the full model's prediction, draft_ms included.
    Candidate order (ties keep the earlier): uniform k = 0..K, then the iterates from L = 0, then from L = caps.
    """
    B = base.num_requests
    if len(survival) != B:
        raise ValueError(f"survival has {len(survival)} rows but the base composition {B} requests")
    caps = _clip_caps(survival, caps)
    fps = list(footprints) if footprints is not None else [None] * B
    K = max((len(r) for r in survival), default=0)
    gain0 = float(B) if base_gain is None else float(base_gain)
    fixed_ms = (coefs.const_ms + coefs.ms_per_token * base.num_tokens + coefs.ms_per_request * B
                + coefs.ms_per_context_token * base.context_tokens + draft_ms)
    best: list[Plan] = []

    def consider(lengths: list[int], experts: float) -> None:
        step_ms = fixed_ms + coefs.ms_per_token * sum(lengths) + coefs.ms_per_expert * experts
        gain = gain0 + sum(sum(row[:L]) for row, L in zip(survival, lengths))
        if not best or gain * best[0].step_ms > best[0].expected_tokens * step_ms:
            best[:] = [Plan(list(lengths), gain, step_ms)]

    for k in range(K + 1):
        uniform = fixed_lengths(caps, k)
        consider(uniform, estimator.batch_increments(fps, base.tokens_per_request, 0, uniform)[1])
    for start in ([0] * B, list(caps)):
        lengths = start
        inc, experts = estimator.batch_increments(fps, base.tokens_per_request, K, lengths)
        for _ in range(iterations):
            step_ms = fixed_ms + coefs.ms_per_token * sum(lengths) + coefs.ms_per_expert * experts
            own_ms = sum(coefs.ms_per_token * L + coefs.ms_per_expert * sum(inc[i][:L]) for i, L in enumerate(lengths))
            new = plan_host(survival, caps, PlanCost(step_ms - own_ms, coefs.ms_per_token, coefs.ms_per_expert),
                            inc, gain0).lengths
            if new == lengths:
                break
            lengths = new
            inc, experts = estimator.batch_increments(fps, base.tokens_per_request, K, lengths)
            consider(lengths, experts)
    return best[0]
