"""Mixture-of-experts: softmax top-k routing and the expert MLPs for all tokens of a step (PyTorch references).

Expert weights: `w_gate_up` [E, 2I, H] (gate rows then up rows), `w_down` [E, H, I]. Tokens of every request
are grouped by expert so each touched expert's weights are read once per step.

The shared expert as one more expert (issue 6): the router's logits over E + 1 rows (its last row the shared
expert's gate), `route_ref(..., shared=True)` gives every token a slot k = (expert id E, sigmoid(gate logit)) after
its top-k routed slots, and `fused_moe_ref(..., shared=(w_gate_up_s [2I_s, H], w_down_s [H, I_s]))` runs id E with
the shared expert's own weights (I_s may differ from I): routed and shared experts in one call. A masked token
(token_mask False) gets no routed work and keeps its shared slot, as the shared expert computed apart does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.norm import add_rmsnorm_ref


ROUTER_LOGITS_MAX_N = 64  # tokens up to which the Triton path computes router logits in one kernel


def router_logits_ref(x: Tensor, weight: Tensor) -> Tensor:
    """fp32 router logits: x [N, H] @ weight [E, H]^T -> [N, E] float32 (products of the inputs' values, fp32
    sums: bf16 logits tie often among hundreds of experts)."""
    return F.linear(x.float(), weight.float())


def route_ref(router_logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype | None = None,
              bias: Tensor | None = None, shared: bool = False) -> tuple[Tensor, Tensor]:
    """router_logits [N, E] (+ bias [E], added in the logits' dtype) -> (weights [N, k] in out_dtype, default the
    logits' dtype, expert ids [N, k] int64).

    shared: router_logits is [N, E + 1], its last column the shared expert's gate logit. The routed slots come
    from the first E columns exactly as without it (bias [E] on those only); one more slot per token follows them:
    (expert id E, sigmoid(gate logit) computed in fp32) -> weights, ids [N, k + 1]."""
    if shared:
        num_experts = router_logits.shape[-1] - 1
        weights, ids = route_ref(router_logits[:, :num_experts], top_k, renormalize,
                                 out_dtype or router_logits.dtype, bias)
        gate = torch.sigmoid(router_logits[:, num_experts:].float()).to(weights.dtype)
        return torch.cat([weights, gate], dim=1), torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=1)
    if bias is not None:
        router_logits = router_logits + bias.to(router_logits.dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype or router_logits.dtype), ids


def fused_moe_ref(
    x: Tensor,  # [N, H]
    w_gate_up: Tensor,  # [E, 2I, H]
    w_down: Tensor,  # [E, H, I]
    topk_weights: Tensor,  # [N, k]
    topk_ids: Tensor,  # [N, k] int64
    token_mask: Tensor | None = None,  # [N] bool; False rows get no routed expert work (only the shared slot)
    shared: tuple[Tensor, Tensor] | None = None,  # (w_gate_up_s [2I_s, H], w_down_s [H, I_s]): expert id E
    stats: tuple[Tensor, Tensor | None] | None = None,  # out: (distinct [] int64, counts [E] int64 or None)
) -> Tensor:
    """sum_j topk_weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = topk_ids[n, j]. Returns [N, H].

    With `shared`, id E (= w_gate_up.shape[0]) is the shared expert (its own weights, I_s may differ from I):
    route_ref(..., shared=True) gives each token that slot with weight sigmoid(gate logit). A masked token gets no
    routed work but keeps its shared slot: the layer's output on every row is that of the routed MoE plus the gated
    shared expert computed apart (which runs on every row; the shared weights are read for the batch anyway).

    `stats` (distinct_out [] int64, counts_out [E] int64 or None), the caller's buffers: filled with the step's
    routing statistics, expert_counts_ref of the routed slots (the first k, without the shared one) of the
    unmasked tokens (the Triton version writes them from its grouping, no launch of their own)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    if stats is not None:
        routed_ids = topk_ids[:, :top_k - 1] if shared is not None else topk_ids
        distinct, counts = expert_counts_ref(routed_ids, token_mask, num_experts)
        stats[0].copy_(distinct.reshape(stats[0].shape))
        if stats[1] is not None:
            stats[1].copy_(counts)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)  # [N*k]
    if token_mask is not None:
        keep = token_mask.repeat_interleave(top_k)
        if shared is not None:
            keep = keep | (flat_ids == num_experts)
        flat_ids = torch.where(keep, flat_ids, -1)
    order = torch.argsort(flat_ids, stable=True)  # assignments sorted by expert
    sorted_ids = flat_ids[order]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        if e < 0:
            start += n
            continue
        if e == num_experts and shared is not None:
            w_gu, w_dn = shared
        else:
            w_gu, w_dn = w_gate_up[e], w_down[e]
        rows = token_of[start : start + n]
        gate, up = F.linear(x[rows], w_gu).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_dn) * weight_of[start : start + n, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out


def fused_moe_add_rmsnorm_ref(
    x: Tensor,  # [N, H] the MoE's input
    w_gate_up: Tensor,  # [E, 2I, H]
    w_down: Tensor,  # [E, H, I]
    topk_weights: Tensor,  # [N, k]
    topk_ids: Tensor,  # [N, k] int64
    token_mask: Tensor | None,  # [N] bool or None
    shared: tuple[Tensor, Tensor] | None,  # (w_gate_up_s [2I_s, H], w_down_s [H, I_s]): expert id E, or None
    stats: tuple[Tensor, Tensor | None] | None,  # out: (distinct [] int64, counts [E] int64 or None), or None
    residual: Tensor,  # [N, H]
    norm_weight: Tensor,  # [H]
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The end of a fused MoE layer and the next layer's input norm: fused_moe_ref (its `stats` too), then
    kernels.norm.add_rmsnorm_ref(residual, out, norm_weight, eps) -> (s, rmsnorm(s)), s = residual + out [N, H].
    (The Triton version sums the experts' rows, adds and normalizes in one launch.)"""
    out = fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared, stats)
    return add_rmsnorm_ref(residual, out, norm_weight, eps)


def router_correction_ref(topk_ids: Tensor, extra_rows: Tensor, num_experts: int) -> Tensor:
    """The extra verification token of each request is kept only where every expert it routes to is already
    activated by the batch's other tokens (it then costs no extra expert weight reads).

    topk_ids [N, k], extra_rows [N] bool -> token_mask [N] bool (False = masked out of all later expert work).
    Device ops only, no host sync.
    """
    covered = torch.zeros(num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    others = torch.where(extra_rows[:, None], num_experts, topk_ids)  # extra rows point at a dummy expert
    covered.index_fill_(0, others.reshape(-1), True)  # (no host scalar: capturable in a CUDA graph)
    extra_ok = covered[topk_ids].all(dim=-1)  # [N]
    return ~extra_rows | extra_ok


def distinct_experts_ref(topk_ids: Tensor, token_mask: Tensor | None, num_experts: int) -> Tensor:
    """Number of distinct experts the (unmasked) tokens touch, as a device int64 scalar (no host sync)."""
    return expert_counts_ref(topk_ids, token_mask, num_experts)[0]


def expert_counts_ref(topk_ids: Tensor, token_mask: Tensor | None, num_experts: int) -> tuple[Tensor, Tensor]:
    """(distinct experts touched, a device int64 scalar; routed assignments per expert [E] int64) of the
    unmasked tokens: the routing statistics a step records, no host sync."""
    kept = topk_ids if token_mask is None else torch.where(token_mask[:, None], topk_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    counts.index_add_(0, kept.reshape(-1), torch.ones_like(kept.reshape(-1)))
    return (counts[:num_experts] > 0).sum(), counts[:num_experts]
