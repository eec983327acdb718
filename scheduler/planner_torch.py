"""Device implementations of the planner and its inputs: torch tensors in, tensors out, no host sync.

The only scheduler module that imports torch. Same math as the host code (scheduler/planner.py,
latency_model.ExpertEstimator, calibration.AcceptanceCalibrator); tests check that they agree.

plan_device, in tensor form (see planner.py for why it is optimal):
  1. per request, marginal gains s_ij and costs c_ij (masked past the cap);
  2. the pooled (upper-concave-hull) ratio of every draft by the max-min formula of antitonic regression,
     f_ij = min_{a<=j} max_{b>=j} (S_i[b] - S_i[a-1]) / (C_i[b] - C_i[a-1])   ([B, K, K] elementwise; K is small),
     which is non-increasing in j, so every prefix of the global order below is a per-request prefix;
  3. stable sort of all B*K drafts by f, descending; prefix sums of gains and costs; goodput of every prefix
     (G0 + gains) / (D0 + costs); the argmax prefix is the optimal set; L_i = drafts of request i in it.
Cost O(B K^2 + B K log(B K)), a fixed number of kernels, nothing read back to the host.

plan_with_experts_device = planner.plan_with_experts (distinct-expert cost from routing statistics and request
footprints, consistent linearization from two starts, uniform-K candidates), built from batch_increments_device
and plan_device. Measured on one H200 (CUDA graph replay, K = 16, 40 MoE layers x 256 experts): plan_device
0.10 ms at B = 8 and 0.14 ms at B = 64; plan_with_experts_device (iterations = 2) 0.79 ms and 1.34 ms. All of
them capture in a CUDA graph and pass torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MIN_ITEM_MS = 1e-9
_MAX_Q = 1.0 - 1e-12  # as latency_model._MAX_Q


def _scalar(x: float | int | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d tensor on device: a fill kernel for Python numbers (no host-to-device copy: CUDA-graph safe)."""
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=dtype)
    return torch.full((), x if dtype == torch.long else float(x), dtype=dtype, device=device)


def survival_device(acceptance: Tensor) -> Tensor:
    """[B, K] conditional acceptance probabilities -> survival s_ij = prod_{m<=j} acc_im."""
    return acceptance.clamp(0.0, 1.0).cumprod(dim=-1)


def calibrate_device(confidence: Tensor, table: Tensor) -> Tensor:
    """Calibrated acceptance [B, K] from raw confidence [B, K] and AcceptanceCalibrator.table(drafter) as a
    tensor [P, num_bins] (positions >= P use the last row); linear interpolation between bin centres."""
    B, K = confidence.shape
    P, nb = table.shape
    table = table.to(device=confidence.device, dtype=torch.promote_types(confidence.dtype, table.dtype))
    pos = torch.arange(K, device=confidence.device).clamp(max=P - 1)
    rows = table[pos].unsqueeze(0).expand(B, K, nb)
    x = (confidence.to(table.dtype) * nb - 0.5).clamp(0.0, nb - 1.0)
    lo = x.floor().long().clamp(max=nb - 1)
    hi = (lo + 1).clamp(max=nb - 1)
    frac = x - lo.to(x.dtype)
    v_lo = rows.gather(2, lo.unsqueeze(-1)).squeeze(-1)
    v_hi = rows.gather(2, hi.unsqueeze(-1)).squeeze(-1)
    return v_lo + frac * (v_hi - v_lo)


def footprint_touch_probs(footprint_counts: Tensor, top_k: int) -> Tensor:
    """[B, layers, E] routing-slot counts of each request's recent tokens -> per-token touch probabilities
    min(1, top_k * share) (rows with no slots stay 0, meaning: no footprint for that layer)."""
    tot = footprint_counts.sum(dim=-1, keepdim=True)
    return torch.where(tot > 0, (top_k * footprint_counts / tot.clamp(min=1e-30)).clamp(max=1.0),
                       torch.zeros_like(footprint_counts))


def request_touch_probs_device(touch_probs: Tensor, footprint_probs: Tensor | None, locality: float | Tensor,
                               num_requests: int) -> Tensor:
    """[B, layers, E] per-request routing probabilities: the global ones (ExpertEstimator.touch_prob_table() as
    a tensor) mixed with each request's footprint (footprint_touch_probs) by ExpertEstimator.locality; layers
    where a request has no footprint use the global probabilities. = ExpertEstimator.request_touch_probs."""
    q = touch_probs.unsqueeze(0).expand(num_requests, *touch_probs.shape)
    if footprint_probs is None:
        return q
    has = footprint_probs.sum(dim=-1, keepdim=True) > 0
    return torch.where(has, (1.0 - locality) * q + locality * footprint_probs.to(q.dtype), q)


