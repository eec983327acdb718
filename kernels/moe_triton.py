"""Mixture-of-experts in Triton: softmax top-k routing and the fused expert MLPs of a whole step.

Same signatures and semantics as the PyTorch references in kernels/moe.py (`route_ref`, `fused_moe_ref`).

fused_moe_triton runs three or four launches and never synchronizes with the host, so a step can be captured in a
CUDA graph (every grid is sized from shapes only, with an upper bound on the work; surplus programs exit at once):

1. `_moe_align_kernel` (one program): the N*k (token, expert) assignments are grouped by expert into blocks of
   BLOCK_M rows; each touched expert gets ceil(count / BLOCK_M) blocks, the tail of its last block padded with
   a sentinel. Assignments of masked-out tokens (token_mask False) go to no block, so they cost nothing.
   Outputs: sorted_ids [max_rows] (assignment index n*k + j, or the sentinel N*k), block_expert [max_blocks],
   num_blocks [1]. max_blocks = cdiv(N*k, BLOCK_M) + min(E, N*k) bounds sum_e ceil(count_e / BLOCK_M).
   For small N*k (FUSE_ALIGN_MAX_NK) this step runs inside the gate/up kernel instead (`_block_rows`: every
   program finds its own block's rows; one launch fewer). The grouping's histogram is the step's routing
   statistics (`stats=` of fused_moe_triton: distinct routed experts, assignments per expert, of unmasked tokens):
   one program writes them (the align kernel's, or program (0, 0) of the gate/up kernel), no launch of their own.
2. `_moe_gate_up_kernel`: grouped GEMM, one program per (block, BLOCK_N columns of I): gathers its rows of x,
   reads the expert's gate and up rows once, writes silu(gate) * up [max_rows, I].
3. `_moe_down_kernel`: grouped GEMM over the down weights, times the routing weight, written to the
   assignment's own row of y [N*k, H] (no atomics, deterministic).
4. `_moe_reduce_kernel`: out[n] = sum_j y[n*k + j] (0 for masked tokens). Optionally (FUSE_REDUCE_MAX_NK, off
   by default) the last down program of each column slice does this instead. Where the layer's residual add and
   the next layer's input norm follow (fused_moe_add_rmsnorm_triton), `_moe_reduce_rmsnorm_kernel` does the same
   sum, the add and the norm in one launch instead of this one and kernels/norm_triton.py's.

Up to MOE_GEMV_MAX_N tokens (2; HYBRIDSPEC_MOE_GEMV_MAX_N) steps 1-3 are instead two per-assignment GEMVs with no
grouping: `_moe_gemv_gate_up_kernel`, one program per (assignment, BLOCK_I intermediate columns) reading its gate and
up rows in one tile on the CUDA cores, and `_moe_gemv_down_kernel`, one per (assignment, BLOCK_H output rows), which
reads its routing and weights before its PDL wait in a captured step (the gate/up's shared-expert programs, launched
first, may read the shared weights and x and sum before theirs: MOE_SHARED_EARLY, on; -1.1 us a layer at one token,
H100). At one token the grouped kernels run ~160 programs of 256 KB on 132 SMs (part of them a second wave); the
GEMVs run thousands of 16 KB programs. A token has distinct experts, so no weight is read twice; at two tokens a
shared expert is read twice (from L2 the second time). Measured on an H100 (bench/moe_gemv.py, bench/NOTES.md
2026-12-06 05:14): the MoE layer's tail 35.3 -> 28.2 us at one token, 48.3 -> 38.7 at two, a tie at four.

The shared expert as one more expert (`shared=` of fused_moe_triton, route_triton(..., shared=True)): id E reads
the shared expert's own tensors (a base pointer picked per block, `_expert_weights`; its own intermediate size
I_s by masks), so a MoE layer at few tokens is router logits, route, gate/up, down, and the reduce with the
residual + norm (one kernel where a norm follows, fused_moe_add_rmsnorm_triton), with no shared-expert kernels of
its own. A masked token keeps its shared slot (grouped, and added by the reduce): every row gets what the shared
expert computed apart gives it, and the shared weights are read for the batch anyway.

Every touched expert's weights are read once per n-tile; the blocks of one expert sit next to each other in
the grid (axis 0 fastest), so an expert with several blocks re-reads its tiles from L2, not HBM.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.moe import ROUTER_LOGITS_MAX_N  # one program column holds every token up to this many
from kernels.pdl import early_reads, pdl_args, pdl_prologue


# ---------------------------------------------------------------------------------------------------------------
# router logits for few tokens: fp32 sums of the bf16 products, read straight from the bf16 inputs
# ---------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["early"])  # one compile for eager and captured calls
def _router_logits_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, H]
    out_ptr,  # [N, E] float32
    N,
    E,
    H,
    stride_xn,
    stride_we,
    early,  # 1: the first weight tile is read before the PDL prologue (kernels/pdl.py early_reads), 0: after
    BLOCK_N: tl.constexpr,  # >= N (one program covers every token)
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot tiles (>= 16 experts wide); else fp32 products and sums on the CUDA cores
    IEEE: tl.constexpr,  # with DOT, fp32 inputs: full-precision dots (not tf32)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    # with `early` the first weight tile is in flight while the kernel before this one finishes (kernels/pdl.py)
    if early == 0:
        pdl_prologue(PDL)
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + k[None, :], mask=(e < E)[:, None] & (k < H)[None, :],
                other=0.0)  # [BE, BK]
    if early != 0:
        pdl_prologue(PDL)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + k) < H
        if k0 > 0:
            w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + (k0 + k)[None, :],
                        mask=(e < E)[:, None] & kmask[None, :], other=0.0)
        a = tl.load(x_ptr + n[:, None].to(tl.int64) * stride_xn + (k0 + k)[None, :],
                    mask=(n < N)[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
        if DOT:
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)  # bf16 x bf16 products are exact in fp32
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BN, BE]
    tl.store(out_ptr + n[:, None].to(tl.int64) * E + e[None, :], acc, mask=(n < N)[:, None] & (e < E)[None, :])


ROUTER_GEMV_MAX_N = 4  # up to this many tokens the router logits take the CUDA-core kernel (tl.dot beyond)


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    """An integer setting from the environment (read at import), with a named error outside [lo, hi]."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise ValueError(f"{name}={text!r}: must be an integer in [{lo}, {hi}]")
    return value


