"""One entry point per kernel: the Triton kernel for CUDA tensors, the PyTorch reference otherwise.

HYBRIDSPEC_KERNELS (read at each call):
    unset / "auto"  Triton on CUDA tensors, references elsewhere
    "ref"           references everywhere (the specification; eager CPU/GPU debugging)
    "triton"        Triton everywhere (on CPU only under TRITON_INTERPRET=1, for tests)
Each entry has its reference's signature. The Triton modules are imported on first use, so the CPU path never
imports triton.
"""

from __future__ import annotations

import os

from torch import Tensor

from kernels.conv import causal_conv1d_ref, conv_commit_ref
from kernels.gdn import gdn_commit_ref, gdn_ref
from kernels.moe import distinct_experts_ref


def use_triton(x: Tensor) -> bool:
    mode = os.environ.get("HYBRIDSPEC_KERNELS", "auto")
    if mode == "ref":
        return False
    return mode == "triton" or x.is_cuda


# ---------------------------------------------------------------------------------------------- GDN (issue 6)

def gdn(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale=None, use_qk_l2norm=True, write_state=True):
    """Gated delta rule over a ragged batch (kernels.gdn.gdn_ref): o [N, HV, DV]."""
    if use_triton(v):
        from kernels.gdn_triton import gdn_triton
        return gdn_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm, write_state)
    return gdn_ref(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm, write_state)


def gdn_commit(k, v, g, beta, cu_seqlens, keep_lens, state, slots, max_len, use_qk_l2norm=True):
    """S_0 -> S_a over each request's first keep_lens[i] tokens (kernels.gdn.gdn_commit_ref)."""
    if use_triton(v):
        from kernels.gdn_triton import gdn_commit_triton
        return gdn_commit_triton(k, v, g, beta, cu_seqlens, keep_lens, state, slots, max_len, use_qk_l2norm)
    return gdn_commit_ref(k, v, g, beta, cu_seqlens, keep_lens, state, slots, max_len, use_qk_l2norm)


# --------------------------------------------------------------------------------------------- conv (issue 6)

def causal_conv1d(x, weight, cu_seqlens, conv_state, slots, max_len, write_state=True):
    """Causal depthwise conv1d + SiLU continuing each request's window (kernels.conv.causal_conv1d_ref)."""
    if use_triton(x):
        from kernels.conv_triton import causal_conv1d_triton
        return causal_conv1d_triton(x, weight, cu_seqlens, conv_state, slots, max_len, write_state)
    return causal_conv1d_ref(x, weight, cu_seqlens, conv_state, slots, max_len, write_state)


def conv_commit(x, cu_seqlens, keep_lens, conv_state, slots, max_len):
    """Moves each window over its first keep_lens[i] inputs (kernels.conv.conv_commit_ref)."""
    if use_triton(x):
        from kernels.conv_triton import conv_commit_triton
        return conv_commit_triton(x, cu_seqlens, keep_lens, conv_state, slots, max_len)
    return conv_commit_ref(x, cu_seqlens, keep_lens, conv_state, slots, max_len)


def gdn_decode(x, z, a, b, conv_weight, neg_a, dt_bias, norm_weight, eps, cu_seqlens, conv_state, state, slots,
               scale=None, write_state=True, keep_inputs=False):
    """A GDN layer's plain decode (0 or 1 token per request): conv, gates, delta rule, gated norm in one launch
    (kernels.gdn_decode.gdn_decode_ref): o [N, HV*DV] (with keep_inputs: (o, conv output, g, beta))."""
    if use_triton(x):
        from kernels.gdn_decode_triton import gdn_decode_triton
        return gdn_decode_triton(x, z, a, b, conv_weight, neg_a, dt_bias, norm_weight, eps, cu_seqlens, conv_state,
                                 state, slots, scale, write_state, keep_inputs)
    from kernels.gdn_decode import gdn_decode_ref
    return gdn_decode_ref(x, z, a, b, conv_weight, neg_a, dt_bias, norm_weight, eps, cu_seqlens, conv_state, state,
                          slots, scale, write_state, keep_inputs)


# ------------------------------------------------------------------- MoE / attention (issue 6, items 4 and 5)
# Triton versions: kernels/moe_triton.py, kernels/attention_triton.py. Same signatures as the references; the
# Triton attention uses the host lists only as size hints (results come from the device tensors), and neither
# MoE nor attention synchronizes with the host, so both can be captured in a CUDA graph.

def router_logits(x, weight):
    """fp32 router logits x @ weight^T (kernels.moe.router_logits_ref): [N, E] float32."""
    if use_triton(x):
        from kernels.moe_triton import router_logits_triton
        return router_logits_triton(x, weight)
    from kernels.moe import router_logits_ref
    return router_logits_ref(x, weight)


