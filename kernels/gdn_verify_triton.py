"""GDN verification as one state product (Triton): `gdn_verify_factored_triton` ~ kernels.gdn.gdn_recurrent_ref
for blocks of T_i <= 32 tokens a request, with write_state False (the pool untouched) or a [B] mask (the engine's
verification steps: the requests that decode one token without drafts advance their states).

For one request's block (value head h; q, k L2-normalised, q scaled; S = S_0 [DK, DV] fp32) the block (WY) form
of kernels/gdn_triton.py is
    gc = cumsum(g),  D_ij = exp(gc_i - gc_j) (j <= i),  A = strictly_lower(beta_i k_i.k_j D_ij)
    v_new = U - W S,  U = (I + A)^-1 diag(beta) v,  W = (I + A)^-1 diag(beta e^gc) k
    o = diag(e^gc) q S + P v_new,  P = lower_incl(q k^T * D)
Multiplying out with M = P (I + A)^-1 [T, T]:
    o = q' S + y,   q' = diag(e^gc) q - M diag(beta e^gc) k   [T, DK],   y = M diag(beta) v   [T, DV]
so the state enters in ONE product, and everything else depends only on the block's inputs. Two launches:

Phase 1 `_verify_prep_kernel`, one program per (request, value head): k k^T, q k^T and the row norms from KC-wide
column pieces of the raw q, k; the gates; the [BT, BT] forward substitution for (I + A)^-1; M; then q' and y piece
by piece into fp32 scratch [N, HV, BK] and [N, HV, BDV] (the request's rows only). Nothing of the state is read.
The large products take the raw q, k, v (bf16 values, exact in tf32) with the norms and gates folded into the fp32
[BT, BT] factor, so a tf32 dot rounds only that factor (FACTORED_PREP_PRECISION tf32: o within 2.0e-3 of the
reference in bf16 at the bench shapes, the one-launch block kernel 2.3e-3, tf32x3 here 1.2e-3 at +3-10% time).

Phase 2 `_verify_out_kernel`, one program per (request, value head, BV value columns): the state tile through the
TMA engine (as kernels/gdn_triton.py), then o = q' S + y (TRANS: o^T = S^T q'^T + y^T) in `precision_out`
(DOT_PRECISION_OUT, tf32, as the one-launch kernel's output-only dots). A request whose state is written (the mask)
is walked token by token on the tile in fp32 FMA, as the sequential kernel does, and its tile stored. With
programmatic dependent launch the state tile is read BEFORE the prologue: the kernel launched just before phase 2
is always its own phase 1, which writes no state, and phase 1's programs let phase 2 launch only after their own
wait for the kernel before them (kernels/pdl.py), so every write of the state that precedes this call is complete.
The read of the state, the largest by far (64 KB a request and head), thus overlaps phase 1's tail.

Block width, decided per request on the device: 16 tokens where a request's n <= 16; for n = 17 (16 drafts + 1, the
longest block the engine verifies) phase 1 takes the 16-wide block plus a rank-one extension (_prep_block's EXTRA,
SPLIT17) and phase 2 a 32-row q'; above 17, 32 (MAX_BT) in both. Measured 16 + 1 against 32 wide: B=32, T=17 80.0 ->
68.7 us, B=64 138 -> 118 (bench/NOTES.md, 2026-12-02 second session). Every width is compiled into every launch:
a captured verification graph's max_len is its bucket's largest block (17 at max_verify_len 16) whatever its steps
verify, and one kernel a launch keeps the compile keys of eager steps few.

What it replaces (kernels/gdn_triton.py): the one-launch block kernel redoes the [T, T] work (k k^T, the
substitution) in every value tile's program and runs two state products (W S and q S) in a dependent chain behind
it (83 us at B=32, T=16 on the H200, 4.5x the state-read floor); the sequential kernel walks T tokens one by one
(115 us there), and it was what the engine's verification ran every time (its calls pass a write mask, which the
old auto choice sent to the sequential kernel). Here: 50-53 us (bench/NOTES.md, 2026-12-02). The two-phase prefill
kernel (kernels/gdn_chunk_triton.py) tried as a verification kernel kept both state products in its phase 2
(bench/NOTES.md, 2026-12-01 item 6).

Inputs are upcast to fp32 right after their loads (the Triton interpreter computes bf16 arithmetic wrongly).
Nothing synchronizes with the host: grids come from B and the shapes; lengths from cu_seqlens on the device. A
request of 0 tokens (a graph bucket's idle padding request) reads and writes nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gdn_triton import (DOT_PRECISION_OUT, _load_state, _rowmajor, _seq_token, _state_desc,
                                _store_state, _ut_inverse, _write_mode)
from kernels.pdl import pdl_args, pdl_prologue

# Defaults from bench/gdn_verify2.py on the H200 (bench/NOTES.md, 2026-12-02: 80ce65b's sweep; us at B x T = 32x16 /
# 64x8 / 16x17 / 8x17): phase 2 with BV = 128 and q' [BT, DK] times S (49.4 / 76.2 / 47.6 / 32.2) against BV = 64 with
# S^T times q'^T (55.8 / 93.4 / 52.8 / 34.0); phase 1 with 2 warps (4: 69.0 / 107.0 / 52.8 / 34.1; 8 slower), 32 key
# columns a piece, tf32 (tf32x3 +3-10%). One or two requests (32-64 programs, latency-bound): fewer, wider steps,
# the whole key dimension at once with 4 warps (B = 1, T = 16: 7.1 us in 2c787c4's run; 64 columns 9.3, 32 columns
# 11.6 in 80ce65b's). Registers (ptxas, sm_90, both block widths compiled in): 205 at 2 warps / 32 columns, 238 at
# 4 warps / 128 columns; 2 warps / 64 columns spill.
FACTORED_BV = 128  # phase 2 value tile
FACTORED_WARPS = 4  # phase 2
FACTORED_TRANS = False  # phase 2: q' [BT, DK] times S [DK, BV] (True: S^T [BV, DK] times q'^T, M = BV)
FACTORED_PREP_WARPS = 2  # phase 1
# phase 1's dots: tf32 (its large products take the raw bf16 q, k, v, exact in tf32: only the [T, T] factor rounds)
FACTORED_PREP_PRECISION = "tf32"
FACTORED_KC = 32  # phase 1: columns of q, k, v per piece
FACTORED_FEW, FACTORED_KC_FEW, FACTORED_PREP_WARPS_FEW = 2, 128, 4  # phase 1 up to FACTORED_FEW requests
# The widest block: every launch compiles both widths (16 where a request's n <= 16), whatever max_len says: a graph's
# max_len is its bucket's largest block anyway, and one compile key fewer for eager steps (tests/test_specializations)
MAX_BT = 32
# A 17-token block as 16 + 1 (_prep_block's EXTRA); HYBRIDSPEC_GDN_VERIFY_SPLIT17=0 takes the 32-wide block (A/B
# measurement only; read once here, so that captured graphs and eager steps run the same variant)
SPLIT17 = os.environ.get("HYBRIDSPEC_GDN_VERIFY_SPLIT17", "1") != "0"


@triton.jit
def _prep_block(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qp_ptr, y_ptr, scale, bos, n, hk, hv,
                s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
                HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BDV: tl.constexpr, KC: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                EXTRA: tl.constexpr = False):
    """Phase 1 for one request (n <= BT tokens from row bos) and value head hv: q', y into the scratch.

    EXTRA: the request has one more token, row bos + n with n = BT (a block of 17 = 16 + 1 tokens, what a graph of
    16 drafts verifies), taken as a rank-one extension of the BT-wide system instead of a 32-wide block: with
    (I + A) = [[L, 0], [a, 1]] (L the leading BT x BT system, a the extra row of A) the extra row of M = P (I + A)^-1
    is [(p - p_x a) L^-1, p_x] (p the extra row of P left of the diagonal, p_x its diagonal), so its q' and y are
    vector-matrix products on the CUDA cores beside the BT-wide work, and the [BT, BT] substitution stays 16 wide
    (the 32-wide block made T = 17 cost 1.5x T = 16: bench/NOTES.md, 2026-12-02)."""
    t = tl.arange(0, BT)  # [BT]
    tm = t < n
    rows = bos + t  # [BT] int64
    k_rows = k_ptr + rows[:, None] * s_kn + hk * s_kh  # [BT, 1]
    q_rows = q_ptr + rows[:, None] * s_qn + hk * s_qh  # [BT, 1]
    rk, rq, p, beta, gc, g_last, inv = _ut_inverse(k_rows, q_rows, g_ptr, b_ptr, rows, n, hv, scale,
                                                   s_gn, s_gh, s_bn, s_bh, DK, BT, BK, KC, True, L2NORM, PREC, PREC)
    eg = tl.exp(gc)  # [BT]
    m = tl.dot(p, inv, input_precision=PREC)  # [BT, BT] M = P (I + A)^-1
    # q' = diag(rq e^gc) q_raw - (M diag(rk beta e^gc)) k_raw;  y = (M diag(beta)) v_raw; piece by piece
    mk = m * (rk * beta * eg)[None, :]  # [BT, BT]
    mb = m * beta[None, :]  # [BT, BT]
    fq = rq * eg  # [BT]
    if EXTRA:  # the extra row x = bos + n: its products with the block's raw keys, its norms, gate, beta
        rx = bos + n  # int64
        xk = tl.zeros([BT], dtype=tl.float32)  # k_raw . k_x
        xq = tl.zeros([BT], dtype=tl.float32)  # k_raw . q_x
        kx_sq = 0.0
        qx_sq = 0.0
        qx_kx = 0.0
        for c in range(0, BK, KC):
            dc = c + tl.arange(0, KC)  # [KC]
            dm = dc < DK
            kc = tl.load(k_rows + dc[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)  # [BT, KC]
            kx = tl.load(k_ptr + rx * s_kn + hk * s_kh + dc, mask=dm, other=0.0).to(tl.float32)  # [KC]
            qx = tl.load(q_ptr + rx * s_qn + hk * s_qh + dc, mask=dm, other=0.0).to(tl.float32)  # [KC]
            xk += tl.sum(kc * kx[None, :], axis=1)
            xq += tl.sum(kc * qx[None, :], axis=1)
            kx_sq += tl.sum(kx * kx, axis=0)
            qx_sq += tl.sum(qx * qx, axis=0)
            qx_kx += tl.sum(qx * kx, axis=0)
        if L2NORM:
            rkx = tl.rsqrt(kx_sq + 1e-6)
            rqx = tl.rsqrt(qx_sq + 1e-6) * scale
        else:
            rkx = 1.0
            rqx = scale
        gx = tl.load(g_ptr + rx * s_gn + hv * s_gh).to(tl.float32)
        betax = tl.load(b_ptr + rx * s_bn + hv * s_bh).to(tl.float32)
        gcx = g_last + gx  # the extra token's cumulative log decay
        egx = tl.exp(gcx)
        dx = tl.where(tm, tl.exp(gcx - gc), 0.0)  # [BT] decay from each token to the extra one
        ax = betax * rkx * xk * rk * dx  # [BT] the extra row of A
        px = rqx * xq * rk * dx  # [BT] the extra row of P left of the diagonal
        pxx = rqx * qx_kx * rkx  # its diagonal (decay 1)
        mx = tl.sum((px - pxx * ax)[:, None] * inv, axis=0)  # [BT] the extra row of M left of the diagonal
        mkx = mx * rk * beta * eg  # [BT]
        mbx = mx * beta  # [BT]
        kxf = pxx * rkx * betax * egx  # the diagonal's weight of k_x in q'_x
        vxf = pxx * betax  # ... of v_x in y_x
    for c in range(0, BK, KC):
        dc = c + tl.arange(0, KC)  # [KC]
        cm = tm[:, None] & (dc < DK)[None, :]
        kc = tl.load(k_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
        qc = tl.load(q_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
        qp = qc * fq[:, None] - tl.dot(mk, kc, input_precision=PREC)  # [BT, KC] q'
        tl.store(qp_ptr + (rows[:, None] * HV + hv) * BK + dc[None, :], qp, mask=tm[:, None])
        if EXTRA:
            dm = dc < DK
            kx = tl.load(k_ptr + rx * s_kn + hk * s_kh + dc, mask=dm, other=0.0).to(tl.float32)  # [KC]
            qx = tl.load(q_ptr + rx * s_qn + hk * s_qh + dc, mask=dm, other=0.0).to(tl.float32)  # [KC]
            qpx = rqx * egx * qx - tl.sum(mkx[:, None] * kc, axis=0) - kxf * kx  # [KC] q'_x
            tl.store(qp_ptr + (rx * HV + hv) * BK + dc, qpx)
    for c in range(0, BDV, KC):
        dc = c + tl.arange(0, KC)  # [KC]
        vc = tl.load(v_ptr + rows[:, None] * s_vn + hv * s_vh + dc[None, :],
                     mask=tm[:, None] & (dc < DV)[None, :], other=0.0).to(tl.float32)  # [BT, KC]
        tl.store(y_ptr + (rows[:, None] * HV + hv) * BDV + dc[None, :],
                 tl.dot(mb, vc, input_precision=PREC), mask=tm[:, None])  # [BT, KC] y
        if EXTRA:
            vx = tl.load(v_ptr + rx * s_vn + hv * s_vh + dc, mask=dc < DV, other=0.0).to(tl.float32)  # [KC]
            tl.store(y_ptr + (rx * HV + hv) * BDV + dc, tl.sum(mbx[:, None] * vc, axis=0) + vxf * vx)  # [KC] y_x


@triton.jit
def _verify_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr, wmask_ptr, qp_ptr, y_ptr, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    MAX_BT: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, KC: tl.constexpr,
    WRITE: tl.constexpr,  # 0: no request's state is written, 2: those where wmask[b] (phase 2 walks them)
    L2NORM: tl.constexpr, PREC: tl.constexpr,
    SPLIT17: tl.constexpr = True,  # a 17-token block as 16 + 1 (_prep_block's EXTRA); False: the 32-wide block
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """q' [n, BK] and y [n, BDV] of request b (n tokens), value head hv, into the scratch rows of its tokens
    (module docstring); scratch layouts [N, HV, BK] and [N, HV, BDV], contiguous. The block is 16 tokens wide
    where n <= 16, 16 + 1 where n = 17 (SPLIT17), else MAX_BT (32): chosen per request on the device, so a graph
    captured for blocks of up to 17 tokens pays for a wider block only in the requests that verify 17. The large
    products take the raw q, k, v (bf16 values, exact in tf32) with the norms and gates folded into the fp32
    [BT, BT] factor, so a tf32 dot rounds only that factor."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    if WRITE == 2:
        if tl.load(wmask_ptr + b) != 0:
            n = 0  # a request whose state is written: phase 2 walks its tokens one by one
    if SPLIT17 and n == 17:  # 16 + 1: the extra token as a rank-one extension of the 16-wide system (_prep_block)
        _prep_block(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qp_ptr, y_ptr, scale, bos, 16, hk, hv,
                    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
                    HV, DK, DV, 16, BK, BDV, KC, L2NORM, PREC, EXTRA=True)
    elif n > 16:
        if MAX_BT > 16:
            _prep_block(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qp_ptr, y_ptr, scale, bos, n, hk, hv,
                        s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
                        HV, DK, DV, MAX_BT, BK, BDV, KC, L2NORM, PREC)
    elif n > 0:
        _prep_block(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, qp_ptr, y_ptr, scale, bos, n, hk, hv,
                    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
                    HV, DK, DV, 16, BK, BDV, KC, L2NORM, PREC)