def _env_tiles(name: str, default: dict[int, tuple[int, int, int]]) -> dict[int, tuple[int, int, int]]:
    """`default` ({BLOCK_N: (BLOCK_E, BLOCK_K, warps)}) with the entries the environment variable `name` sets
    ("1:2x2048x4,4:2x512x4"): A/B runs without a code change. Keys must be default's, values three powers of two."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    usage = (f"{name}={text!r}: expected comma-separated BLOCK_N:BLOCK_ExBLOCK_Kxwarps with BLOCK_N in "
             f"{sorted(default)} and powers of two, e.g. 1:2x2048x4")
    try:
        parsed = {int(n): tuple(int(v) for v in t.split("x")) for n, t in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise ValueError(usage) from None
    if any(n not in default or len(t) != 3 or any(v < 1 or v & (v - 1) for v in t) for n, t in parsed.items()):
        raise ValueError(usage)
    return {**default, **parsed}


# the CUDA-core kernel's tiles by BLOCK_N (the token count's power of two): (experts a program, K a step, warps).
# 2 experts a program: 128 programs for 256 experts. The whole 2048-wide row in one step: inside a captured step
# a program reads all its weights before the PDL wait (early_reads), while the kernel before it runs; after the
# wait only x. H200 (bench/router_logits.py --sweep, 40 calls in a graph, PDL, early reads): 3.82 -> 1.40 us at
# N=1, 3.87 -> 1.55 at 2, 4.29 -> 1.80 at 4 against 512 a step; the graphed AR step at B=1 -0.10 to -0.12 ms
# (bench/NOTES.md). HYBRIDSPEC_ROUTER_GEMV_TILES overrides them (read at import: "1:2x512x4,...")
ROUTER_GEMV_TILES = _env_tiles("HYBRIDSPEC_ROUTER_GEMV_TILES", {1: (2, 2048, 4), 2: (2, 2048, 4), 4: (2, 2048, 4)})


def router_logits_triton(x: Tensor, weight: Tensor) -> Tensor:
    """kernels.moe.router_logits_ref for N <= ROUTER_LOGITS_MAX_N tokens in one launch: the fp32 copy of x (a
    kernel per MoE layer) and the fp32 GEMV over an fp32 copy of the router's weights (2 MB a layer) become one
    kernel reading the bf16 weights (1 MB). Up to ROUTER_GEMV_MAX_N tokens a few experts a program
    (ROUTER_GEMV_TILES) on the CUDA cores (the tl.dot kernel's 16 experts a program left 16 programs for 256
    experts: latency-bound, 6.1 us a layer at N=1 on the H200; 5.0 us on the CUDA cores, but 24.6 us at N=16,
    03a1322), beyond that 16 experts a program with tl.dot (bench/router_logits.py times both). Larger N: the
    reference (cuBLAS)."""
    n, h = x.shape
    e = weight.shape[0]
    if n > ROUTER_LOGITS_MAX_N or n == 0:
        return F.linear(x.float(), weight.float())
    x = x if x.stride(-1) == 1 else x.contiguous()
    early = int(early_reads(x.device) and weight.stride(-1) == 1)  # (a copy made just now is read after the wait)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(n, e, dtype=torch.float32, device=x.device)
    if n <= ROUTER_GEMV_MAX_N:
        block_n = triton.next_power_of_2(n)
        # [BN <= 4, BE, BK] products in registers (bench/router_logits.py --sweep times the tiles)
        block_e, block_k, warps = ROUTER_GEMV_TILES[block_n]
        _router_logits_kernel[(triton.cdiv(e, block_e),)](
            x, weight, out, n, e, h, x.stride(0), weight.stride(0), early, BLOCK_N=block_n, BLOCK_E=block_e,
            BLOCK_K=min(block_k, triton.next_power_of_2(h)), DOT=False, IEEE=False, num_warps=warps,
            **pdl_args(x.device))
        return out
    block_e = 16
    _router_logits_kernel[(triton.cdiv(e, block_e),)](
        x, weight, out, n, e, h, x.stride(0), weight.stride(0), early, BLOCK_N=max(16, triton.next_power_of_2(n)),
        BLOCK_E=block_e, BLOCK_K=128, DOT=True, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
        **pdl_args(x.device))
    return out


# ---------------------------------------------------------------------------------------------------------------
# routing: softmax over experts, top-k, optional renormalization
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(
    logits_ptr,  # [N, E]
    bias_ptr,  # [E] fp32 logit bias (HAS_BIAS) or a dummy
    w_ptr,  # [N, K] out, the weights' dtype
    ids_ptr,  # [N, K] out, int64
    E,
    stride_l,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,  # logits column E: the shared expert's gate -> slot TOP_K = (E, sigmoid)
    ROW_OUT: tl.constexpr,  # output row length: TOP_K, or TOP_K + 1 with SHARED
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + row * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    if HAS_BIAS:
        x = (x + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)).to(logits_ptr.dtype.element_ty)
        x = x.to(tl.float32)  # the reference adds in the logits' dtype
    x = x - tl.max(x, axis=0)
    p = tl.exp(x)
    p = p / tl.sum(p, axis=0)  # [E_P2] softmax in fp32, 0 in the padding
    p = tl.where(e < E, p, -1.0)
    kk = tl.arange(0, K_P2)
    vals = tl.zeros([K_P2], tl.float32)
    idxs = tl.zeros([K_P2], tl.int64)
    for j in tl.static_range(TOP_K):
        m = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == m, e, E_P2), axis=0)  # lowest index among ties
        vals = tl.where(kk == j, m, vals)
        idxs = tl.where(kk == j, idx.to(tl.int64), idxs)
        p = tl.where(e == idx, -2.0, p)
    if RENORM:
        vals = vals / tl.sum(tl.where(kk < TOP_K, vals, 0.0), axis=0)
    tl.store(w_ptr + row * ROW_OUT + kk, vals.to(w_ptr.dtype.element_ty), mask=kk < TOP_K)
    tl.store(ids_ptr + row * ROW_OUT + kk, idxs, mask=kk < TOP_K)
    if SHARED:
        gate = tl.sigmoid(tl.load(logits_ptr + row * stride_l + E).to(tl.float32))
        tl.store(w_ptr + row * ROW_OUT + TOP_K, gate.to(w_ptr.dtype.element_ty))
        tl.store(ids_ptr + row * ROW_OUT + TOP_K, E.to(tl.int64))


# warps of the route kernel and of the MoE's reduce + norm kernel (None: the rule at their launch;
# bench/small_kernels.py sets them to sweep). H200, 40 calls in a graph with PDL (`small_kernels_*.json`): the route at N = 1 .. 64 takes
# 2.48-2.59 us with one warp against 3.33-3.46 with the four it had for 257 experts (its 16 reductions over 512 lanes
# stay inside a warp: no shared-memory round trips; wider rows, e.g. 512 experts + the shared column, keep four:
# not measured); the MoE tail at N = 1 / 4 / 16 25.08 / 64.54 / 171.05 us with 16
# warps for the reduce + norm against 25.74 / 64.71 / 171.80 with 8
ROUTE_WARPS: int | None = None
REDUCE_NORM_WARPS: int | None = None


def route_triton(router_logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype | None = None,
                 bias: Tensor | None = None, shared: bool = False) -> tuple[Tensor, Tensor]:
    """router_logits [N, E] (+ bias [E]) -> (weights [N, k] in out_dtype (default the logits' dtype), expert ids
    [N, k] int64). As route_ref: the bias add and the cast are in the same launch. `shared`: logits [N, E + 1],
    the last column the shared expert's gate; one more slot per token (id E, sigmoid) -> [N, k + 1]."""
    n, cols = router_logits.shape
    e = cols - 1 if shared else cols
    row_out = top_k + 1 if shared else top_k
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(n, row_out, dtype=out_dtype or router_logits.dtype, device=router_logits.device)
    ids = torch.empty(n, row_out, dtype=torch.int64, device=router_logits.device)
    if n == 0:
        return weights, ids
    e_p2 = triton.next_power_of_2(e)
    _route_kernel[(n,)](logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0),
                        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, RENORM=bool(renormalize),
                        HAS_BIAS=bias is not None, SHARED=bool(shared), ROW_OUT=row_out,
                        num_warps=ROUTE_WARPS or (1 if e_p2 <= 512 else 4), **pdl_args(logits.device))
    return weights, ids


def _mask_i8(token_mask: Tensor) -> Tensor:
    """A [N] token mask as int8 for the kernels: a contiguous bool mask is reinterpreted (no copy, no launch)."""
    if token_mask.dtype == torch.bool and token_mask.is_contiguous():
        return token_mask.view(torch.int8)
    return (token_mask != 0).to(torch.int8).contiguous()


