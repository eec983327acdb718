"""ModelRunner: executes one scheduled step on the device: drafting, one ragged verification forward,
acceptance, and the commit of exactly the accepted tokens.

It owns the model, its state storage, the drafter and each request's sampling generator (so a seed reproduces a
stream wherever the request runs). The engine talks to it through plain data (StepRequest / StepResult).
"""

from __future__ import annotations

import time

import torch

from scheduler.types import StepRequest, StepResult
from workers.acceptance import accept
from workers.batch import ForwardBatch
from workers.cache import ModelCache, StepScratch
from workers.config import ModelConfig
from workers.drafters import Drafter, DraftRequest
from workers.model import HybridModel
from workers.sampling import make_generator

POLICIES = ("ar", "fixed")


class ModelRunner:
    def __init__(self, model: HybridModel, cache: ModelCache, drafter: Drafter | None = None,
                 policy: str = "fixed"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES} in this build, got {policy!r}")
        self.model, self.cache, self.drafter, self.policy = model, cache, drafter, policy
        self.device = model.device
        self.generators: dict[str, torch.Generator | None] = {}

    @classmethod
    def create(cls, model_config: ModelConfig, model_dir, dtype: torch.dtype, device: str, num_pages: int,
               page_size: int, num_slots: int) -> "ModelRunner":
        from workers.weights import load_weights

        model = HybridModel(model_config, dtype, device)
        load_weights(model, model_dir)
        return cls(model, ModelCache(model_config, num_pages, page_size, num_slots, dtype, device))

    def verification_lengths(self, requests: list[StepRequest], proposals: list[list[int]]) -> list[int]:
        """The policy: how many of each request's drafts to verify (0 = plain decoding)."""
        if self.policy == "ar":
            return [0] * len(requests)
        return [min(len(p), r.draft_cap) for r, p in zip(requests, proposals)]

    def execute(self, requests: list[StepRequest]) -> StepResult:
        """Runs every request's tokens as one ragged forward. Prefill chunks advance their state directly;
        decodes verify their drafts (if any) without writing GDN state, and the commit replays exactly the
        accepted tokens. A request with nothing cached starts from a zero GDN state."""
        start = time.perf_counter()
        result = StepResult()
        if not requests:
            return result
        fresh = [r for r in requests if r.context_len == 0]
        self.cache.reset_slots([r.slot for r in fresh])
        if self.drafter is not None and fresh:
            self.drafter.release([r.request_id for r in fresh])  # (re)starting: forget stale draft state
        decode = [i for i, r in enumerate(requests) if r.sample and len(r.tokens) == 1 and r.context_len > 0]
        drafts: dict[int, list[int]] = {}
        draft_probs: dict[int, torch.Tensor | None] = {}
        draft_reqs: list[DraftRequest] = []
        if self.drafter is not None and self.policy != "ar":
            spec = [i for i in decode if requests[i].draft_cap > 0]
            draft_reqs = [self._draft_request(requests[i]) for i in spec]
            if draft_reqs:
                proposal = self.drafter.propose(draft_reqs)
                lengths = self.verification_lengths([requests[i] for i in spec], proposal.tokens)
                for i, toks, probs, n in zip(spec, proposal.tokens, proposal.probs, lengths):
                    if n > 0:  # L = 0 is plain decoding
                        drafts[i] = toks[:n]
                        draft_probs[i] = probs[:n] if probs is not None else None
        blocks = [r.tokens + drafts.get(i, []) for i, r in enumerate(requests)]
        batch = ForwardBatch.build(blocks, [r.context_len for r in requests], [r.pages for r in requests],
                                   [r.slot for r in requests], self.device)
        # logits: every position of a verified block, the last position of other sampling requests
        rows, spans = [], {}
        starts = batch.cu_seqlens.tolist()
        for i, r in enumerate(requests):
            if not r.sample:
                continue
            first = starts[i + 1] - 1 - len(drafts.get(i, []))
            spans[i] = (len(rows), len(rows) + starts[i + 1] - first)
            rows.extend(range(first, starts[i + 1]))
        write = torch.tensor([i not in drafts for i in range(len(requests))], device=self.device)
        scratch = StepScratch({}) if drafts else None
        needs_hidden = getattr(self.drafter, "needs_hidden", False)
        out = self.model(batch, self.cache, torch.tensor(rows, dtype=torch.long, device=self.device),
                         write=True if scratch is None else write, scratch=scratch, return_hidden=needs_hidden)
        logits, hidden = out if needs_hidden else (out, None)
        keep = [len(b) for b in blocks]
        accepted_counts = {}
        for i, (lo, hi) in spans.items():
            r = requests[i]
            a, new = accept(logits[lo:hi], drafts.get(i, []), draft_probs.get(i), r.params, self._generator(r))
            result.new_tokens[r.request_id] = new
            if i in drafts:
                keep[i] = len(r.tokens) + a
                result.draft_tokens[r.request_id] = len(drafts[i])
                result.accepted_tokens[r.request_id] = a
            accepted_counts[i] = a
        if scratch is not None:
            self.model.commit(batch, self.cache, scratch, torch.tensor(keep, device=self.device), written=write)
        if draft_reqs:
            self.drafter.commit(draft_reqs, [accepted_counts.get(i, 0) if i in drafts else 0 for i in spec])
        if hidden is not None:  # the MTP head pairs every committed token with the target's hidden state
            self.drafter.observe([(r.request_id, blocks[i][:keep[i]], hidden[starts[i]:starts[i] + keep[i]],
                                   r.context_len, r.pages, r.slot) for i, r in enumerate(requests)])
        result.step_ms = (time.perf_counter() - start) * 1e3
        return result

    def _draft_request(self, r: StepRequest) -> DraftRequest:
        return DraftRequest(r.request_id, r.all_tokens, r.context_len, r.pages, r.slot, r.draft_cap, r.params)

    def release(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests' sampling and drafting state."""
        for rid in request_ids:
            self.generators.pop(rid, None)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    def _generator(self, request: StepRequest) -> torch.Generator | None:
        if request.request_id not in self.generators:
            self.generators[request.request_id] = make_generator(request.params.seed, self.device)
        return self.generators[request.request_id]
