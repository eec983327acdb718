"""One Gated DeltaNet layer's decode step (every request 0 or 1 new token) in one Triton launch.

Same signature and semantics as kernels/gdn_decode.py (`gdn_decode_ref`: causal conv + SiLU with the window
update, the gates from the raw a/b projections, q/k L2 norm, one delta-rule step on state[slots], the gated RMSNorm
of every value head), rounding where the four kernels of the general path round (the conv output, beta and o to
the activation dtype; the norm as kernels/norm_triton.py); with DECODE_SHORT_CHAIN the delta rule's fp32 sums run in
another order (o and the new state equal the chain's up to fp32 rounding). Nothing synchronizes with the host
(graph-capturable).

A program owns (request b, value head hv, BV-wide value tile vt) and reads its [DK, BV] fp32 state tile once,
writes it once. Its inputs: the DK q and k channels of its key head hk = hv // G (G = HV / HK), its BV v channels,
a and b of its head. It runs the conv of those channels itself (the window and x are a few hundred bytes).

Who writes what:
  * v channels' conv window and the state tile: their one owner program.
  * q/k channels' conv window: shared by the G * NT programs of key head hk (NT = DV / BV tiles); each reads the
    old window, and the LAST of them to finish (an atomic counter per (request, key head): barrier, then one
    acq_rel atomic add; the program that sees G*NT - 1 writes, and resets the counter to 0 for the next launch)
    writes the new one. No program waits for another, so any number of programs and any schedule is safe.
  * the gated RMSNorm needs all DV outputs of a value head: with BV = DV (NT = 1) the program has them and the
    norm runs in place. With BV < DV each program stores its o tile unnormalised into the output and the last
    program of the key head group (the same counter) normalises the G heads in place from L2 (NORM=2); or the
    norm runs as the separate kernels/norm_triton.py launch (norm="separate", NORM=0).
Counters: a zeroed int32 buffer per state pool ([B * HK] used), kept for the process (graphs bake its address);
every launch leaves it zero. The write rule (True / False / a [B] mask) and whether the commit's block inputs are
stored are runtime arguments: the eager and the graph-captured calls share one compile per value tile.

Programs: B * HV * NT. At B=1 on the 35B-A3B shapes (HV=32) BV=128 gives 32 programs, each moving 128 KB of state
(64 KB in, 64 KB out) through one SM: about 1 us of one SM's bandwidth plus the DRAM latency; BV=32 gives 128
programs of 32 KB (one per SM) for the cost of the counter atomic (one L2 round trip) and an L2 re-read of the
head's 256 B of o. `_auto_bv` takes BV = 32 (DECODE_AUTO_BV, measured);
bench/kernels_gdn_decode.py measures every choice.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gdn_decode import decode_heads
from kernels.pdl import early_reads, pdl_args, pdl_prologue

# measured on the H200 (bench/kernels_gdn_decode.py sweeps BV and the norm placement; see _auto_bv)
DECODE_AUTO_BV = 32
DECODE_BV = int(os.environ.get("HYBRIDSPEC_GDN_DECODE_BV", "0"))  # 0: _auto_bv
DECODE_NORM = os.environ.get("HYBRIDSPEC_GDN_DECODE_NORM", "fused")  # "fused" (in the kernel) or "separate"
# With PDL, inside a CUDA-graph capture (kernels/pdl.py early_reads), the kernel reads cu_seqlens, slots and its state
# tile (the longest load) before its prologue, while the kernel launched just before it finishes: that kernel must
# write none of them. In a captured step a decode follows its layer's input projection; the graph unpacks cu_seqlens
# and slots in its first kernels, and state resets and commits run outside the step's forward graph.
# HYBRIDSPEC_GDN_DECODE_EARLY=0 (read at import): every read after the prologue.
EARLY_STATE_READS = os.environ.get("HYBRIDSPEC_GDN_DECODE_EARLY", "1") == "1"
# The output from the old state (e^g S^T qn + (kn . qn) delta: both sums over DK in one pass, then o) instead of
# S^T qn after the update (the chain's order: o and the state equal up to fp32 rounding), and with NORM 2 every program
# loads its group's z and norm weight before the counter, so the last one's tail is the counter, o and the norm.
# HYBRIDSPEC_GDN_DECODE_SHORT=0 (read at import; step_ab: kernels.gdn_decode_triton.DECODE_SHORT_CHAIN=0,1) turns it
# off. Measured on an H100 (5d8ded4, bench/NOTES.md 2026-12-06 23:28): the kernel alone is no faster (6.28 / 6.47 us a
# layer at B=1, 3% slower where the four-kernel chain moved 1.7% between the two processes); in the B=1 step with
# moe_triton.MOE_SHARED_EARLY on it was faster than without in both rounds (2.976 against 2.989 / 3.022 ms), and the two
# together in 6 of 6 rounds against neither
DECODE_SHORT_CHAIN = os.environ.get("HYBRIDSPEC_GDN_DECODE_SHORT", "1") == "1"


@triton.jit
def _conv_channels(xrow_ptr, cw_ptr, win_ptr, c, cmask, s_cwc, s_cwk, s_csc, s_csk,
                   KW: tl.constexpr, BKW: tl.constexpr):
    """Conv + SiLU of channels c [BC] for one token: (output [BC] fp32 holding x-dtype values, the new window
    [BC, BKW] = old window shifted by one with x last). The taps are 1-D loads: a [BC, BKW] tile's layout would
    spread into the state tile's (a 64 KB layout conversion through shared memory, measured offline)."""
    dt = xrow_ptr.dtype.element_ty
    xv = tl.load(xrow_ptr + c, mask=cmask, other=0.0)  # [BC]
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(KW):  # in tap order, as kernels/conv_triton.py sums them
        xj = tl.load(win_ptr + c * s_csc + j * s_csk, mask=cmask, other=0.0).to(dt).to(tl.float32)
        acc += xj * tl.load(cw_ptr + c * s_cwc + j * s_cwk, mask=cmask, other=0.0).to(tl.float32)
    acc += xv.to(tl.float32) * tl.load(cw_ptr + c * s_cwc + KW * s_cwk, mask=cmask, other=0.0).to(tl.float32)
    out = (acc * tl.sigmoid(acc)).to(dt).to(tl.float32)
    p = tl.arange(0, BKW)  # [BKW] window positions
    shifted = tl.load(win_ptr + c[:, None] * s_csc + (p[None, :] + 1) * s_csk,
                      mask=cmask[:, None] & (p + 1 < KW)[None, :], other=0.0)  # [BC, BKW] old window[p + 1]
    new = tl.where((p == KW - 1)[None, :], xv[:, None].to(shifted.dtype), shifted)
    return out, new


