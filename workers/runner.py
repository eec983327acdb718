"""ModelRunner: turns one scheduled step (host lists) into a ragged forward and returns next-token logits."""

from __future__ import annotations

import torch
from torch import Tensor

from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.model import HybridModel


class ModelRunner:
    def __init__(self, model: HybridModel, cache: ModelCache):
        self.model, self.cache = model, cache
        self.device = model.device

    def execute(
        self,
        tokens: list[list[int]],  # new tokens per request
        context_lens: list[int],  # tokens already cached per request
        page_rows: list[list[int]],  # KV pages per request
        slots: list[int],  # GDN state slot per request
    ) -> Tensor:
        """Runs the step and returns logits [B, V] (fp32) at each request's last new token.

        A request with nothing cached (context 0) starts from a zero GDN state and an empty conv window.
        """
        self.cache.reset_slots([s for s, c in zip(slots, context_lens) if c == 0])
        batch = ForwardBatch.build(tokens, context_lens, page_rows, slots, self.device)
        return self.model(batch, self.cache).float()

    @torch.inference_mode()
    def forward_rows(self, batch: ForwardBatch, logit_rows: Tensor) -> Tensor:
        """Logits [M, V] for chosen flat rows (verification needs every drafted position)."""
        return self.model(batch, self.cache, logit_rows).float()
