"""Gated delta rule over a ragged batch (PyTorch references).

Per value head h (k-head h // (HV / HK)), per token t, with the state S [DK, DV] (fp32):
    S <- exp(g_t) * S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (q_t * scale)
q and k are L2-normalised first when `use_qk_l2norm`. Each request starts from its slot of `state`
[S, HV, DK, DV]; with `write_state` (True, or a [B] bool mask choosing requests) its slot ends as the
state after its last token. Verification runs with write_state False and keeps (k, v, g, beta); the commit
(`gdn_commit_ref`) then replays each request's first `keep_lens[i]` tokens onto its untouched slot.

Padding a request with tokens whose beta = 0 and g = 0 leaves its state unchanged, which is how the padded
references below treat ragged batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.ragged import padded_index, to_padded

CHUNK_SIZE = 64
CHUNKED_FORM_MIN_LEN = 33  # gdn_ref uses the chunked form for blocks at least this long


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, cu_seqlens, max_len, scale, use_qk_l2norm):
    """Pads to [B, HV, T, .] fp32, repeats k-heads onto value heads, normalises and scales q/k."""
    rows, valid = padded_index(cu_seqlens, max_len)
    heads_v, heads_k = v.shape[1], k.shape[1]
    q, k = (x.repeat_interleave(heads_v // heads_k, dim=1) if heads_v != heads_k else x for x in (q, k))
    q, k, v, g, beta = (to_padded(x.float(), rows, valid).transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    # q, k [B, HV, T, DK]; v [B, HV, T, DV]; g, beta [B, HV, T]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, k, v, g, beta, valid


def gdn_recurrent_ref(
    q: Tensor,  # [N, HK, DK]
    k: Tensor,  # [N, HK, DK]
    v: Tensor,  # [N, HV, DV]
    g: Tensor,  # [N, HV] log decay (<= 0)
    beta: Tensor,  # [N, HV]
    cu_seqlens: Tensor,  # [B+1] int32
    state: Tensor,  # [S, HV, DK, DV] fp32 pool
    slots: Tensor,  # [B] int64
    max_len: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    write_state: bool = True,
) -> Tensor:
    """Token-by-token form. Returns o [N, HV, DV] in v's dtype."""
    out_dtype = v.dtype
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, cu_seqlens, max_len, scale, use_qk_l2norm)
    s = state[slots].float()  # [B, HV, DK, DV]
    out = torch.empty_like(v)  # [B, HV, T, DV]
    for t in range(max_len):
        s = s * g[:, :, t].exp()[..., None, None]
        kv_mem = (s * k[:, :, t, :, None]).sum(dim=-2)  # [B, HV, DV]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(dim=-2)
    _write(state, slots, s, write_state)
    return out.transpose(1, 2)[valid].to(out_dtype)


def _write(state: Tensor, slots: Tensor, s: Tensor, write_state: bool | Tensor) -> None:
    if isinstance(write_state, Tensor):
        state[slots[write_state]] = s[write_state].to(state.dtype)
    elif write_state:
        state[slots] = s.to(state.dtype)


def gdn_chunk_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    state: Tensor,
    slots: Tensor,
    max_len: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    write_state: bool = True,
) -> Tensor:
    """Chunked (WY / UT-transform) form, chunks of CHUNK_SIZE; same signature and result as the recurrent form."""
    out_dtype = v.dtype
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, cu_seqlens, max_len, scale, use_qk_l2norm)
    bsz, heads, length, dim_k = k.shape
    dim_v = v.shape[-1]
    c = CHUNK_SIZE
    pad = (c - length % c) % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n_chunks = (length + pad) // c
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(bsz, heads, n_chunks, c, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(bsz, heads, n_chunks, c).cumsum(-1)  # cumulative log decay inside each chunk
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, HV, n, c, c]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # (I + strictly-lower part) is the UT system; diagonal unused
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [B, HV, n, c, DV]
    w = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, HV, n, c, c]
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, HV, n, 1, 1]
    s = state[slots].float()  # [B, HV, DK, DV]
    out = torch.empty(bsz, heads, n_chunks, c, dim_v, dtype=torch.float32, device=q.device)
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + attn[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    _write(state, slots, s, write_state)
    out = out.reshape(bsz, heads, -1, dim_v)[:, :, :length]  # [B, HV, T, DV]
    return out.transpose(1, 2)[valid].to(out_dtype)


def gdn_ref(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale=None, use_qk_l2norm=True, write_state=True):
    """Picks the recurrent form for short blocks (decode, verification) and the chunked form for prefill."""
    fn = gdn_recurrent_ref if max_len < CHUNKED_FORM_MIN_LEN else gdn_chunk_ref
    return fn(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm, write_state)


def gdn_commit_ref(
    k: Tensor,  # [N, HK, DK] the verified block's keys (before L2 norm, as the forward got them)
    v: Tensor,  # [N, HV, DV]
    g: Tensor,  # [N, HV]
    beta: Tensor,  # [N, HV]
    cu_seqlens: Tensor,  # [B+1] int32 the block of each request
    keep_lens: Tensor,  # [B] int64 tokens of each block to commit (0..T_i)
    state: Tensor,  # [S, HV, DK, DV] fp32 pool, still holding S_0 of every request
    slots: Tensor,  # [B] int64
    max_len: int,
    use_qk_l2norm: bool = True,
) -> None:
    """S_0 -> S_a: advances each request's state over exactly its first keep_lens[i] tokens.

    Tokens past the kept prefix get beta = 0 and g = 0, which leaves the state as it is.
    """
    pos = torch.arange(k.shape[0], device=k.device) - torch.repeat_interleave(
        cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long())  # [N] index inside the block
    owner_keep = torch.repeat_interleave(keep_lens.long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long())  # [N]
    kept = (pos < owner_keep)[:, None]  # [N, 1]
    g = torch.where(kept, g.float(), 0.0)
    beta = torch.where(kept, beta.float(), 0.0)
    fn = gdn_recurrent_ref if max_len < CHUNKED_FORM_MIN_LEN else gdn_chunk_ref
    fn(k, k, v, g, beta, cu_seqlens, state, slots, max_len, None, use_qk_l2norm, True)
