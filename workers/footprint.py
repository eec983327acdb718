"""What a worker will hold on its device, computed before it loads anything: weights, per-token KV, per-slot GDN
state, for the target and for a drafter with a model of its own. The engine sizes the KV page pool from it (the
pool is sized before the worker starts: free memory alone does not say what its weights will leave for KV).

Weights are counted on the meta device (the same modules the worker builds, no storage). An expert-parallel rank
holds every non-expert weight and its share of each MoE layer's routed experts (it loads only those,
ModelRunner.create's `local_experts`), counted as ceil(E / N) of E: what the even and the popularity placements
give the largest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from workers.cache import ModelCache
from workers.config import ModelConfig


@dataclass(frozen=True)
class Footprint:
    weight_bytes: int  # resident weights on one device
    kv_bytes_per_token: int  # attention KV, all layers
    state_bytes_per_slot: int  # GDN recurrent state + conv window, all layers


def _state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes per token, GDN bytes per slot), as workers/cache.py's ModelCache allocates them."""
    elem = torch.tensor([], dtype=dtype).element_size()
    gdn_layers = sum(1 for kind in cfg.layer_types if kind != "full_attention")
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32 recurrent
    state += cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem  # conv window
    return ModelCache.kv_bytes_per_token(cfg, dtype), gdn_layers * state


def _weight_bytes(module: torch.nn.Module, expert_parallel: int = 1) -> int:
    total = 0
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        n = t.numel() * t.element_size()
        if expert_parallel > 1 and ".mlp.experts." in name:
            n = -(-t.shape[0] // expert_parallel) * (n // t.shape[0])  # the largest rank's rows
        total += n
    return total


def model_footprint(cfg: ModelConfig, dtype: torch.dtype, expert_parallel: int = 1) -> Footprint:
    """The target (or a draft model): HybridModel's weights (on one of `expert_parallel` ranks) and its cache's
    per-token / per-slot bytes (every rank allocates the whole pools: engine/ep_executor.py)."""
    from workers.model import HybridModel

    kv, state = _state_bytes(cfg, dtype)
    return Footprint(_weight_bytes(HybridModel(cfg, dtype, "meta"), expert_parallel), kv, state)


def mtp_footprint(cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype) -> Footprint:
    """The MTP head of the target's checkpoint (spec 'mtp'): its layers' weights and its own cache."""
    from workers.mtp import MTPHead, count_mtp_layers

    head = MTPHead(cfg, count_mtp_layers(model_dir), dtype, "meta")
    kv, state = _state_bytes(head.config, dtype)
    return Footprint(_weight_bytes(head), kv, state)