def _coverage_logs(probs: Tensor, touch_probs: Tensor, extra_base_tokens: int | Tensor) -> tuple[Tensor, Tensor]:
    """log P(a token misses e): per request [B, layers, E], and for the globally routed extra tokens [layers, E]."""
    logs = torch.log1p(-probs.clamp(max=_MAX_Q))
    extra = _scalar(extra_base_tokens, probs.dtype, probs.device) * torch.log1p(
        -touch_probs.to(probs.dtype).clamp(max=_MAX_Q))
    return logs, extra


def _increments(probs: Tensor, logs: Tensor, extra_log: Tensor, base_tokens: Tensor, lengths: Tensor,
                max_drafts: int) -> tuple[Tensor, Tensor]:
    n = (base_tokens + lengths).to(probs.dtype)
    tot = torch.einsum("b,ble->le", n, logs) + extra_log  # log P(e untouched by the whole step)
    experts = (1.0 - tot.exp()).sum()
    miss = (tot.unsqueeze(0) - lengths.to(probs.dtype).view(-1, 1, 1) * logs).exp()  # ... by all but own drafts
    j = torch.arange(max_drafts, device=probs.device, dtype=probs.dtype)
    powers = (1.0 - probs).unsqueeze(-1).pow(j)  # [B, layers, E, K]
    inc = torch.einsum("bx,bxk->bk", (miss * probs).flatten(1), powers.flatten(1, 2))
    return inc, experts


def distinct_by_tokens_device(touch_probs: Tensor, max_tokens: int, chunk: int = 256, exact_upto: int = 1024,
                              rel_step: float = 2e-3) -> Tensor:
    """[max_tokens + 1]: expected distinct experts (summed over layers) touched by n tokens routed by global
    popularity, n = 0..max_tokens = ExpertEstimator.expected_distinct_total(n). touch_probs [layers, E].

    Up to `exact_upto` probabilities exactly; beyond (40 x 256 for the bench model), the probabilities are
    grouped on a log grid of relative step `rel_step` and each group counted once with its multiplicity: a few
    hundred groups instead of 10240 columns (128 ms -> ~2 ms on a CPU at 1088 token counts), each probability
    moved by < 0.1%."""
    q = touch_probs.reshape(-1).clamp(min=0.0, max=_MAX_Q)
    weights = None
    if q.numel() > exact_upto:
        pos = q > 0
        key = torch.round(torch.log(q[pos]) / math.log1p(rel_step))
        key, weights = torch.unique(key, return_counts=True)
        q = torch.exp(key * math.log1p(rel_step)).clamp(max=_MAX_Q)
        weights = weights.to(q.dtype)
    logs = torch.log1p(-q)
    n = torch.arange(max_tokens + 1, device=touch_probs.device, dtype=logs.dtype)
    parts = []
    for part in n.split(chunk):
        touched = 1.0 - (part.unsqueeze(1) * logs).exp()  # [chunk, columns]
        parts.append(touched.sum(1) if weights is None else touched @ weights)
    return torch.cat(parts)


def batch_increments_device(probs: Tensor, touch_probs: Tensor, base_tokens: Tensor, lengths: Tensor,
                            max_drafts: int, extra_base_tokens: int | Tensor = 0) -> tuple[Tensor, Tensor]:
    """(increments [B, max_drafts], experts_total 0-d) = ExpertEstimator.batch_increments on device.

    probs: [B, layers, E] from request_touch_probs_device; base_tokens, lengths: [B]. Memory B * layers * E * K.
    """
    logs, extra_log = _coverage_logs(probs, touch_probs, extra_base_tokens)
    return _increments(probs, logs, extra_log, base_tokens.to(probs.device), lengths, max_drafts)


