"""Dense projections of a few rows in Triton: `linear_small_triton(x [N, K], weight [M, K], bias [M] | None)`,
kernels.gemv.linear_small_ref's signature and semantics (fp32 products and sums, the bias in fp32, one rounding to
x's dtype), for 1 <= N <= GEMV_MAX_ROWS.

One launch, no split-K reduce, no host synchronization (capturable in a CUDA graph). Each program owns BLOCK_M
output rows over all of K: it streams its [BLOCK_M, K] slice of the weight in [BLOCK_M, BLOCK_K] tiles (wide
vector loads, every weight byte read once for all N input rows) and keeps the sums on the CUDA cores (tl.dot's
16-row minimum would pad N = 1 sixteen times). Bytes in flight per SM are what bound a GEMV on the H200 (~30 KB a
SM for 4.3 TB/s at ~1 us DRAM latency), so a configuration is (BLOCK_M, BLOCK_K, warps, stages):
  - stages > 1: the K loop is software-pipelined (`tl.range(num_stages=...)`: cp.async copies of the next
    stages - 1 tiles into shared memory while the current one is summed);
  - stages = 1 with BLOCK_K >= K: one tile per program, all of its loads issued at once ("one-shot"); bytes in
    flight come from many small resident programs.
CONFIGS names the candidates bench/kernels_gemv.py times; SHAPE_TABLE picks one per (M, K) (and optionally per
BLOCK_N), DEFAULT otherwise. HYBRIDSPEC_GEMV_CONFIG=<name> (read at import) forces one for every shape.

Compile keys: N and M are not specialized (no recompile per row count or width); BLOCK_N = next power of two of N,
the configuration, HAS_BIAS, the dtypes and K / strides' divisibility by 16 are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gemv import GEMV_MAX_ROWS, linear_small_ref
from kernels.pdl import early_reads, pdl_args, pdl_prologue


@triton.jit
def _gemv_tile(acc, w, x_ptr, stride_xn, k0, k, kmask, N, cols, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += w [BLOCK_M, BLOCK_K] . x[:, k0 + k]^T for the N input rows (fp32)."""
    for i in tl.static_range(BLOCK_N):
        xi = tl.load(x_ptr + i * stride_xn + k0 + k, mask=kmask & (i < N), other=0.0).to(tl.float32)
        part = tl.sum(w * xi[None, :], axis=1)  # [BLOCK_M]
        acc = tl.where(cols[None, :] == i, acc + part[:, None], acc)
    return acc


