"""Causal attention over a paged KV cache for a ragged batch, in Triton (decode, verification and prefill).

Same signatures and semantics as kernels/attention.py (`write_kv_ref`, `paged_attention_ref`). The host lists
`query_lens` / `context_lens_host` are accepted and used by the Triton kernel only as size hints (tile shape,
grid, KV splits): its results never depend on them, every length is read from the device tensors, nothing
synchronizes with the host, so a step can be captured in a CUDA graph and replayed with other lengths (the one
exception, the SDPA path for batches of fresh prompts, is described below).

`_paged_attn_kernel`: one program per (query tile, KV head x KV split, request). A query tile holds TPT tokens x
all G = H / HKV query heads of one KV head (GQA: BLOCK_M = G * TPT rows share every K/V tile they load). The
program walks the request's pages through the page table with an online softmax (exp2). For decode and
verification (q_len <= 17) a request has 1-3 tiles; when few programs would run, the keys are split into
S ranges (flash-decoding) whose partial results `_combine_kernel` merges. The same kernel with no split is the
varlen prefill path (a causal flash kernel over pages; tiles stride over the request's tokens), used for chunked
prefill (prompts continuing a cached context) and mixed batches. A batch made only of fresh prompts longer than
SDPA_PREFILL_MIN_LEN goes to torch SDPA (flash) per request instead: 123 us against 175 us for this kernel at one
2048-token prompt on the H200 (bench/NOTES_moe_attn.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from kernels.attention import check_gate, gated_ref
from kernels.pdl import pdl_args, pdl_prologue
from kernels.rounding import REFERENCE_ROUNDING


# ---------------------------------------------------------------------------------------------------------------
# write_kv: scatter this step's keys and values into their pages
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr,  # [N, HKV, D]
    v_ptr,
    kc_ptr,  # [P, page_size, HKV, D]
    vc_ptr,
    pt_ptr,  # [B, max_pages] int32
    pos_ptr,  # [N] int64
    req_ptr,  # [N] int64
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    stride_pt,
    HKV,
    D,
    PAGE_SIZE: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    req = tl.load(req_ptr + row).to(tl.int64)
    page = tl.load(pt_ptr + req * stride_pt + pos // PAGE_SIZE).to(tl.int64)
    off = pos % PAGE_SIZE
    hh = tl.arange(0, BLOCK_HKV)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    m = (hh < HKV) & (dd < D)
    kv = tl.load(k_ptr + row * stride_kn + hh * stride_kh + dd, mask=m)
    tl.store(kc_ptr + page * stride_cp + off * stride_cs + hh * stride_ch + dd, kv.to(kc_ptr.dtype.element_ty), mask=m)
    vv = tl.load(v_ptr + row * stride_vn + hh * stride_vh + dd, mask=m)
    tl.store(vc_ptr + page * stride_vcp + off * stride_vcs + hh * stride_vch + dd, vv.to(vc_ptr.dtype.element_ty),
             mask=m)


def write_kv_triton(
    k: Tensor,  # [N, HKV, D] new keys
    v: Tensor,  # [N, HKV, D]
    k_cache: Tensor,  # [P, page_size, HKV, D]
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    positions: Tensor,  # [N] int64 absolute position of each new token
    request_of_row: Tensor,  # [N] int64 request index of each new token
) -> None:
    """As write_kv_ref: k/v of token n go to page page_table[req, pos // page_size], row pos % page_size."""
    n, hkv, d = k.shape
    if n == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _write_kv_kernel[(n,)](
        k, v, k_cache, v_cache, page_table, positions, request_of_row,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), hkv, d,
        PAGE_SIZE=k_cache.shape[1], BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4, **pdl_args(k.device))


