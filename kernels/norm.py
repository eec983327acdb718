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


def add_rmsnorm_ref(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add and the next RMSNorm: (s, rmsnorm(s)) with s = x + h in x's dtype. x, h [N, D]."""
    s = x + h
    return s, rmsnorm_ref(s, weight, eps)


def moe_residual_rmsnorm_ref(x: Tensor, routed: Tensor, gate_logit: Tensor, shared: Tensor, weight: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    """The end of a MoE layer and the next layer's input norm: (s, rmsnorm(s)) with
    s = x + (routed + sigmoid(gate_logit) * shared) (kernels.elementwise.moe_residual_ref)."""
    from kernels.elementwise import moe_residual_ref
    s = moe_residual_ref(x, routed, gate_logit, shared)
    return s, rmsnorm_ref(s, weight, eps)