@triton.jit(do_not_specialize=["N", "M", "early"])  # (early: one compile for eager and captured calls)
def _gemv_kernel(
    x_ptr,  # [N, K], unit column stride
    w_ptr,  # [M, K], unit column stride
    b_ptr,  # [M] (HAS_BIAS) or a dummy
    out_ptr,  # [N, M] contiguous, x's dtype
    N,
    M,
    K,
    stride_xn,
    stride_wm,
    early,  # 1: the first weight tile is read before the PDL prologue (kernels/pdl.py early_reads), 0: after
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= N: every input row in one program (the weights are read once)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the K loop (1: none)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wm + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # out^T: the row sums land in this layout without a shuffle
    # with `early` the first weight tile (all of it where K <= BLOCK_K) is in flight while the kernel before this one
    # finishes (kernels/pdl.py); the input rows are read after the prologue
    # (the weights are read once per step: evict_first keeps them from evicting activations / states from L2)
    if early == 0:
        pdl_prologue(PDL)
    kmask = k < K
    w = tl.load(w_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0,
                eviction_policy="evict_first").to(tl.float32)  # [BLOCK_M, BLOCK_K]
    if early != 0:
        pdl_prologue(PDL)
    acc = _gemv_tile(acc, w, x_ptr, stride_xn, 0, k, kmask, N, cols, BLOCK_N)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        kmask = (k0 + k) < K
        w = tl.load(w_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        acc = _gemv_tile(acc, w, x_ptr, stride_xn, k0, k, kmask, N, cols, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols[None, :] < N))


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_k: int
    warps: int
    stages: int


# candidates (bench/kernels_gemv.py times each at every shape); sm_90 compiles (triton 3.6 and 3.7, bf16, BLOCK_N
# 1..8): no spills, 38-172 registers, shared memory up to 66 KB (the pipelined ones), ~0 (the one-shot ones)
CONFIGS: dict[str, GemvConfig] = {
    "m4k512w4s4": GemvConfig(4, 512, 4, 4),  # 4 KB tiles, 3 in flight a program, many programs
    "m8k512w4s4": GemvConfig(8, 512, 4, 4),  # 8 KB tiles, 3 in flight a program
    "m16k256w4s4": GemvConfig(16, 256, 4, 4),  # 8 KB tiles, a warp per 4 rows: no cross-warp reduction
    "m16k512w8s3": GemvConfig(16, 512, 8, 3),  # 16 KB tiles, 2 in flight a program
    "m8k1024w8s3": GemvConfig(8, 1024, 8, 3),  # 16 KB tiles, fewer loop trips
    "m4k512w4s1": GemvConfig(4, 512, 4, 1),  # one-shot at K = 512 (4 KB a program)
    "m2k2048w4s1": GemvConfig(2, 2048, 4, 1),  # one-shot at K = 2048 (8 KB a program)
    "m4k2048w8s1": GemvConfig(4, 2048, 8, 1),  # one-shot at K = 2048 (16 KB a program)
    "m2k4096w8s1": GemvConfig(2, 4096, 8, 1),  # one-shot at K = 4096 (16 KB a program)
}
DEFAULT = "m8k512w4s4"
# (M, K) or (M, K, BLOCK_N) -> a CONFIGS name: the bench model's projections (Qwen3.6-35B-A3B shapes). Picked
# before measuring (bench/kernels_gemv.py prints the measured best per shape): the large ones want a steady
# stream (pipelined loop, several programs a SM), the small latency-bound ones every byte in flight at once.
SHAPE_TABLE: dict[tuple[int, ...], str] = {
    # measured on the H200 at N = 1 (bench/kernels_gemv.py, bench/NOTES.md 2026-12-01): cuBLAS / this kernel us
    # GDN out_proj, attention o_proj, MTP fc: 8.66 (split-K + reduce) / 7.04 (m2k2048w4s1); with PDL (kernels/pdl.py,
    # 40 calls back to back, 2026-12-01): 8.79 / 5.29 (m4k2048w8s1; m2k2048w4s1 5.68)
    (2048, 4096): "m4k2048w8s1",
    # (with PDL the others' picks are within 3% of their best: in_proj 13.38, qkv 10.45, shared gate/up 2.39, down 1.85)
    (12352, 2048): "m4k512w4s1",  # GDN in_proj (qkv, z, b, a fused): 15.99 / 14.44
    (9216, 2048): "m2k2048w4s1",  # attention q (+ gate), k, v fused: 11.85 / 11.77
    (1025, 2048): "m2k2048w4s1",  # shared expert gate/up/gate logit at one row (unpadded): 4.07 / 3.60
    (1032, 2048): "m2k2048w4s1",  # the same, padded (2+ rows)
    (2048, 512): "m4k512w4s1",  # shared expert down: 3.72 / 2.50
}
_FORCED = os.environ.get("HYBRIDSPEC_GEMV_CONFIG") or None
if _FORCED is not None and _FORCED not in CONFIGS:
    raise ValueError(f"HYBRIDSPEC_GEMV_CONFIG={_FORCED!r}: not one of {sorted(CONFIGS)}")


def pick_config(m: int, k: int, block_n: int) -> GemvConfig:
    """The configuration for an [N <= block_n, K] x [M, K]^T product (see SHAPE_TABLE)."""
    name = _FORCED or SHAPE_TABLE.get((m, k, block_n)) or SHAPE_TABLE.get((m, k)) or DEFAULT
    return CONFIGS[name]


def linear_small_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                        config: GemvConfig | str | None = None) -> Tensor:
    """kernels.gemv.linear_small_ref in one launch for 1 <= N <= GEMV_MAX_ROWS (other N: the reference).
    `config`: a GemvConfig or a CONFIGS name (benchmarks); default pick_config."""
    n, k = x.shape
    m = weight.shape[0]
    if n == 0 or n > GEMV_MAX_ROWS:
        return linear_small_ref(x, weight, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    early = early_reads(x.device) and weight.stride(-1) == 1  # (a copy made just now is read after the wait)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_n = triton.next_power_of_2(n)
    cfg = CONFIGS[config] if isinstance(config, str) else config or pick_config(m, k, block_n)
    out = torch.empty(n, m, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(m, cfg.block_m),)](
        x, weight, bias if bias is not None else weight, out, n, m, k, x.stride(0), weight.stride(0), int(early),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_args(x.device))
    return out