@triton.jit
def _store_window(win_ptr, c, cmask, new, s_csc, s_csk, KW: tl.constexpr, BKW: tl.constexpr):
    p = tl.arange(0, BKW)
    tl.store(win_ptr + c[:, None] * s_csc + p[None, :] * s_csk, new.to(win_ptr.dtype.element_ty),
             mask=cmask[:, None] & (p < KW)[None, :])


@triton.jit
def _gated_norm(o, zz, w, eps, out_ptr, D: tl.constexpr, AXIS: tl.constexpr):
    """kernels/norm_triton.py's gated RMSNorm of o (fp32 holding values of out_ptr's dtype) along AXIS, with its
    roundings."""
    dt = out_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=AXIS) / D + eps)
    if AXIS == 0:
        y = (o * rstd).to(dt)
    else:
        y = (o * rstd[:, None]).to(dt)
    y = (w.to(tl.float32) * y.to(tl.float32)).to(dt)
    silu = zz / (1.0 + tl.exp(-zz))
    return (y.to(tl.float32) * silu).to(dt)


@triton.jit(do_not_specialize=["write", "keep", "early"])
def _gdn_decode_kernel(
    x_ptr, z_ptr, a_ptr, b_ptr, cw_ptr, na_ptr, dtb_ptr, nw_ptr, o_ptr, cu_ptr, cs_ptr, st_ptr, slots_ptr,
    wmask_ptr, ctr_ptr, mx_ptr, g_ptr, beta_ptr, scale, eps,
    s_xn, s_zn, s_an, s_bn, s_cwc, s_cwk, s_on, s_css, s_csc, s_csk, s_ss, s_sh, s_sk, s_mxn,
    write,  # 0: nothing written, 1: always, 2: where wmask[b] (runtime: one compile for the eager and graph calls)
    keep,  # 1: also store the conv output, g and beta (a commit's block inputs)
    early,  # 1: cu_seqlens, slots and the state tile are read before the PDL prologue (kernels/pdl.py), 0: after
    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BKW: tl.constexpr, GP: tl.constexpr,
    NORM: tl.constexpr,  # 0: o unnormalised (norm launched after), 1: in the program (BV == DV), 2: last program
    SHORT: tl.constexpr,  # o from the old state (DECODE_SHORT_CHAIN), else after the update, as the chain
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    if early == 0:
        pdl_prologue(PDL)
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vt = tl.program_id(2)
    G: tl.constexpr = HV // HK
    NT: tl.constexpr = DV // BV
    hk = hv // G
    bos = tl.load(cu_ptr + b).to(tl.int64)
    seq_len = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    if seq_len > 0:  # one token (row bos); a request of none (a graph bucket's idle one) reads and writes nothing
        dt = o_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + b).to(tl.int64)
        dk = tl.arange(0, BK)
        kmask = dk < DK
        dv = vt * BV + tl.arange(0, BV)  # [BV] (DV % BV == 0)
        s_ptrs = st_ptr + slot * s_ss + hv * s_sh + dk[:, None] * s_sk + dv[None, :]  # [BK, BV]
        S = tl.load(s_ptrs, mask=kmask[:, None], other=0.0)  # fp32 state tile, first: the longest load
        if early != 0:
            pdl_prologue(PDL)
        xrow = x_ptr + bos * s_xn
        win = cs_ptr + slot * s_css
        cq = hk * DK + dk
        ck = HK * DK + hk * DK + dk
        cv = 2 * HK * DK + hv * DV + dv
        vmask = dv < DV
        q, q_win = _conv_channels(xrow, cw_ptr, win, cq, kmask, s_cwc, s_cwk, s_csc, s_csk, KW, BKW)
        k, k_win = _conv_channels(xrow, cw_ptr, win, ck, kmask, s_cwc, s_cwk, s_csc, s_csk, KW, BKW)
        v, v_win = _conv_channels(xrow, cw_ptr, win, cv, vmask, s_cwc, s_cwk, s_csc, s_csk, KW, BKW)
        # gates (kernels/elementwise_triton.py's roundings: g fp32, beta in b's dtype)
        za = tl.load(a_ptr + bos * s_an + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
        softplus = tl.where(za > 20.0, za, tl.log(1.0 + tl.exp(tl.minimum(za, 20.0))))
        g = tl.load(na_ptr + hv).to(tl.float32) * softplus
        braw = tl.load(b_ptr + bos * s_bn + hv)
        beta = (1.0 / (1.0 + tl.exp(-braw.to(tl.float32)))).to(braw.dtype)
        if keep != 0:
            tl.store(mx_ptr + bos * s_mxn + cv, v.to(mx_ptr.dtype.element_ty), mask=vmask)
            if vt == 0:
                tl.store(g_ptr + bos * HV + hv, g)
                tl.store(beta_ptr + bos * HV + hv, beta)
                if hv % G == 0:
                    tl.store(mx_ptr + bos * s_mxn + cq, q.to(mx_ptr.dtype.element_ty), mask=kmask)
                    tl.store(mx_ptr + bos * s_mxn + ck, k.to(mx_ptr.dtype.element_ty), mask=kmask)
        if NORM == 2:  # the group's z rows and the norm weight, in case this program is the group's last
            gi = tl.arange(0, GP)
            d = tl.arange(0, DV)
            hm = (gi < G)[:, None] & (d < DV)[None, :]
            cols = (hk * G + gi)[:, None] * DV + d[None, :]  # [GP, DV]
            zz_g = tl.load(z_ptr + bos * s_zn + cols, mask=hm, other=0.0).to(tl.float32)
            w_g = tl.load(nw_ptr + d)
        qn = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        qn = qn * scale
        kn = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        if SHORT:
            # o from the old state: S' = e^g S + kn delta^T, so o = S'^T qn = e^g (S^T qn) + (kn . qn) delta, and
            # both sums over DK read the old S at once (one reduction level fewer before o than the order below)
            eg = tl.exp(g)
            sk = tl.sum(S * kn[:, None], axis=0)  # [BV]
            sq = tl.sum(S * qn[:, None], axis=0)  # [BV]
            delta = (v - eg * sk) * beta.to(tl.float32)  # [BV]
            S = S * eg + kn[:, None] * delta[None, :]
            o = (eg * sq + tl.sum(kn * qn, axis=0) * delta).to(dt).to(tl.float32)  # [BV], rounded as the chain's o
        else:  # the delta rule (kernels/gdn_triton.py _gdn_seq_kernel's order of operations)
            S = S * tl.exp(g)
            delta = (v - tl.sum(S * kn[:, None], axis=0)) * beta.to(tl.float32)  # [BV]
            S = S + kn[:, None] * delta[None, :]
            o = tl.sum(S * qn[:, None], axis=0).to(dt).to(tl.float32)  # [BV], rounded as the chain's o
        do_write = write == 1
        if write == 2:
            do_write = tl.load(wmask_ptr + b) != 0
        if do_write:
            tl.store(s_ptrs, S, mask=kmask[:, None])
        orow = o_ptr + bos * s_on
        if NORM == 1:
            zz = tl.load(z_ptr + bos * s_zn + hv * DV + dv).to(tl.float32)
            w = tl.load(nw_ptr + dv)
            tl.store(orow + hv * DV + dv, _gated_norm(o, zz, w, eps, o_ptr, DV, 0))
        else:
            tl.store(orow + hv * DV + dv, o.to(dt))
        if do_write:
            tl.debug_barrier()  # every read of the old window in this program is done
            _store_window(win, cv, vmask, v_win, s_csc, s_csk, KW, BKW)
            if G * NT == 1:  # q/k channels are this program's alone
                _store_window(win, cq, kmask, q_win, s_csc, s_csk, KW, BKW)
                _store_window(win, ck, kmask, k_win, s_csc, s_csk, KW, BKW)
        if G * NT > 1:
            if NORM == 2:
                need = True
            else:
                need = do_write
            if need:  # the last program of key head hk's group writes the shared window (and NORM 2: the norm)
                tl.debug_barrier()  # this program's o stores and window reads are done, CTA-wide
                ctr = ctr_ptr + b * HK + hk
                arrived = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
                if arrived == G * NT - 1:
                    tl.store(ctr, 0)  # ready for the next launch
                    if do_write:
                        _store_window(win, cq, kmask, q_win, s_csc, s_csk, KW, BKW)
                        _store_window(win, ck, kmask, k_win, s_csc, s_csk, KW, BKW)
                    if NORM == 2:  # the G value heads of hk, every tile stored by now
                        oo = tl.load(orow + cols, mask=hm, other=0.0, cache_modifier=".cg").to(tl.float32)
                        tl.store(orow + cols, _gated_norm(oo, zz_g, w_g[None, :], eps, o_ptr, DV, 1), mask=hm)
    elif early != 0:  # a request of no token: its programs pass the prologue too (kernels/pdl.py's ordering)
        pdl_prologue(PDL)


_COUNTERS: dict[tuple, Tensor] = {}
_RETIRED: list[Tensor] = []  # outgrown counter buffers: captured graphs may still point at them


def _counters(state: Tensor, size: int) -> Tensor:
    """The zeroed int32 counters of this state pool's launches (each launch leaves them zero)."""
    key = (state.device, state.data_ptr())
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < size:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(1024, triton.next_power_of_2(size)), dtype=torch.int32, device=state.device)
        _COUNTERS[key] = buf
    return buf


