"""ModelRunner: executes one scheduled step on the device and samples the next tokens.

It owns the model, its state storage, and each request's sampling generator (so a seed reproduces a
stream wherever the request runs). The engine talks to it through plain data (StepRequest/StepResult).
"""

from __future__ import annotations

import time

import torch

from scheduler.types import StepRequest, StepResult
from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.sampling import make_generator, sample


class ModelRunner:
    def __init__(self, model: HybridModel, cache: ModelCache):
        self.model, self.cache = model, cache
        self.device = model.device
        self.generators: dict[str, torch.Generator | None] = {}

    @classmethod
    def create(cls, model_config: ModelConfig, model_dir, dtype: torch.dtype, device: str, num_pages: int,
               page_size: int, num_slots: int) -> "ModelRunner":
        from workers.weights import load_weights

        model = HybridModel(model_config, dtype, device)
        load_weights(model, model_dir)
        return cls(model, ModelCache(model_config, num_pages, page_size, num_slots, dtype, device))

    def execute(self, requests: list[StepRequest]) -> StepResult:
        """Runs every request's new tokens as one ragged forward; samples for those with `sample` set.

        A request with nothing cached (context 0) starts from a zero GDN state and an empty conv window.
        """
        start = time.perf_counter()
        result = StepResult()
        if not requests:
            return result
        self.cache.reset_slots([r.slot for r in requests if r.context_len == 0])
        batch = ForwardBatch.build([r.tokens for r in requests], [r.context_len for r in requests],
                                   [r.pages for r in requests], [r.slot for r in requests], self.device)
        rows = [i for i, r in enumerate(requests) if r.sample]
        if rows:
            logit_rows = batch.last_token_rows()[rows]
            logits = self.model(batch, self.cache, logit_rows)  # [len(rows), V]
            chosen = [requests[i] for i in rows]
            gens = [self._generator(r) for r in chosen]
            tokens = sample(logits, [r.params for r in chosen], gens).tolist()
            for r, tok in zip(chosen, tokens):
                result.new_tokens[r.request_id] = [tok]
        else:
            self.model(batch, self.cache, batch.last_token_rows()[:0])
        result.step_ms = (time.perf_counter() - start) * 1e3
        return result

    def release(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests' sampling state."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, request: StepRequest) -> torch.Generator | None:
        if request.request_id not in self.generators:
            self.generators[request.request_id] = make_generator(request.params.seed, self.device)
        return self.generators[request.request_id]
