"""The batch latency model: step time (ms) from a step's composition, not from its token count alone.

For hybrid GDN + MoE targets a step's time is (DESIGN.md, "The batch latency model")

    step_ms = const_ms                              launches, dense weights (attention/GDN projections, shared expert)
            + ms_per_token   * total tokens         per-token compute and activations
            + ms_per_expert  * sum over MoE layers of distinct experts touched   (each expert's weights read once)
            + ms_per_request * requests             per-request GDN state read/write (one S per GDN layer)
            + ms_per_context_token * sum of context lengths                       (attention KV reads)

a linear model over interpretable features, fitted by non-negative least squares on relative error from
(composition, measured_ms) samples: a start-up profile, then online from measured step times.

`ExpertEstimator` predicts the distinct-expert feature before routing, from routing statistics; `TokenCostTable`
is the token-count-only cost of the `budget` baseline (vLLM adaptive verification). Host Python and numpy, no tensors.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# Shared small pieces


@dataclass(frozen=True)
class ErrorStats:
    """Prediction error over a set of (predicted, measured) pairs, in percent of the measured value."""

    n: int
    mean_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float

    @staticmethod
    def of(pairs: Iterable[tuple[float, float]]) -> "ErrorStats":
        errs = sorted(abs(p - m) / abs(m) * 100.0 for p, m in pairs if m != 0)
        if not errs:
            return ErrorStats(0, float("nan"), float("nan"), float("nan"))
        p90 = errs[max(0, math.ceil(0.9 * len(errs)) - 1)]  # nearest rank
        return ErrorStats(len(errs), sum(errs) / len(errs), p90, errs[-1])


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solves a x = b (small, dense) by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def nnls_normal(gram: list[list[float]], rhs: list[float]) -> list[float]:
    """min_w 1/2 w'Gw - h'w subject to w >= 0, for a handful of features (G = X'X, h = X'y).

    Exhaustive over supports: the optimum's support is one of the 2^n subsets, and on it the optimum is the
    unconstrained solution, so the best feasible (all >= 0) subset solution is the NNLS optimum. n = 5 here:
    31 tiny solves, robust where active-set methods need care.
    """
    n = len(rhs)
    best, best_obj = [0.0] * n, 0.0
    for mask in range(1, 1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        sub = _solve([[gram[i][j] for j in idx] for i in idx], [rhs[i] for i in idx])
        if sub is None or any(v < 0 for v in sub):
            continue
        w = [0.0] * n
        for i, v in zip(idx, sub):
            w[i] = v
        obj = 0.5 * sum(w[i] * gram[i][j] * w[j] for i in idx for j in idx) - sum(rhs[i] * w[i] for i in idx)
        if obj < best_obj:
            best, best_obj = w, obj
    return best


# ---------------------------------------------------------------------------------------------------------
# Composition and the model


@dataclass
class StepComposition:
    """What one engine step runs: the inputs of the latency model.

    distinct_experts_per_layer is observed after routing (one count per MoE layer); before the step the
    planner gives estimated_experts_total instead (summed over MoE layers; ExpertEstimator).
    """

    tokens_per_request: list[int]
    context_lens: list[int]  # tokens already cached per request (attention KV read by this step)
    num_moe_layers: int = 0
    distinct_experts_per_layer: list[int] | None = None
    estimated_experts_total: float | None = None

    def __post_init__(self) -> None:
        if len(self.tokens_per_request) != len(self.context_lens):
            raise ValueError(f"tokens_per_request ({len(self.tokens_per_request)}) and context_lens "
                             f"({len(self.context_lens)}) must have one entry per request")

    @property
    def num_requests(self) -> int:
        return len(self.tokens_per_request)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_request)

    @property
    def context_tokens(self) -> int:
        return sum(self.context_lens)

    def experts_total(self) -> float | None:
        """Distinct experts summed over MoE layers: observed if known, else the estimate, else None."""
        if self.distinct_experts_per_layer is not None:
            return float(sum(self.distinct_experts_per_layer))
        return self.estimated_experts_total


FEATURES = ("const", "tokens", "experts", "requests", "context_tokens")


@dataclass(frozen=True)
class LatencyCoefs:
    """Fitted coefficients (all >= 0): step_ms = sum of coefficient x feature."""

    const_ms: float = 0.0
    ms_per_token: float = 0.0
    ms_per_expert: float = 0.0  # per distinct expert per MoE layer (summed over layers)
    ms_per_request: float = 0.0  # GDN state read/write of one request, all GDN layers
    ms_per_context_token: float = 0.0

    def as_list(self) -> list[float]:
        return [self.const_ms, self.ms_per_token, self.ms_per_expert, self.ms_per_request, self.ms_per_context_token]


@dataclass(frozen=True)
class PlanCost:
    """The latency model, linearized for one step (LatencyModel.plan_cost builds it)."""

    base_ms: float  # predicted step time with every L_i = 0 (plus drafting time, if it is to be counted)
    ms_per_token: float  # marginal ms of one more verified token
    ms_per_expert: float = 0.0  # marginal ms of one more distinct expert (per MoE layer, summed over layers)


COLLINEAR_TOL = 1e-3  # a column whose weighted residual on the earlier kept ones is below this share of its norm


def identifiable_columns(xs: np.ndarray, w: np.ndarray) -> list[int]:
    """Columns of xs [R, n] (FEATURES order: const first, context last) the rows can tell apart: each in turn is
    kept unless the earlier columns explain it (weighted residual <= COLLINEAR_TOL of its norm: |R[k, k]| of a
    QR without pivoting, the residual on every earlier column, whose span the kept ones already give). A dropped
    feature gets no weight until samples vary it apart from the others. The start-up profile at one batch size
    holds the request count and each request's context fixed: without this the fit split the constant between
    const, requests and context (the tiny ridge's minimum-norm split), and serving's ~30x longer contexts
    predicted c=1 steps at ~12x their time until the first online refit (dc9b6bc on the H200: 43-67 ms
    predicted for 4.0-6.6 ms steps; the mean prequential error at c=1, acceptance 0.85-0.95 was 53-114%). With
    nothing to keep (no finite row of positive weight) the constant alone."""
    sw = np.sqrt(w)[:, None] * xs  # [R, n]
    norms = np.linalg.norm(sw, axis=0)  # [n]
    diag = np.abs(np.diag(np.linalg.qr(sw, mode="r"))) if sw.shape[0] >= sw.shape[1] else None
    kept: list[int] = []
    for k in range(xs.shape[1]):
        if norms[k] == 0.0:
            continue
        if kept:
            if diag is not None:
                residual = diag[k]
            else:  # fewer rows than columns: project on the kept ones
                basis = sw[:, kept]
                coef, *_ = np.linalg.lstsq(basis, sw[:, k], rcond=None)
                residual = np.linalg.norm(sw[:, k] - basis @ coef)
            if residual <= COLLINEAR_TOL * norms[k]:
                continue
        kept.append(k)
    return kept or [0]


class LatencyModel:
    """Predicts step time (ms) from a StepComposition; fitted by NNLS, refined online.

    `observe` scores the current model on each new sample before learning from it (prequential error, the
    honest number to report), keeps the last `window` samples in a ring buffer and refits every
    `refit_every` samples (a 5x5 problem: cheap).
    """

    WORST = 4

    def __init__(self, coefs: LatencyCoefs | None = None, estimator: "ExpertEstimator | None" = None,
                 window: int = 512, refit_every: int = 16, min_samples: int = 8, relative: bool = True):
        self.coefs = coefs
        self.estimator = estimator
        self.samples: deque[tuple[list[float], float]] = deque(maxlen=window)
        # the start-up profile's samples stay in every fit: its shapes (several batch sizes x block lengths) pin
        # the slopes, which the online samples alone cannot once a policy keeps choosing similar steps
        self.anchors: list[tuple[list[float], float]] = []
        self.errors: deque[tuple[float, float]] = deque(maxlen=window)  # (predicted, measured), prequential
        self.refit_every, self.min_samples, self.relative = refit_every, min_samples, relative
        self._since_fit = 0
        self.observed = 0  # samples observed online
        # a diagnostic: the WORST samples by prequential error, as (abs error %, observe index, predicted ms,
        # measured ms, features), largest first (a mean of abs % is led by a few of them)
        self.worst: list[tuple[float, int, float, float, list[float]]] = []

    @property
    def fitted(self) -> bool:
        return self.coefs is not None

    def features(self, comp: StepComposition) -> list[float]:
        experts = comp.experts_total()
        if experts is None:
            if comp.num_moe_layers and self.estimator is None:
                raise ValueError("composition has neither observed nor estimated distinct experts, and the "
                                 "latency model has no ExpertEstimator")
            experts = self.estimator.expected_distinct_total(comp.num_tokens) if comp.num_moe_layers else 0.0
        return [1.0, float(comp.num_tokens), float(experts), float(comp.num_requests), float(comp.context_tokens)]

    def fit(self, samples: Iterable[tuple[StepComposition, float]] | None = None) -> LatencyCoefs:
        """Fits from `samples` (added to the buffer, e.g. a start-up profile) plus the buffer; returns coefs."""
        if samples is not None:
            for comp, ms in samples:
                self.samples.append((self.features(comp), float(ms)))
        if not self.samples and not self.anchors:
            raise ValueError("no samples to fit the latency model from")
        n = len(FEATURES)
        rows = self.anchors + list(self.samples)
        x = np.array([f for f, _ in rows], dtype=np.float64)  # [R, n] features
        y = np.array([ms for _, ms in rows], dtype=np.float64)  # [R] measured ms
        finite = np.isfinite(x).all(axis=1) & np.isfinite(y)  # [R] (a non-finite sample is no measurement)
        if not finite.all():
            x, y = x[finite], y[finite]
            if len(y) == 0:
                raise ValueError("no finite samples to fit the latency model from")
        w = np.where(y > 0, 1.0 / np.where(y > 0, y * y, 1.0), 1.0) if self.relative else np.ones_like(y)  # [R]
        # scale columns to unit weighted RMS so the tiny ridge and the solver see a well-conditioned problem
        ms2 = (w[:, None] * x * x).sum(axis=0) / w.sum()  # [n]
        scale = np.where(ms2 > 0, np.sqrt(np.where(ms2 > 0, ms2, 1.0)), 1.0)  # [n]
        xs = x / scale  # [R, n]
        kept = identifiable_columns(xs, w)
        xk = xs[:, kept]  # [R, n kept]
        wx = w[:, None] * xk
        gram_np = wx.T @ xk  # [n kept, n kept]
        gram_np = np.triu(gram_np) + np.triu(gram_np, 1).T  # exactly symmetric
        gram_np[np.diag_indices(len(kept))] += 1e-9 * np.trace(gram_np) / len(kept)  # the tiny ridge
        ws_kept = nnls_normal(gram_np.tolist(), (wx.T @ y).tolist())  # plain floats
        ws = [0.0] * n
        for k, v in zip(kept, ws_kept):
            ws[k] = v
        self.coefs = LatencyCoefs(*[float(ws[k] / scale[k]) for k in range(n)])
        self._since_fit = 0
        return self.coefs

    def anchor(self, comp: StepComposition, measured_ms: float) -> None:
        """A start-up profile sample: part of every later fit (the online window never drops it)."""
        self.anchors.append((self.features(comp), float(measured_ms)))

    @property
    def num_samples(self) -> int:
        return len(self.anchors) + len(self.samples)

    def predict(self, comp: StepComposition) -> float:
        """Predicted step time in ms."""
        return self.predict_features(self.features(comp))

    def predict_features(self, x: Sequence[float]) -> float:
        """Predicted ms of a step given its features (FEATURES order, as `features` returns them)."""
        if self.coefs is None:
            raise RuntimeError("latency model is not fitted: run a start-up profile (fit) or pass coefs")
        return sum(c * v for c, v in zip(self.coefs.as_list(), x))

    def token_cost(self, base: StepComposition, distinct_total: Sequence[float]) -> "ModelTokenCost":
        """The model as a cost of the step's token count, for a batch whose tokens all route by global
        popularity (no request footprints): then the distinct experts of a step depend on its token count only,
        distinct_total[n] = ExpertEstimator.expected_distinct_total(n), and the best plan for any token count
        is the highest survival scores (planner.budget_plan's search, exact here). base: the step with every
        L_i = 0 (its requests and context lengths are fixed; its token count is the argument of cost_ms)."""
        if self.coefs is None:
            raise RuntimeError("latency model is not fitted: run a start-up profile (fit) or pass coefs")
        c = self.coefs
        fixed = c.const_ms + c.ms_per_request * base.num_requests + c.ms_per_context_token * base.context_tokens
        return ModelTokenCost(fixed, c.ms_per_token, c.ms_per_expert if base.num_moe_layers else 0.0,
                              distinct_total)

    def observe(self, comp: StepComposition, measured_ms: float) -> None:
        """Online refinement from one measured step (observed expert counts preferred)."""
        x = self.features(comp)
        self.observed += 1
        if self.coefs is not None:
            predicted = self.predict_features(x)
            self.errors.append((predicted, float(measured_ms)))
            if measured_ms != 0:
                pct = abs(predicted - measured_ms) / abs(measured_ms) * 100.0
                if len(self.worst) < self.WORST or pct > self.worst[-1][0]:
                    self.worst.append((pct, self.observed, predicted, float(measured_ms), list(x)))
                    self.worst = sorted(self.worst, key=lambda w: -w[0])[:self.WORST]
        self.samples.append((x, float(measured_ms)))
        self._since_fit += 1
        if self.num_samples >= self.min_samples and (self.coefs is None or self._since_fit >= self.refit_every):
            self.fit()

    def error_stats(self) -> ErrorStats:
        """Prequential error: each sample predicted by the model as it was before seeing that sample."""
        return ErrorStats.of(self.errors)

    def evaluate(self, samples: Iterable[tuple[StepComposition, float]]) -> ErrorStats:
        """Error on a held-out set."""
        return ErrorStats.of((self.predict(c), ms) for c, ms in samples)


@dataclass(frozen=True)
class ModelTokenCost:
    """LatencyModel.token_cost: cost_ms(n) = fixed_ms + ms_per_token n + ms_per_expert distinct_total[n] (the
    same interface as TokenCostTable, so planner.budget_plan searches it)."""

    fixed_ms: float  # const + per-request + context terms of the step's batch
    ms_per_token: float
    ms_per_expert: float
    distinct_total: Sequence[float]  # expected distinct experts (summed over MoE layers) of n tokens, n = 0, 1, ...

    def cost_ms(self, num_tokens: float) -> float:
        n = int(num_tokens)
        if not 0 <= n < len(self.distinct_total):
            raise ValueError(f"num_tokens must be in [0, {len(self.distinct_total) - 1}], got {num_tokens}")
        return self.fixed_ms + self.ms_per_token * n + self.ms_per_expert * self.distinct_total[n]

    def costs_ms(self, lo: int, hi: int) -> list[float]:
        """[cost_ms(n) for n in lo..hi] in one pass (the planner's search reads every one of them)."""
        if not 0 <= lo <= hi < len(self.distinct_total):
            raise ValueError(f"token range must be within [0, {len(self.distinct_total) - 1}], got [{lo}, {hi}]")
        f, t, e, d = self.fixed_ms, self.ms_per_token, self.ms_per_expert, self.distinct_total
        return [f + t * n + e * d[n] for n in range(lo, hi + 1)]


# ---------------------------------------------------------------------------------------------------------
# Distinct experts before routing

_MAX_Q = 1.0 - 1e-12  # touch probabilities are clipped below 1 so log1p(-q) stays finite
Footprint = list[dict[int, float]]  # per MoE layer: expert id -> routing slots of the request's recent tokens


def footprint_from_routing(expert_ids_per_layer: Sequence[Iterable[int]]) -> Footprint:
    """A request's expert footprint from the expert ids its recent tokens were routed to (flat, per layer)."""
    out: Footprint = []
    for ids in expert_ids_per_layer:
        d: dict[int, float] = {}
        for e in ids:
            d[int(e)] = d.get(int(e), 0.0) + 1.0
        out.append(d)
    return out


class ExpertEstimator:
    """Estimates distinct experts touched by tokens not yet routed, from routing statistics.

    Per MoE layer it keeps (decayed) routing-slot counts per expert; share_e = slots on e / all slots and
    q_e = min(1, top_k * share_e) is the probability that one token is routed to e (a token takes e at most
    once, so this is exact). Tokens treated as independent: E[distinct of n tokens] = sum_e 1 - (1 - q_e)^n.

    Requests reuse experts: with a request's footprint (experts its recent tokens used), its next tokens
    route to e with q_ie = (1 - locality) q_e + locality * min(1, top_k * footprint share_e); `locality` is
    learned online (observe_request) from how often a request's new tokens hit its footprint beyond what the
    global popularity predicts.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, prior_count: float = 1.0,
                 decay: float = 1.0, locality: float = 0.0, locality_ema: float = 0.05):
        if not (num_layers >= 1 and num_experts >= 1 and 1 <= top_k <= num_experts):
            raise ValueError("need num_layers >= 1, num_experts >= 1 and 1 <= top_k <= num_experts")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.prior_count, self.decay = prior_count, decay
        self.locality, self.locality_ema = locality, locality_ema
        self.counts = [[0.0] * num_experts for _ in range(num_layers)]
        self._probs: list[list[float]] | None = None
        self._distinct_cache: dict[float, float] = {}
        self._distinct_cache_of: list[list[float]] | None = None  # the touch table the cache was computed from
        self.errors: deque[tuple[float, float]] = deque(maxlen=512)

    # ---- learning ------------------------------------------------------------------------------------
    def observe_counts(self, counts_per_layer: Sequence[Sequence[float]]) -> None:
        """Adds one step's routing: per layer, slots routed to each expert (a bincount of top-k ids)."""
        old = np.asarray(self.counts, dtype=np.float64)  # [layers, E]
        new = np.asarray(counts_per_layer, dtype=np.float64)
        if new.shape != old.shape:
            raise ValueError(f"routing counts must be [{self.num_layers}][{self.num_experts}], got {list(new.shape)}")
        self.counts = (old * self.decay + new if self.decay != 1.0 else old + new).tolist()
        self._probs = None

    def observe_routing(self, expert_ids_per_layer: Sequence[Iterable[int]]) -> None:
        """Like observe_counts, from flat routed expert ids per layer."""
        counts = [[0.0] * self.num_experts for _ in range(self.num_layers)]
        for layer, ids in zip(counts, expert_ids_per_layer):
            for e in ids:
                layer[int(e)] += 1.0
        self.observe_counts(counts)

    def observe_request(self, footprint: Footprint, routed_ids_per_layer: Sequence[Iterable[int]]) -> None:
        """Updates `locality` from one request's new routing against its previous footprint."""
        hit = slots = expected = 0.0
        for layer, (fp, ids) in enumerate(zip(footprint, routed_ids_per_layer)):
            ids = list(ids)
            if not fp or not ids:
                continue
            share = self._shares(layer)
            g = sum(share[e] for e in fp)
            hit += sum(1 for e in ids if e in fp)
            slots += len(ids)
            expected += g * len(ids)
        if slots == 0 or expected >= slots:
            return
        lam = min(1.0, max(0.0, (hit - expected) / (slots - expected)))
        self.locality += self.locality_ema * (lam - self.locality)

    def observe_distinct(self, num_tokens: int, distinct_per_layer: Sequence[int]) -> None:
        """Scores the estimate against a step's observed distinct experts (error_stats)."""
        self.errors.append((self.expected_distinct_total(num_tokens), float(sum(distinct_per_layer))))

    def error_stats(self) -> ErrorStats:
        return ErrorStats.of(self.errors)

    # ---- estimates -----------------------------------------------------------------------------------
    def _shares(self, layer: int) -> list[float]:
        c = self.counts[layer]
        tot = sum(c) + self.prior_count * self.num_experts
        return [(x + self.prior_count) / tot for x in c]

    def touch_prob_table(self) -> list[list[float]]:
        """[layer][expert] probability that one token is routed to the expert (feed planner_torch as a tensor).
        In numpy: rebuilt after every fold of the routing counts, layers x experts at once."""
        if self._probs is None:
            c = np.asarray(self.counts, dtype=np.float64)  # [layers, E]
            shares = (c + self.prior_count) / (c.sum(axis=1, keepdims=True) + self.prior_count * self.num_experts)
            self._probs = np.minimum(1.0, self.top_k * shares).tolist()
        return self._probs

    def expected_distinct(self, num_tokens: float) -> list[float]:
        """Expected distinct experts touched by num_tokens independent tokens, per MoE layer."""
        return [sum(1.0 - (1.0 - q) ** num_tokens for q in qs) for qs in self.touch_prob_table()]

    def expected_distinct_total(self, num_tokens: float) -> float:
        """Memoized per token count until the routing statistics change (every step asks for a handful)."""
        if self._probs is None or self._distinct_cache_of is not self._probs:
            self.touch_prob_table()
            self._distinct_cache, self._distinct_cache_of = {}, self._probs
        key = float(num_tokens)
        if key not in self._distinct_cache:
            self._distinct_cache[key] = sum(self.expected_distinct(num_tokens))
        return self._distinct_cache[key]

    def request_touch_probs(self, footprint: Footprint | None) -> list[list[float]]:
        """[layer][expert] probability that one token of a request with this footprint is routed to the expert."""
        table = self.touch_prob_table()
        if not footprint or self.locality <= 0.0:
            return table
        lam = self.locality
        out = []
        for layer, qs in enumerate(table):
            fp = footprint[layer] if layer < len(footprint) else {}
            tot = sum(fp.values())
            row = [(1.0 - lam) * q for q in qs]
            if tot > 0:
                for e, c in fp.items():
                    row[e] += lam * min(1.0, self.top_k * c / tot)
            else:
                row = list(qs)
            out.append(row)
        return out

    def batch_increments(self, footprints: Sequence[Footprint | None], base_tokens: Sequence[int],
                         max_drafts: int, lengths: Sequence[int] | None = None,
                         extra_base_tokens: int = 0) -> tuple[list[list[float]], float]:
        """Expert cost of drafts, for the planner: (increments [B][max_drafts], experts_total).

        The step runs, per request i, base_tokens[i] tokens (1 for a decode: its pending token; a prefill
        chunk's size) routed like its footprint (None: global popularity), plus lengths[i] drafts (default 0),
        plus extra_base_tokens routed globally. experts_total = expected distinct experts of that whole step,
        summed over MoE layers (sum_e 1 - prod over tokens (1 - q_te)): the latency model's expert feature.
        increments[i][j] = expected NEW distinct experts if request i verifies j + 1 drafts instead of j, with
        every other request at its lengths: sublinear in j, and small when what the request routes to is
        already covered by the batch. planner.plan_with_experts linearizes the step cost with these.
        Pure Python, O(B * layers * experts * max_drafts): for tests and small batches; the worker uses
        planner_torch.plan_with_experts_device.
        """
        B = len(footprints)
        lens = list(lengths) if lengths is not None else [0] * B
        probs = [self.request_touch_probs(fp) for fp in footprints]
        glob = self.touch_prob_table()
        inc = [[0.0] * max_drafts for _ in range(B)]
        experts = 0.0
        for layer in range(self.num_layers):
            for e in range(self.num_experts):
                logs = [math.log1p(-min(p[layer][e], _MAX_Q)) for p in probs]
                tot = extra_base_tokens * math.log1p(-min(glob[layer][e], _MAX_Q))
                tot += sum((n + drafts) * lg for n, drafts, lg in zip(base_tokens, lens, logs))
                experts += 1.0 - math.exp(tot)
                for i in range(B):
                    p = probs[i][layer][e]
                    if p <= 0.0:
                        continue
                    miss = math.exp(tot - lens[i] * logs[i])  # uncovered by everything but i's own drafts
                    row = inc[i]
                    for j in range(max_drafts):
                        row[j] += miss * p
                        miss *= 1.0 - p
        return inc, experts


# ---------------------------------------------------------------------------------------------------------
# Token-count-only cost (the `budget` baseline)


@dataclass
class TokenCostTable:
    """Step cost (ms) indexed by token count only, as vLLM's adaptive verification profiles it.

    Points are (tokens, ms), kept non-decreasing; cost_ms interpolates linearly between them and extrapolates
    beyond the last point along the least-squares line through all of them.
    """

    tokens: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    _counts: list[float] = field(default_factory=list, repr=False)
    _NUMPY_MIN = 64  # costs_ms over at least this many token counts runs in numpy (below: a Python loop is faster)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.step_ms):
            raise ValueError("tokens and step_ms must have the same length")
        if len(self._counts) != len(self.tokens):
            self._counts = [1.0] * len(self.tokens)
        self._monotone()

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]]) -> "TokenCostTable":
        """From (token count, measured ms) samples, e.g. a start-up profile: mean per token count, then made
        non-decreasing (pool adjacent violators)."""
        acc: dict[int, list[float]] = {}
        for t, ms in samples:
            a = acc.setdefault(int(t), [0.0, 0.0])
            a[0] += ms
            a[1] += 1.0
        table = cls()
        for t in sorted(acc):
            table.tokens.append(t)
            table.step_ms.append(acc[t][0] / acc[t][1])
            table._counts.append(acc[t][1])
        table._monotone()
        return table

    def observe(self, num_tokens: int, ms: float, max_count: float = 64.0) -> None:
        """Online update of one token count's mean (window of about max_count samples)."""
        t = int(num_tokens)
        if t in self.tokens:
            i = self.tokens.index(t)
            n = min(self._counts[i] + 1.0, max_count)
            self.step_ms[i] += (ms - self.step_ms[i]) / n
            self._counts[i] = n
        else:
            i = sum(1 for x in self.tokens if x < t)
            self.tokens.insert(i, t)
            self.step_ms.insert(i, float(ms))
            self._counts.insert(i, 1.0)
        self._monotone()

    def _monotone(self) -> None:
        blocks: list[list[float]] = []  # [sum, weight, n points]
        for v, w in zip(self.step_ms, self._counts):
            blocks.append([v * w, w, 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, w2, n = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += w2
                blocks[-1][2] += n
        self._fitted_ms = [b[0] / b[1] for b in blocks for _ in range(b[2])]

    def cost_ms(self, num_tokens: float) -> float:
        """Predicted step ms for a step of num_tokens tokens."""
        if not self.tokens:
            raise RuntimeError("token cost table is empty: fit it from a profile first")
        ts, ys = self.tokens, self._fitted_ms
        if len(ts) == 1:
            return ys[0]
        if num_tokens <= ts[0]:
            return ys[0]
        for i in range(1, len(ts)):
            if num_tokens <= ts[i]:
                f = (num_tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        return ys[-1] + self._tail_slope() * (num_tokens - ts[-1])

    def costs_ms(self, lo: int, hi: int) -> list[float]:
        """[cost_ms(n) for n in lo..hi], walking the table once (the budget search reads every one of them)."""
        ts, ys = self.tokens, self._fitted_ms
        if len(ts) <= 1:
            return [self.cost_ms(n) for n in range(lo, hi + 1)]
        if hi - lo >= self._NUMPY_MIN:
            return self.costs_array(lo, hi).tolist()
        slope = self._tail_slope()
        out, i = [], bisect.bisect_left(ts, lo)
        for n in range(lo, hi + 1):
            while i < len(ts) and ts[i] < n:
                i += 1
            if n <= ts[0]:
                out.append(ys[0])
            elif i == len(ts):
                out.append(ys[-1] + slope * (n - ts[-1]))  # beyond the last point: the fitted line
            else:
                out.append(ys[i - 1] + (n - ts[i - 1]) / (ts[i] - ts[i - 1]) * (ys[i] - ys[i - 1]))
        return out

    def costs_array(self, lo: int, hi: int) -> np.ndarray:
        """costs_ms(lo, hi) as a float64 array [hi - lo + 1], with the same arithmetic (equal bit for bit)."""
        ts, ys = self.tokens, self._fitted_ms
        if len(ts) <= 1:
            return np.array([self.cost_ms(n) for n in range(lo, hi + 1)], dtype=np.float64)
        # per segment i (n in (ts[i-1], ts[i]]): cost = y0 + (n - t0) / dt * dy; segment 0 (n <= ts[0]) is the
        # constant ys[0] (dy = 0), segment P (beyond the last point) the fitted line (dt = 1, dy = slope)
        seg = np.array([[0, *ts],  # t0
                        [1, *(b - a for a, b in zip(ts, ts[1:])), 1],  # dt
                        [ys[0], *ys],  # y0
                        [0.0, *(b - a for a, b in zip(ys, ys[1:])), self._tail_slope() if hi > ts[-1] else 0.0]],
                       dtype=np.float64)  # [4, P + 1]
        n = np.arange(lo, hi + 1, dtype=np.float64)  # [N]
        t0, dt, y0, dy = seg[:, np.searchsorted(seg[0, 1:], n)]  # [4, N] segment of each n (first ts[i] >= n)
        return y0 + (n - t0) / dt * dy

    def _tail_slope(self) -> float:
        """Slope of the least-squares line through all points (>= 0): how cost_ms extrapolates."""
        ts, ys = self.tokens, self._fitted_ms
        mt = sum(ts) / len(ts)
        my = sum(ys) / len(ys)
        var = sum((t - mt) ** 2 for t in ts)
        return max(0.0, sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var) if var else 0.0

    def dense_ms(self, max_tokens: int) -> list[float]:
        """cost_ms(t) for t = 0..max_tokens (a lookup table for planner_torch.budget_plan_device)."""
        return self.costs_ms(0, max_tokens)


@dataclass
class DraftCost:
    """The drafter's ms per step by the rows it drafted (its drafts plus the pending token of each request that
    got drafts), at one batch-size bucket: measured on served steps, each row count's mean kept as
    TokenCostTable keeps it. Row counts measured: interpolated, beyond the last along the table's fitted line;
    below the first point (a narrower block than any measured), proportional to the rows (a drafter's forward,
    or its sequence of forwards, scales with its block; proportional overstates the saving where part of the
    cost is fixed, and the plan that acts on it measures the narrower block, which corrects it)."""

    table: TokenCostTable = field(default_factory=TokenCostTable)

    def observe(self, rows: int, ms: float) -> None:
        """One drafting's ms, at its row count rounded to a grid of 8 points per octave (a row count is requests
        x block, and every distinct one as its own point made hundreds of points at c=64, each kept up in Python
        on the step's critical path)."""
        if rows > 0 and ms >= 0:
            self.table.observe(self.grid(rows), ms, max_count=16.0)

    @staticmethod
    def grid(rows: int) -> int:
        step = 1 << max(0, int(rows).bit_length() - 4)  # 8-16 points per octave
        return max(1, int(round(rows / step)) * step)

    @property
    def measured(self) -> bool:
        return bool(self.table.tokens)

    def ms(self, rows: float) -> float:
        return float(self.ms_array(np.array([rows], dtype=np.float64))[0])

    def ms_array(self, rows: np.ndarray) -> np.ndarray:
        """ms(r) for every r of a float array (one pass in numpy: the plan asks for every width each step)."""
        ts = self.table.tokens
        if not ts:
            raise RuntimeError("draft cost is empty: observe a drafted step first")
        t = np.asarray(ts, dtype=np.float64)
        y = np.asarray(self.table._fitted_ms, dtype=np.float64)
        below = y[0] * np.maximum(rows, 0.0) / t[0]  # proportional to the first point
        if len(ts) == 1:
            return y[0] * np.maximum(rows, 0.0) / t[0]
        inside = np.interp(rows, t, y)
        beyond = y[-1] + self.table._tail_slope() * (rows - t[-1])
        return np.where(rows < t[0], below, np.where(rows > t[-1], beyond, inside))
