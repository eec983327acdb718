"""Gated delta rule in Triton: verification / decode, commit, chunked prefill, and commit fused into verification.

Same signatures and semantics as the PyTorch references in kernels/gdn.py (the specification):
    gdn_triton          ~ gdn_ref / gdn_recurrent_ref / gdn_chunk_ref (any block length, ragged)
    gdn_verify_triton   ~ gdn_recurrent_ref (T_i <= 32)
    gdn_chunk_triton    ~ gdn_chunk_ref (varlen prefill, from each request's state)
    gdn_commit_triton   ~ gdn_commit_ref
    gdn_commit_verify_triton ~ gdn_commit_verify_ref (defined here: commit of the last step + this verification)

Two kernels here and the factored verification kernel of kernels/gdn_verify_triton.py, chosen per call by
`_auto_impl` from measurements (bench/NOTES_gdn.md, bench/NOTES.md 2026-12-02), and for chunked prefill
(max_len > 32) by default the two-phase kernel of kernels/gdn_chunk_triton.py (PREFILL_IMPL):

Block (WY) kernel `_gdn_fwd_kernel`. A program owns one (request, value head, BV-wide value tile); the state tile
comes in and goes out through the TMA engine (a descriptor of the pool viewed as [S*HV*DK, DV]) and is held as
S^T [BV, BK] so that every state product has BV = 64 rows (Hopper wgmma; operands staged in shared memory). It
walks the request's tokens in blocks of BT (16 or 32 for verification: one block; 16 for prefill) and advances S
over each block in the WY / UT form:
    gc = cumsum(g) inside the block,  D_ij = exp(gc_i - gc_j) (j <= i)
    A = strictly_lower(beta_i k_i.k_j D_ij)            (I + A) is the UT system
    v_new = (I + A)^-1 beta * (v - (k * exp(gc)) @ S)  ((I + A)^-1 by forward substitution on the [BT, BT] block)
    o = (q * exp(gc)) @ S + lower(q k^T * D) @ v_new
    S <- exp(gc_last) S + (k * exp(gc_last - gc))^T @ v_new
q and k are L2-normalised in the kernel (norms from the same K-chunked loop that forms k k^T and q k^T); q is
scaled; inputs are upcast to fp32 right after their loads. Dots that feed a state that is written run in
DOT_PRECISION (tf32x3: fp32-level, 3e-7 state error), output-only dots in DOT_PRECISION_OUT (tf32: ~2e-3 on o,
about one bf16 rounding). The `trans=False` layout ([BK, BV] tiles, run 1) is kept for comparison only.

Sequential kernel `_gdn_seq_kernel`: the fused-recurrent form, one token at a time with the [BK, BV=16] tile in
one warp's registers, fp32 FMA. Faster than the block kernel for decode, short blocks, T = 17 and every call that
writes the state (run 3).

Verification (no state write, or the engine's write mask) takes the factored kernel of kernels/gdn_verify_triton.py
from a few tokens a request on (impl "factored": o = q' S_0 + y, the state in one product; two launches); the
block kernel is no longer chosen by "auto" up to 32 tokens (kept for prefill in blocks, the commit and measurement).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.gdn import gdn_commit_ref, gdn_recurrent_ref
from kernels.pdl import pdl_args, pdl_prologue

# Tuning, from bench/kernels_gdn.py on the H200 (bench/NOTES_gdn.md, run 3). num_warps=8 stays out of the
# one-block kernels: (bv=64, 8 warps) with a state write hit an illegal memory access on triton 3.6 (run 2).
VERIFY_BV = int(os.environ.get("HYBRIDSPEC_GDN_BV", "64"))  # block kernel, B > 1 (B = 1, T <= 16: 32)
VERIFY_WARPS = int(os.environ.get("HYBRIDSPEC_GDN_WARPS", "4"))
SEQ_BV, SEQ_WARPS = 16, 1  # sequential kernel
# the sequential commit from this many requests on (bench/gdn_commit.py --sweep, 7f99428): at B=64, T=17 bv=32 with
# 2 warps took 82 / 86 / 112 / 216 us for 1 / 2.2 / 5.5 / 17 kept tokens against 130 / 131 / 133 / 235 with
# (16, 1); at B=16 (16, 1) stays (30 vs 34 us at 7.2 kept). B=32 was not measured: the threshold is a guess.
COMMIT_WIDE_FROM, COMMIT_WIDE_BV, COMMIT_WIDE_WARPS = 32, 32, 2
CHUNK_BT = 16  # prefill: blocks of 16 walked in order (measured: 16 < 32 < 64 in time; same result as chunks of 64)
CHUNK_BV = 64
CHUNK_WARPS = 4
# Chunked prefill (max_len > 32) under impl "auto": "block" (_gdn_fwd_kernel, blocks of CHUNK_BT walked in order) or
# "two_phase" (kernels/gdn_chunk_triton.py: parallel UT transform per chunk, then the state pass). The environment
# variable HYBRIDSPEC_GDN_PREFILL (read at each call) overrides it. Measured on the H200 (bench/kernels_gdn.py prefill,
# 2026-12-01, B=1, eager, us per layer): T = 1024 / 2048 / 4096 / 8192: block 852 / 1706 / 3415 / 6844, two_phase
# 325 / 637 / 1260 / 2508 (fla-core's chunk_gated_delta_rule: 1280 / 1252 / 1282 / 710 in the same run); with phase
# 1's inverse by blocks (c9b58c0 run): 225 / 429 / 835 / 1640, fla 722 / 690 / 726 / 671, block 842-6751.
PREFILL_IMPL = "two_phase"
# fp32 dots: "ieee" (exact fp32, FMA units), "tf32x3" (three tf32 tensor-core passes, ~fp32) or "tf32".
DOT_PRECISION = os.environ.get("HYBRIDSPEC_GDN_DOT", "tf32x3")  # dots that feed a state that is written
DOT_PRECISION_OUT = os.environ.get("HYBRIDSPEC_GDN_DOT_OUT", "tf32")  # dots that feed only outputs
VERIFY_TRANS = os.environ.get("HYBRIDSPEC_GDN_TRANS", "1") == "1"  # state tile kept transposed (wgmma-shaped)


# --------------------------------------------------------------------------------------------------------------
# Triton: block (WY) form
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _block_step(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, row0, n, hk, hv, v0, scale,
                s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                HAS_OUT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    """Advances the state tile S [BK, BV] over rows row0 .. row0+n-1 (n <= BT); stores their outputs when
    HAS_OUT. Returns the new S."""
    t = tl.arange(0, BT)  # [BT]
    dk = tl.arange(0, BK)  # [BK]
    dv = v0 + tl.arange(0, BV)  # [BV]
    tm = t < n
    km = tm[:, None] & (dk < DK)[None, :]  # [BT, BK]
    vm = tm[:, None] & (dv < DV)[None, :]  # [BT, BV]
    rows = (row0 + t).to(tl.int64)  # [BT]
    k = tl.load(k_ptr + rows[:, None] * s_kn + hk * s_kh + dk[None, :], mask=km, other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]  # [BT, BK]
    v = tl.load(v_ptr + rows[:, None] * s_vn + hv * s_vh + dv[None, :], mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * s_gn + hv * s_gh, mask=tm, other=0.0).to(tl.float32)  # [BT]
    beta = tl.load(b_ptr + rows * s_bn + hv * s_bh, mask=tm, other=0.0).to(tl.float32)  # [BT]
    gc = tl.cumsum(g, axis=0)  # [BT] cumulative log decay (padding adds 0)
    g_last = tl.sum(g, axis=0)

    ti = t[:, None]
    tj = t[None, :]
    lower_eq = tj <= ti  # [BT, BT]
    decay = tl.exp(tl.where(lower_eq, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 above diagonal
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)  # [BT, BT]
    # Y = (I + A)^-1 - I, strictly lower; row i of Y = -A_i + sum_j (-A_ij) Y_j, rows j < i already final.
    y = tl.where(tj < ti, -(beta[:, None] * kk * decay), 0.0)  # [BT, BT], starts as -A
    for i in range(2, n):
        a = tl.sum(tl.where(ti == i, y, 0.0), axis=0)  # [BT] row i of -A
        a = a + tl.sum(a[:, None] * y, axis=0)
        y = tl.where(ti == i, a[None, :], y)
    inv = y + (ti == tj).to(tl.float32)  # [BT, BT] (I + A)^-1

    kg = k * tl.exp(gc)[:, None]  # [BT, BK]
    r = beta[:, None] * (v - tl.dot(kg, S, input_precision=PREC))  # [BT, BV]
    v_new = tl.dot(inv, r, input_precision=PREC)  # [BT, BV]
    if HAS_OUT:
        q = tl.load(q_ptr + rows[:, None] * s_qn + hk * s_qh + dk[None, :], mask=km, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
        q = q * scale
        qk = tl.where(lower_eq, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)  # [BT, BT]
        o = tl.dot(q * tl.exp(gc)[:, None], S, input_precision=PREC) + tl.dot(qk, v_new, input_precision=PREC)
        tl.store(o_ptr + rows[:, None] * s_on + hv * s_oh + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=vm)
    kd = k * tl.exp(g_last - gc)[:, None]  # [BT, BK]
    return S * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new, input_precision=PREC)  # [BK, BV]


@triton.jit
def _ut_inverse(k_rows, q_rows, g_ptr, b_ptr, rows, n, hv, scale, s_gn, s_gh, s_bn, s_bh,
                DK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, HAS_Q: tl.constexpr,
                L2NORM: tl.constexpr, PK: tl.constexpr, PQ: tl.constexpr):
    """The S-independent [BT, BT] work of a block of n <= BT tokens (rows `rows`; k_rows / q_rows: [BT, 1] row
    pointers of the key head), shared by the block kernel and kernels/gdn_verify_triton.py. Returns rk, rq [BT] (the
    L2 norms' reciprocals, rq scaled), P [BT, BT] (lower_incl(q k^T * D) of the normalised q, k; zeros without
    HAS_Q), beta, gc [BT] (cumulative log decay), g_last (the block's total) and (I + A)^-1 [BT, BT]. k k^T (in PK),
    q k^T (in PQ) and the row norms come from KC-wide column pieces of the raw q, k (the registers hold [BT, KC]
    pieces, never a whole [BT, DK] tile: with whole tiles the factored kernel took 255 registers and spilled at
    BT = 32; the pieces' loop stays a loop, unrolled it took 207 / 255). Rows t >= n: k, q, g, beta 0."""
    t = tl.arange(0, BT)  # [BT]
    tm = t < n
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    ksq = tl.zeros([BT], dtype=tl.float32)
    qsq = tl.zeros([BT], dtype=tl.float32)
    for c in range(0, BK, KC):
        dc = c + tl.arange(0, KC)  # [KC]
        cm = tm[:, None] & (dc < DK)[None, :]
        kc = tl.load(k_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
        kk += tl.dot(kc, tl.trans(kc), input_precision=PK)
        ksq += tl.sum(kc * kc, axis=1)
        if HAS_Q:
            qc = tl.load(q_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
            qk += tl.dot(qc, tl.trans(kc), input_precision=PQ)
            qsq += tl.sum(qc * qc, axis=1)
    if L2NORM:
        rk = tl.rsqrt(ksq + 1e-6)  # [BT]
        rq = tl.rsqrt(qsq + 1e-6) * scale
    else:
        rk = tl.full([BT], 1.0, tl.float32)
        rq = tl.full([BT], 1.0, tl.float32) * scale
    g = tl.load(g_ptr + rows * s_gn + hv * s_gh, mask=tm, other=0.0).to(tl.float32)  # [BT] (padding: 0)
    beta = tl.load(b_ptr + rows * s_bn + hv * s_bh, mask=tm, other=0.0).to(tl.float32)  # [BT]
    gc = tl.cumsum(g, axis=0)  # [BT] cumulative log decay
    ti = t[:, None]
    tj = t[None, :]
    lower_eq = tj <= ti  # [BT, BT]
    decay = tl.exp(tl.where(lower_eq, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 above diagonal
    kk = kk * rk[:, None] * rk[None, :]  # [BT, BT] of the normalised keys
    # Y = (I + A)^-1 - I, strictly lower; row i of Y = -A_i + sum_j (-A_ij) Y_j, rows j < i already final
    y = tl.where(tj < ti, -(beta[:, None] * kk * decay), 0.0)  # [BT, BT], starts as -A
    for i in range(2, n):
        a = tl.sum(tl.where(ti == i, y, 0.0), axis=0)  # [BT] row i of -A
        a = a + tl.sum(a[:, None] * y, axis=0)
        y = tl.where(ti == i, a[None, :], y)
    inv = y + (ti == tj).to(tl.float32)  # [BT, BT] (I + A)^-1
    p = tl.where(lower_eq, qk * rq[:, None] * rk[None, :] * decay, 0.0)  # [BT, BT] P
    return rk, rq, p, beta, gc, tl.sum(g, axis=0), inv


@triton.jit
def _block_step_t(ST, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, row0, n, hk, hv, v0, scale,
                  s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                  DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_OUT: tl.constexpr, L2NORM: tl.constexpr, PS: tl.constexpr, PO: tl.constexpr,
                  UPDATE: tl.constexpr = True):
    """_block_step on the transposed state tile ST = S^T [BV, BK]: every state product has the value tile as
    its M dimension (BV = 64 -> Hopper wgmma, operands staged in shared memory instead of being replicated in
    every warp's registers). The [BT, BT] products k k^T and q k^T are summed over KC-wide column chunks for
    the same reason. PS: precision of the dots that feed the state and v_new; PO: of the output-only dots."""
    KC: tl.constexpr = 32
    t = tl.arange(0, BT)  # [BT]
    dk = tl.arange(0, BK)  # [BK]
    dv = v0 + tl.arange(0, BV)  # [BV]
    tm = t < n
    rows = (row0 + t).to(tl.int64)  # [BT]
    k_rows = k_ptr + rows[:, None] * s_kn + hk * s_kh  # [BT, 1]
    q_rows = q_ptr + rows[:, None] * s_qn + hk * s_qh  # [BT, 1]
    rk, rq, p, beta, gc, g_last, inv = _ut_inverse(k_rows, q_rows, g_ptr, b_ptr, rows, n, hv, scale,
                                                   s_gn, s_gh, s_bn, s_bh, DK, BT, BK, KC, HAS_OUT, L2NORM, PS, PO)
    inv_t = tl.trans(inv)  # [BT, BT] ((I + A)^-1)^T
    vt = tl.load(v_ptr + rows[None, :] * s_vn + hv * s_vh + dv[:, None],
                 mask=tm[None, :] & (dv < DV)[:, None], other=0.0).to(tl.float32)  # [BV, BT]
    km = tm[:, None] & (dk < DK)[None, :]  # [BT, BK]
    k = tl.load(k_rows + dk[None, :], mask=km, other=0.0).to(tl.float32) * rk[:, None]  # [BT, BK] normalised
    rt = beta[None, :] * (vt - tl.dot(ST, tl.trans(k * tl.exp(gc)[:, None]), input_precision=PS))  # [BV, BT]
    vnt = tl.dot(rt, inv_t, input_precision=PS)  # [BV, BT] v_new^T
    if HAS_OUT:
        q = tl.load(q_rows + dk[None, :], mask=km, other=0.0).to(tl.float32) * (rq * tl.exp(gc))[:, None]
        ot = tl.dot(ST, tl.trans(q), input_precision=PO) + tl.dot(vnt, tl.trans(p), input_precision=PO)
        tl.store(o_ptr + rows[None, :] * s_on + hv * s_oh + dv[:, None], ot.to(o_ptr.dtype.element_ty),
                 mask=tm[None, :] & (dv < DV)[:, None])  # o^T [BV, BT]
    if UPDATE:  # (UPDATE False: the state after this block is not needed)
        kd = k * tl.exp(g_last - gc)[:, None]  # [BT, BK]
        ST = ST * tl.exp(g_last) + tl.dot(vnt, kd, input_precision=PS)  # [BV, BK]
    return ST


@triton.jit
def _load_state(desc, row, v0, TRANS: tl.constexpr):
    """One state tile through the TMA engine (a descriptor of the pool viewed as [S*HV*DK, DV], block [BK, BV]):
    no per-element address registers held across the program."""
    tile = desc.load([row, v0]).to(tl.float32)  # [BK, BV]
    if TRANS:
        return tl.trans(tile)  # [BV, BK]
    else:
        return tile


@triton.jit
def _store_state(desc, row, v0, S, TRANS: tl.constexpr):
    if TRANS:
        desc.store([row, v0], tl.trans(S))
    else:
        desc.store([row, v0], S)


@triton.jit
def _gdn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, cu_ptr, state_desc, slots_ptr, wmask_ptr, keep_ptr,
    pk_ptr, pv_ptr, pg_ptr, pb_ptr, pstart_ptr, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
    s_pkn, s_pkh, s_pvn, s_pvh, s_pgn, s_pgh, s_pbn, s_pbh,
    s_ss, s_sh, s_sk,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_OUT: tl.constexpr,  # verification / prefill: store o
    WRITE: tl.constexpr,  # 0: never write the final state, 1: always, 2: where wmask[b]
    COMMIT: tl.constexpr,  # commit mode: the block length is min(T_i, keep[b])
    REPLAY: tl.constexpr,  # fused: first replay rows pstart[b] .. +keep[b] of the previous block, store S_a
    L2NORM: tl.constexpr, PREC: tl.constexpr,
    PREC_MAIN: tl.constexpr,  # the same for this block (PREC_OUT where nothing is written after it)
    PREC_OUT: tl.constexpr,  # precision of the dots that only feed outputs
    TRANS: tl.constexpr,  # keep the state transposed, S^T [BV, BK] (_block_step_t)
    SINGLE: tl.constexpr,  # every request's block fits in one BT block (verification): no loop
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    if COMMIT:
        seq_len = tl.minimum(seq_len, tl.load(keep_ptr + b).to(tl.int32))
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_row = ((slot * HV + hv) * DK).to(tl.int32)  # row of this tile in the state pool viewed as [S*HV*DK, DV]
    # A block of 0 tokens (a commit of none, a graph bucket's idle padding request) leaves the slot as it is: skip
    # the whole state read and write (REPLAY: unless the previous block has kept tokens to replay).
    if seq_len + REPLAY > 0:
        S = _load_state(state_desc, s_row, v0, TRANS)  # [BK, BV] (TRANS: S^T [BV, BK])
        if REPLAY:
            n_prev = tl.load(keep_ptr + b).to(tl.int32)
            if n_prev > 0:
                p0 = tl.load(pstart_ptr + b).to(tl.int64)
                if TRANS:
                    S = _block_step_t(S, pk_ptr, pk_ptr, pv_ptr, pg_ptr, pb_ptr, o_ptr, p0, n_prev, hk, hv, v0,
                                      scale, s_pkn, s_pkh, s_pkn, s_pkh, s_pvn, s_pvh, s_pgn, s_pgh, s_pbn, s_pbh,
                                      s_on, s_oh, DK, DV, BT, BK, BV, False, L2NORM, PREC, PREC_OUT)
                else:
                    S = _block_step(S, pk_ptr, pk_ptr, pv_ptr, pg_ptr, pb_ptr, o_ptr, p0, n_prev, hk, hv, v0,
                                    scale, s_pkn, s_pkh, s_pkn, s_pkh, s_pvn, s_pvh, s_pgn, s_pgh, s_pbn, s_pbh,
                                    s_on, s_oh, DK, DV, BT, BK, BV, False, L2NORM, PREC)
                _store_state(state_desc, s_row, v0, S, TRANS)  # S_a
        if SINGLE and TRANS:
            S = _block_step_t(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, bos, seq_len, hk, hv, v0, scale,
                              s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                              DK, DV, BT, BK, BV, HAS_OUT, L2NORM, PREC_MAIN, PREC_OUT, WRITE != 0)
        else:
            for c0 in range(0, seq_len, BT):
                if TRANS:
                    S = _block_step_t(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, bos + c0,
                                      tl.minimum(seq_len - c0, BT), hk, hv, v0, scale,
                                      s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                                      DK, DV, BT, BK, BV, HAS_OUT, L2NORM, PREC_MAIN, PREC_OUT)
                else:
                    S = _block_step(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, bos + c0, tl.minimum(seq_len - c0, BT),
                                    hk, hv, v0, scale,
                                    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                                    DK, DV, BT, BK, BV, HAS_OUT, L2NORM, PREC)
        if WRITE == 1:
            _store_state(state_desc, s_row, v0, S, TRANS)
        if WRITE == 2:
            if tl.load(wmask_ptr + b) != 0:
                _store_state(state_desc, s_row, v0, S, TRANS)


# --------------------------------------------------------------------------------------------------------------
# Triton: sequential (fused-recurrent) form, one token at a time; kept for measurement
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _seq_token(S, k_ptr, v_ptr, g_ptr, b_ptr, row, hk, hv, dk, dv, kmask, vmask,
               s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, L2NORM: tl.constexpr):
    """One token of the gated delta rule on a [BK, BV] state tile (fp32 FMA): S <- exp(g) S, then
    S <- S + k (beta (v - S^T k))^T with k L2-normalised."""
    k = tl.load(k_ptr + row * s_kn + hk * s_kh + dk, mask=kmask, other=0.0).to(tl.float32)  # [BK]
    v = tl.load(v_ptr + row * s_vn + hv * s_vh + dv, mask=vmask, other=0.0).to(tl.float32)  # [BV]
    g = tl.load(g_ptr + row * s_gn + hv * s_gh).to(tl.float32)
    beta = tl.load(b_ptr + row * s_bn + hv * s_bh).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
    return S + k[:, None] * delta[None, :]


@triton.jit
def _gdn_seq_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, cu_ptr, state_desc, slots_ptr, wmask_ptr, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh, s_ss, s_sh, s_sk,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    WRITE: tl.constexpr, L2NORM: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dk = tl.arange(0, BK)
    dv = v0 + tl.arange(0, BV)
    kmask = dk < DK
    vmask = dv < DV
    s_row = ((slot * HV + hv) * DK).to(tl.int32)
    if seq_len > 0:  # a request of no tokens (a graph bucket's idle padding request) reads and writes nothing
        S = _load_state(state_desc, s_row, v0, False)  # [BK, BV]
        for t in range(0, seq_len):
            row = bos + t
            q = tl.load(q_ptr + row * s_qn + hk * s_qh + dk, mask=kmask, other=0.0).to(tl.float32)  # [BK]
            if L2NORM:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            q = q * scale
            S = _seq_token(S, k_ptr, v_ptr, g_ptr, b_ptr, row, hk, hv, dk, dv, kmask, vmask,
                           s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, L2NORM)
            o = tl.sum(S * q[:, None], axis=0)  # [BV]
            tl.store(o_ptr + row * s_on + hv * s_oh + dv, o.to(o_ptr.dtype.element_ty), mask=vmask)
        if WRITE == 1:
            _store_state(state_desc, s_row, v0, S, False)
        if WRITE == 2:
            if tl.load(wmask_ptr + b) != 0:
                _store_state(state_desc, s_row, v0, S, False)


@triton.jit
def _gdn_seq_commit_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr, keep_ptr, state_desc, slots_ptr,
    s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """The commit in the sequential form: request b's first keep[b] tokens onto its state, one at a time (work
    in proportion to the accepted tokens, not the block); keep 0 reads and writes nothing."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    n = tl.minimum(tl.load(keep_ptr + b).to(tl.int32), seq_len)
    if n > 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        dk = tl.arange(0, BK)
        dv = v0 + tl.arange(0, BV)
        kmask = dk < DK
        vmask = dv < DV
        s_row = ((slot * HV + hv) * DK).to(tl.int32)
        S = _load_state(state_desc, s_row, v0, False)  # [BK, BV]
        for t in range(0, n):
            S = _seq_token(S, k_ptr, v_ptr, g_ptr, b_ptr, bos + t, hk, hv, dk, dv, kmask, vmask,
                           s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, L2NORM)
        _store_state(state_desc, s_row, v0, S, False)


# --------------------------------------------------------------------------------------------------------------
# Python wrappers (signatures of the references)
# --------------------------------------------------------------------------------------------------------------

def _rowmajor(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _state_desc(state: Tensor, bk: int, bv: int) -> TensorDescriptor:
    """The TMA descriptor of a state pool [S, HV, DK, DV] viewed as [S*HV*DK, DV], in [bk, bv] tiles."""
    num, heads_v, dim_k, dim_v = state.shape
    return TensorDescriptor(state, [num * heads_v * dim_k, dim_v], [dim_v, 1], [bk, bv])


def _write_mode(write_state: bool | Tensor, dummy: Tensor) -> tuple[int, Tensor]:
    if isinstance(write_state, Tensor):
        return 2, write_state.to(torch.bool).view(torch.uint8)  # [B]
    return (1 if write_state else 0), dummy


def _launch(q, k, v, g, beta, o, cu_seqlens, state, slots, *, scale, use_qk_l2norm, write, wmask, has_out,
            commit, keep, prev, bt, bv, warps, prec, prec_out, trans, single):
    heads_k, dim_k = k.shape[1], k.shape[2]
    heads_v, dim_v = v.shape[1], v.shape[2]
    assert heads_v % heads_k == 0 and state.stride(-1) == 1 and state.shape[1:] == (heads_v, dim_k, dim_v)
    bsz = slots.shape[0]
    bk = max(16, triton.next_power_of_2(dim_k))
    bv = min(bv, max(16, triton.next_power_of_2(dim_v)))
    if prev is None:
        pk, pv, pg, pb, pstart, replay = k, v, g, beta, cu_seqlens, False
    else:
        pk, pv, pg, pb, pstart = prev
        pk, pv = _rowmajor(pk), _rowmajor(pv)
        replay = True
    o_ = o if o is not None else v  # never written when not has_out
    grid = (bsz, heads_v, triton.cdiv(dim_v, bv))
    if bsz == 0:
        return
    assert state.is_contiguous() and state.dtype == torch.float32 and dim_k == bk and dim_v % bv == 0
    desc = _state_desc(state, bk, bv)
    _gdn_fwd_kernel[grid](
        q, k, v, g, beta, o_, cu_seqlens, desc, slots, wmask, keep, pk, pv, pg, pb, pstart, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), o_.stride(0), o_.stride(1),
        pk.stride(0), pk.stride(1), pv.stride(0), pv.stride(1), pg.stride(0), pg.stride(1), pb.stride(0),
        pb.stride(1), state.stride(0), state.stride(1), state.stride(2),
        HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BT=bt, BK=bk, BV=bv, HAS_OUT=has_out, WRITE=write,
        COMMIT=commit, REPLAY=int(replay), L2NORM=use_qk_l2norm, PREC=prec,
        PREC_MAIN=prec if (write != 0 or commit) else prec_out, PREC_OUT=prec_out, TRANS=trans, SINGLE=single,
        num_warps=warps,
        **pdl_args(q.device),
    )


VERIFY_IMPLS = ("auto", "block", "seq", "factored")


def _verify_override() -> str:
    """HYBRIDSPEC_GDN_VERIFY (read at each call, for A/B runs): "auto" (the default: _auto_impl's table) or one
    kernel for every verification call, without a state write or with a write mask ("block", "seq", "factored")."""
    impl = os.environ.get("HYBRIDSPEC_GDN_VERIFY", "auto")
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"HYBRIDSPEC_GDN_VERIFY must be one of {VERIFY_IMPLS}, got {impl!r}")
    return impl


def _factored_from(bsz: int) -> int:
    """Tokens a request from which the factored kernel beats the sequential one (bench/gdn_verify2.py, H200,
    2026-12-02, cd1b132, as a captured graph calls it, us seq / factored): B=1 T=4 5.9 / 5.0; B=4 T=4 8.6 / 10.7,
    T=8 12.9 / 11.3; B=8 T=4 13.8 / 14.2, T=8 20.0 / 15.2; B=16 T=4 25.4 / 22.3; B=32 T=4 46.8 / 41.5; B=64 T=4
    88.8 / 70.5. At T=16 it takes 0.37-0.60x the sequential kernel's time, at T=17 0.53-0.99x."""
    return 4 if bsz == 1 or bsz >= 16 else 6


def _factored_fits(dim_k: int, dim_v: int) -> bool:
    """Head dims the factored kernel takes: the key dim a power of two (its tiles hold it whole), the value dim a
    multiple of 16 (its value tile is the largest power of two up to 128 dividing it)."""
    return dim_k >= 16 and dim_k == triton.next_power_of_2(dim_k) and dim_v % 16 == 0


def _auto_impl(bsz: int, max_len: int, write_state, n_tokens: int | None = None) -> str:
    """The kernel for a call of up to 32 tokens a request. Verification (no state written, or a [B] mask: the
    engine's verification steps write the states of the requests that decode without drafts) takes the factored
    kernel (kernels/gdn_verify_triton.py) from _factored_from(B) tokens a request on, judged by the mean block
    n_tokens / B where n_tokens is given (a captured graph's max_len is its bucket's largest block, 17, whatever its
    steps verify), the sequential kernel below; a call that writes every state takes the sequential kernel. Before
    the factored kernel, verification without a write took the block kernel at some shapes, but the engine's
    masked calls took the sequential kernel every time."""
    if max_len > 32:
        return "block"  # prefill in blocks of CHUNK_BT (reached with HYBRIDSPEC_GDN_PREFILL=block or a large DK)
    if write_state is not False and not isinstance(write_state, Tensor):  # every state written
        return "seq"
    override = _verify_override()
    if override != "auto":
        return override
    per_request = max_len if n_tokens is None else -(-n_tokens // max(bsz, 1))
    return "factored" if per_request >= _factored_from(bsz) else "seq"


def _prefill_impl(dim_k: int | None = None) -> str:
    """PREFILL_IMPL or HYBRIDSPEC_GDN_PREFILL; "block" where the two-phase kernel does not cover the key head dim
    (it holds the key dimension in at most two pieces of CHUNK2_KS: DK <= 128 at the default)."""
    impl = os.environ.get("HYBRIDSPEC_GDN_PREFILL", PREFILL_IMPL)
    if impl not in ("block", "two_phase"):
        raise ValueError(f"HYBRIDSPEC_GDN_PREFILL must be 'block' or 'two_phase', got {impl!r}")
    if impl == "two_phase" and dim_k is not None:
        from kernels.gdn_chunk_triton import CHUNK2_KS
        if max(16, triton.next_power_of_2(dim_k)) > 2 * CHUNK2_KS:
            return "block"
    return impl


_prefill_impl()  # a bad HYBRIDSPEC_GDN_PREFILL fails at import, not in the first prefill
_verify_override()  # the same for HYBRIDSPEC_GDN_VERIFY


def _block_tokens(max_len: int) -> int:
    return 16 if max_len <= 16 else 32 if max_len <= 32 else CHUNK_BT


def gdn_triton(
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
    write_state: bool | Tensor = True,
    *,
    impl: str = "auto",  # "block" (WY form), "seq" (one token at a time), "factored" (verification, no state
    # write or a write mask, in two launches, kernels/gdn_verify_triton.py), "two_phase" (prefill, kernels/
    # gdn_chunk_triton.py) or "auto" (_auto_impl, measured; prefill: PREFILL_IMPL / HYBRIDSPEC_GDN_PREFILL)
    bt: int | None = None,
    bv: int | None = None,
    num_warps: int | None = None,
    precision: str | None = None,
    precision_out: str | None = None,
    trans: bool | None = None,
) -> Tensor:
    """gdn_ref: o [N, HV, DV] in v's dtype. Blocks of 16/32 tokens for verification (one block per request, one
    launch); longer (prefill) requests: the two-phase kernel (PREFILL_IMPL; two launches) or blocks of CHUNK_BT
    walked in order. The keyword-only arguments are for measurement (bt, bv, num_warps, precision, precision_out
    go to the two-phase kernel too)."""
    if impl == "two_phase" or (impl == "auto" and max_len > 32 and _prefill_impl(k.shape[-1]) == "two_phase"):
        from kernels.gdn_chunk_triton import gdn_chunk2_triton
        opts = dict(bt=bt, bv=bv, num_warps=num_warps, precision=precision, precision_out=precision_out)
        return gdn_chunk2_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm,
                                 write_state, **{key: val for key, val in opts.items() if val is not None})
    bsz = slots.shape[0]
    if impl == "auto":
        impl = _auto_impl(bsz, max_len, write_state, k.shape[0])
        if impl == "factored" and not _factored_fits(k.shape[-1], v.shape[-1]):
            impl = "seq"
    if impl == "factored":
        from kernels.gdn_verify_triton import gdn_verify_factored_triton
        opts = dict(bv=bv, num_warps=num_warps, precision=precision, precision_out=precision_out, trans=trans)
        return gdn_verify_factored_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale,
                                          use_qk_l2norm, write_state,
                                          **{key: val for key, val in opts.items() if val is not None})
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    scale = float(scale) if scale is not None else k.shape[-1] ** -0.5
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [N, HV, DV] contiguous (as in every step)
    write, wmask = _write_mode(write_state, slots)
    if impl == "seq":
        heads_k, dim_k = k.shape[1], k.shape[2]
        heads_v, dim_v = v.shape[1], v.shape[2]
        bk = max(16, triton.next_power_of_2(dim_k))
        bvv = min(bv or SEQ_BV, triton.next_power_of_2(dim_v))
        grid = (slots.shape[0], heads_v, triton.cdiv(dim_v, bvv))
        if slots.shape[0]:
            assert state.is_contiguous() and state.dtype == torch.float32 and dim_k == bk and dim_v % bvv == 0
            desc = _state_desc(state, bk, bvv)
            _gdn_seq_kernel[grid](
                q, k, v, g, beta, o, cu_seqlens, desc, slots, wmask, scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
                g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
                state.stride(0), state.stride(1), state.stride(2),
                HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BK=bk, BV=bvv, WRITE=write, L2NORM=use_qk_l2norm,
                num_warps=num_warps or SEQ_WARPS,
                **pdl_args(q.device),
            )
        return o
    long = max_len > 32
    if bv is None and not long and bsz == 1 and max_len <= 16 and "HYBRIDSPEC_GDN_BV" not in os.environ:
        bv = 32  # one request: twice the programs (measured 8.9 vs 10.1 us at T=16)
    bt = bt or _block_tokens(max_len)
    _launch(q, k, v, g, beta, o, cu_seqlens, state, slots, scale=scale, use_qk_l2norm=use_qk_l2norm, write=write,
            wmask=wmask, has_out=True, commit=False, keep=slots, prev=None, bt=bt, single=max_len <= bt,
            bv=bv or (CHUNK_BV if long else VERIFY_BV), warps=num_warps or (CHUNK_WARPS if long else VERIFY_WARPS),
            prec=precision or DOT_PRECISION, prec_out=precision_out or DOT_PRECISION_OUT,
            trans=VERIFY_TRANS if trans is None else trans)
    return o


def gdn_verify_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale=None, use_qk_l2norm=True,
                      write_state=False, **kw):
    """Verification / decode (T_i <= 32, one block per request); same semantics as gdn_recurrent_ref."""
    assert max_len <= 32, "verification blocks are at most 32 tokens; use gdn_chunk_triton"
    return gdn_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm, write_state, **kw)


def gdn_chunk_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale=None, use_qk_l2norm=True,
                     write_state=True, **kw):
    """Varlen chunked prefill from each request's state; same semantics as gdn_chunk_ref. impl "two_phase" (or
    "auto" with PREFILL_IMPL / HYBRIDSPEC_GDN_PREFILL = "two_phase", the default): kernels/gdn_chunk_triton.py with
    the remaining keyword arguments (its own; others raise a TypeError that names them); "block"
    (HYBRIDSPEC_GDN_PREFILL=block, or a key head dim the two-phase kernel does not cover): the block kernel in
    blocks of CHUNK_BT."""
    impl = kw.get("impl", "auto")
    if impl == "two_phase" or (impl == "auto" and _prefill_impl(k.shape[-1]) == "two_phase"):
        import inspect

        from kernels.gdn_chunk_triton import gdn_chunk2_triton
        kw.pop("impl", None)
        unknown = sorted(set(kw) - set(inspect.signature(gdn_chunk2_triton).parameters))
        if unknown:
            raise TypeError(f"gdn_chunk_triton (two-phase kernel) got options it does not take: {unknown}; "
                            "pass impl='block' for the block kernel's")
        return gdn_chunk2_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm,
                                 write_state, **kw)
    kw.setdefault("bt", CHUNK_BT)
    kw.setdefault("bv", CHUNK_BV)
    kw.setdefault("num_warps", CHUNK_WARPS)
    return gdn_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm, write_state, **kw)


def gdn_commit_triton(
    k: Tensor,  # [N, HK, DK] the verified block's keys (before L2 norm)
    v: Tensor,  # [N, HV, DV]
    g: Tensor,  # [N, HV]
    beta: Tensor,  # [N, HV]
    cu_seqlens: Tensor,  # [B+1] int32
    keep_lens: Tensor,  # [B] tokens of each block to commit (0..T_i)
    state: Tensor,  # [S, HV, DK, DV] fp32 pool holding S_0
    slots: Tensor,  # [B] int64
    max_len: int,
    use_qk_l2norm: bool = True,
    *,
    impl: str = "seq",
    bv: int | None = None,
    num_warps: int | None = None,
    precision: str | None = None,
    precision_out: str | None = None,
    trans: bool | None = None,
) -> None:
    """gdn_commit_ref in one launch for all requests; a request with keep 0 is neither read nor written.
    impl "seq" (the default): one token at a time, work in proportion to each request's kept tokens (the
    engine's commits keep the accepted drafts + 1, a fraction of the block); "block": the WY block kernel over the
    whole block of BT tokens whatever is kept (measured: bench/NOTES.md, 2026-11-30 second session)."""
    k, v = _rowmajor(k), _rowmajor(v)
    if impl == "seq":
        heads_k, dim_k = k.shape[1], k.shape[2]
        heads_v, dim_v = v.shape[1], v.shape[2]
        bk = max(16, triton.next_power_of_2(dim_k))
        wide = slots.shape[0] >= COMMIT_WIDE_FROM  # many requests: wider tiles, fewer programs
        bvv = min(bv or (COMMIT_WIDE_BV if wide else SEQ_BV), triton.next_power_of_2(dim_v))
        num_warps = num_warps or (COMMIT_WIDE_WARPS if wide else SEQ_WARPS)
        if slots.shape[0] == 0:
            return
        assert state.is_contiguous() and state.dtype == torch.float32 and dim_k == bk and dim_v % bvv == 0
        assert heads_v % heads_k == 0 and state.shape[1:] == (heads_v, dim_k, dim_v)
        desc = _state_desc(state, bk, bvv)
        _gdn_seq_commit_kernel[(slots.shape[0], heads_v, triton.cdiv(dim_v, bvv))](
            k, v, g, beta, cu_seqlens, keep_lens, desc, slots,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0),
            beta.stride(1),
            HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BK=bk, BV=bvv, L2NORM=use_qk_l2norm, num_warps=num_warps,
            **pdl_args(k.device),
        )
        return
    if impl != "block":
        raise ValueError(f"impl must be 'seq' or 'block', got {impl!r}")
    _launch(k, k, v, g, beta, None, cu_seqlens, state, slots, scale=1.0, use_qk_l2norm=use_qk_l2norm, write=1,
            wmask=slots, has_out=False, commit=True, keep=keep_lens, prev=None, bt=_block_tokens(max_len),
            single=max_len <= _block_tokens(max_len),
            bv=bv or VERIFY_BV, warps=num_warps or VERIFY_WARPS, prec=precision or DOT_PRECISION,
            prec_out=precision_out or DOT_PRECISION_OUT, trans=VERIFY_TRANS if trans is None else trans)


