"""Gated delta rule chunked prefill in two phases (Triton): `gdn_chunk2_triton` ~ kernels.gdn.gdn_chunk_ref.

The block kernel of kernels/gdn_triton.py (`gdn_chunk_triton`) walks each request's whole sequence in one program
per (request, value head, value tile) and redoes the S-independent work of every block (k k^T, the UT inverse)
inside that sequential walk. Here the work is split in two launches:

Phase 1 `_chunk_prep_kernel`, one program per (request, chunk of BT tokens, value head), all chunks in parallel
(programs past their request's length exit). For the chunk's rows i, j (k, q L2-normalised, q scaled):
    gc = cumsum(g) inside the chunk,  D_ij = exp(gc_i - gc_j) for j <= i, else 0
    A = strictly_lower(beta_i k_i.k_j D_ij),  T = (I + A)^-1
    w = T (beta k exp(gc))  [BT, DK],  u = T (beta v)  [BT, DV],  P = lower_incl_diag(q k^T * D)  [BT, BT]
k k^T, q k^T and the row norms come from KC-wide column pieces of the raw q, k. Stored by flat token row: w [N, HV,
DK], u [N, HV, DV], P [N, HV, BT] (row i's row of P) in `scratch_dtype`; gc, fq = |q|^-1 scale exp(gc) and
fk = |k|^-1 exp(gc_last - gc) as fp32 [N, HV]. Nothing of the state enters phase 1.
T by `inverse`: "rows": forward substitution, BT dependent row steps on the [BT, BT] tile (each a masked row
extraction and a reduction over the whole tile: latency-bound, ~65% of the two-phase time on the H200);
"blocks" (PREP_INVERSE, the default up to BT = 64; phase 1 2.1x faster on the H200: 389 against 819 us at 4096
tokens, bench/NOTES.md 2026-12-01): -A goes to an fp32 scratch [N, HV, BT] (this program's rows), the BT/16
diagonal 16x16 blocks are inverted together (14 steps on an [NB, 16, 16] stack, rows of -A loaded back from the
scratch), and merged 16 -> 32 -> 64 by [BT, BT] tensor-core products in `precision` (see _block_inverse). Same T up
to fp32 / tf32x3 rounding.

Phase 2 `_chunk_state_kernel`, one program per (request, value head, BV-wide value tile), sequential over the
request's chunks; the state tile S [DK, BV] fp32 comes from state[slots[b]] and stays in registers (as one or two
KS-row pieces, so that the [BT, DK] operands are multiplied piece by piece):
    v_new = u - w S
    o = (q_raw fq) S + P v_new
    S <- exp(gc_last) S + (k_raw fk)^T v_new
then S is stored (write_state True / False / [B] mask). Phase 2 re-reads the raw q, k (input dtype, shared by the
HV / HK value heads of a key head) times the row factors instead of normalised fp32 copies: half the bytes or less.
With one request phase 2 has HV * DV / BV programs (128 at BV = 32 for 132 SMs), each walking every chunk: latency-
bound; BV = 16 doubles the programs (two per SM).

state_pass="split" (opt-in; STATE_PASS = "fused" is the default): phase 2 becomes
  pass A, the same kernel with SPLIT=1, per (request, value head, value tile), sequential: stores the chunk-start
    state S_c [DK, BV] to h [N // BT + B, HV, DK, DV] (h_dtype, default the scratch dtype; request b's chunk c is row
    bos // BT + b + c: unique, and below N // BT + B), then v_new = u - w S, stored over u in place (each element
    is read and rewritten by the same program), and S <- exp(g_last) S + (k fk)^T v_new. No q, P, o: three of its
    five dots per chunk remain (w S and k^T v_new, the tf32x3 ones) and its registers fit without spill at BV=16;
  pass B `_chunk_out_kernel`, all (request, chunk, value head, BVO value columns) in parallel:
    o = (q fq) S_c + P v_new.
What pass B reads: S_c cannot be rebuilt without the sequential walk, so the chunk-start states are stored (DK DV 4
bytes per chunk and head = 1 KB per token and head at BT = 64, fp32, written once, read once); v_new is stored (over
u, no extra memory) rather than recomputed as u - w S_c in pass B: the same HBM bytes (v_new written + read, 2 x 512
B, against w + u read again, 2 x 512 B per token and head) without a tf32x3 dot and DV / BVO re-reads of w in pass
B, and the stores sit off pass A's dependency chain. Extra traffic against "fused": ~3 KB per token and head (~400
MB at 4096 tokens, HV = 32; ~1/2 of h's share with h_dtype=bfloat16, o only).

Scratch dtype: fp32 by default. w and u feed the state directly (v_new = u - w S, summed into S over every chunk of
the request); bf16 copies put ~4e-3 relative rounding on every chunk's update of an fp32 state that the block
kernel keeps to ~3e-7 (3e-3 state error measured under the interpreter). The cost is bandwidth: at HV=32,
DK=DV=128, fp32 w + u + P are 1.25 KB per token and head (340 MB for 8192 tokens), written once and read DV/BV
times (mostly from L2: the value tiles of a head walk the same chunks together); `scratch_dtype=torch.bfloat16`
halves it, for measurement.

Dot precision as in kernels/gdn_triton.py: dots that feed the state (k k^T, T applied to w and u, w S, k^T v_new) in
`precision` (DOT_PRECISION, tf32x3), output-only dots (q k^T, q S, P v_new) in `precision_out` (tf32). Inputs are
upcast to fp32 right after their loads (the Triton interpreter computes bf16 arithmetic wrongly). No host
synchronization: the grids come from B, max_len (a host int) and the tensor shapes. Nothing size-derived is a
kernel argument (no recompiles per step shape): lengths come from cu_seqlens on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gdn_triton import DOT_PRECISION, DOT_PRECISION_OUT, _rowmajor, _write_mode
from kernels.pdl import pdl_args, pdl_prologue

# Defaults from sm_90 compiles of this file (triton 3.7 offline, ptxas -v; DK=DV=128, bf16 in), then timed on the
# H200 (bench/kernels_gdn.py prefill, bench/NOTES.md 2026-12-01: BT=64 / BV=32 / 4 warps / blocks was the fastest):
#   phase 1: BT=64, KC=32, 4 warps: 242 registers, no spill, 32 KB shared (KC=64: 584 B spill a thread, 48 KB);
#            inverse="blocks": 255 registers, no spill, 96 KB shared (8 warps: 24 B spill); BT=32: 168, 24 KB.
#   phase 2: KS=64 pieces, 4 warps: BV=32 152 B spill, 40 KB shared; BV=64 432 B, 64 KB; BV=128 3.5 KB spill;
#            8 warps spill more (M=64 dots: each warp group holds the whole [64, KS] A operand); with
#            precision="tf32" BV=64 spills 8 B (the tf32x3 A operand is two register copies).
# BV=32 also gives HV * DV / 32 = 128 programs for one request, about one per SM.
# Recompiled 2026-12-01 (triton 3.7.1, sm_90, ptxas -v), phase 2 fused (every config at 255 registers):
#   BV=32 4 warps 2 stages 224 B spill 113 KB shared (1 stage 176 B, 40 KB); BV=32 2 warps 2.6 KB spill;
#   BV=16 4 warps 2 stages 60 B spill 97 KB (1 stage 348 B, 28 KB; 3 stages 136 B, 149 KB); BV=16 2 warps 700 B
#   (1 stage 176 B, 20 KB); BV=16 8 warps 140 B. The pressure is the [BT, KS] tf32x3 operands, not BV.
#   split, pass A (SPLIT=1): BV=16 4 warps 2 stages 255 registers no spill 60 KB (1 stage 243, 16 KB); BV=32 4 warps
#   2 stages 172 B spill 72 KB, 1 stage 247 registers no spill 24 KB; BV=16 2 warps 516 B spill (1 stage 112 B).
#   split, pass B (_chunk_out_kernel, 1 stage, no spill): BVO=64 4 warps 128 registers 32 KB; BVO=128 4 warps 176,
#   8 warps 168, 48 KB; BVO=32 104.
CHUNK2_BT = 64  # tokens per chunk (phase 1 parallel unit, phase 2 step)
CHUNK2_BV = 32  # phase 2 value tile
CHUNK2_KS = 64  # phase 2: the key dimension in pieces of KS (1 or 2 pieces): [BT, KS] operands, not [BT, DK]
CHUNK2_WARPS = 4  # phase 2
CHUNK2_STAGES = 2  # phase 2 (H200, T=4096: 1260 us against 1457 with 1 stage; 2 stages at BV=64: 145 KB shared)
PREP_WARPS = 4  # phase 1
PREP_KC = 32  # phase 1: key columns per piece of k k^T, q k^T and w
PREP_BVU = 64  # phase 1: value columns of u per dot
PREP_INVERSE = "blocks"  # phase 1's (I + A)^-1 where BT <= 64 ("rows" beyond)
STATE_PASS = "fused"  # phase 2 in one sequential launch; "split": state walk + parallel output pass
SPLIT_BVO = 64  # split: the output pass's value tile
SPLIT_OUT_WARPS = 4  # split: the output pass's warps


@triton.jit
def _block_inverse(a_base, n, s_row, BT: tl.constexpr, PS: tl.constexpr):
    """T = (I + A)^-1 [BT, BT] fp32 (BT = 16, 32 or 64) from -A (strictly lower; rows >= n are not read) stored at
    a_base + row * s_row + col, by 16x16 blocks:
    1. the NB = BT / 16 diagonal blocks are inverted together by forward substitution: 14 dependent steps on an
       [NB, 16, 16] stack, each step's rows of -A loaded from the scratch (no register row extraction);
    2. their inverses go back into the scratch over the diagonal blocks of -A and the whole [BT, BT] comes back as
       one tile: D = blockdiag(T_00, .., T_33), the off-diagonal blocks -A_IJ;
    3. merges 16 -> 32 -> 64 as full [BT, BT] tensor-core products (`precision` dots): with D block diagonal and
       N the strictly block-lower part of -A that couples the pairs being merged (blocks (1,0), (3,2), then the
       lower-left 32x32 quadrant), N D N = 0, so (D^-1 - N)^-1 = D + D (N D) exactly."""
    blk = tl.arange(0, BT // 16)[:, None, None]  # [NB, 1, 1]
    r3 = tl.arange(0, 16)[None, :, None]  # [1, 16, 1] row inside the block
    c3 = tl.arange(0, 16)[None, None, :]  # [1, 1, 16] column inside the block
    row3 = blk * 16 + r3  # [NB, 16, 1] row of the chunk
    d_ptrs = a_base + row3 * s_row + blk * 16 + c3  # [NB, 16, 16] the diagonal blocks
    y3 = tl.load(d_ptrs, mask=row3 < n, other=0.0)  # [NB, 16, 16] -A's diagonal blocks
    blk2 = tl.arange(0, BT // 16)[:, None]  # [NB, 1]
    c2 = tl.arange(0, 16)[None, :]  # [1, 16]
    # Y = T - I, strictly lower: row i of Y = -A_i + sum_j (-A_ij) Y_j, rows j < i final (rows 0, 1: -A's)
    for i in tl.static_range(2, 16):
        row2 = blk2 * 16 + i  # [NB, 1] row i of every block
        a = tl.load(a_base + row2 * s_row + blk2 * 16 + c2, mask=row2 < n, other=0.0)  # [NB, 16] rows i of -A
        a = a + tl.sum(a[:, :, None] * y3, axis=1)  # [NB, 16]
        y3 = tl.where(r3 == i, a[:, None, :], y3)
    tl.debug_barrier()  # every thread's loads of -A's diagonal blocks before they are overwritten
    tl.store(d_ptrs, y3 + (r3 == c3).to(tl.float32), mask=row3 < n)
    tl.debug_barrier()
    ti = tl.arange(0, BT)[:, None]  # [BT, 1]
    tj = tl.arange(0, BT)[None, :]  # [1, BT]
    m = tl.load(a_base + ti * s_row + tj, mask=ti < n, other=0.0)  # [BT, BT] D on the diagonal blocks, -A below
    bi = ti // 16
    bj = tj // 16
    inv = tl.where(bi == bj, m, 0.0)  # D
    if BT >= 32:  # 16 -> 32: blocks (1, 0), (3, 2)
        nl = tl.where((bi == bj + 1) & (bi % 2 == 1), m, 0.0)
        inv = inv + tl.dot(inv, tl.dot(nl, inv, input_precision=PS), input_precision=PS)
    if BT == 64:  # 32 -> 64: the lower-left quadrant
        nl = tl.where((bi >= 2) & (bj < 2), m, 0.0)
        inv = inv + tl.dot(inv, tl.dot(nl, inv, input_precision=PS), input_precision=PS)
    return inv


@triton.jit
def _chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr,
    w_ptr, u_ptr, p_ptr,  # scratch (scratch dtype): w [N, HV, DK], u [N, HV, DV], P [N, HV, BT]
    gc_ptr, fq_ptr, fk_ptr,  # scratch fp32 [N, HV]: gc, q's row factor, k's row factor
    a_ptr,  # scratch fp32 [N, HV, BT]: -A (INV == 1 only; otherwise unused)
    scale,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_gn, s_gh, s_bn, s_bh,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, BVU: tl.constexpr,
    L2NORM: tl.constexpr, PS: tl.constexpr, PO: tl.constexpr,
    INV: tl.constexpr,  # (I + A)^-1 by 0: forward substitution row by row; 1: 16x16 diagonal blocks + merges
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    hv = tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    t0 = c * BT
    if t0 < seq_len:  # programs past the request's last chunk do nothing
        n = tl.minimum(seq_len - t0, BT)
        t = tl.arange(0, BT)  # [BT]
        tm = t < n  # [BT]
        rows = bos + t0 + t.to(tl.int64)  # [BT] flat token rows
        k_rows = k_ptr + rows[:, None] * s_kn + hk * s_kh  # [BT, 1]
        q_rows = q_ptr + rows[:, None] * s_qn + hk * s_qh  # [BT, 1]
        # k k^T, q k^T and the row norms from KC-wide column pieces of the raw q, k ([BT, KC] operands: modest
        # registers and shared memory), normalised afterwards
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        ksq = tl.zeros([BT], dtype=tl.float32)
        qsq = tl.zeros([BT], dtype=tl.float32)
        for c0 in range(0, BK, KC):
            dc = c0 + tl.arange(0, KC)  # [KC]
            cm = tm[:, None] & (dc < DK)[None, :]  # [BT, KC]
            kc = tl.load(k_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
            qc = tl.load(q_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
            kk = tl.dot(kc, tl.trans(kc), kk, input_precision=PS)
            qk = tl.dot(qc, tl.trans(kc), qk, input_precision=PO)
            ksq += tl.sum(kc * kc, axis=1)
            qsq += tl.sum(qc * qc, axis=1)
        if L2NORM:
            rk = tl.rsqrt(ksq + 1e-6)  # [BT]
            rq = tl.rsqrt(qsq + 1e-6) * scale  # [BT]
        else:
            rk = tl.full([BT], 1.0, tl.float32)
            rq = tl.full([BT], 1.0, tl.float32) * scale
        g = tl.load(g_ptr + rows * s_gn + hv * s_gh, mask=tm, other=0.0).to(tl.float32)  # [BT]
        beta = tl.load(b_ptr + rows * s_bn + hv * s_bh, mask=tm, other=0.0).to(tl.float32)  # [BT]
        gc = tl.cumsum(g, axis=0)  # [BT] cumulative log decay inside the chunk (padding adds 0)
        g_last = tl.sum(g, axis=0)  # the chunk's total log decay

        ti = t[:, None]  # [BT, 1]
        tj = t[None, :]  # [1, BT]
        lower_eq = tj <= ti  # [BT, BT]
        decay = tl.exp(tl.where(lower_eq, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 above diag
        # P = causal (diagonal included) (q k^T * D) with q, k normalised and q scaled: phase 2's intra-chunk term
        p = tl.where(lower_eq, qk * rq[:, None] * rk[None, :] * decay, 0.0)  # [BT, BT]
        row_ht = rows * HV + hv  # [BT] row of (token, value head) in the scratch buffers
        tl.store(p_ptr + row_ht[:, None] * BT + tj, p.to(p_ptr.dtype.element_ty), mask=tm[:, None])
        tl.store(gc_ptr + row_ht, gc, mask=tm)
        tl.store(fq_ptr + row_ht, rq * tl.exp(gc), mask=tm)  # o's inter-chunk term uses q_raw * fq
        tl.store(fk_ptr + row_ht, rk * tl.exp(g_last - gc), mask=tm)  # the state update uses k_raw * fk

        y = tl.where(tj < ti, -(beta[:, None] * kk * rk[:, None] * rk[None, :] * decay), 0.0)  # [BT, BT] = -A
        if INV == 0:
            # Y = (I + A)^-1 - I, strictly lower; row i of Y = -A_i + sum_j (-A_ij) Y_j, rows j < i already final
            for i in range(2, n):
                a = tl.sum(tl.where(ti == i, y, 0.0), axis=0)  # [BT] row i of -A
                a = a + tl.sum(a[:, None] * y, axis=0)
                y = tl.where(ti == i, a[None, :], y)
            inv = y + (ti == tj).to(tl.float32)  # [BT, BT] T = (I + A)^-1
        else:
            # -A goes through the scratch (this program's rows only) so that its rows and 16x16 blocks can be
            # read back as separate tiles; then the block inverse (see _block_inverse)
            a_rows = a_ptr + row_ht[:, None] * BT  # [BT, 1]
            tl.store(a_rows + tj, y, mask=tm[:, None])
            tl.debug_barrier()  # the stores of every thread before any load of them
            inv = _block_inverse(a_ptr + ((bos + t0) * HV + hv) * BT, n, HV * BT, BT, PS)  # [BT, BT]

        fw = rk * beta * tl.exp(gc)  # [BT] w = T (k_raw * fw)
        for c0 in range(0, BK, KC):
            dc = c0 + tl.arange(0, KC)  # [KC]
            cm = tm[:, None] & (dc < DK)[None, :]  # [BT, KC]
            kc = tl.load(k_rows + dc[None, :], mask=cm, other=0.0).to(tl.float32)  # [BT, KC]
            w = tl.dot(inv, kc * fw[:, None], input_precision=PS)  # [BT, KC]
            tl.store(w_ptr + row_ht[:, None] * DK + dc[None, :], w.to(w_ptr.dtype.element_ty), mask=cm)
        for v0 in range(0, DV, BVU):
            dv = v0 + tl.arange(0, BVU)  # [BVU]
            vm = tm[:, None] & (dv < DV)[None, :]  # [BT, BVU]
            v = tl.load(v_ptr + rows[:, None] * s_vn + hv * s_vh + dv[None, :], mask=vm, other=0.0).to(tl.float32)
            u = tl.dot(inv, v * beta[:, None], input_precision=PS)  # [BT, BVU]
            tl.store(u_ptr + row_ht[:, None] * DV + dv[None, :], u.to(u_ptr.dtype.element_ty), mask=vm)


@triton.jit
def _rows_tile(ptr, row_off, cols, tm, NCOLS: tl.constexpr):
    """[BT, KS] fp32 tile: rows at ptr + row_off (pointer offsets [BT]), columns `cols` (< NCOLS), rows where tm."""
    return tl.load(ptr + row_off[:, None] + cols[None, :], mask=tm[:, None] & (cols < NCOLS)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _chunk_state_kernel(
    q_ptr, k_ptr, o_ptr, cu_ptr, w_ptr, u_ptr, p_ptr, gc_ptr, fq_ptr, fk_ptr, state_ptr, slots_ptr, wmask_ptr,
    h_ptr,  # SPLIT only: chunk-start states [N // BT + B, HV, DK, DV] (h dtype); otherwise unused
    s_qn, s_qh, s_kn, s_kh, s_on, s_oh, s_ss, s_sh, s_sk,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, KS: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    WRITE: tl.constexpr,  # 0: never write the final state, 1: always, 2: where wmask[b]
    PS: tl.constexpr, PO: tl.constexpr,
    SPLIT: tl.constexpr = 0,  # 1: the state walk alone (pass A of state_pass="split"): no o; every chunk's start
    # state goes to h[bos // BT + b + c] and v_new over u (in place), for _chunk_out_kernel
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """The state tile is held as NK (1 or 2) pieces S0, S1 [KS, BV] of its DK rows, and every [BT, DK] operand is
    loaded and multiplied piece by piece, so that no [BT, DK] fp32 tile (two of them for a tf32x3 operand) is held
    in registers at once. q and k come raw (input dtype) times phase 1's row factors fq, fk."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    if seq_len > 0:  # a request of no tokens reads and writes nothing (its state is unchanged either way)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        t = tl.arange(0, BT)  # [BT]
        d0 = tl.arange(0, KS)  # [KS] key rows of piece 0
        d1 = KS + tl.arange(0, KS)  # [KS] key rows of piece 1 (NK == 2)
        dv = v0 + tl.arange(0, BV)  # [BV]
        vmask = dv < DV
        s_base = state_ptr + slot * s_ss + hv * s_sh
        S0 = tl.load(s_base + d0[:, None] * s_sk + dv[None, :], mask=(d0 < DK)[:, None] & vmask[None, :],
                     other=0.0)  # [KS, BV] fp32
        S1 = tl.zeros([KS, BV], dtype=tl.float32)
        if NK == 2:
            S1 = tl.load(s_base + d1[:, None] * s_sk + dv[None, :], mask=(d1 < DK)[:, None] & vmask[None, :],
                         other=0.0)  # [KS, BV]
        h_base = h_ptr + ((bos // BT + b) * HV + hv) * (DK * DV)  # this request's first chunk-start state
        for t0 in range(0, seq_len, BT):
            n = tl.minimum(seq_len - t0, BT)
            tm = t < n  # [BT]
            rows = bos + t0 + t.to(tl.int64)  # [BT]
            row_ht = rows * HV + hv  # [BT]
            vm = tm[:, None] & vmask[None, :]  # [BT, BV]
            if SPLIT:  # the chunk-start state, for the output pass
                h_c = h_base + (t0 // BT) * (HV * DK * DV)
                tl.store(h_c + d0[:, None] * DV + dv[None, :], S0.to(h_ptr.dtype.element_ty),
                         mask=(d0 < DK)[:, None] & vmask[None, :])
                if NK == 2:
                    tl.store(h_c + d1[:, None] * DV + dv[None, :], S1.to(h_ptr.dtype.element_ty),
                             mask=(d1 < DK)[:, None] & vmask[None, :])
            # v_new = u - w S
            u_ptrs = u_ptr + row_ht[:, None] * DV + dv[None, :]  # [BT, BV]
            u = tl.load(u_ptrs, mask=vm, other=0.0).to(tl.float32)  # [BT, BV]
            ws = tl.dot(_rows_tile(w_ptr, row_ht * DK, d0, tm, DK), S0, input_precision=PS)  # [BT, BV]
            if NK == 2:
                ws = tl.dot(_rows_tile(w_ptr, row_ht * DK, d1, tm, DK), S1, ws, input_precision=PS)
            v_new = u - ws  # [BT, BV]
            if SPLIT:
                tl.store(u_ptrs, v_new.to(u_ptr.dtype.element_ty), mask=vm)  # over u: read by this program only
            else:
                # o = (q exp(gc)) S + P v_new
                fq = tl.load(fq_ptr + row_ht, mask=tm, other=0.0)  # [BT]
                q_off = rows * s_qn + hk * s_qh  # [BT]
                o = tl.dot(_rows_tile(q_ptr, q_off, d0, tm, DK) * fq[:, None], S0, input_precision=PO)  # [BT, BV]
                if NK == 2:
                    o = tl.dot(_rows_tile(q_ptr, q_off, d1, tm, DK) * fq[:, None], S1, o, input_precision=PO)
                p = tl.load(p_ptr + row_ht[:, None] * BT + t[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
                o = tl.dot(p, v_new, o, input_precision=PO)  # [BT, BV]
                tl.store(o_ptr + rows[:, None] * s_on + hv * s_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                         mask=vm)
            # S <- exp(g_last) S + (k exp(g_last - gc))^T v_new
            g_last = tl.load(gc_ptr + (bos + t0 + n - 1) * HV + hv)  # the chunk's total log decay
            eg = tl.exp(g_last)
            fk = tl.load(fk_ptr + row_ht, mask=tm, other=0.0)  # [BT]
            k_off = rows * s_kn + hk * s_kh  # [BT]
            S0 = tl.dot(tl.trans(_rows_tile(k_ptr, k_off, d0, tm, DK) * fk[:, None]), v_new, S0 * eg,
                        input_precision=PS)  # [KS, BV]
            if NK == 2:
                S1 = tl.dot(tl.trans(_rows_tile(k_ptr, k_off, d1, tm, DK) * fk[:, None]), v_new, S1 * eg,
                            input_precision=PS)
        if WRITE == 2:
            do_write = tl.load(wmask_ptr + b) != 0
        else:
            do_write = WRITE == 1
        if do_write:
            tl.store(s_base + d0[:, None] * s_sk + dv[None, :], S0, mask=(d0 < DK)[:, None] & vmask[None, :])
            if NK == 2:
                tl.store(s_base + d1[:, None] * s_sk + dv[None, :], S1, mask=(d1 < DK)[:, None] & vmask[None, :])


@triton.jit
def _chunk_out_kernel(
    q_ptr, o_ptr, cu_ptr, u_ptr, p_ptr, fq_ptr, h_ptr,
    s_qn, s_qh, s_on, s_oh,
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, KS: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    PO: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """Pass B of state_pass="split", one program per (request, chunk, value head x value tile), all in parallel:
    o = (q_raw fq) h_c + P v_new with h_c the chunk-start state and v_new (in u's scratch) from pass A. The key
    dimension in NK pieces of KS (as in _chunk_state_kernel: [BT, KS] operands)."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    hv = tl.program_id(2) // NV
    v0 = (tl.program_id(2) % NV) * BV
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    t0 = c * BT
    if t0 < seq_len:  # programs past the request's last chunk do nothing
        n = tl.minimum(seq_len - t0, BT)
        t = tl.arange(0, BT)  # [BT]
        tm = t < n
        rows = bos + t0 + t.to(tl.int64)  # [BT]
        row_ht = rows * HV + hv  # [BT]
        dv = v0 + tl.arange(0, BV)  # [BV]
        vmask = dv < DV
        vm = tm[:, None] & vmask[None, :]  # [BT, BV]
        h_c = h_ptr + ((bos // BT + b + c) * HV + hv) * (DK * DV)
        fq = tl.load(fq_ptr + row_ht, mask=tm, other=0.0)  # [BT]
        q_off = rows * s_qn + hk * s_qh  # [BT]
        p = tl.load(p_ptr + row_ht[:, None] * BT + t[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        v_new = tl.load(u_ptr + row_ht[:, None] * DV + dv[None, :], mask=vm, other=0.0).to(tl.float32)  # [BT, BV]
        o = tl.dot(p, v_new, input_precision=PO)  # [BT, BV]
        for i in tl.static_range(NK):
            d = i * KS + tl.arange(0, KS)  # [KS]
            h = tl.load(h_c + d[:, None] * DV + dv[None, :], mask=(d < DK)[:, None] & vmask[None, :],
                        other=0.0).to(tl.float32)  # [KS, BV]
            o = tl.dot(_rows_tile(q_ptr, q_off, d, tm, DK) * fq[:, None], h, o, input_precision=PO)
        tl.store(o_ptr + rows[:, None] * s_on + hv * s_oh + dv[None, :], o.to(o_ptr.dtype.element_ty), mask=vm)


def gdn_chunk2_triton(
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
    bt: int = CHUNK2_BT,
    bv: int = CHUNK2_BV,
    ks: int = CHUNK2_KS,
    num_warps: int = CHUNK2_WARPS,
    num_stages: int = CHUNK2_STAGES,
    prep_warps: int = PREP_WARPS,
    prep_stages: int = 1,
    bvu: int = PREP_BVU,
    kc: int = PREP_KC,
    scratch_dtype: torch.dtype | str = torch.float32,  # w, u, P (a name: "bfloat16")
    precision: str | None = None,
    precision_out: str | None = None,
    inverse: str | None = None,  # phase 1's (I + A)^-1: "rows" (forward substitution), "blocks" (16x16 blocks)
    # or None: PREP_INVERSE up to BT = 64, "rows" beyond
    only_prep: bool = False,  # measurement: run phase 1 alone (o is left unwritten, the state untouched)
    state_pass: str = STATE_PASS,  # phase 2: "fused" (one sequential launch) or "split" (state walk + output pass)
    bvo: int = SPLIT_BVO,  # split: the output pass's value tile
    out_warps: int = SPLIT_OUT_WARPS,  # split: the output pass's warps
    h_dtype: torch.dtype | str | None = None,  # split: the chunk-start states' dtype (None: scratch_dtype)
    only_walk: bool = False,  # measurement (split): phase 1 and the state walk, not the output pass
) -> Tensor:
    """gdn_chunk_ref in two launches (parallel UT transform per chunk, then the sequential state pass): o [N, HV,
    DV] in v's dtype; the keyword-only arguments are tile sizes / launch options for measurement."""
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    scale = float(scale) if scale is not None else k.shape[-1] ** -0.5
    n_tok, heads_k, dim_k = k.shape
    heads_v, dim_v = v.shape[1], v.shape[2]
    assert heads_v % heads_k == 0 and state.shape[1:] == (heads_v, dim_k, dim_v) and state.dtype == torch.float32
    assert state.stride(-1) == 1 and bt >= 16 and bt == triton.next_power_of_2(bt)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [N, HV, DV]
    bsz = slots.shape[0]
    if bsz == 0 or n_tok == 0 or max_len <= 0:
        return o
    write, wmask = _write_mode(write_state, slots)
    bk = max(16, triton.next_power_of_2(dim_k))
    bv = min(bv, max(16, triton.next_power_of_2(dim_v)))
    bvu = min(bvu, max(16, triton.next_power_of_2(dim_v)))
    ks, kc = min(ks, bk), min(kc, bk)
    nk = triton.cdiv(bk, ks)
    if inverse is None:
        inverse = PREP_INVERSE if bt <= 64 else "rows"
    assert inverse in ("rows", "blocks") and (inverse == "rows" or bt <= 64), (inverse, bt)
    assert nk <= 2, f"the key dimension {dim_k} is at most two pieces of ks={ks}"
    assert state_pass in ("fused", "split"), state_pass
    prec, prec_out = precision or DOT_PRECISION, precision_out or DOT_PRECISION_OUT
    scratch_dtype = getattr(torch, scratch_dtype) if isinstance(scratch_dtype, str) else scratch_dtype
    dev = v.device
    w_s = torch.empty(n_tok, heads_v, dim_k, dtype=scratch_dtype, device=dev)  # [N, HV, DK]
    u_s = torch.empty(n_tok, heads_v, dim_v, dtype=scratch_dtype, device=dev)  # [N, HV, DV]
    p_s = torch.empty(n_tok, heads_v, bt, dtype=scratch_dtype, device=dev)  # [N, HV, BT]
    gc_s, fq_s, fk_s = torch.empty(3, n_tok, heads_v, dtype=torch.float32, device=dev)  # [N, HV] each
    blocks = inverse == "blocks"
    a_s = torch.empty(n_tok, heads_v, bt, dtype=torch.float32, device=dev) if blocks else gc_s  # -A [N, HV, BT]
    _chunk_prep_kernel[(bsz, triton.cdiv(max_len, bt), heads_v)](
        q, k, v, g, beta, cu_seqlens, w_s, u_s, p_s, gc_s, fq_s, fk_s, a_s, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1),
        HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BT=bt, BK=bk, KC=kc, BVU=bvu, L2NORM=use_qk_l2norm, PS=prec,
        PO=prec_out, INV=int(blocks), num_warps=prep_warps, num_stages=prep_stages,
        **pdl_args(q.device),
    )
    if only_prep:
        return o
    split = state_pass == "split"
    h_s = gc_s  # chunk-start states (split): [N // BT + B, HV, DK, DV], request b's chunk c at bos // BT + b + c
    if split:
        h_dtype = getattr(torch, h_dtype) if isinstance(h_dtype, str) else (h_dtype or scratch_dtype)
        h_s = torch.empty(n_tok // bt + bsz, heads_v, dim_k, dim_v, dtype=h_dtype, device=dev)
    _chunk_state_kernel[(bsz, heads_v, triton.cdiv(dim_v, bv))](
        q, k, o, cu_seqlens, w_s, u_s, p_s, gc_s, fq_s, fk_s, state, slots, wmask, h_s,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BT=bt, KS=ks, NK=nk, BV=bv, WRITE=write, PS=prec, PO=prec_out,
        SPLIT=int(split), num_warps=num_warps, num_stages=num_stages,
        **pdl_args(q.device),
    )
    if split and not only_walk:
        bvo = min(bvo, max(16, triton.next_power_of_2(dim_v)))
        nvo = triton.cdiv(dim_v, bvo)
        _chunk_out_kernel[(bsz, triton.cdiv(max_len, bt), heads_v * nvo)](
            q, o, cu_seqlens, u_s, p_s, fq_s, h_s,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1),
            HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, BT=bt, KS=ks, NK=nk, BV=bvo, NV=nvo, PO=prec_out,
            num_warps=out_warps, num_stages=1,
            **pdl_args(q.device),
        )
    return o