@triton.jit
def _kept_ids(topk_ids_ptr, mask_ptr, offs, NK, E, TOP_K: tl.constexpr, HAS_MASK: tl.constexpr,
              SHARED: tl.constexpr):
    """Experts of assignments `offs` as int32; E (a bin of its own) where out of range or the token is masked
    (with SHARED, a masked token keeps its shared slot, id E - 1)."""
    inb = offs < NK
    ids = tl.load(topk_ids_ptr + offs, mask=inb, other=E).to(tl.int32)
    if HAS_MASK:
        keep = tl.load(mask_ptr + offs // TOP_K, mask=inb, other=0) != 0
        if SHARED:
            keep = keep | (ids == E - 1)
        ids = tl.where(keep, ids, E)
    return ids


@triton.jit(do_not_specialize=["NK"])  # NK varies every step: one compile for all
def _distinct_experts_kernel(ids_ptr, mask_ptr, out_ptr, counts_ptr, NK, E, stride_row, TOP_K: tl.constexpr,
                             HAS_MASK: tl.constexpr, COUNTS: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
    """One program: how many of the E experts the unmasked assignments touch (int64 scalar) and, with COUNTS,
    the assignments per expert (int64 [E]). ids [N, TOP_K] with rows stride_row apart (the routed columns of
    route's [N, k + 1] with the shared slot are read in place)."""
    pdl_prologue(PDL)
    e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    for start in range(0, NK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < NK
        ids = tl.load(ids_ptr + (offs // TOP_K).to(tl.int64) * stride_row + offs % TOP_K, mask=inb,
                      other=E).to(tl.int32)
        if HAS_MASK:
            ids = tl.where(tl.load(mask_ptr + offs // TOP_K, mask=inb, other=0) != 0, ids, E)
        counts += tl.histogram(ids, E_P2)
    tl.store(out_ptr, tl.sum(((e < E) & (counts > 0)).to(tl.int64), axis=0))
    if COUNTS:
        tl.store(counts_ptr + e, counts.to(tl.int64), mask=e < E)


def _expert_stats(topk_ids: Tensor, token_mask: Tensor | None, num_experts: int,
                  with_counts: bool) -> tuple[Tensor, Tensor | None]:
    n, k = topk_ids.shape
    dev = topk_ids.device
    if n == 0:
        return (torch.zeros((), dtype=torch.int64, device=dev),
                torch.zeros(num_experts, dtype=torch.int64, device=dev) if with_counts else None)
    # the kernel writes the scalar and every expert's count: no memsets (two launches a layer in every step)
    out = torch.empty((), dtype=torch.int64, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int64, device=dev) if with_counts else None
    ids = topk_ids if topk_ids.stride(-1) == 1 else topk_ids.contiguous()  # strided rows: read in place
    mask = _mask_i8(token_mask) if token_mask is not None else ids
    nk = n * k
    _distinct_experts_kernel[(1,)](ids, mask, out, counts if with_counts else out, nk, num_experts, ids.stride(0),
                                   TOP_K=k, HAS_MASK=token_mask is not None, COUNTS=with_counts,
                                   E_P2=triton.next_power_of_2(num_experts + 1), BLOCK=128 if nk <= 128 else 1024,
                                   num_warps=4 if nk <= 128 else 8, **pdl_args(ids.device))
    return out, counts


def distinct_experts_triton(topk_ids: Tensor, token_mask: Tensor | None, num_experts: int) -> Tensor:
    """kernels.moe.distinct_experts_ref in one launch: topk_ids [N, k], token_mask [N] bool -> int64 scalar."""
    return _expert_stats(topk_ids, token_mask, num_experts, False)[0]


def expert_counts_triton(topk_ids: Tensor, token_mask: Tensor | None, num_experts: int) -> tuple[Tensor, Tensor]:
    """kernels.moe.expert_counts_ref in the same single launch: (distinct experts, per-expert counts [E])."""
    return _expert_stats(topk_ids, token_mask, num_experts, True)


# ---------------------------------------------------------------------------------------------------------------
# 1. align: group assignments by expert into padded blocks (one program, no host sync)
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _store_stats(counts, bins, E, distinct_ptr, counts_ptr, STATS, SHARED: tl.constexpr):
    """The step's routing statistics from the grouping's histogram (`counts` [E_P2] of the kept assignments:
    masked tokens' routed slots in no bin): distinct routed experts touched (int64 scalar) and, with STATS == 2,
    the count per routed expert (int64 [E_routed]). With SHARED the last id (E - 1) is the shared expert, not
    counted (a masked token keeps its shared slot)."""
    e_routed = E - 1 if SHARED else E
    routed = bins < e_routed
    tl.store(distinct_ptr, tl.sum((routed & (counts > 0)).to(tl.int64), axis=0))
    tl.store(counts_ptr + bins, counts.to(tl.int64), mask=routed & (STATS > 1))


# NK varies every step, STATS (and the statistics' buffers) with the policy: one compile for all
@triton.jit(do_not_specialize=["NK", "STATS", "distinct_ptr", "counts_ptr"])
def _moe_align_kernel(
    topk_ids_ptr,  # [N*K] expert of each assignment (int64 or int32)
    mask_ptr,  # [N] token mask (int8) or a dummy when HAS_MASK is False
    sorted_ids_ptr,  # [max_rows] int32 out: assignment index per row, NK = padding
    block_expert_ptr,  # [max_blocks] int32 out: expert of each block (only blocks < num_blocks are written)
    num_blocks_ptr,  # [1] int32 out
    cursor_ptr,  # [E_P2] int32 scratch
    distinct_ptr,  # [] int64 out (STATS >= 1): routed experts the kept assignments touch
    counts_ptr,  # [E_routed] int64 out (STATS == 2): kept assignments per routed expert
    NK,
    E,
    STATS,  # routing statistics: 0 none, 1 distinct experts, 2 distinct experts and per-expert counts
    TOP_K: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,  # power of two > E (bin E collects masked / out-of-range assignments)
    CHUNK: tl.constexpr,
    SHARED: tl.constexpr,  # id E - 1 is the shared expert (kept for masked tokens)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    bins = tl.arange(0, E_P2)
    # pass 1: assignments per expert
    counts = tl.zeros([E_P2], tl.int32)
    for start in range(0, NK, CHUNK):
        counts += tl.histogram(_kept_ids(topk_ids_ptr, mask_ptr, start + tl.arange(0, CHUNK), NK, E, TOP_K, HAS_MASK,
                                         SHARED), E_P2)
    counts = tl.where(bins < E, counts, 0)
    if STATS > 0:
        _store_stats(counts, bins, E, distinct_ptr, counts_ptr, STATS, SHARED)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M  # [E_P2]
    blk_end = tl.cumsum(nblk, axis=0)
    row_start = (blk_end - nblk) * BLOCK_M  # first row of each expert's blocks
    tl.store(num_blocks_ptr, tl.sum(nblk, axis=0))
    # padding rows at the tail of each expert's last block: [E_P2, BLOCK_M], disjoint from the real rows
    j = tl.arange(0, BLOCK_M)
    pad = counts[:, None] + j[None, :]
    tl.store(sorted_ids_ptr + row_start[:, None] + pad, tl.zeros([E_P2, BLOCK_M], tl.int32) + NK,
             mask=pad < nblk[:, None] * BLOCK_M)
    tl.store(cursor_ptr + bins, row_start)
    tl.debug_barrier()
    # pass 2: each assignment takes the next free row of its expert (order inside an expert does not matter:
    # the GEMM rows are independent and results are scattered back by assignment index)
    for start in range(0, NK, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = _kept_ids(topk_ids_ptr, mask_ptr, offs, NK, E, TOP_K, HAS_MASK, SHARED)
        real = ids < E
        dest = tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=real)
        tl.store(sorted_ids_ptr + dest, offs, mask=real)
        tl.store(block_expert_ptr + dest // BLOCK_M, ids, mask=real)


# ---------------------------------------------------------------------------------------------------------------
# 1b. the same grouping computed inside the gate/up kernel (small N*k): each program finds its own block's rows
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _block_rows(topk_ids_ptr, mask_ptr, pid_m, NK, E, TOP_K: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK_M: tl.constexpr, E_P2: tl.constexpr, NK_P2: tl.constexpr, SHARED: tl.constexpr):
    """(expert of block pid_m, its BLOCK_M assignment indices (NK = padding), number of blocks, kept assignments
    per expert [E_P2]), in the order of moe_align_ref (ascending assignment index inside an expert)."""
    offs = tl.arange(0, NK_P2)
    ids = _kept_ids(topk_ids_ptr, mask_ptr, offs, NK, E, TOP_K, HAS_MASK, SHARED)
    bins = tl.arange(0, E_P2)
    counts = tl.where(bins < E, tl.histogram(ids, E_P2), 0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, axis=0)
    total = tl.sum(nblk, axis=0)
    expert = tl.sum((blk_end <= pid_m).to(tl.int32), axis=0)  # owner of block pid_m when pid_m < total
    first = tl.sum(tl.where(bins == expert, blk_end - nblk, 0), axis=0)
    member = ids == expert
    rank = tl.cumsum(member.to(tl.int32), axis=0) - 1  # [NK_P2] rank among the expert's assignments
    want = (pid_m - first) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    hit = member[None, :] & (rank[None, :] == want[:, None])  # [BM, NK_P2]
    aid = tl.max(tl.where(hit, offs[None, :], -1), axis=1)
    aid = tl.where(aid >= 0, aid, NK)
    return expert, aid, total, counts


@triton.jit
def _expert_weights(w_ptr, ws_ptr, expert, E, I, I_S, stride_we, stride_wn, stride_swn, SHARED: tl.constexpr):
    """(base pointer, row stride, intermediate size) of `expert`'s weights: with SHARED, id E - 1 is the shared
    expert (its own 2-D tensor at ws_ptr, intermediate size I_S), the others experts of the 3-D tensor at w_ptr."""
    base = w_ptr + expert * stride_we
    wn = stride_wn
    inter = I
    if SHARED:
        if expert == E - 1:
            base = ws_ptr
            wn = stride_swn
            inter = I_S
    return base, wn, inter


# ---------------------------------------------------------------------------------------------------------------
# 2. gate/up grouped GEMM with SiLU * up fused
# ---------------------------------------------------------------------------------------------------------------
# NK varies every step, STATS (and the statistics' buffers) with the policy: one compile for all
@triton.jit(do_not_specialize=["NK", "STATS", "distinct_ptr", "counts_ptr"])
def _moe_gate_up_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, 2I, H] gate rows 0..I-1, up rows I..2I-1 (with SHARED: the E - 1 routed experts)
    ws_ptr,  # [2I_S, H] the shared expert's gate and up rows (SHARED only)
    h_ptr,  # [max_rows, max(I, I_S)] out: silu(gate) * up per sorted row
    sorted_ids_ptr,  # [max_rows] int32 (in, or out when FUSED_ALIGN)
    block_expert_ptr,  # [max_blocks] int32 (in, or out when FUSED_ALIGN)
    num_blocks_ptr,  # [1] int32 (in, or out when FUSED_ALIGN)
    topk_ids_ptr,  # [N*K] (FUSED_ALIGN only)
    mask_ptr,  # [N] int8 (FUSED_ALIGN with HAS_MASK only)
    distinct_ptr,  # [] int64 out (FUSED_ALIGN with STATS >= 1, by program (0, 0))
    counts_ptr,  # [E_routed] int64 out (FUSED_ALIGN with STATS == 2, by program (0, 0))
    STATS,  # routing statistics (FUSED_ALIGN only; else the align kernel's): 0 none, 1 distinct, 2 and counts
    NK,
    E,  # expert ids 0..E-1 (the shared expert's included)
    H,
    I,
    I_S,
    stride_xn,
    stride_we,
    stride_wn,
    stride_swn,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED_ALIGN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    E_P2: tl.constexpr,
    NK_P2: tl.constexpr,
    SHARED: tl.constexpr,  # expert id E - 1 is the shared expert (ws_ptr, I_S)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if FUSED_ALIGN:
        expert32, aid, total, counts = _block_rows(topk_ids_ptr, mask_ptr, pid_m, NK, E, TOP_K, HAS_MASK, BLOCK_M,
                                                   E_P2, NK_P2, SHARED)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(num_blocks_ptr, total)
            if STATS > 0:
                _store_stats(counts, tl.arange(0, E_P2), E, distinct_ptr, counts_ptr, STATS, SHARED)
        if pid_m >= total:
            return
        if pid_n == 0:  # publish the grouping for the down kernel
            tl.store(sorted_ids_ptr + rows, aid)
            tl.store(block_expert_ptr + pid_m, expert32)
        expert = expert32.to(tl.int64)
    else:
        if pid_m >= tl.load(num_blocks_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        aid = tl.load(sorted_ids_ptr + rows)
    w_base, wn, inter = _expert_weights(w_ptr, ws_ptr, expert, E, I, I_S, stride_we, stride_wn, stride_swn, SHARED)
    if SHARED:
        if pid_n * BLOCK_N >= inter:  # I != I_S: column tiles past this expert's width
            return
    valid = aid < NK
    tok = (aid // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < inter
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xn + k[None, :]  # [BM, BK]
    wg_ptrs = w_base + n[:, None].to(tl.int64) * wn + k[None, :]  # [BN, BK]
    wu_ptrs = wg_ptrs + inter * wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + k) < H
        a = tl.load(x_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc_g = tl.dot(a, tl.trans(wg), acc_g)
        acc_u = tl.dot(a, tl.trans(wu), acc_u)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    hval = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_hm + n[None, :], hval.to(h_ptr.dtype.element_ty),
             mask=nmask[None, :])


# ---------------------------------------------------------------------------------------------------------------
# 3. down grouped GEMM, times the routing weight, scattered to the assignment's row
# ---------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["NK"])  # NK varies every step: one compile for all
def _moe_down_kernel(
    h_ptr,  # [max_rows, max(I, I_S)]
    w_ptr,  # [E, H, I] (with SHARED: the E - 1 routed experts)
    ws_ptr,  # [H, I_S] the shared expert's down projection (SHARED only)
    y_ptr,  # [N*K, H] out
    topk_w_ptr,  # [N*K] routing weights
    sorted_ids_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    out_ptr,  # [N, H] (FUSED_REDUCE only)
    mask_ptr,  # [N] int8 (FUSED_REDUCE with HAS_MASK only)
    counter_ptr,  # [>= grid n] int32, zero between calls (FUSED_REDUCE only)
    NK,
    E,  # expert ids 0..E-1 (the shared expert's included)
    H,
    I,
    I_S,
    stride_hm,
    stride_we,
    stride_wn,
    stride_swn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FENCE: tl.constexpr,  # emit a gpu-scope fence per thread (real GPUs; the interpreter runs programs in order)
    RED_T: tl.constexpr,  # tokens per reduce step
    SHARED: tl.constexpr,  # expert id E - 1 is the shared expert (ws_ptr, I_S)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    if pid_m < tl.load(num_blocks_ptr):
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        aid = tl.load(sorted_ids_ptr + rows)
        valid = aid < NK
        w_base, wn, inter = _expert_weights(w_ptr, ws_ptr, expert, E, I, I_S, stride_we, stride_wn, stride_swn,
                                            SHARED)
        k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + k[None, :]  # [BM, BK]
        w_ptrs = w_base + n[:, None].to(tl.int64) * wn + k[None, :]  # [BN, BK]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kmask = (k0 + k) < inter
            a = tl.load(h_ptrs, mask=kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        rw = tl.load(topk_w_ptr + aid, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        tl.store(y_ptr + aid[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])
    if FUSED_REDUCE:
        # the last program of this column slice to finish sums every token's k rows of y (threadfence-reduction
        # pattern: fence + barrier, then one acq_rel atomic per program; the counter goes back to 0)
        if FENCE:
            tl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.u32 $0, $1;", "=r,r", [n], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.debug_barrier()
            num_tokens = NK // TOP_K
            tt = tl.arange(0, RED_T)
            for t0 in range(0, num_tokens, RED_T):
                tok = t0 + tt
                tmask = tok < num_tokens
                if HAS_MASK:
                    tmask = tmask & (tl.load(mask_ptr + tok, mask=tmask, other=0) != 0)
                acc2 = tl.zeros([RED_T, BLOCK_N], tl.float32)
                for j in tl.static_range(TOP_K):
                    acc2 += tl.load(y_ptr + (tok[:, None].to(tl.int64) * TOP_K + j) * stride_ym + n[None, :],
                                    mask=tmask[:, None] & nmask[None, :], other=0.0,
                                    cache_modifier=".cg").to(tl.float32)
                tl.store(out_ptr + tok[:, None].to(tl.int64) * H + n[None, :], acc2.to(out_ptr.dtype.element_ty),
                         mask=(tok < num_tokens)[:, None] & nmask[None, :])
            tl.atomic_xchg(counter_ptr + pid_n, 0)


# ---------------------------------------------------------------------------------------------------------------
# 2'./3'. few tokens (MOE_GEMV_MAX_N): one GEMV per (assignment, slice), no grouping
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _assignment(topk_ids_ptr, mask_ptr, a, E, TOP_K: tl.constexpr, HAS_MASK: tl.constexpr, SHARED: tl.constexpr):
    """(expert, token, kept) of assignment a: kept False for a masked token's routed slot (with SHARED its shared
    slot, id E - 1, is kept)."""
    expert = tl.load(topk_ids_ptr + a).to(tl.int64)
    tok = (a // TOP_K).to(tl.int64)
    keep = a >= 0  # (every assignment, without a mask)
    if HAS_MASK:
        keep = tl.load(mask_ptr + tok) != 0
        if SHARED:
            keep = keep | (expert == E - 1)
    return expert, tok, keep


@triton.jit
def _gate_up_sums(x_ptr, w_base, wn, inter, tok, stride_xn, pid_n, H, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (gate, up) sums [BLOCK_I] of columns pid_n*BLOCK_I.. of one expert (rows at w_base, wn apart, gate rows
    then `inter` rows on its up rows) for token tok's row of x."""
    n = pid_n * BLOCK_I + tl.arange(0, BLOCK_I)
    nmask = n < inter
    k = tl.arange(0, BLOCK_K)
    wg_ptrs = w_base + n[:, None].to(tl.int64) * wn + k[None, :]  # [BI, BK]
    wu_ptrs = wg_ptrs + inter * wn
    acc_g = tl.zeros([BLOCK_I], tl.float32)
    acc_u = tl.zeros([BLOCK_I], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + k) < H
        wmask = nmask[:, None] & kmask[None, :]
        # (the expert weights are read once per step: evict_first keeps them from evicting activations from L2)
        wg = tl.load(wg_ptrs + k0, mask=wmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        wu = tl.load(wu_ptrs + k0, mask=wmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        xv = tl.load(x_ptr + tok * stride_xn + k0 + k, mask=kmask, other=0.0).to(tl.float32)  # [BK]
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    return acc_g, acc_u


# NK varies every step, STATS (and the statistics' buffers) with the policy, `early` with the capture: one compile
@triton.jit(do_not_specialize=["NK", "STATS", "distinct_ptr", "counts_ptr", "early"])
def _moe_gemv_gate_up_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, 2I, H] gate rows 0..I-1, up rows I..2I-1 (with SHARED: the E - 1 routed experts)
    ws_ptr,  # [2I_S, H] the shared expert's gate and up rows (SHARED only)
    h_ptr,  # [N*K, max(I, I_S)] out: silu(gate) * up per assignment (rows of masked assignments unwritten)
    topk_ids_ptr,  # [N*K]
    mask_ptr,  # [N] int8 (HAS_MASK only)
    distinct_ptr,  # [] int64 out (STATS >= 1, by program (0, 0))
    counts_ptr,  # [E_routed] int64 out (STATS == 2, by program (0, 0))
    STATS,  # routing statistics: 0 none, 1 distinct, 2 and counts
    NK,
    E,  # expert ids 0..E-1 (the shared expert's included)
    H,
    I,
    I_S,
    stride_xn,
    stride_we,
    stride_wn,
    stride_swn,
    stride_hm,
    early,  # 1 (SHARED): the shared slots' sums are computed before the PDL prologue (see below), 0: after
    TOP_K: tl.constexpr,
    BLOCK_I: tl.constexpr,  # intermediate columns a program: its BLOCK_I gate rows and BLOCK_I up rows
    BLOCK_K: tl.constexpr,  # >= H: the rows in one tile, every load issued at once ("one-shot")
    HAS_MASK: tl.constexpr,
    E_P2: tl.constexpr,
    NK_P2: tl.constexpr,
    SHARED: tl.constexpr,  # expert id E - 1 is the shared expert (ws_ptr, I_S)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """Program (j, s): assignment a's columns j*BLOCK_I.. of silu(x W_gate^T) * (x W_up^T), summed in fp32 on the
    CUDA cores (no 16-row tl.dot padding for one token), rounded once to h's dtype as the grouped kernel's.
    Axis 1 walks the assignments slot-major with SHARED: s < N are the tokens' last slots (route's layout puts the
    shared expert there), launched first. With `early` (a captured step under PDL) those programs read the shared
    weights and x (written three launches back: kernels/pdl.py) and sum before their prologue, while the route
    before this kernel still runs; after it they check the slot's id and store (a slot that is not the shared
    expert after all is summed again from its own expert: any layout gives the same h)."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    if SHARED:  # slot-major: s = j' * N + t, slot j = j' - 1 (mod TOP_K), so s < N are the last slots
        ntok = NK // TOP_K
        a = (s % ntok) * TOP_K + (s // ntok + TOP_K - 1) % TOP_K
    else:
        a = s
    acc_g = tl.zeros([BLOCK_I], tl.float32)
    acc_u = tl.zeros([BLOCK_I], tl.float32)
    pre = SHARED and (early != 0) and (a % TOP_K == TOP_K - 1)
    if pre:  # the shared expert's sums before the wait (no store: the allocator's order holds only after it)
        if pid_n * BLOCK_I < I_S:
            acc_g, acc_u = _gate_up_sums(x_ptr, ws_ptr, stride_swn, I_S, (a // TOP_K).to(tl.int64), stride_xn,
                                         pid_n, H, BLOCK_I, BLOCK_K)
    pdl_prologue(PDL)
    if STATS > 0:
        if (s == 0) & (pid_n == 0):  # the step's routing statistics: the grouping's histogram, computed here
            offs = tl.arange(0, NK_P2)
            kept = _kept_ids(topk_ids_ptr, mask_ptr, offs, NK, E, TOP_K, HAS_MASK, SHARED)
            bins = tl.arange(0, E_P2)
            _store_stats(tl.where(bins < E, tl.histogram(kept, E_P2), 0), bins, E, distinct_ptr, counts_ptr, STATS,
                         SHARED)
    expert, tok, keep = _assignment(topk_ids_ptr, mask_ptr, a, E, TOP_K, HAS_MASK, SHARED)
    if not keep:  # a masked token's routed slot: no work, its row of h is never read
        return
    w_base, wn, inter = _expert_weights(w_ptr, ws_ptr, expert, E, I, I_S, stride_we, stride_wn, stride_swn, SHARED)
    if pid_n * BLOCK_I >= inter:  # I != I_S: slices past this expert's width
        return
    if pre:
        pre = expert == E - 1
    if not pre:
        acc_g, acc_u = _gate_up_sums(x_ptr, w_base, wn, inter, tok, stride_xn, pid_n, H, BLOCK_I, BLOCK_K)
    n = pid_n * BLOCK_I + tl.arange(0, BLOCK_I)
    hval = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    tl.store(h_ptr + a.to(tl.int64) * stride_hm + n, hval.to(h_ptr.dtype.element_ty), mask=n < inter)


@triton.jit(do_not_specialize=["early"])  # (early: one compile for eager and captured calls)
def _moe_gemv_down_kernel(
    h_ptr,  # [N*K, max(I, I_S)] the gate/up GEMV's
    w_ptr,  # [E, H, I] (with SHARED: the E - 1 routed experts)
    ws_ptr,  # [H, I_S] the shared expert's down projection (SHARED only)
    y_ptr,  # [N*K, H] out: the routing weight times the expert's output, per assignment
    topk_w_ptr,  # [N*K] routing weights
    topk_ids_ptr,  # [N*K]
    mask_ptr,  # [N] int8 (HAS_MASK only)
    E,
    H,
    I,
    I_S,
    stride_hm,
    stride_we,
    stride_wn,
    stride_swn,
    stride_ym,
    early,  # 1: the routing and the first weight tile are read before the PDL prologue (see below), 0: after
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,  # output rows a program
    BLOCK_K: tl.constexpr,  # >= max(I, I_S): one tile
    HAS_MASK: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (a, r): rows r*BLOCK_H.. of y[a] = topk_weights[a] * W_down[e] h[a] (fp32 sums, one rounding).
    With `early` (a captured step under PDL): the expert ids, the mask and the routing weights were written by the
    route (and the router correction) two launches back or more, and the weights before the capture, so they are
    read while the gate/up GEMV before this kernel finishes (kernels/pdl.py); h after the prologue."""
    a = tl.program_id(0)
    pid_h = tl.program_id(1)
    if early == 0:
        pdl_prologue(PDL)
    expert, tok, keep = _assignment(topk_ids_ptr, mask_ptr, a, E, TOP_K, HAS_MASK, SHARED)
    if not keep:  # (its row of y is never read)
        if early != 0:
            pdl_prologue(PDL)
        return
    w_base, wn, inter = _expert_weights(w_ptr, ws_ptr, expert, E, I, I_S, stride_we, stride_wn, stride_swn, SHARED)
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < H
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_base + rows[:, None].to(tl.int64) * wn + k[None, :]  # [BH, BK]
    rw = tl.load(topk_w_ptr + a).to(tl.float32)
    kmask = k < inter
    w = tl.load(w_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0,
                eviction_policy="evict_first").to(tl.float32)  # [BH, BK]
    if early != 0:
        pdl_prologue(PDL)
    hv = tl.load(h_ptr + a.to(tl.int64) * stride_hm + k, mask=kmask, other=0.0).to(tl.float32)
    acc = tl.sum(w * hv[None, :], axis=1)  # [BH]
    for k0 in range(BLOCK_K, inter, BLOCK_K):  # (widths beyond one tile: the bench model's fit in one)
        kmask = (k0 + k) < inter
        w = tl.load(w_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        hv = tl.load(h_ptr + a.to(tl.int64) * stride_hm + k0 + k, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(w * hv[None, :], axis=1)
    acc = acc * rw
    tl.store(y_ptr + a.to(tl.int64) * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)


# ---------------------------------------------------------------------------------------------------------------
# 4. sum over each token's k assignments (4b: the same sum with the residual add and the next RMSNorm)
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _sum_assignments(y_ptr, mask_ptr, topk_ids_ptr, tok, h, hmask, E, H, TOP_K: tl.constexpr,
                     HAS_MASK: tl.constexpr, BLOCK_H: tl.constexpr, SHARED: tl.constexpr):
    """fp32 sum over token `tok`'s TOP_K rows of y [N*K, H] (contiguous) at columns h [BLOCK_H], in slot order
    j = 0..TOP_K-1; 0 where hmask is False. A masked token's routed rows were never written and count 0; with
    SHARED its shared slot (id E - 1) was computed and counts. One helper for both reduce kernels: the same sum."""
    if HAS_MASK:
        keep = tl.load(mask_ptr + tok) != 0  # masked tokens: their (routed) rows of y were never written
        if not SHARED:
            hmask = hmask & keep
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        jmask = hmask
        if HAS_MASK:
            if SHARED:  # a masked token's shared slot was computed
                jmask = hmask & (keep | (tl.load(topk_ids_ptr + tok * TOP_K + j) == E - 1))
        acc += tl.load(y_ptr + (tok * TOP_K + j) * H + h, mask=jmask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _moe_reduce_kernel(
    y_ptr,  # [N*K, H]
    mask_ptr,  # [N] int8 or dummy
    out_ptr,  # [N, H]
    topk_ids_ptr,  # [N*K] (SHARED with HAS_MASK only)
    E,  # expert ids 0..E-1, the shared expert's E - 1 (SHARED only)
    H,
    TOP_K: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = _sum_assignments(y_ptr, mask_ptr, topk_ids_ptr, tok, h, h < H, E, H, TOP_K, HAS_MASK, BLOCK_H,
                           SHARED)  # [BLOCK_H] fp32
    tl.store(out_ptr + tok * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _moe_reduce_rmsnorm_kernel(
    y_ptr,  # [N*K, H] one row per assignment (the down kernel's)
    mask_ptr,  # [N] int8 or dummy
    topk_ids_ptr,  # [N*K] (SHARED with HAS_MASK only)
    x_ptr,  # [N, H] the residual, rows stride_x apart
    w_ptr,  # [H] the norm's weight
    s_ptr,  # [N, H] out: x + the token's expert sum, rows stride_s apart
    o_ptr,  # [N, H] out: rmsnorm(s), rows stride_o apart
    E,  # expert ids 0..E-1, the shared expert's E - 1 (SHARED only)
    H,
    stride_x,
    stride_s,
    stride_o,
    eps,
    TOP_K: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: one program holds the token's whole row (the norm needs all of it)
    SHARED: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    """`_moe_reduce_kernel` then kernels/norm_triton.py's `_residual_rmsnorm_kernel` (MOE=False) in one launch, one
    program per token: the end of a MoE layer and the next layer's input norm, one kernel fewer per layer. Every
    rounding of the two-kernel path is kept: the expert sum (fp32, slot order) rounds to y's dtype (the reduce's
    [N, H] output), s = x + that rounds to x's dtype, the norm runs on s as stored."""
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    acc = _sum_assignments(y_ptr, mask_ptr, topk_ids_ptr, tok, h, hmask, E, H, TOP_K, HAS_MASK, BLOCK_H,
                           SHARED)  # [BLOCK_H] fp32
    moe = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the reduce kernel stores its sum in the activation dtype
    x = tl.load(x_ptr + tok * stride_x + h, mask=hmask, other=0.0)  # [BLOCK_H]
    s = (x.to(tl.float32) + moe).to(x.dtype)
    tl.store(s_ptr + tok * stride_s + h, s, mask=hmask)
    sf = s.to(tl.float32)
    w = tl.load(w_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
    tl.store(o_ptr + tok * stride_o + h, (sf * rstd * (1.0 + w)).to(o_ptr.dtype.element_ty), mask=hmask)


_stats_dummies: dict = {}


def _stats_args(stats: tuple[Tensor, Tensor | None] | None, num_routed: int,
                device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(distinct buffer, counts buffer, STATS flag) for the grouping kernels from fused_moe's `stats`. Without
    statistics both pointers are one int64 tensor per device that is never written (kept for the process: a
    captured graph holds its address)."""
    if stats is None:
        dummy = _stats_dummies.get(device)
        if dummy is None:
            dummy = _stats_dummies[device] = torch.zeros(1, dtype=torch.int64, device=device)
        return dummy, dummy, 0
    distinct, counts = stats
    if distinct.dtype != torch.int64 or distinct.numel() != 1 or distinct.device != device:
        raise ValueError(f"stats: distinct_out must be one int64 element on {device}, got {distinct.dtype} "
                         f"{tuple(distinct.shape)} on {distinct.device}")
    if counts is None:
        return distinct, distinct, 1
    if counts.dtype != torch.int64 or counts.shape != (num_routed,) or not counts.is_contiguous() \
            or counts.device != device:
        raise ValueError(f"stats: counts_out must be a contiguous int64 [{num_routed}] on {device}, got "
                         f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")
    return distinct, counts, 2


def _zero_stats(stats: tuple[Tensor, Tensor | None] | None) -> None:
    """Statistics of a step without assignments (no grouping kernel runs)."""
    if stats is not None:
        for t in stats:
            if t is not None:
                t.zero_()


def moe_align_triton(
    flat_ids: Tensor,  # [N*k] expert of each assignment (token n's j-th expert at n*k + j)
    token_mask: Tensor | None,  # [N] bool or None
    num_experts: int,
    top_k: int,
    block_m: int,
    shared: bool = False,  # id num_experts - 1 is the shared expert: a masked token keeps that slot
    stats: tuple[Tensor, Tensor | None] | None = None,  # (distinct [] int64, counts [E_routed] int64 or None) out
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group assignments by expert into blocks of block_m rows, on the device.

    Returns sorted_ids [max_rows] int32 (assignment index, N*k on padding rows), block_expert [max_blocks] int32
    (valid for blocks < num_blocks), num_blocks [1] int32, and the int8 token mask passed to the kernels
    (or a dummy tensor). max_blocks = cdiv(N*k, block_m) + min(E, N*k), max_rows = max_blocks * block_m.
    Rows past num_blocks * block_m are left unwritten. Within an expert, rows come in any order.
    `stats`: the same program writes the routing statistics of its histogram (kernels.moe.expert_counts_ref of
    the routed ids 0..E_routed-1 of unmasked tokens; E_routed = num_experts - 1 with `shared`)."""
    nk = flat_ids.numel()
    dev = flat_ids.device
    max_blocks = triton.cdiv(nk, block_m) + min(num_experts, nk)
    max_rows = max_blocks * block_m
    e_p2 = triton.next_power_of_2(num_experts + 1)
    work = torch.empty(max_rows + max_blocks + 1 + e_p2, dtype=torch.int32, device=dev)
    sorted_ids = work[:max_rows]
    block_expert = work[max_rows : max_rows + max_blocks]
    num_blocks = work[max_rows + max_blocks : max_rows + max_blocks + 1]
    cursor = work[max_rows + max_blocks + 1 :]
    has_mask = token_mask is not None
    mask = _mask_i8(token_mask) if has_mask else work
    chunk = 128 if nk <= 128 else 1024  # two compiled variants, not one per power of two of NK
    distinct, counts, flag = _stats_args(stats, num_experts - 1 if shared else num_experts, dev)
    _moe_align_kernel[(1,)](flat_ids, mask, sorted_ids, block_expert, num_blocks, cursor, distinct, counts, nk,
                            num_experts, flag, TOP_K=top_k, HAS_MASK=has_mask, BLOCK_M=block_m, E_P2=e_p2,
                            CHUNK=chunk, SHARED=bool(shared), num_warps=4 if chunk <= 256 else 8,
                            **pdl_args(flat_ids.device))
    return sorted_ids, block_expert, num_blocks, mask


def moe_align_ref(
    flat_ids: Tensor, token_mask: Tensor | None, num_experts: int, top_k: int, block_m: int, shared: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch reference of moe_align_triton (stable order inside each expert; host sync, for tests)."""
    nk = flat_ids.numel()
    ids = flat_ids.long().clone()
    if token_mask is not None:
        drop = ~token_mask.bool().repeat_interleave(top_k)
        if shared:
            drop &= ids != num_experts - 1
        ids[drop] = num_experts
    max_blocks = triton.cdiv(nk, block_m) + min(num_experts, nk)
    sorted_ids = torch.full((max_blocks * block_m,), nk, dtype=torch.int32, device=flat_ids.device)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=flat_ids.device)
    row = 0
    for e in range(num_experts):
        members = torch.nonzero(ids == e).flatten()
        if members.numel() == 0:
            continue
        sorted_ids[row : row + members.numel()] = members.int()
        nblk = triton.cdiv(members.numel(), block_m)
        block_expert[row // block_m : row // block_m + nblk] = e
        row += nblk * block_m
    num_blocks = torch.tensor([row // block_m], dtype=torch.int32, device=flat_ids.device)
    mask = _mask_i8(token_mask) if token_mask is not None else sorted_ids
    return sorted_ids, block_expert, num_blocks, mask


def moe_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per expert block, from shapes only: 16 while experts see few tokens each, larger for prefill."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 8:
        return 16
    if per_expert <= 32:
        return 32
    return 64


# tile configs (BLOCK_N, BLOCK_K, num_warps, num_stages) per block_m; the bench can override them
MOE_CONFIGS = {
    16: {"gate_up": (32, 128, 4, 4), "down": (128, 128, 8, 3)},
    32: {"gate_up": (64, 64, 4, 4), "down": (64, 64, 4, 4)},
    64: {"gate_up": (64, 64, 4, 3), "down": (128, 64, 8, 3)},
}
# Launch structure by N*k (bench/kernels_moe_attn.py sweep on an H200, bench/NOTES_moe_attn.md): grouping inside
# the gate/up kernel saved ~2.5 us up to N=4 and lost beyond N=16; the down kernel's own reduction (one launch
# fewer) measured within noise at N=1, so it is off by default (it also needs counters shared per device).
FUSE_ALIGN_MAX_NK = 32  # grouping inside the gate/up kernel up to this many assignments
# Up to MOE_GEMV_MAX_N tokens the experts run as per-assignment GEMVs (`_moe_gemv_*`: no grouping, thousands of
# small one-shot programs; the grouped kernels' ~160 programs of 256 KB at one token leave part of the SMs a
# second wave). HYBRIDSPEC_MOE_GEMV_MAX_N (read at import; 0: the grouped kernels at every size) for A/B; config
# "gemv" forces either path, and a config with any of GROUPED_CONFIG_KEYS (and no "gemv") runs the grouped kernels.
# MOE_GEMV_TILES: (gate/up columns a program, its warps, down rows a program, its warps).
MOE_GEMV_MAX_N = _env_int("HYBRIDSPEC_MOE_GEMV_MAX_N", 2, 0, 64)
MOE_GEMV_TILES = (2, 8, 8, 4)
# In a captured step under PDL the GEMV gate/up's shared-expert programs (launched first) sum before their prologue,
# while the route runs (the shared weights and x are not the route's). HYBRIDSPEC_MOE_SHARED_EARLY=0 (read at
# import) turns it off. Measured on an H100 (5d8ded4, bench/NOTES.md 2026-12-06 23:28): the MoE tail at one token
# 26.90 -> 25.76 us at the default tiles, at two 40.38 -> 39.42 (bench/moe_gemv.py); with DECODE_SHORT_CHAIN the AR
# step at B=1 faster in 6 of 6 rounds (3.008 -> 2.979 ms over four), B=2 unchanged (3.908 / 3.907)
MOE_SHARED_EARLY = _env_int("HYBRIDSPEC_MOE_SHARED_EARLY", 1, 0, 1) == 1
GROUPED_CONFIG_KEYS = frozenset(("block_m", "gate_up", "down", "fuse_align", "fuse_reduce"))
FUSE_REDUCE_MAX_NK = 0  # reduction by the down kernel's last program up to this many assignments

_counters: dict = {}


class MoeRows(NamedTuple):
    """fused_moe_triton(..., reduce=False): the down kernel's per-assignment rows and what summing them needs
    (the arguments of `_sum_assignments`)."""

    y: Tensor  # [N*k, H] row n*k + j: topk_weights[n, j] times expert topk_ids[n, j]'s output for token n
    mask: Tensor  # [N] int8 token mask as the kernels read it (a dummy without one)
    ids: Tensor  # [N*k] expert ids (the flat topk_ids)
    num_ids: int  # expert ids 0..num_ids-1 (with the shared expert: E + 1, its id E)
    has_mask: bool
    shared: bool


def _reduce_counters(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 counters the fused-reduce down kernel leaves at zero (one set per device: calls on one
    device must not run concurrently on different streams)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def fused_moe_triton(
    x: Tensor,  # [N, H]
    w_gate_up: Tensor,  # [E, 2I, H]
    w_down: Tensor,  # [E, H, I]
    topk_weights: Tensor,  # [N, k]
    topk_ids: Tensor,  # [N, k] int64
    token_mask: Tensor | None = None,  # [N] bool; False rows get no routed expert work (only the shared slot)
    config: dict | None = None,  # {"block_m", "gate_up": (BN, BK, warps, stages), "down", "fuse_align", "fuse_reduce",
    #                               "gemv": bool, "gemv_tiles": (BI, warps, BH, warps)}
    shared: tuple[Tensor, Tensor] | None = None,  # (w_gate_up_s [2I_s, H], w_down_s [H, I_s]): expert id E
    stats: tuple[Tensor, Tensor | None] | None = None,  # out: (distinct [] int64, counts [E] int64 or None)
    reduce: bool = True,  # False: no reduce launch; returns MoeRows (the caller's kernel sums each token's rows)
) -> Tensor | MoeRows:
    """sum_j topk_weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = topk_ids[n, j]. Returns [N, H].

    As fused_moe_ref, on the device without a host sync (graph-capturable). With `shared`, id E is one more
    expert read from the shared expert's own tensors (no copy of any weights; I_s != I handled by masks: column
    tiles past an expert's width exit at once, its down product runs over its own width), grouped, weighted and
    reduced with the routed slots: the shared expert costs no launch of its own. A masked token keeps its shared
    slot (fused_moe_ref). Tiles and the in-kernel grouping threshold follow the routed assignments (N * (k - 1)
    with the shared slot), as without it.

    `stats` (the caller's buffers): the grouping also writes the step's routing statistics (expert_counts_ref of
    the routed slots of unmasked tokens: the distinct experts 0..E-1 they touch and, unless counts is None, their
    count per expert) from the histogram it computes anyway: program (0, 0) of the gate/up kernel where the
    grouping runs inside it, else the align kernel's one program; no launch of their own (a runtime flag, not a
    constexpr: no extra compiles).

    `reduce=False`: stops after the down kernel and returns MoeRows (y [N*k, H], one weighted row per assignment,
    and what a reduction of them needs), for a caller whose own kernel sums each token's rows
    (fused_moe_add_rmsnorm_triton). The down kernel's own reduction (config "fuse_reduce") is then off; asking
    for both is an error."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    inter = two_i // 2
    dev = x.device
    cfg = dict(config or {})
    if not reduce and cfg.get("fuse_reduce"):
        raise ValueError("fused_moe_triton: config fuse_reduce=True (the down kernel sums each token's rows into "
                         "[N, H]) and reduce=False (the caller sums the rows of y) exclude each other")
    if num_tokens == 0:
        _zero_stats(stats)
        if not reduce:
            y0 = torch.empty(0, hidden, dtype=x.dtype, device=dev)
            return MoeRows(y0, y0, topk_ids.reshape(-1), num_experts + (shared is not None), token_mask is not None,
                           shared is not None)
        return torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    # the GEMV gate/up's shared programs read x and the shared weights before their PDL wait: not a copy made now
    shared_early = x.stride(-1) == 1 and shared is not None and shared[0].stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    w_down = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    if shared is not None:
        ws_gu, ws_dn = (w if w.stride(-1) == 1 else w.contiguous() for w in shared)
        inter_s = ws_gu.shape[0] // 2
        if ws_gu.shape != (2 * inter_s, hidden) or ws_dn.shape != (hidden, inter_s):
            raise ValueError(f"shared expert weights {tuple(ws_gu.shape)}, {tuple(ws_dn.shape)} do not match hidden "
                             f"size {hidden}")
        ids_total = num_experts + 1  # the shared expert is id E
        routed_k = top_k - 1  # tiles and thresholds as for the routed slots alone
    else:
        ws_gu, ws_dn, inter_s = w_gate_up, w_down, inter  # dummies (the kernels never read them)
        ids_total, routed_k = num_experts, top_k
    inter_max = max(inter, inter_s)
    ids = topk_ids.reshape(-1).contiguous()  # [NK]
    rw = topk_weights.reshape(-1).contiguous()  # [NK]
    nk = ids.numel()
    # a config that sets the grouped kernels' tiles or launch structure runs them (benches time those at any N)
    if cfg.get("gemv", num_tokens <= MOE_GEMV_MAX_N and not GROUPED_CONFIG_KEYS & cfg.keys()):
        if cfg.get("fuse_reduce"):
            raise ValueError("fused_moe_triton: config gemv=True (per-assignment GEMVs, summed by the reduce kernel) "
                             "and fuse_reduce=True (the grouped down kernel's own sum) exclude each other")
        y, mask = _moe_gemv(x, w_gate_up, w_down, ws_gu, ws_dn, ids, rw, token_mask, stats, num_experts, ids_total,
                            top_k, inter, inter_s, shared is not None, cfg.get("gemv_tiles", MOE_GEMV_TILES),
                            shared_early)
        if not reduce:
            return MoeRows(y, mask, ids, ids_total, token_mask is not None, shared is not None)
        return _reduce(y, mask, ids, ids_total, num_tokens, top_k, token_mask is not None, shared is not None)
    block_m = cfg.get("block_m") or moe_block_m(num_tokens, max(routed_k, 1), num_experts)
    tiles = {**MOE_CONFIGS[block_m if block_m in MOE_CONFIGS else 64], **cfg}
    fuse_align = cfg.get("fuse_align", num_tokens * routed_k <= FUSE_ALIGN_MAX_NK)
    fuse_reduce = cfg.get("fuse_reduce", num_tokens * routed_k <= FUSE_REDUCE_MAX_NK)
    if (shared is not None and token_mask is not None) or not reduce:
        fuse_reduce = False  # the separate reduce adds a masked token's shared slot (the down kernel's does not)
    max_blocks = triton.cdiv(nk, block_m) + min(ids_total, nk)
    max_rows = max_blocks * block_m
    e_p2 = triton.next_power_of_2(ids_total + 1)
    has_mask = token_mask is not None

    if fuse_align:
        work = torch.empty(max_rows + max_blocks + 1, dtype=torch.int32, device=dev)
        sorted_ids = work[:max_rows]
        block_expert = work[max_rows : max_rows + max_blocks]
        num_blocks = work[max_rows + max_blocks :]
        mask = _mask_i8(token_mask) if has_mask else work
        stats_distinct, stats_counts, stats_flag = _stats_args(stats, num_experts, dev)
    else:
        sorted_ids, block_expert, num_blocks, mask = moe_align_triton(ids, token_mask, ids_total, top_k, block_m,
                                                                      shared is not None, stats)
        stats_distinct, stats_counts, stats_flag = _stats_args(None, num_experts, dev)  # written by the align

    h = torch.empty(max_rows, inter_max, dtype=x.dtype, device=dev)  # [max_rows, max(I, I_s)]
    bn, bk, warps, stages = tiles["gate_up"]
    bk = min(bk, max(16, triton.next_power_of_2(hidden)))
    _moe_gate_up_kernel[(max_blocks, triton.cdiv(inter_max, bn))](
        x, w_gate_up, ws_gu, h, sorted_ids, block_expert, num_blocks, ids, mask, stats_distinct, stats_counts,
        stats_flag, nk, ids_total, hidden, inter, inter_s, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        ws_gu.stride(0), h.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, FUSED_ALIGN=fuse_align, HAS_MASK=has_mask,
        E_P2=e_p2, NK_P2=triton.next_power_of_2(max(nk, FUSE_ALIGN_MAX_NK)) if fuse_align else 1,
        SHARED=shared is not None, num_warps=warps, num_stages=stages, **pdl_args(x.device))

    y = torch.empty(nk, hidden, dtype=x.dtype, device=dev)  # [N*k, H] one row per assignment
    # [N, H] the down kernel's own sum (y: a dummy, never written)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev) if fuse_reduce else y
    bn, bk, warps, stages = tiles["down"]
    bk = min(bk, max(16, triton.next_power_of_2(inter_max)))
    grid_n = triton.cdiv(hidden, bn)
    counters = _reduce_counters(dev, grid_n) if fuse_reduce else num_blocks
    _moe_down_kernel[(max_blocks, grid_n)](
        h, w_down, ws_dn, y, rw, sorted_ids, block_expert, num_blocks, out, mask, counters, nk, ids_total, hidden,
        inter, inter_s, h.stride(0), w_down.stride(0), w_down.stride(1), ws_dn.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, TOP_K=top_k, FUSED_REDUCE=fuse_reduce, HAS_MASK=has_mask,
        FENCE=fuse_reduce and x.is_cuda, RED_T=16, SHARED=shared is not None, num_warps=warps, num_stages=stages,
        **pdl_args(h.device))

    if not reduce:
        return MoeRows(y, mask, ids, ids_total, has_mask, shared is not None)
    if not fuse_reduce:
        return _reduce(y, mask, ids, ids_total, num_tokens, top_k, has_mask, shared is not None)
    return out


def _reduce(y: Tensor, mask: Tensor, ids: Tensor, ids_total: int, num_tokens: int, top_k: int, has_mask: bool,
            shared: bool) -> Tensor:
    """`_moe_reduce_kernel`: [N, H] sums of each token's rows of y [N*k, H]."""
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_reduce_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, mask, out, ids, ids_total, hidden, TOP_K=top_k, HAS_MASK=has_mask, BLOCK_H=block_h, SHARED=shared,
        num_warps=4, **pdl_args(y.device))
    return out


def _moe_gemv(x: Tensor, w_gate_up: Tensor, w_down: Tensor, ws_gu: Tensor, ws_dn: Tensor, ids: Tensor, rw: Tensor,
              token_mask: Tensor | None, stats, num_experts: int, ids_total: int, top_k: int, inter: int,
              inter_s: int, shared: bool, tiles: tuple[int, int, int, int],
              shared_early: bool = False) -> tuple[Tensor, Tensor]:
    """fused_moe_triton's experts as per-assignment GEMVs (two launches, no grouping): (y [N*k, H], one weighted
    row per kept assignment; the int8 mask the reduce reads). The routing statistics from program (0, 0).
    `shared_early`: x and the shared weights are the caller's tensors (no copy launched just now), so in a captured
    step the shared programs may read them before their PDL wait (MOE_SHARED_EARLY)."""
    nk, hidden = ids.numel(), x.shape[1]
    dev = x.device
    has_mask = token_mask is not None
    mask = _mask_i8(token_mask) if has_mask else ids  # (a dummy without a mask)
    stats_distinct, stats_counts, stats_flag = _stats_args(stats, num_experts, dev)
    inter_max = max(inter, inter_s)
    block_i, warps_i, block_h, warps_h = tiles
    h = torch.empty(nk, inter_max, dtype=x.dtype, device=dev)  # [N*k, max(I, I_s)]
    _moe_gemv_gate_up_kernel[(triton.cdiv(inter_max, block_i), nk)](
        x, w_gate_up, ws_gu, h, ids, mask, stats_distinct, stats_counts, stats_flag, nk, ids_total, hidden, inter,
        inter_s, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), ws_gu.stride(0), h.stride(0),
        early=int(shared_early and MOE_SHARED_EARLY and early_reads(dev)), TOP_K=top_k, BLOCK_I=block_i,
        BLOCK_K=min(triton.next_power_of_2(hidden), 4096), HAS_MASK=has_mask,
        E_P2=triton.next_power_of_2(ids_total + 1), NK_P2=triton.next_power_of_2(max(nk, 16)), SHARED=shared,
        num_warps=warps_i, **pdl_args(dev))
    y = torch.empty(nk, hidden, dtype=x.dtype, device=dev)  # [N*k, H] one row per assignment
    _moe_gemv_down_kernel[(nk, triton.cdiv(hidden, block_h))](
        h, w_down, ws_dn, y, rw, ids, mask, ids_total, hidden, inter, inter_s, h.stride(0), w_down.stride(0),
        w_down.stride(1), ws_dn.stride(0), y.stride(0), int(early_reads(dev)), TOP_K=top_k, BLOCK_H=block_h,
        BLOCK_K=min(triton.next_power_of_2(inter_max), 2048), HAS_MASK=has_mask, SHARED=shared, num_warps=warps_h,
        **pdl_args(dev))
    return y, mask


def fused_moe_add_rmsnorm_triton(
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
    config: dict | None = None,  # fused_moe_triton's (its "fuse_reduce" must stay off)
) -> tuple[Tensor, Tensor]:
    """kernels.moe.fused_moe_add_rmsnorm_ref: (s, rmsnorm(s)) with s = residual + fused_moe(...), each [N, H] in
    the residual's dtype. fused_moe_triton without its reduce launch, then `_moe_reduce_rmsnorm_kernel` sums each
    token's rows, adds the residual and normalizes (one launch where fused_moe + add_rmsnorm took two), with the
    two-kernel path's roundings: the same values. The routing statistics as fused_moe_triton's."""
    n, hidden = topk_ids.shape[0], x.shape[-1]
    if residual.shape != (n, hidden) or norm_weight.shape != (hidden,):
        raise ValueError(f"fused_moe_add_rmsnorm: residual {tuple(residual.shape)} and norm weight "
                         f"{tuple(norm_weight.shape)} do not match [{n}, {hidden}]")
    rows = fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, token_mask, config=config, shared=shared,
                            stats=stats, reduce=False)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    norm_weight = norm_weight.contiguous()
    s = torch.empty(n, hidden, dtype=residual.dtype, device=residual.device)
    out = torch.empty(n, hidden, dtype=residual.dtype, device=residual.device)
    if n:
        block_h = triton.next_power_of_2(hidden)
        _moe_reduce_rmsnorm_kernel[(n,)](
            rows.y, rows.mask, rows.ids, residual, norm_weight, s, out, rows.num_ids, hidden, residual.stride(0),
            s.stride(0), out.stride(0), float(eps), TOP_K=topk_ids.shape[1], HAS_MASK=rows.has_mask,
            BLOCK_H=block_h, SHARED=rows.shared, num_warps=REDUCE_NORM_WARPS or (4 if block_h <= 1024 else 16),
            **pdl_args(rows.y.device))
    return s, out
