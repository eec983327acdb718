"""CUDA graphs for plain decode steps (every request feeds one token, no drafts).

One graph per batch-size bucket, captured over static input buffers; a step copies its inputs into the bucket's
buffers and replays. Padding rows point at a spare KV page and a spare GDN slot that no request owns, so they
never touch real state. Inside the graph nothing syncs with the host: attention is planned for the page table's
full width (no host lengths), GDN/conv/MoE kernels take device tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.model import HybridModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static input buffers
    logits: Tensor  # static output [B, V]


class DecodeGraphs:
    def __init__(self, model: HybridModel, cache: ModelCache, max_batch: int, spare_page: int, spare_slot: int):
        self.model, self.cache = model, cache
        self.max_pages = cache.num_pages
        self.spare_page, self.spare_slot = spare_page, spare_slot
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, _Captured] = {}
        self.width = 0  # page-table columns of the captured graphs

    def capture(self, max_pages_per_request: int) -> None:
        self.width = max_pages_per_request
        pool = None
        for size in self.buckets:
            batch = self._static_batch(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compile and warm every kernel outside the capture
                for _ in range(2):
                    self.model(batch, self.cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(batch, self.cache)
            pool = graph.pool()
            self.graphs[size] = _Captured(graph, batch, logits)

    def _static_batch(self, size: int) -> ForwardBatch:
        device = self.model.device
        return ForwardBatch(
            input_ids=torch.zeros(size, dtype=torch.int64, device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            request_of_row=torch.arange(size, dtype=torch.int64, device=device),
            cu_seqlens=torch.arange(size + 1, dtype=torch.int32, device=device),
            context_lens=torch.zeros(size, dtype=torch.int32, device=device),
            page_table=torch.full((size, self.width), self.spare_page, dtype=torch.int32, device=device),
            state_slots=torch.full((size,), self.spare_slot, dtype=torch.int64, device=device),
            query_lens=[1] * size,
            context_lens_host=None,  # type: ignore[arg-type]  # attention plans for the full page-table width
        )

    def fits(self, batch_size: int, max_pages: int) -> bool:
        return bool(self.graphs) and batch_size <= self.buckets[-1] and max_pages <= self.width

    def run(self, tokens: list[int], context_lens: list[int], page_rows: list[list[int]], slots: list[int]) -> Tensor:
        """One decode step for len(tokens) requests; returns logits [B, V] (fp32)."""
        size = next(b for b in self.buckets if b >= len(tokens))
        cap = self.graphs[size]
        pad = size - len(tokens)
        table = torch.full((size, self.width), self.spare_page, dtype=torch.int32)
        for i, row in enumerate(page_rows):
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        b = cap.batch
        b.input_ids.copy_(torch.tensor(tokens + [0] * pad), non_blocking=True)
        b.positions.copy_(torch.tensor(context_lens + [0] * pad), non_blocking=True)
        b.context_lens.copy_(torch.tensor(context_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        b.page_table.copy_(table, non_blocking=True)
        b.state_slots.copy_(torch.tensor(slots + [self.spare_slot] * pad), non_blocking=True)
        cap.graph.replay()
        return cap.logits[:len(tokens)]
