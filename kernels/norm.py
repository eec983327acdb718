"""RMS norms of the Qwen3-Next family (PyTorch references; computed in fp32, returned in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight). x [..., D], weight [D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rmsnorm_ref(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """GDN output norm: weight * (x / rms(x)) * silu(gate). x, gate [..., D], weight [D]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * F.silu(gate.float())).to(x.dtype)
