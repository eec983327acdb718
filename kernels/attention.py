"""Causal attention over a paged KV cache for a ragged batch (PyTorch references).

KV lives in pages: `k_cache`/`v_cache` [P, page_size, HKV, D]; request i's token at position p is in page
page_table[i, p // page_size], row p % page_size. A step brings T_i new tokens per request at positions
context_lens[i] .. context_lens[i] + T_i - 1; each attends to every cached position up to its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.elementwise import rope_ref
from kernels.norm import rmsnorm_ref


def _flat_slots(page_table: Tensor, positions: Tensor, request_of_row: Tensor, page_size: int) -> Tensor:
    """Flat cache row (page * page_size + offset) of each (request, position)."""
    pages = page_table[request_of_row, positions // page_size].long()
    return pages * page_size + positions % page_size


def write_kv_ref(
    k: Tensor,  # [N, HKV, D] new keys
    v: Tensor,  # [N, HKV, D]
    k_cache: Tensor,  # [P, page_size, HKV, D]
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    positions: Tensor,  # [N] int64 absolute position of each new token
    request_of_row: Tensor,  # [N] int64 request index of each new token
) -> None:
    page_size = k_cache.shape[1]
    rows = _flat_slots(page_table, positions, request_of_row, page_size)
    k_cache.view(-1, *k_cache.shape[2:])[rows] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[rows] = v.to(v_cache.dtype)


def paged_attention_ref(
    q: Tensor,  # [N, H, D]
    k_cache: Tensor,  # [P, page_size, HKV, D] (already holding this step's keys)
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    cu_seqlens: Tensor,  # [B+1] int32 new tokens per request
    context_lens: Tensor,  # [B] int32 tokens cached before this step
    scale: float,
    query_lens: list[int],  # host copies of the lengths (the reference loops over requests)
    context_lens_host: list[int],
    gate: Tensor | None = None,  # [N, H, D] (any row strides): the output gate, o * sigmoid(gate)
) -> Tensor:
    """Returns o [N, H, D] in q's dtype (gated: o * sigmoid(gate), each rounded to q's dtype as it is computed)."""
    check_gate(q, gate)
    page_size = k_cache.shape[1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (t_new, t_old) in enumerate(zip(query_lens, context_lens_host)):
        total = t_old + t_new
        pos = torch.arange(total, device=q.device)
        rows = page_table[i, pos // page_size].long() * page_size + pos % page_size
        keys = k_cache.view(-1, kv_heads, k_cache.shape[-1])[rows].transpose(0, 1)  # [HKV, total, D]
        vals = v_cache.view(-1, kv_heads, v_cache.shape[-1])[rows].transpose(0, 1)
        if heads != kv_heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=0)
            vals = vals.repeat_interleave(heads // kv_heads, dim=0)
        qi = q[start : start + t_new].transpose(0, 1)  # [H, t_new, D]
        # query j sits at position t_old + j and may see positions <= t_old + j
        mask = pos[None, :] <= (t_old + torch.arange(t_new, device=q.device))[:, None]  # [t_new, total]
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), keys.to(q.dtype).unsqueeze(0), vals.to(q.dtype).unsqueeze(0), attn_mask=mask, scale=scale
        )
        out[start : start + t_new] = o[0].transpose(0, 1)
        start += t_new
    return gated_ref(out, gate)


def check_gate(q: Tensor, gate: Tensor | None) -> None:
    """paged_attention's `gate` must be [N, H, D] as q (a view with its own strides is fine)."""
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"paged_attention: gate must have q's shape {tuple(q.shape)} ([N, H, D]), got "
                         f"{tuple(gate.shape)}")


def gated_ref(o: Tensor, gate: Tensor | None) -> Tensor:
    """o * sigmoid(gate) in o's dtype (the gate rounded to it first), or o where there is no gate."""
    return o if gate is None else o * torch.sigmoid(gate.to(o.dtype))


def qk_norm_rope_write_ref(
    q: Tensor,  # [N, H, D] (rows may be strided: the query half of a fused q/gate projection)
    k: Tensor,  # [N, HKV, D]
    v: Tensor,  # [N, HKV, D]
    q_weight: Tensor,  # [D] zero-centred RMSNorm weights
    k_weight: Tensor,  # [D]
    eps: float,
    cos: Tensor,  # [N, R] in q's dtype
    sin: Tensor,
    rotary_dim: int,
    k_cache: Tensor,  # [P, page_size, HKV, D]
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    positions: Tensor,  # [N] int64
    request_of_row: Tensor,  # [N] int64
) -> Tensor:
    """An attention layer's inputs before its attention: q and k RMSNorm'd per head and rotated, this step's k
    and v written to their pages. Returns q [N, H, D] (new, contiguous)."""
    q = rope_ref(rmsnorm_ref(q, q_weight, eps), cos, sin, rotary_dim)
    k = rope_ref(rmsnorm_ref(k, k_weight, eps), cos, sin, rotary_dim)
    write_kv_ref(k, v, k_cache, v_cache, page_table, positions, request_of_row)
    return q