# --------------------------------------------------------------------------------------------------------------
# Commit fused into the next verification
# --------------------------------------------------------------------------------------------------------------

def gdn_commit_verify_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,  # this step's block, as gdn_recurrent_ref
    cu_seqlens: Tensor,  # [B+1] int32
    state: Tensor,  # [S, HV, DK, DV] fp32, holding S_0 (before the last step's accepted tokens)
    slots: Tensor,  # [B] int64
    max_len: int,
    prev_k: Tensor,  # [M, HK, DK] the previous step's block (keys before L2 norm)
    prev_v: Tensor,  # [M, HV, DV]
    prev_g: Tensor,  # [M, HV]
    prev_beta: Tensor,  # [M, HV]
    prev_starts: Tensor,  # [B] row of each request's previous block in prev_* (any value where keep is 0)
    keep_lens: Tensor,  # [B] accepted tokens of the previous block to replay first (0 = none)
    prev_max_len: int,  # max keep_lens (host int)
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    write_state: bool | Tensor = False,
) -> Tensor:
    """Replays each request's kept previous tokens onto S_0 and stores S_a (as gdn_commit_ref), then verifies
    this step's block from S_a (as gdn_recurrent_ref with write_state). Returns o [N, HV, DV]."""
    keep = keep_lens.long()
    cu_prev = torch.zeros(keep.shape[0] + 1, dtype=torch.int32, device=keep.device)
    cu_prev[1:] = keep.cumsum(0)
    rows = prev_starts.long().repeat_interleave(keep) + torch.arange(int(cu_prev[-1]), device=keep.device) \
        - cu_prev[:-1].long().repeat_interleave(keep)  # [sum keep] rows of the kept tokens
    gdn_commit_ref(prev_k[rows], prev_v[rows], prev_g[rows], prev_beta[rows], cu_prev, keep, state, slots,
                   max(prev_max_len, 1), use_qk_l2norm)
    return gdn_recurrent_ref(q, k, v, g, beta, cu_seqlens, state, slots, max_len, scale, use_qk_l2norm,
                             write_state)