@triton.jit
def _token_step(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, row, hk, hv, dk, dv, scale,
                s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr, TRANS: tl.constexpr):
    """One token of the delta rule on the state tile (S [BK, BV]: kernels/gdn_triton.py's _seq_token; or S^T
    [BV, BK] with TRANS), fp32 FMA as the sequential kernel; stores the token's o [BV]. Returns the new tile."""
    kmask = dk < DK
    vmask = dv < DV
    q = tl.load(q_ptr + row * s_qn + hk * s_qh + dk, mask=kmask, other=0.0).to(tl.float32)  # [BK]
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
    q = q * scale
    if TRANS:
        k = tl.load(k_ptr + row * s_kn + hk * s_kh + dk, mask=kmask, other=0.0).to(tl.float32)  # [BK]
        v = tl.load(v_ptr + row * s_vn + hv * s_vh + dv, mask=vmask, other=0.0).to(tl.float32)  # [BV]
        g = tl.load(g_ptr + row * s_gn + hv * s_gh).to(tl.float32)
        beta = tl.load(b_ptr + row * s_bn + hv * s_bh).to(tl.float32)
        if L2NORM:
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[None, :], axis=1)) * beta  # [BV]
        S = S + delta[:, None] * k[None, :]
        o = tl.sum(S * q[None, :], axis=1)  # [BV]
    else:
        S = _seq_token(S, k_ptr, v_ptr, g_ptr, b_ptr, row, hk, hv, dk, dv, kmask, vmask,
                       s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, L2NORM)
        o = tl.sum(S * q[:, None], axis=0)  # [BV]
    tl.store(o_ptr + row * s_on + hv * s_oh + dv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    return S


@triton.jit
def _out_block(S, qp_ptr, y_ptr, o_ptr, bos, n, hv, dk, dv, s_on, s_oh,
               HV: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
               PREC: tl.constexpr, TRANS: tl.constexpr):
    """o = q' S + y for n <= BT tokens from row bos, value head hv, the tile's columns dv."""
    t = tl.arange(0, BT)  # [BT]
    tm = t < n
    rows = bos + t  # [BT] int64
    if TRANS:
        qpt = tl.load(qp_ptr + (rows[None, :] * HV + hv) * BK + dk[:, None], mask=tm[None, :], other=0.0)
        yt = tl.load(y_ptr + (rows[None, :] * HV + hv) * BDV + dv[:, None], mask=tm[None, :], other=0.0)
        ot = tl.dot(S, qpt, input_precision=PREC) + yt  # [BV, BT] o^T
        tl.store(o_ptr + rows[None, :] * s_on + hv * s_oh + dv[:, None], ot.to(o_ptr.dtype.element_ty),
                 mask=tm[None, :] & (dv < DV)[:, None])
    else:
        qp = tl.load(qp_ptr + (rows[:, None] * HV + hv) * BK + dk[None, :], mask=tm[:, None], other=0.0)
        yv = tl.load(y_ptr + (rows[:, None] * HV + hv) * BDV + dv[None, :], mask=tm[:, None], other=0.0)
        o = tl.dot(qp, S, input_precision=PREC) + yv  # [BT, BV]
        tl.store(o_ptr + rows[:, None] * s_on + hv * s_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & (dv < DV)[None, :])


@triton.jit
def _verify_out_kernel(
    qp_ptr, y_ptr, o_ptr, cu_ptr, state_desc, slots_ptr, wmask_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    MAX_BT: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, BV: tl.constexpr,
    WRITE: tl.constexpr,  # 0: no state written, 2: request b's where wmask[b] (walked token by token here)
    L2NORM: tl.constexpr, PREC: tl.constexpr, TRANS: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """o = q' S_0 + y for request b, value head hv, value columns v0 .. v0+BV; the state tile is read before the
    PDL prologue (module docstring: the kernel before is phase 1, which writes no state). A request whose state
    is written (WRITE 2 and wmask[b]: in a verification step, a request decoding one token without drafts) is
    walked token by token on the tile, which is then stored."""
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    n = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    if n > 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        s_row = ((slot * HV + hv) * DK).to(tl.int32)  # row of this tile in the pool viewed as [S*HV*DK, DV]
        S = _load_state(state_desc, s_row, v0, TRANS)  # [BK, BV] (TRANS: S^T [BV, BK])
        pdl_prologue(PDL)  # q' and y come from phase 1
        dk = tl.arange(0, BK)  # [BK]
        dv = v0 + tl.arange(0, BV)  # [BV]
        write = False
        if WRITE == 2:
            write = tl.load(wmask_ptr + b) != 0
        if write:
            for j in range(0, n):
                S = _token_step(S, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, bos + j, hk, hv, dk, dv, scale,
                                s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh, s_on, s_oh,
                                DK, DV, L2NORM, TRANS)
            _store_state(state_desc, s_row, v0, S, TRANS)
        elif n > 16:
            if MAX_BT > 16:
                _out_block(S, qp_ptr, y_ptr, o_ptr, bos, n, hv, dk, dv, s_on, s_oh, HV, DV, MAX_BT, BK, BDV, PREC,
                           TRANS)
        else:
            _out_block(S, qp_ptr, y_ptr, o_ptr, bos, n, hv, dk, dv, s_on, s_oh, HV, DV, 16, BK, BDV, PREC, TRANS)
    else:  # a request of no tokens: its programs pass the prologue too (kernels/pdl.py's ordering)
        pdl_prologue(PDL)


def _value_tile(dim_v: int, widest: int) -> int:
    """The largest power of two up to `widest` dividing the value head dim (kernels/gdn_triton.py _factored_fits:
    a multiple of 16)."""
    bv = widest
    while bv > 16 and dim_v % bv:
        bv //= 2
    return bv


def gdn_verify_factored_triton(
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
    write_state: bool | Tensor = False,  # False, or a [B] bool mask of the requests whose state is advanced
    *,
    bv: int | None = None,
    num_warps: int | None = None,
    prep_warps: int | None = None,
    kc: int | None = None,
    precision: str | None = None,
    precision_out: str | None = None,
    trans: bool | None = None,
) -> Tensor:
    """gdn_recurrent_ref in two launches (module docstring) for verification: o [N, HV, DV] in v's dtype, every
    block at most 32 tokens. write_state False leaves the pool untouched; a [B] mask advances the chosen requests'
    states over their whole blocks (walked token by token in phase 2: in the engine's verification steps those are
    the requests decoding one token without drafts). write_state=True (every state written) is the sequential
    kernel's job (kernels/gdn_triton.py) and is refused. The keyword-only arguments are tile sizes / launch options
    for measurement."""
    if not 0 <= max_len <= 32:
        raise ValueError(f"max_len must be between 0 and 32 (one block a request), got {max_len}")
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    scale = float(scale) if scale is not None else k.shape[-1] ** -0.5
    n_tok, heads_k, dim_k = k.shape
    heads_v, dim_v = v.shape[1], v.shape[2]
    assert heads_v % heads_k == 0 and state.shape[1:] == (heads_v, dim_k, dim_v) and state.dtype == torch.float32
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [N, HV, DV]
    bsz = slots.shape[0]
    if bsz == 0 or n_tok == 0 or max_len == 0:
        return o
    write, wmask = _write_mode(write_state, slots)
    if write == 1:
        raise ValueError(f"gdn_verify_factored_triton: write_state must be False or a [B] mask, got {write_state!r} "
                         "(a call that writes every state takes gdn_triton's sequential kernel)")
    bt = MAX_BT  # each request's block is 16 or 32 wide on the device; one compile for every max_len
    bk = max(16, triton.next_power_of_2(dim_k))
    bdv = max(16, triton.next_power_of_2(dim_v))
    bv = min(bv, bdv) if bv else _value_tile(dim_v, FACTORED_BV)
    assert state.is_contiguous() and dim_k == bk and dim_v % bv == 0, "DK a power of two >= 16, BV dividing DV"
    trans = FACTORED_TRANS if trans is None else trans
    dev = v.device
    qp = torch.empty(n_tok, heads_v, bk, dtype=torch.float32, device=dev)  # [N, HV, BK] q'
    y = torch.empty(n_tok, heads_v, bdv, dtype=torch.float32, device=dev)  # [N, HV, BDV] y
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
               g.stride(1), beta.stride(0), beta.stride(1))
    few = bsz <= FACTORED_FEW
    _verify_prep_kernel[(bsz, heads_v)](
        q, k, v, g, beta, cu_seqlens, wmask, qp, y, scale, *strides,
        HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, MAX_BT=bt, BK=bk, BDV=bdv,
        KC=min(kc or (FACTORED_KC_FEW if few else FACTORED_KC), bk, bdv),
        WRITE=write, L2NORM=use_qk_l2norm, PREC=precision or FACTORED_PREP_PRECISION,
        SPLIT17=SPLIT17,
        num_warps=prep_warps or (FACTORED_PREP_WARPS_FEW if few else FACTORED_PREP_WARPS),
        **pdl_args(dev),
    )
    desc = _state_desc(state, bk, bv)
    _verify_out_kernel[(bsz, heads_v, dim_v // bv)](
        qp, y, o, cu_seqlens, desc, slots, wmask, q, k, v, g, beta, scale, *strides, o.stride(0), o.stride(1),
        HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, MAX_BT=bt, BK=bk, BDV=bdv, BV=bv, WRITE=write,
        L2NORM=use_qk_l2norm, PREC=precision_out or DOT_PRECISION_OUT, TRANS=trans,
        num_warps=num_warps or FACTORED_WARPS,
        **pdl_args(dev),
    )
    return o