def route(router_logits, top_k, renormalize, out_dtype=None, bias=None, shared=False):
    """Softmax top-k routing (kernels.moe.route_ref): (weights [N, k] in out_dtype or the logits' dtype,
    ids [N, k] int64); `bias` [E] is added to the logits first. `shared`: logits [N, E + 1] (the last column the
    shared expert's gate), one more slot per token (id E, sigmoid(gate)): [N, k + 1]."""
    from kernels.moe import route_ref
    if use_triton(router_logits):
        from kernels.moe_triton import route_triton
        return route_triton(router_logits, top_k, renormalize, out_dtype, bias, shared)
    return route_ref(router_logits, top_k, renormalize, out_dtype, bias, shared)


def expert_counts(topk_ids, token_mask, num_experts):
    """(distinct experts, assignments per expert [E]) of the unmasked tokens (kernels.moe.expert_counts_ref)."""
    if use_triton(topk_ids):
        from kernels.moe_triton import expert_counts_triton
        return expert_counts_triton(topk_ids, token_mask, num_experts)
    from kernels.moe import expert_counts_ref
    return expert_counts_ref(topk_ids, token_mask, num_experts)


def distinct_experts(topk_ids, token_mask, num_experts):
    """Distinct experts the unmasked tokens touch, a device int64 scalar (kernels.moe.distinct_experts_ref)."""
    if use_triton(topk_ids):
        from kernels.moe_triton import distinct_experts_triton
        return distinct_experts_triton(topk_ids, token_mask, num_experts)
    return distinct_experts_ref(topk_ids, token_mask, num_experts)


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask=None, shared=None, stats=None):
    """Routed experts of all tokens of a step (kernels.moe.fused_moe_ref): [N, H]; masked rows cost no routed expert
    work (with `shared`, their shared slot stays).
    `shared` (w_gate_up_s [2I_s, H], w_down_s [H, I_s]): expert id E is the shared expert, in the same launches.
    `stats` (distinct_out [] int64, counts_out [E] int64 or None): the routing statistics (expert_counts of the
    routed slots of unmasked tokens) written by the grouping, no launch of their own."""
    from kernels.moe import fused_moe_ref
    if use_triton(x):
        from kernels.moe_triton import fused_moe_triton
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared=shared,
                                stats=stats)
    return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared, stats)


def fused_moe_add_rmsnorm(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared, stats, residual,
                         norm_weight, eps):
    """fused_moe, then add_rmsnorm(residual, out, norm_weight, eps): (s, rmsnorm(s)) for s = residual + the experts
    (kernels.moe.fused_moe_add_rmsnorm_ref). The Triton path sums each token's expert rows, adds the residual and
    normalizes in one launch (one fewer than fused_moe + add_rmsnorm; the same values)."""
    if use_triton(x):
        from kernels.moe_triton import fused_moe_add_rmsnorm_triton
        return fused_moe_add_rmsnorm_triton(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared, stats,
                                            residual, norm_weight, eps)
    from kernels.moe import fused_moe_add_rmsnorm_ref
    return fused_moe_add_rmsnorm_ref(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, shared, stats,
                                     residual, norm_weight, eps)


def qk_norm_rope_write(q, k, v, q_weight, k_weight, eps, cos, sin, rotary_dim, k_cache, v_cache, page_table,
                       positions, request_of_row):
    """q and k RMSNorm'd per head and rotated, k and v into their pages; returns q
    (kernels.attention.qk_norm_rope_write_ref; one launch on the Triton path)."""
    if use_triton(q):
        from kernels.attention_triton import qk_norm_rope_write_triton
        return qk_norm_rope_write_triton(q, k, v, q_weight, k_weight, eps, cos, sin, rotary_dim, k_cache, v_cache,
                                         page_table, positions, request_of_row)
    from kernels.attention import qk_norm_rope_write_ref
    return qk_norm_rope_write_ref(q, k, v, q_weight, k_weight, eps, cos, sin, rotary_dim, k_cache, v_cache,
                                  page_table, positions, request_of_row)


def paged_attention(q, k_cache, v_cache, page_table, cu_seqlens, context_lens, scale, query_lens,
                    context_lens_host, gate=None):
    """Causal attention over paged KV, ragged batch, decode/verify/prefill (kernels.attention.paged_attention_ref);
    `gate` [N, H, D]: the output times sigmoid(gate) (in the kernel's epilogue on the Triton path).

    Triton path: query_lens / context_lens_host are size hints only (tile shape, KV splits); under graph capture
    pass the bucket's lengths, results stay right for any lengths at replay."""
    from kernels.attention import paged_attention_ref
    if use_triton(q):
        from kernels.attention_triton import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, page_table, cu_seqlens, context_lens, scale, query_lens,
                                      context_lens_host, gate)
    return paged_attention_ref(q, k_cache, v_cache, page_table, cu_seqlens, context_lens, scale, query_lens,
                               context_lens_host, gate)