def _auto_bv(bsz: int, heads_v: int, dim_v: int) -> int:
    """The value tile: DECODE_BV where set, else DECODE_AUTO_BV (measured best or within 2% of it at B = 1, 4,
    16, 64 on the H200: bench/NOTES.md 2026-12-01, kernels_gdn_decode_*.json; BV = DV lost 1.4-1.8x from B = 4
    on, where it already had 128 programs)."""
    return min(DECODE_BV or DECODE_AUTO_BV, dim_v)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode_triton(
    x: Tensor, z: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, neg_a: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, eps: float, cu_seqlens: Tensor, conv_state: Tensor, state: Tensor, slots: Tensor,
    scale: float | None = None, write_state: bool | Tensor = True, keep_inputs: bool = False,
    *, bv: int | None = None, num_warps: int | None = None, norm: str | None = None,
) -> Tensor | tuple[Tensor, Tensor, Tensor, Tensor]:
    """gdn_decode_ref in one launch (norm "separate": two). Keyword-only options are for measurement: bv (value
    tile, a power of two dividing DV), num_warps, norm ("fused" / "separate")."""
    n = x.shape[0]
    heads_k, heads_v, dim_k, dim_v = decode_heads(x, a, state)
    x, a, b = _rows(x), _rows(a), _rows(b)
    z = _rows(z.reshape(n, heads_v * dim_v))
    if state.dtype != torch.float32 or state.stride(-1) != 1 or state.shape[1] != heads_v:
        raise ValueError(f"state must be a contiguous-rows fp32 [S, {heads_v}, DK, DV] pool, got {state.dtype} "
                         f"{tuple(state.shape)}")
    if norm_weight.shape[0] != dim_v or dim_v != triton.next_power_of_2(dim_v):
        raise ValueError(f"the value head dim must be a power of two matching norm_weight, got DV={dim_v}, "
                         f"norm_weight {tuple(norm_weight.shape)}")
    bsz = slots.shape[0]
    bv = bv or _auto_bv(bsz, heads_v, dim_v)
    assert dim_v % bv == 0 and bv == triton.next_power_of_2(bv)
    tiles = dim_v // bv
    norm = norm or DECODE_NORM
    if norm not in ("fused", "separate"):
        raise ValueError(f"norm must be 'fused' or 'separate', got {norm!r}")
    norm_mode = 0 if norm == "separate" else (1 if tiles == 1 else 2)
    out = torch.empty(n, heads_v * dim_v, dtype=x.dtype, device=x.device)
    if keep_inputs:
        mixed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        g = torch.empty(n, heads_v, dtype=torch.float32, device=x.device)
        beta = torch.empty(n, heads_v, dtype=b.dtype, device=x.device)
    else:  # never written; the same dtypes as the kept ones (one compile key)
        mixed, g, beta = out, state, b
    if isinstance(write_state, Tensor):
        write, wmask = 2, write_state.to(torch.bool).view(torch.uint8)
    else:
        write, wmask = (1 if write_state else 0), out.view(torch.uint8)  # never read
    scale = float(scale) if scale is not None else dim_k ** -0.5
    bk = max(16, triton.next_power_of_2(dim_k))
    if bsz and n:
        _gdn_decode_kernel[(bsz, heads_v, tiles)](
            x, z, a, b, conv_weight, neg_a, dt_bias, norm_weight, out, cu_seqlens, conv_state, state, slots,
            wmask, _counters(state, bsz * heads_k), mixed, g, beta, scale, float(eps),
            x.stride(0), z.stride(0), a.stride(0), b.stride(0), conv_weight.stride(0), conv_weight.stride(1),
            out.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            state.stride(0), state.stride(1), state.stride(2), mixed.stride(0), write, int(keep_inputs),
            int(EARLY_STATE_READS and early_reads(x.device)),
            HV=heads_v, HK=heads_k, DK=dim_k, DV=dim_v, KW=conv_weight.shape[1] - 1, BK=bk, BV=bv,
            BKW=max(2, triton.next_power_of_2(conv_weight.shape[1] - 1)),
            GP=max(2, triton.next_power_of_2(heads_v // heads_k)), NORM=norm_mode, SHORT=bool(DECODE_SHORT_CHAIN),
            num_warps=num_warps or max(2, min(16, bk * bv // 1024)),
            **pdl_args(x.device),
        )
    if norm_mode == 0:
        from kernels.norm_triton import gated_rmsnorm_triton
        out = gated_rmsnorm_triton(out.view(n, heads_v, dim_v), z.view(n, heads_v, dim_v), norm_weight,
                                   eps).view(n, heads_v * dim_v)
    return (out, mixed, g, beta) if keep_inputs else out