# ---------------------------------------------------------------------------------------------------------------
# qk_norm_rope_write: q and k RMSNorm'd per head and rotated, k and v written to their pages, in one launch
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _qk_prep_kernel(
    q_ptr,  # [N, H, D] (rows may be strided)
    k_ptr,  # [N, HKV, D]
    v_ptr,  # [N, HKV, D]
    qw_ptr,  # [D]
    kw_ptr,  # [D]
    cos_ptr,  # [N, R]
    sin_ptr,
    qo_ptr,  # [N, H, D] out
    kc_ptr,  # [P, page_size, HKV, D]
    vc_ptr,
    pt_ptr,  # [B, max_pages] int32
    pos_ptr,  # [N] int64
    req_ptr,  # [N] int64
    H,
    D,
    s_q0, s_q1, s_k0, s_k1, s_v0, s_v1, s_c, s_qo0, s_qo1,
    s_kcp, s_kcs, s_kch, s_vcp, s_vcs, s_vch, s_pt,
    eps,
    R: tl.constexpr,
    HALF: tl.constexpr,
    BD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """One program per (token, head) of q's H heads and then k's HKV heads (k's program also moves v's head).
    Rounds where rmsnorm_ref and rope_ref round (the normalized row once, then after each of rope's ops; launched
    with kernels.rounding.REFERENCE_ROUNDING: with fp fusion, rope's second product went unrounded into an fma)."""
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BD)
    mask = cols < D
    in_rot = cols < R
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    is_q = h < H
    kh = tl.maximum(h - H, 0)
    if is_q:
        base = q_ptr + n * s_q0 + h * s_q1
        w_ptr = qw_ptr
    else:
        base = k_ptr + n * s_k0 + kh * s_k1
        w_ptr = kw_ptr
    xr = tl.load(base + cols, mask=mask, other=0.0)
    dt = xr.dtype
    x = xr.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * (1.0 + w)).to(dt)  # rmsnorm_ref's output
    xp = tl.load(base + partner, mask=in_rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)  # the partner column's normalized value
    rotated = tl.where(cols < HALF, -yp, yp).to(dt)
    c = tl.load(cos_ptr + n * s_c + cols, mask=in_rot, other=0.0)
    sn = tl.load(sin_ptr + n * s_c + cols, mask=in_rot, other=0.0)
    t1 = (y.to(tl.float32) * c.to(tl.float32)).to(dt)
    t2 = (rotated.to(tl.float32) * sn.to(tl.float32)).to(dt)
    out = tl.where(in_rot, (t1.to(tl.float32) + t2.to(tl.float32)).to(dt), y)
    if is_q:
        tl.store(qo_ptr + n * s_qo0 + h * s_qo1 + cols, out, mask=mask)
    else:
        pos = tl.load(pos_ptr + n).to(tl.int64)
        req = tl.load(req_ptr + n).to(tl.int64)
        page = tl.load(pt_ptr + req * s_pt + pos // PAGE_SIZE).to(tl.int64)
        off = pos % PAGE_SIZE
        tl.store(kc_ptr + page * s_kcp + off * s_kcs + kh * s_kch + cols, out.to(kc_ptr.dtype.element_ty), mask=mask)
        vv = tl.load(v_ptr + n * s_v0 + kh * s_v1 + cols, mask=mask)
        tl.store(vc_ptr + page * s_vcp + off * s_vcs + kh * s_vch + cols, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_write_triton(
    q: Tensor,  # [N, H, D] (rows may be strided)
    k: Tensor,  # [N, HKV, D]
    v: Tensor,  # [N, HKV, D]
    q_weight: Tensor,  # [D]
    k_weight: Tensor,  # [D]
    eps: float,
    cos: Tensor,  # [N, R]
    sin: Tensor,
    rotary_dim: int,
    k_cache: Tensor,  # [P, page_size, HKV, D]
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    positions: Tensor,  # [N] int64
    request_of_row: Tensor,  # [N] int64
) -> Tensor:
    """kernels.attention.qk_norm_rope_write_ref in one launch (instead of two norms, two rotations and write_kv).
    Returns q [N, H, D] (new, contiguous)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and d <= 8192
    _qk_prep_kernel[(n, heads + kv_heads)](
        q, k, v, q_weight, k_weight, cos, sin, out, k_cache, v_cache, page_table, positions, request_of_row,
        heads, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), float(eps),
        R=rotary_dim, HALF=rotary_dim // 2, BD=triton.next_power_of_2(d), PAGE_SIZE=k_cache.shape[1],
        num_warps=1 if d <= 128 else 2, **REFERENCE_ROUNDING, **pdl_args(q.device))
    return out


# ---------------------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------------------
# Compile keys: every launch argument that follows the step's shapes is a runtime value, never specialized (N and
# S only index and divide; Triton would otherwise compile again for N == 1, N % 16 == 0 and the same for S), so a
# serving run compiles one variant per tile plan (attention_plan: BLOCK_M 16/32/64/128, split or not, prefill)
# and one combine kernel (tests/test_specializations.py).
@triton.jit(do_not_specialize=["N", "S"])
def _paged_attn_kernel(
    q_ptr,  # [N, H, D]
    k_ptr,  # [P, page_size, HKV, D]
    v_ptr,
    pt_ptr,  # [B, max_pages] int32
    cu_ptr,  # [B+1] int32
    ctx_ptr,  # [B] int32
    o_ptr,  # [N, H, D] (no split)
    g_ptr,  # [N, H, D] output gate (GATED, no split)
    op_ptr,  # [S, N, H, D] fp32 partial outputs (split)
    lse_ptr,  # [S, N, H] fp32 partial log2-sum-exp2 (split)
    scale_log2,  # softmax scale * log2(e)
    N,
    S,  # number of key splits
    stride_qn,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_on,
    stride_oh,
    stride_gn,
    stride_gh,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TPT: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # >= G * TPT rows: row r = (token r // G, head r % G of this KV head's group)
    BLOCK_N: tl.constexpr,  # keys per iteration
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    GATED: tl.constexpr = False,  # o * sigmoid(gate) (no split; the combine kernel gates split outputs)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    G: tl.constexpr = H // HKV
    pid_m = tl.program_id(0)
    grid_m = tl.num_programs(0)
    kvh = tl.program_id(1) % HKV
    split = tl.program_id(1) // HKV
    b = tl.program_id(2).to(tl.int64)
    start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - start
    ctx = tl.load(ctx_ptr + b)
    total = ctx + q_len
    per_split = tl.cdiv(tl.cdiv(total, S), BLOCK_N) * BLOCK_N
    lo = split * per_split

    r = tl.arange(0, BLOCK_M)
    g = r % G
    head = kvh * G + g  # [BM]
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    kn = tl.arange(0, BLOCK_N)
    for mt in range(pid_m, tl.cdiv(q_len, TPT), grid_m):
        t = mt * TPT + r // G  # token index inside the request, [BM]
        rvalid = (r < G * TPT) & (t < q_len)
        qrow = (start + t).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=rvalid[:, None] & dmask[None, :], other=0.0)  # [BM, BD]
        qpos = ctx + t  # absolute position of each row's token
        hi = tl.minimum(lo + per_split, ctx + tl.minimum(q_len, (mt + 1) * TPT))  # keys this tile may see
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            kpos = k0 + kn  # [BN]
            kmask = kpos < hi
            page = tl.load(pt_ptr + b * stride_pt + kpos // PAGE_SIZE, mask=kmask, other=0).to(tl.int64)
            off = kpos % PAGE_SIZE
            kt = tl.load(k_ptr + (page * stride_kp + off * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
                         mask=kmask[:, None] & dmask[None, :], other=0.0)  # [BN, BD]
            vt = tl.load(v_ptr + (page * stride_vp + off * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                         mask=kmask[:, None] & dmask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(kt.to(q.dtype))) * scale_log2  # [BM, BN]
            visible = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
            s = tl.where(visible, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vt.to(q.dtype))
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if SPLIT:
            prow = split.to(tl.int64) * N + qrow  # [BM]
            tl.store(op_ptr + ((prow * H + head) * D)[:, None] + d[None, :], o,
                     mask=rvalid[:, None] & dmask[None, :])
            tl.store(lse_ptr + prow * H + head, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf")),
                     mask=rvalid)
        else:
            omask = rvalid[:, None] & dmask[None, :]
            o = _gated(o, g_ptr + qrow[:, None] * stride_gn + head[:, None] * stride_gh + d[None, :], omask,
                       o_ptr.dtype.element_ty, GATED)
            tl.store(o_ptr + qrow[:, None] * stride_on + head[:, None] * stride_oh + d[None, :], o, mask=omask)


@triton.jit
def _gated(o, g_ptrs, mask, dt: tl.constexpr, GATED: tl.constexpr):
    """o (fp32) in the output dtype, times sigmoid(gate) where GATED; rounded as paged_attention_ref rounds (the
    attention output, the sigmoid, then the product)."""
    o = o.to(dt)
    if GATED:
        gf = tl.load(g_ptrs, mask=mask, other=0.0).to(dt).to(tl.float32)  # the gate in o's dtype, as the reference
        sig = (1.0 / (1.0 + tl.exp(-gf))).to(dt)
        o = (o.to(tl.float32) * sig.to(tl.float32)).to(dt)
    return o


@triton.jit(do_not_specialize=["N", "S"])
def _combine_kernel(
    op_ptr,  # [S, N, H, D] fp32
    lse_ptr,  # [S, N, H] fp32
    o_ptr,  # [N, H, D]
    g_ptr,  # [N, H, D] output gate (GATED)
    N,
    S,
    stride_on,
    stride_oh,
    stride_gn,
    stride_gh,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits per chunk (S is a runtime value: one compiled kernel for every split count)
    GATED: tl.constexpr = False,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    # pass 1: the largest partial log2-sum-exp2
    m_vec = tl.full([BLOCK_S], -float("inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + (s.to(tl.int64) * N + n) * H + h, mask=s < S, other=-float("inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    m = tl.where(m == -float("inf"), 0.0, m)
    # pass 2: the partial outputs weighted by exp2(lse - m) (0 for empty splits)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    wsum = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < S
        prow = (s.to(tl.int64) * N + n) * H + h  # [BLOCK_S]
        lse = tl.load(lse_ptr + prow, mask=smask, other=-float("inf"))
        w = tl.exp2(lse - m)
        part = tl.load(op_ptr + (prow * D)[:, None] + d[None, :], mask=(smask & (lse > -float("inf")))[:, None]
                       & (d < D)[None, :], other=0.0)  # [BLOCK_S, BD]
        acc += part * w[:, None]
        wsum += w
    o = tl.sum(acc, axis=0) / tl.sum(wsum, axis=0)
    o = _gated(o, g_ptr + n * stride_gn + h * stride_gh + d, d < D, o_ptr.dtype.element_ty, GATED)
    tl.store(o_ptr + n * stride_on + h * stride_oh + d, o, mask=d < D)


def _fresh_prefill_sdpa(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, scale: float,
                        query_lens: list[int], out: Tensor) -> Tensor:
    """Requests with no cached context: plain causal attention over their own keys, per request (torch SDPA)."""
    page_size, kv_heads, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    start = 0
    for i, t in enumerate(query_lens):
        pos = torch.arange(t, device=q.device)
        rows = page_table[i, pos // page_size].long() * page_size + pos % page_size
        keys = k_cache.view(-1, kv_heads, d)[rows].transpose(0, 1).to(q.dtype)  # [HKV, T, D]
        vals = v_cache.view(-1, kv_heads, d)[rows].transpose(0, 1).to(q.dtype)
        qi = q[start : start + t].transpose(0, 1)  # [H, T, D]
        o = F.scaled_dot_product_attention(qi.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), is_causal=True,
                                           scale=scale, enable_gqa=True)
        out[start : start + t] = o[0].transpose(0, 1)
        start += t
    return out


# SMs assumed off CUDA (the interpreter: tests); tests/specializations.py sets the H200's 132 for its sweep
CPU_SM_COUNT = 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index or 0) if device.type == "cuda" else CPU_SM_COUNT


# (BLOCK_N, num_warps, num_stages) per BLOCK_M for decode/verify tiles, and (BLOCK_M, BLOCK_N, warps, stages) for
# prefill; picked by the sweeps of bench/kernels_moe_attn.py on an H200 (bench/NOTES_moe_attn.md)
ATTN_TILES = {16: (32, 4, 3), 32: (64, 8, 3), 64: (64, 8, 2), 128: (32, 8, 2)}
PREFILL_TILE = (128, 64, 8, 2)
SPLIT_MIN_KEYS = 128  # keys per KV split at least
SPLIT_WAVES = 3  # aim for this many programs per SM when splitting
COMBINE_BLOCK_S = 16  # splits the combine kernel reads per step (up to 128 splits: at most 8 steps)
# Fresh prompts longer than this go to torch SDPA (flash) when every request of the batch is one. H200, bf16: at
# B=1 T=2048 the SDPA path took 123 us against 175 us for the kernel, at B=4 T=512 172 us against 63 us (the path
# costs ~35 us of small gather/copy launches per request); 1536 sits above the crossover estimated from these.
SDPA_PREFILL_MIN_LEN = 1536


def attention_plan(num_tokens: int, num_requests: int, heads: int, kv_heads: int, max_q: int, max_kv: int,
                   sm_count: int) -> dict:
    """Tile shape, grid and KV splits from sizes only (hints; correctness does not depend on them)."""
    group = heads // kv_heads
    if max_q > 64:  # prefill
        block_m, block_n, warps, stages = PREFILL_TILE
        block_m = max(block_m, triton.next_power_of_2(group))
    else:
        block_m = max(16, min(64, triton.next_power_of_2(group * max_q)), triton.next_power_of_2(group))
        if block_m == 64 and group * max_q > 64 and 128 in ATTN_TILES:
            # verification with enough programs already: 128-row tiles read each request's KV fewer times
            if triton.cdiv(max_q, 64 // group) * kv_heads * num_requests >= sm_count:
                block_m = 128
        block_n, warps, stages = ATTN_TILES.get(block_m, ATTN_TILES[64])
    tpt = max(1, block_m // group)
    grid_m = max(1, triton.cdiv(max(max_q, 1), tpt))
    base = grid_m * kv_heads * num_requests
    splits = 1
    if max_q <= 64:
        want = triton.cdiv(SPLIT_WAVES * sm_count, max(base, 1))
        by_len = triton.cdiv(max(max_kv, 1), SPLIT_MIN_KEYS)
        # fp32 partials (written and read once more) stay under max(KV bytes, 16 MB)
        per_split = max(num_tokens * heads * 256 * 4, 1)
        by_traffic = max(1, max(num_requests * max_kv * kv_heads * 256 * 4, 16 << 20) // per_split)
        splits = max(1, min(want, by_len, by_traffic, 128))
    return {"block_m": block_m, "block_n": block_n, "tpt": tpt, "grid_m": grid_m, "splits": splits,
            "num_warps": warps, "num_stages": stages}


def paged_attention_triton(
    q: Tensor,  # [N, H, D]
    k_cache: Tensor,  # [P, page_size, HKV, D] (already holding this step's keys)
    v_cache: Tensor,
    page_table: Tensor,  # [B, max_pages] int32
    cu_seqlens: Tensor,  # [B+1] int32 new tokens per request
    context_lens: Tensor,  # [B] int32 tokens cached before this step
    scale: float,
    query_lens: list[int] | None = None,  # host copies: size hints only (may be None)
    context_lens_host: list[int] | None = None,
    gate: Tensor | None = None,  # [N, H, D] (any row strides): o * sigmoid(gate), in the kernel's epilogue
    *,
    plan: dict | None = None,  # override attention_plan (tests, benchmarks)
    prefill_sdpa: bool | None = None,  # None: SDPA when every request is a fresh prompt > SDPA_PREFILL_MIN_LEN
) -> Tensor:
    """Returns o [N, H, D] in q's dtype. As paged_attention_ref, without a host sync.

    Exception: a batch of fresh prompts only (every context length 0 and every query longer than
    SDPA_PREFILL_MIN_LEN, by the host lists) goes to torch SDPA per request (flash, is_causal), which was faster
    than this kernel for long prompts on the H200; that path uses the host lengths and is not for graph capture."""
    check_gate(q, gate)
    n, heads, d = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_requests = cu_seqlens.numel() - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: its strides are launch arguments
    if n == 0 or num_requests == 0:
        return out
    if prefill_sdpa is None:
        prefill_sdpa = bool(query_lens and context_lens_host and len(query_lens) == num_requests
                            and sum(query_lens) == n and not any(context_lens_host)
                            and min(query_lens) > SDPA_PREFILL_MIN_LEN)
    if prefill_sdpa:
        out = _fresh_prefill_sdpa(q, k_cache, v_cache, page_table, scale, query_lens, out)
        return gated_ref(out, gate)
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    g = out if gate is None else gate
    assert heads % kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    max_q = max(query_lens) if query_lens else n
    if query_lens and context_lens_host:
        max_kv = max(c + t for c, t in zip(context_lens_host, query_lens))
    else:
        max_kv = page_table.shape[1] * page_size
    sms = _sm_count(q.device)
    p = attention_plan(n, num_requests, heads, kv_heads, max_q, max_kv, sms)
    if plan:
        p.update(plan)
    splits = p["splits"]
    block_d = triton.next_power_of_2(d)
    if splits > 1:
        o_part = torch.empty(splits, n, heads, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, n, heads, dtype=torch.float32, device=q.device)
    else:
        o_part = lse = out
    grid = (p["grid_m"], kv_heads * splits, num_requests)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, page_table, cu_seqlens, context_lens, out, g, o_part, lse,
        float(scale) * 1.4426950408889634, n, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1), g.stride(0), g.stride(1),
        H=heads, HKV=kv_heads, D=d, BLOCK_D=block_d, TPT=p["tpt"], BLOCK_M=p["block_m"], BLOCK_N=p["block_n"],
        PAGE_SIZE=page_size, SPLIT=splits > 1, GATED=gate is not None and splits == 1, num_warps=p["num_warps"],
        num_stages=p["num_stages"], **pdl_args(q.device))
    if splits > 1:
        _combine_kernel[(n, heads)](o_part, lse, out, g, n, splits, out.stride(0), out.stride(1), g.stride(0),
                                    g.stride(1), H=heads, D=d, BLOCK_D=block_d, BLOCK_S=COMBINE_BLOCK_S,
                                    GATED=gate is not None, num_warps=4, **pdl_args(o_part.device))
    return out
