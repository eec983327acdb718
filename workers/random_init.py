"""Random weights for models without a checkpoint (the embedded default model, the bench model).

Scales keep every layer meaningful (not the near-identity of std 0.02 on tiny widths): matrices
N(0, 1/fan_in), RMSNorm offsets small, GDN decay rates in a realistic range.
"""

from __future__ import annotations

import math

import torch

from workers.model import HybridModel


@torch.no_grad()
def init_random_(model: HybridModel, seed: int, matrix_gain: float = 1.0) -> HybridModel:
    """Fills every parameter of `model` in place, deterministically from `seed` (on the model's device)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 8.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, device=p.device, generator=gen))
        elif p.dim() == 1:  # zero-centred RMSNorm weights (applied as 1 + w)
            p.copy_(0.1 * torch.randn(p.shape, device=p.device, generator=gen))
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen) / math.sqrt(p.shape[-1]))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen))
        else:
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, device=p.device, generator=gen, dtype=torch.float32)
                    * (matrix_gain / math.sqrt(fan_in)))
    return model