def plan_with_experts_device(survival: Tensor, caps: Tensor, fixed_ms: float | Tensor, ms_per_token: float | Tensor,
                             ms_per_expert: float | Tensor, touch_probs: Tensor, base_tokens: Tensor,
                             footprint_probs: Tensor | None = None, locality: float | Tensor = 0.0,
                             iterations: int = 2, base_gain: float | Tensor | None = None,
                             extra_base_tokens: int | Tensor = 0) -> Tensor:
    """planner.plan_with_experts on device: lengths [B] (int64), no host sync (fixed iteration counts).

    fixed_ms: the predicted step ms with every L_i = 0 minus its expert term (const + tokens + requests +
    context terms, plus drafting time if counted); base_tokens [B]: tokens each request runs with L_i = 0.
    Same candidates in the same order as the host: uniform min(k, cap_i) for k = 0..K, then the linearization
    iterates from L = 0 and from L = caps; the best under the full coverage model wins (ties: the earlier).
    Cost: 2 * iterations passes over [B, layers, E, K] plus 2 * iterations plan_device calls.
    Give touch_probs in float64 for exact agreement with the host; float32 is fine in serving.
    """
    B, K = survival.shape
    dev = survival.device
    if B == 0 or K == 0:
        return torch.zeros(B, dtype=torch.long, device=dev)
    dt = torch.float64
    touch_probs = touch_probs.to(dev)
    probs = request_touch_probs_device(touch_probs, footprint_probs, locality, B)
    logs, extra_log = _coverage_logs(probs, touch_probs, extra_base_tokens)
    base_tokens = base_tokens.to(dev)
    caps = caps.to(dev).long().clamp(0, K)
    tok = _scalar(ms_per_token, dt, dev)
    ex = _scalar(ms_per_expert, dt, dev)
    fixed = _scalar(fixed_ms, dt, dev)
    g0 = _scalar(float(B) if base_gain is None else base_gain, dt, dev)
    pad = torch.zeros(B, 1, dtype=dt, device=dev)
    surv_pad = torch.cat([pad, survival.to(dt).cumsum(1)], 1)

    # the uniform plans min(k, cap_i), k = 0..K, all at once
    uniform = caps.unsqueeze(0).clamp(max=torch.arange(K + 1, device=dev).unsqueeze(1))  # [K + 1, B]
    tot = torch.einsum("cb,ble->cle", (base_tokens.unsqueeze(0) + uniform).to(logs.dtype), logs) + extra_log
    ms_u = fixed + tok * uniform.sum(1) + ex * (1.0 - tot.exp()).sum(dim=(1, 2)).to(dt)
    gain_u = g0 + surv_pad.gather(1, uniform.t()).sum(0)
    k_best = (gain_u / ms_u).argmax().view(1)  # index_select, not [k]: indexing by a tensor syncs
    best = [uniform.index_select(0, k_best).squeeze(0), gain_u.index_select(0, k_best).squeeze(0),
            ms_u.index_select(0, k_best).squeeze(0)]  # lengths, gain, step_ms

    def consider(lengths: Tensor, experts: Tensor) -> None:
        step_ms = fixed + tok * lengths.sum() + ex * experts.to(dt)
        gain = g0 + surv_pad.gather(1, lengths.view(-1, 1)).sum()
        better = gain * best[2] > best[1] * step_ms
        best[:] = [torch.where(better, lengths, best[0]), torch.where(better, gain, best[1]),
                   torch.where(better, step_ms, best[2])]

    for start in (torch.zeros(B, dtype=torch.long, device=dev), caps):
        lengths = start
        inc, experts = _increments(probs, logs, extra_log, base_tokens, lengths, K)
        for it in range(iterations):
            inc = inc.to(dt)
            step_ms = fixed + tok * lengths.sum() + ex * experts.to(dt)
            own = tok * lengths.sum() + ex * torch.cat([pad, inc.cumsum(1)], 1).gather(1, lengths.view(-1, 1)).sum()
            lengths = plan_device(survival, caps, step_ms - own, tok, ex, inc, g0)
            last = it == iterations - 1  # the last iterate needs only its expert total
            inc, experts = _increments(probs, logs, extra_log, base_tokens, lengths, 0 if last else K)
            consider(lengths, experts)
    return best[0]