def gdn_commit_verify_triton(q, k, v, g, beta, cu_seqlens, state, slots, max_len, prev_k, prev_v, prev_g,
                             prev_beta, prev_starts, keep_lens, prev_max_len, scale=None, use_qk_l2norm=True,
                             write_state=False, *, bv=None, num_warps=None, precision=None, precision_out=None,
                             trans=None):
    """gdn_commit_verify_ref in one launch: each state tile is read once and written once (S_a, or the state
    after this block where write_state)."""
    assert max_len <= 32 and prev_max_len <= 32
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    scale = float(scale) if scale is not None else k.shape[-1] ** -0.5
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    write, wmask = _write_mode(write_state, slots)
    _launch(q, k, v, g, beta, o, cu_seqlens, state, slots, scale=scale, use_qk_l2norm=use_qk_l2norm, write=write,
            wmask=wmask, has_out=True, commit=False, keep=keep_lens,
            prev=(prev_k, prev_v, prev_g, prev_beta, prev_starts), bt=_block_tokens(max(max_len, prev_max_len)),
            single=True,
            bv=bv or VERIFY_BV, warps=num_warps or VERIFY_WARPS, prec=precision or DOT_PRECISION,
            prec_out=precision_out or DOT_PRECISION_OUT, trans=VERIFY_TRANS if trans is None else trans)
    return o
