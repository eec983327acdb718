"""Device storage for per-request model state: paged attention KV and GDN slots.

Addressed only through a request's page table and state slot (handed out by scheduler.memory), never by
batch position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from workers.config import ModelConfig


@dataclass
class AttentionKV:
    k: Tensor  # [P, page_size, HKV, D]
    v: Tensor  # [P, page_size, HKV, D]


@dataclass
class GDNState:
    recurrent: Tensor  # [S, HV, DK, DV] fp32
    conv: Tensor  # [S, conv_dim, K-1] in the model dtype


class ModelCache:
    """All layers' state: `layers[i]` is an AttentionKV or a GDNState (by the layer's type)."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.config, self.num_pages, self.page_size, self.num_slots = config, num_pages, page_size, num_slots
        self.layers: list[AttentionKV | GDNState] = []
        for kind in config.layer_types:
            if kind == "full_attention":
                shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
                self.layers.append(AttentionKV(torch.zeros(shape, dtype=dtype, device=device),
                                               torch.zeros(shape, dtype=dtype, device=device)))
            else:
                rec = (num_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                       config.linear_value_head_dim)
                conv = (num_slots, config.conv_dim, config.linear_conv_kernel_dim - 1)
                self.layers.append(GDNState(torch.zeros(rec, dtype=torch.float32, device=device),
                                            torch.zeros(conv, dtype=dtype, device=device)))

    def reset_slots(self, slots: list[int]) -> None:
        """Zero the GDN state of freshly allocated slots (a new request starts from S = 0, empty window)."""
        if not slots:
            return
        for layer in self.layers:
            if isinstance(layer, GDNState):
                idx = torch.tensor(slots, device=layer.recurrent.device)
                layer.recurrent[idx] = 0
                layer.conv[idx] = 0

    def gdn_bytes_per_request(self) -> int:
        """Persistent GDN bytes one request holds: one recurrent state and one conv window per GDN layer
        (independent of the verification length: drafts live only in the per-step scratch)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, GDNState):
                total += layer.recurrent[0].numel() * layer.recurrent.element_size()
                total += layer.conv[0].numel() * layer.conv.element_size()
        return total

    @staticmethod
    def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return len(config.attention_layers) * 2 * config.num_key_value_heads * config.head_dim * elem


@dataclass
class GDNScratch:
    """One GDN layer's block inputs from a verification forward, kept until the commit (a few KB/token)."""

    conv_in: Tensor  # [N, conv_dim] inputs of the short conv
    k: Tensor  # [N, HK, DK] keys after the conv (before L2 norm)
    v: Tensor  # [N, HV, DV]
    g: Tensor  # [N, HV] fp32 log decay
    beta: Tensor  # [N, HV]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_in, self.k, self.v, self.g, self.beta))


@dataclass
class StepScratch:
    """Per-step scratch of every GDN layer (by layer index). Its size is O(tokens in the step)."""

    layers: dict[int, GDNScratch]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers.values())