def plan_device(survival: Tensor, caps: Tensor, base_ms: float | Tensor, ms_per_token: float | Tensor,
                ms_per_expert: float | Tensor = 0.0, expert_increments: Tensor | None = None,
                base_gain: float | Tensor | None = None) -> Tensor:
    """Joint verification lengths [B] (int64) maximizing expected goodput; equals planner.plan_host.

    survival [B, K] non-increasing in K; caps [B]; base_ms, ms_per_token, ms_per_expert: PlanCost's fields
    (floats or 0-d tensors); expert_increments [B, K] or None; base_gain: tokens with every L_i = 0 (default B).
    Computed in float64 (tiny tensors).
    """
    B, K = survival.shape
    dev = survival.device
    if B == 0 or K == 0:
        return torch.zeros(B, dtype=torch.long, device=dev)
    dt = torch.float64
    j = torch.arange(K, device=dev)
    valid = j.unsqueeze(0) < caps.to(dev).long().clamp(0, K).unsqueeze(1)  # [B, K]
    inc = torch.zeros((), dtype=dt, device=dev) if expert_increments is None else expert_increments.to(dt)
    c = (_scalar(ms_per_token, dt, dev) + _scalar(ms_per_expert, dt, dev)
         * inc).expand(B, K).clamp(min=_MIN_ITEM_MS)
    zero = torch.zeros((), dtype=dt, device=dev)
    s = torch.where(valid, survival.to(dt), zero)
    c = torch.where(valid, c, zero)
    pad = torch.zeros(B, 1, dtype=dt, device=dev)
    S = torch.cat([pad, s.cumsum(1)], 1)  # [B, K + 1]
    C = torch.cat([pad, c.cumsum(1)], 1)
    # av[b, a, e] = average ratio of drafts a..e (inclusive) = (S[e+1] - S[a]) / (C[e+1] - C[a])
    a_idx, e_idx = j.view(K, 1), j.view(1, K)
    ok = (e_idx >= a_idx).unsqueeze(0) & valid.unsqueeze(1)
    num = S[:, None, 1:] - S[:, :K, None]
    den = C[:, None, 1:] - C[:, :K, None]
    neg_inf = torch.full((), float("-inf"), dtype=dt, device=dev)
    av = torch.where(ok, num / torch.where(ok, den, torch.ones((), dtype=dt, device=dev)), neg_inf)
    m = av.flip(-1).cummax(-1).values.flip(-1)  # m[b, a, j] = max_{e >= j} av[b, a, e]
    f = torch.where((a_idx <= e_idx).unsqueeze(0), m, -neg_inf).amin(dim=1)  # min over a <= j
    f = torch.where(valid, f, neg_inf)
    order = torch.sort(f.reshape(-1), descending=True, stable=True).indices
    gains = torch.cat([pad[0], s.reshape(-1)[order].cumsum(0)])
    costs = torch.cat([pad[0], c.reshape(-1)[order].cumsum(0)])
    g0 = _scalar(float(B) if base_gain is None else base_gain, dt, dev)
    goodput = (g0 + gains) / (_scalar(base_ms, dt, dev) + costs)
    best = goodput.argmax()  # first maximum: ties resolved towards fewer tokens
    chosen_sorted = torch.arange(B * K, device=dev) < best
    chosen = torch.zeros(B * K, dtype=torch.bool, device=dev).scatter(0, order, chosen_sorted)
    return chosen.view(B, K).sum(1)


def budget_plan_device(survival: Tensor, caps: Tensor, cost_by_tokens_ms: Tensor, base_tokens: int | Tensor,
                       base_gain: float | Tensor | None = None, draft_ms: float | Tensor = 0.0) -> Tensor:
    """The `budget` baseline on device; equals planner.budget_plan. cost_by_tokens_ms[t] = cost of a t-token
    step (TokenCostTable.dense_ms(max_tokens) as a tensor, long enough for base_tokens + sum(caps); longer
    steps are clamped to its last entry)."""
    B, K = survival.shape
    dev = survival.device
    if B == 0 or K == 0:
        return torch.zeros(B, dtype=torch.long, device=dev)
    dt = torch.float64
    j = torch.arange(K, device=dev)
    valid = j.unsqueeze(0) < caps.to(dev).long().clamp(0, K).unsqueeze(1)
    s = survival.to(dt)
    key = torch.where(valid, s, torch.full((), float("-inf"), dtype=dt, device=dev)).reshape(-1)
    order = torch.sort(key, descending=True, stable=True).indices
    s_sorted = torch.where(valid, s, torch.zeros((), dtype=dt, device=dev)).reshape(-1)[order]
    gains = torch.cat([torch.zeros(1, dtype=dt, device=dev), s_sorted.cumsum(0)])
    b = torch.arange(B * K + 1, device=dev)
    table = cost_by_tokens_ms.to(device=dev, dtype=dt)
    t = (_scalar(base_tokens, torch.long, dev) + b).clamp(max=table.numel() - 1)
    g0 = _scalar(float(B) if base_gain is None else base_gain, dt, dev)
    r = (g0 + gains) / (_scalar(draft_ms, dt, dev) + table[t])
    r = torch.where(b <= valid.sum(), r, torch.full((), float("-inf"), dtype=dt, device=dev))
    best = r.argmax()
    chosen = torch.zeros(B * K, dtype=torch.bool, device=dev).scatter(0, order, b[:-1] < best)
    return chosen.view(B, K).sum(1)
