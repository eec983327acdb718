"""Random weights for models without a checkpoint (the embedded default model, the bench model).

Scales keep every layer meaningful (not the near-identity of std 0.02 on tiny widths): matrices
N(0, 1/fan_in), RMSNorm offsets small, GDN decay rates in a realistic range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from workers.model import HybridModel, local_expert_rows, put_experts_


@torch.no_grad()
def init_random_(model: HybridModel, seed: int, matrix_gain: float = 1.0,
                 local_experts: Sequence[Sequence[int]] | None = None) -> HybridModel:
    """Fills every parameter of `model` in place, deterministically from `seed` (on the model's device).
    `local_experts` (expert parallelism, experts built on "meta"): each MoE layer keeps only those experts' rows,
    with the values the whole model gets (a layer's full tensor is drawn, one at a time, and cut)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    keep = local_expert_rows(model, local_experts) if local_experts is not None else {}
    for name, p in list(model.named_parameters()):
        rows = keep.get(name.rsplit(".", 1)[0])
        if rows is not None:
            full = torch.randn(p.shape, device=model.device, generator=gen, dtype=torch.float32)
            full.mul_(matrix_gain / math.sqrt(p.shape[-1]))
            put_experts_(model, name, full.index_select(0, torch.tensor(rows, dtype=torch.long, device=model.device)))
            del full
            continue
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
