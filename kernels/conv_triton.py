"""Short causal depthwise conv1d + SiLU over a ragged batch, and its commit, in Triton.

Same signatures and semantics as kernels/conv.py (the references `causal_conv1d_ref`, `conv_commit_ref`).
Per request, `full` = its window of the last K-1 inputs ([C, K-1], a slot of `conv_state`) followed by its T_i
new inputs; output t = silu(sum_j w[:, j] * full[t + j]); the new window is full[L : L + K-1] with L = T_i
(forward with write_state) or L = keep_lens[i] (commit).

Grid of `causal_conv1d_triton`: (request, BT-token tile, BC-channel tile), all tokens in parallel. Only the
token tile 0 reads the old window (t + j < K-1 happens only for t < K-1 <= BT), and that same program writes the
new one after a barrier, so no program can read a window that another one already moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from kernels.pdl import pdl_args, pdl_prologue

CONV_BT = 16
CONV_BC = 256
CONV_BC_DECODE = 64  # not measured yet (after the 2026-11-30 runs)


@triton.jit
def _window_values(x_ptr, win_ptr, bos, pos, seq_len, c, cmask, s_xn, s_wc, s_wk, KW: tl.constexpr):
    """full[pos] for pos [R] (full = window ++ x) and channels c [BC] -> [R, BC] in x's dtype."""
    in_win = pos < KW
    in_x = (pos >= KW) & (pos < KW + seq_len)
    w = tl.load(win_ptr + c[None, :] * s_wc + pos[:, None] * s_wk, mask=in_win[:, None] & cmask[None, :], other=0.0)
    xrow = (bos + pos - KW).to(tl.int64)
    xv = tl.load(x_ptr + xrow[:, None] * s_xn + c[None, :], mask=in_x[:, None] & cmask[None, :], other=0.0)
    return tl.where(in_win[:, None], w.to(x_ptr.dtype.element_ty), xv)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, o_ptr, cu_ptr, win_ptr, slots_ptr, wmask_ptr,
    s_xn, s_wtc, s_wtk, s_on, s_ws, s_wc, s_wk, C,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKW: tl.constexpr, WRITE: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    tb = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC]
    cmask = c < C
    KW: tl.constexpr = K - 1
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    win = win_ptr + slot * s_ws
    t = tb * BT + tl.arange(0, BT)  # [BT] output positions
    if tb * BT < seq_len:
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + c * s_wtc + j * s_wtk, mask=cmask, other=0.0).to(tl.float32)  # [BC]
            xj = _window_values(x_ptr, win, bos, t + j, seq_len, c, cmask, s_xn, s_wc, s_wk, KW)  # [BT, BC]
            acc += xj.to(tl.float32) * wj[None, :]
        out = acc * tl.sigmoid(acc)
        rows = (bos + t).to(tl.int64)
        tl.store(o_ptr + rows[:, None] * s_on + c[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(t < seq_len)[:, None] & cmask[None, :])
    if WRITE != 0:
        if tb == 0:
            do_write = seq_len > 0
            if WRITE == 2:
                do_write = do_write & (tl.load(wmask_ptr + b) != 0)
            if do_write:
                p = tl.arange(0, BKW)  # [BKW]
                new = _window_values(x_ptr, win, bos, seq_len + p, seq_len, c, cmask, s_xn, s_wc, s_wk, KW)
                tl.debug_barrier()  # every read of the old window in this program is done
                tl.store(win + c[None, :] * s_wc + p[:, None] * s_wk, new.to(win_ptr.dtype.element_ty),
                         mask=(p < KW)[:, None] & cmask[None, :])


@triton.jit
def _conv_commit_kernel(
    x_ptr, cu_ptr, keep_ptr, win_ptr, slots_ptr, s_xn, s_ws, s_wc, s_wk, C,
    KW: tl.constexpr, BC: tl.constexpr, BKW: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = (tl.load(cu_ptr + b + 1).to(tl.int64) - bos).to(tl.int32)
    keep = tl.minimum(tl.load(keep_ptr + b).to(tl.int32), seq_len)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    win = win_ptr + slot * s_ws
    if keep > 0:
        p = tl.arange(0, BKW)
        new = _window_values(x_ptr, win, bos, keep + p, seq_len, c, cmask, s_xn, s_wc, s_wk, KW)  # [BKW, BC]
        tl.debug_barrier()
        tl.store(win + c[None, :] * s_wc + p[:, None] * s_wk, new.to(win_ptr.dtype.element_ty),
                 mask=(p < KW)[:, None] & cmask[None, :])


def causal_conv1d_triton(
    x: Tensor,  # [N, C] new inputs of all requests
    weight: Tensor,  # [C, K]
    cu_seqlens: Tensor,  # [B+1] int32
    conv_state: Tensor,  # [S, C, K-1] pool of windows
    slots: Tensor,  # [B] int64
    max_len: int,  # max T_i (host int)
    write_state: bool | Tensor = True,  # or a [B] bool mask
) -> Tensor:
    """Same as causal_conv1d_ref: silu(conv(window ++ x)) for every new row, [N, C] in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_c, kernel = weight.shape
    # contiguous whatever x's row stride (empty_like would keep a one-row view's fused-projection stride: another
    # compile key for N == 1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [N, C]
    if isinstance(write_state, Tensor):
        write, wmask = 2, write_state.to(torch.bool).view(torch.uint8)
    else:
        write, wmask = (1 if write_state else 0), slots
    bsz = slots.shape[0]
    if bsz == 0 or max_len == 0:
        return out
    if max_len == 1:  # decode: one row per request; narrower channel tiles give the GPU 4x the programs (the
        # 16 x 256 tile took 5.1 us per layer at B=1 on the H200 for ~50 KB of data: bench/NOTES.md)
        bt, bc = triton.next_power_of_2(kernel - 1), CONV_BC_DECODE
    else:
        bt, bc = max(CONV_BT, triton.next_power_of_2(kernel - 1)), CONV_BC
    grid = (bsz, triton.cdiv(max_len, bt), triton.cdiv(num_c, bc))
    _causal_conv1d_kernel[grid](
        x, weight, out, cu_seqlens, conv_state, slots, wmask,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), num_c,
        K=kernel, BT=bt, BC=bc, BKW=max(2, triton.next_power_of_2(kernel - 1)), WRITE=write, num_warps=4,
        **pdl_args(x.device),
    )
    return out


def conv_commit_triton(
    x: Tensor,  # [N, C] the verified block's conv inputs
    cu_seqlens: Tensor,  # [B+1] int32
    keep_lens: Tensor,  # [B] inputs of each block to commit (0..T_i)
    conv_state: Tensor,  # [S, C, K-1] pool, holding each request's window before the block
    slots: Tensor,  # [B] int64
    max_len: int,
) -> None:
    """Same as conv_commit_ref: moves each window over exactly its first keep_lens[i] inputs (one launch)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    bsz, num_c, width = slots.shape[0], conv_state.shape[1], conv_state.shape[2]
    if bsz == 0:
        return
    grid = (bsz, triton.cdiv(num_c, CONV_BC))
    _conv_commit_kernel[grid](
        x, cu_seqlens, keep_lens, conv_state, slots, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), num_c,
        KW=width, BC=CONV_BC, BKW=max(2, triton.next_power_of_2(width)), num_warps=4,
        **pdl_args(x.device),
    )
