"""Small per-token operations of the layers (PyTorch references; kernels/elementwise_triton.py fuses each into one
launch). Rounding follows the model's own PyTorch code: each elementwise op rounds to the tensor's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """Rotate-half rotary embedding on the first `rotary_dim` dims of each head. x [N, heads, D]; cos/sin [N, R]
    in x's dtype. Returns [N, heads, D]."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((x_rot, x_pass), dim=-1)


def gdn_gates_ref(a: Tensor, b: Tensor, neg_a: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet gates from the raw projections a, b [N, HV]: (g [N, HV] fp32 log decay
    = neg_a * softplus(a + dt_bias), beta [N, HV] = sigmoid(b) in b's dtype). neg_a = -exp(A_log) [HV] fp32."""
    return neg_a * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, [N, I] (an MLP's activation)."""
    return F.silu(gate) * up


def moe_residual_ref(x: Tensor, routed: Tensor, gate_logit: Tensor, shared: Tensor) -> Tensor:
    """The end of a MoE layer: x + (routed + sigmoid(gate_logit) * shared). x, routed, shared [N, H]; gate_logit
    [N, 1] (the shared expert's gate)."""
    return x + (routed + torch.sigmoid(gate_logit) * shared)