# ------------------------------------------------------------------------------------------------ norms (issue 6)

def rmsnorm(x, weight, eps):
    """Zero-centred RMSNorm (kernels.norm.rmsnorm_ref)."""
    if use_triton(x):
        from kernels.norm_triton import rmsnorm_triton
        return rmsnorm_triton(x, weight, eps)
    from kernels.norm import rmsnorm_ref
    return rmsnorm_ref(x, weight, eps)


def add_rmsnorm(x, h, weight, eps):
    """Residual add + RMSNorm: (x + h, rmsnorm(x + h)) (kernels.norm.add_rmsnorm_ref)."""
    if use_triton(x):
        from kernels.norm_triton import add_rmsnorm_triton
        return add_rmsnorm_triton(x, h, weight, eps)
    from kernels.norm import add_rmsnorm_ref
    return add_rmsnorm_ref(x, h, weight, eps)


def moe_residual_rmsnorm(x, routed, gate_logit, shared, weight, eps):
    """The end of a MoE layer and the next input norm (kernels.norm.moe_residual_rmsnorm_ref)."""
    if use_triton(x):
        from kernels.norm_triton import moe_residual_rmsnorm_triton
        return moe_residual_rmsnorm_triton(x, routed, gate_logit, shared, weight, eps)
    from kernels.norm import moe_residual_rmsnorm_ref
    return moe_residual_rmsnorm_ref(x, routed, gate_logit, shared, weight, eps)


def gated_rmsnorm(x, gate, weight, eps):
    """GDN output norm weight * norm(x) * silu(gate) (kernels.norm.gated_rmsnorm_ref)."""
    if use_triton(x):
        from kernels.norm_triton import gated_rmsnorm_triton
        return gated_rmsnorm_triton(x, gate, weight, eps)
    from kernels.norm import gated_rmsnorm_ref
    return gated_rmsnorm_ref(x, gate, weight, eps)


# ------------------------------------------------------------------------------- small per-token ops (issue 6)

def rope(x, cos, sin, rotary_dim):
    """Rotate-half rotary embedding of [N, heads, D] (kernels.elementwise.rope_ref)."""
    if use_triton(x):
        from kernels.elementwise_triton import rope_triton
        return rope_triton(x, cos, sin, rotary_dim)
    from kernels.elementwise import rope_ref
    return rope_ref(x, cos, sin, rotary_dim)


def gdn_gates(a, b, neg_a, dt_bias):
    """(g fp32 log decay, beta) of a GDN layer from its raw projections (kernels.elementwise.gdn_gates_ref)."""
    if use_triton(a):
        from kernels.elementwise_triton import gdn_gates_triton
        return gdn_gates_triton(a, b, neg_a, dt_bias)
    from kernels.elementwise import gdn_gates_ref
    return gdn_gates_ref(a, b, neg_a, dt_bias)


def silu_mul(gate, up):
    """silu(gate) * up (kernels.elementwise.silu_mul_ref)."""
    if use_triton(gate):
        from kernels.elementwise_triton import silu_mul_triton
        return silu_mul_triton(gate, up)
    from kernels.elementwise import silu_mul_ref
    return silu_mul_ref(gate, up)


def moe_residual(x, routed, gate_logit, shared):
    """x + (routed + sigmoid(gate_logit) * shared) (kernels.elementwise.moe_residual_ref)."""
    if use_triton(x):
        from kernels.elementwise_triton import moe_residual_triton
        return moe_residual_triton(x, routed, gate_logit, shared)
    from kernels.elementwise import moe_residual_ref
    return moe_residual_ref(x, routed, gate_logit, shared)


# ------------------------------------------------------------------- dense projections at few rows (issue 6)

def linear(x, weight, bias=None):
    """x @ weight^T + bias (F.linear): on the Triton path a 2-D x of 1..kernels.gemv.SMALL_N_MAX rows takes the
    one-launch GEMV (kernels.gemv_triton.linear_small_triton; reference kernels.gemv.linear_small_ref), anything
    else F.linear (cuBLAS). workers/model.py's Linear and FusedLinears call this; the LM head does not (cuBLAS is at
    its floor there). SMALL_N_MAX = 0 (HYBRIDSPEC_GEMV_MAX_N=0) keeps every projection on F.linear."""
    from kernels import gemv
    if x.dim() == 2 and 0 < x.shape[0] <= min(gemv.SMALL_N_MAX, gemv.GEMV_MAX_ROWS) and use_triton(x):
        from kernels.gemv_triton import linear_small_triton
        return linear_small_triton(x, weight, bias)
    from torch.nn.functional import linear as torch_linear
    return torch_linear(x, weight, bias)
