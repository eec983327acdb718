"""Dense projections of a few rows (PyTorch reference): out = x @ weight^T + bias, fp32 sums, one rounding.

The Triton version (kernels/gemv_triton.py, `linear_small_triton`) replaces cuBLAS for the dense projections of a
decode step at 1..SMALL_N_MAX rows (kernels.dispatch.linear; workers/model.py's Linear and FusedLinears): at one
token cuBLAS split K for the [2048 x 4096] out_proj (two kernels, 2.3x its HBM floor on the H200) and read the
fused GDN in_proj / attention qkv at 1.25x. The LM head keeps cuBLAS (HybridModel.logits calls F.linear itself).
"""

from __future__ import annotations

import os

import torch.nn.functional as F
from torch import Tensor

# rows up to which the Triton path runs the GEMV kernel (kernels.dispatch.linear); 0 turns it off. 1: on the H200
# at 2 rows it was mixed against cuBLAS (out_proj 7.3 vs 9.5 us, qkv 12.6 vs 11.9) and at 4 slower for every shape
# (in_proj 22.0 vs 16.1; bench/NOTES.md 2026-12-01)
# (HYBRIDSPEC_GEMV_MAX_N, read at import: A/B on the device without a code change)
SMALL_N_MAX = int(os.environ.get("HYBRIDSPEC_GEMV_MAX_N", "1"))
GEMV_MAX_ROWS = 8  # the most rows one launch of the kernel takes (its BLOCK_N); more rows: the reference


def linear_small_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [N, K] @ weight [M, K]^T (+ bias [M]) -> [N, M] in x's dtype: products and sums in fp32, the bias added
    in fp32, rounded once (what the kernel computes; F.linear in bf16 differs by the sums' order and rounding)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)
