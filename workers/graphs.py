"""CUDA graphs for decode and verification steps (no prefill chunk in the step).

A graph is captured lazily for each bucket (Bb requests, Nb tokens, max block 1 or up to `max_block`) over
static input buffers; a step copies its ragged batch into the bucket's buffers and replays. One graph runs the
forward (GDN/conv state advanced only for the requests in the write mask, block inputs kept for the commit,
router correction of extra tokens, distinct experts per MoE layer) and a second one the commit of the accepted
tokens. Nothing inside a step synchronizes with the host: attention and GDN take the bucket's sizes as hints and
read the real lengths from device tensors.

Buckets also differ by page-table width (a power of two covering the longest context), since attention plans
its KV splits for the table's full width.

Padding, for a step of B requests and N tokens in bucket (Bb, Nb):
  rows 0..N-1          the real tokens, request by request (cu_seqlens as in the eager batch);
  requests B..Bb-1     zero tokens (their slots and pages are the spare ones no request owns);
  requests Bb..Bb+P-1  the Nb - N padding tokens, at most `max_block` each, on the spare page and slot, never
                       written to GDN state, masked out of every MoE layer (no expert work, not counted).
P is fixed per bucket: enough for the largest padding the bucket can see. On CPU (or with `capture=False`) the
same static batches run eagerly: that path checks the padding on machines without CUDA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import dispatch
from workers.batch import ForwardBatch
from workers.cache import ModelCache, StepScratch
from workers.model import HybridModel, MoEContext

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_PAGES = 16  # narrowest page table of a graph (contexts up to 16 pages share one)
log = logging.getLogger(__name__)


def token_buckets(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ... (steps of 1/2 and 1/3) up to >= limit: few graphs to
    capture; padded rows cost dense GEMM rows only (masked out of the MoE, outside every real request)."""
    out = [1, 2, 3]
    base = 4
    while out[-1] < limit:
        out.extend(b for b in (base, base + base // 2) if b > out[-1])
        base *= 2
    while len(out) > 1 and out[-2] >= limit:  # no bucket past the first one that holds the limit ...
        out.pop()
    out[-1] = max(limit, 1)  # ... and that one exactly the limit (the shared output buffers are this tall)
    return out


@dataclass(frozen=True)
class BucketKey:
    requests: int  # Bb
    tokens: int  # Nb
    max_block: int  # 1 (plain decode) or the runner's largest block (verification)
    pages: int = 0  # page-table width: a power of two >= MIN_TABLE_PAGES covering the longest context


@dataclass
class StepOutputs:
    """Views of a replayed graph's outputs; valid until the next replay of any graph."""

    logits: Tensor  # [N, V] fp32, flat rows (every token of the step, padding cut off)
    hidden: Tensor | None  # [N, H] final-normed hidden states (drafters that need them)
    moe: MoEContext | None  # token_mask [Nb], distinct_experts, expert_counts
    captured: bool = False  # this call captured the bucket's graphs first (its time is no step time)


@dataclass
class _Graph:
    batch: ForwardBatch  # static inputs
    write: Tensor  # [R] bool: requests whose GDN state the forward advances
    extra_rows: Tensor  # [Nb] bool
    row_mask: Tensor  # [Nb] bool: real rows
    keep: Tensor  # [R] int64 commit lengths
    moe: MoEContext
    scratch: StepScratch
    logits: Tensor  # [Nb, V] static output (view of the shared buffer)
    hidden: Tensor | None
    forward: torch.cuda.CUDAGraph | None = None
    commit: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    """Lazily captured graphs for decode/verify steps of one model and cache."""

    def __init__(self, model: HybridModel, cache: ModelCache, *, max_block: int, spare_page: int, spare_slot: int,
                 page_table_width: int, max_tokens: int, return_hidden: bool = False, extra_token: bool = False,
                 collect_counts: bool = False, capture: bool | None = None, max_graphs: int = 96,
                 commits: bool = True):
        self.model, self.cache = model, cache
        self.max_block = max_block
        self.spare_page, self.spare_slot = spare_page, spare_slot
        self.width = page_table_width
        self.return_hidden, self.extra_token, self.collect_counts = return_hidden, extra_token, collect_counts
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.max_graphs = max_graphs
        # commits=False (a drafter's graphs): no commit graph and no block inputs kept; nor for plain decode
        # buckets (nothing to commit there): each kept scratch costs ~Nb x GDN layers x 28 KB at real shapes
        self.commits = commits
        self.tokens = token_buckets(max_tokens)
        self.graphs: dict[BucketKey, _Graph] = {}
        self.failed: dict[BucketKey, str] = {}  # buckets whose capture failed: those steps run eagerly
        self.pool = None
        device, vocab = model.device, model.config.vocab_size
        self.logits_out = torch.empty(self.tokens[-1], vocab, dtype=torch.float32, device=device)  # shared
        self.hidden_out = (torch.empty(self.tokens[-1], model.config.hidden_size, dtype=model.dtype, device=device)
                           if return_hidden else None)
        self.captures = 0

    # ------------------------------------------------------------------------------------------ buckets
    def bucket(self, num_requests: int, num_tokens: int, max_block: int, max_pages: int) -> BucketKey | None:
        if max_block > self.max_block or max_pages > self.width or num_tokens > self.tokens[-1]:
            return None
        reqs = next((b for b in BATCH_BUCKETS if b >= num_requests), None)
        toks = next(t for t in self.tokens if t >= num_tokens)
        if reqs is None:
            return None
        # attention plans its KV splits for the table's width, so short contexts get a narrow table
        pages = min(self.width, max(MIN_TABLE_PAGES, 1 << max(0, max_pages - 1).bit_length()))
        key = BucketKey(reqs, toks, 1 if max_block == 1 else self.max_block, pages)
        if key in self.failed or (key not in self.graphs and len(self.graphs) >= self.max_graphs):
            return None
        return key

    def _keeps_commit(self, key: BucketKey) -> bool:
        return self.commits and key.max_block > 1

    def _pad_requests(self, key: BucketKey) -> int:
        """P: padding requests for the largest padding this bucket can see (N just above the bucket below)."""
        i = self.tokens.index(key.tokens)
        smallest = self.tokens[i - 1] + 1 if i > 0 else 1
        return -(-(key.tokens - smallest) // key.max_block)

    # ------------------------------------------------------------------------------------------ capture
    def _new(self, key: BucketKey) -> _Graph:
        device = self.model.device
        r = key.requests + self._pad_requests(key)
        nb = key.tokens
        i32, i64 = torch.int32, torch.int64
        batch = ForwardBatch(
            input_ids=torch.zeros(nb, dtype=i64, device=device),
            positions=torch.zeros(nb, dtype=i64, device=device),
            request_of_row=torch.full((nb,), r - 1, dtype=i64, device=device),
            cu_seqlens=torch.zeros(r + 1, dtype=i32, device=device),
            context_lens=torch.zeros(r, dtype=i32, device=device),
            page_table=torch.full((r, key.pages), self.spare_page, dtype=i32, device=device),
            state_slots=torch.full((r,), self.spare_slot, dtype=i64, device=device),
            query_lens=[key.max_block] * r,  # size hints for the kernels; real lengths come from cu_seqlens
            context_lens_host=None,  # type: ignore[arg-type]  # attention plans for the full page-table width
        )
        # any valid layout for the capture (a used bucket always has nb <= r * max_block): all rows on padding
        # requests, on the spare page and slot
        lens = self._padding_lens(0, r, nb, key.max_block)
        batch.cu_seqlens.copy_(torch.tensor([0] + lens).cumsum(0).to(i32))
        batch.request_of_row.copy_(torch.repeat_interleave(torch.arange(r), torch.tensor(lens)))
        g = _Graph(batch=batch, write=torch.zeros(r, dtype=torch.bool, device=device),
                   extra_rows=torch.zeros(nb, dtype=torch.bool, device=device),
                   row_mask=torch.zeros(nb, dtype=torch.bool, device=device),
                   keep=torch.zeros(r, dtype=i64, device=device), moe=MoEContext(), scratch=StepScratch({}),
                   logits=self.logits_out[:nb], hidden=self.hidden_out[:nb] if self.hidden_out is not None else None)
        if not self.capture:
            return g
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        commits = self._keeps_commit(key)
        with torch.cuda.stream(stream):  # compile and autotune every kernel outside the capture
            for _ in range(2):
                self._forward(g, commits)
                if commits:
                    self._commit(g)
        torch.cuda.current_stream().wait_stream(stream)
        g.forward = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.forward, pool=self.pool):
            self._forward(g, commits)
        self.pool = g.forward.pool()
        if commits:
            g.commit = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.commit, pool=self.pool):
                self._commit(g)
        self.captures += 1
        return g

    def _forward(self, g: _Graph, keep_scratch: bool = True) -> None:
        g.moe = MoEContext(extra_rows=g.extra_rows if self.extra_token else None, row_mask=g.row_mask,
                           collect_counts=self.collect_counts)
        scratch = StepScratch({})  # block inputs of the verifying requests, for the commit graph
        out = self.model(g.batch, self.cache, None, write=g.write, scratch=scratch,
                         return_hidden=self.return_hidden, moe=g.moe, all_rows_into=g.logits)
        g.scratch = scratch if keep_scratch else StepScratch({})  # else its memory goes back to the pool
        if self.return_hidden:
            g.hidden.copy_(out[1])

    def _commit(self, g: _Graph) -> None:
        self.model.commit(g.batch, self.cache, g.scratch, g.keep)

    # ------------------------------------------------------------------------------------------ steps
    def step(self, blocks: list[list[int]], context_lens: list[int], page_rows: list[list[int]], slots: list[int],
             write: list[bool], extra_rows: list[int] | None = None) -> StepOutputs | None:
        """`run` in the blocks' bucket; None when no bucket holds them or its capture failed (run eagerly)."""
        lens = [len(b) for b in blocks]
        key = self.bucket(len(blocks), sum(lens), max(lens), max(len(p) for p in page_rows))
        if key is None:
            return None
        return self.run(key, blocks, context_lens, page_rows, slots, write, extra_rows or [])

    def run(self, key: BucketKey, blocks: list[list[int]], context_lens: list[int], page_rows: list[list[int]],
            slots: list[int], write: list[bool], extra_rows: list[int]) -> StepOutputs | None:
        """One step in bucket `key` (captured first if new). None if the capture failed (out of memory, a kernel
        that cannot be captured...): the caller runs the step eagerly, and this bucket stays eager."""
        g = self.graphs.get(key)
        captured = g is None and self.capture
        if g is None:
            try:
                g = self._new(key)
            except Exception as e:  # noqa: BLE001 - eager still works; remember why
                self.failed[key] = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture of %s failed, its steps run eagerly: %s", key, self.failed[key])
                return None
            self.graphs[key] = g
        b, r, nb = len(blocks), g.write.shape[0], key.tokens
        lens = [len(x) for x in blocks]
        n = sum(lens)
        # host buffers, one copy each to the device
        cu = [0]
        for t in lens:
            cu.append(cu[-1] + t)
        pad_lens = self._padding_lens(b, r, nb - n, key.max_block)
        for t in pad_lens:
            cu.append(cu[-1] + t)
        flat = [tok for x in blocks for tok in x] + [0] * (nb - n)
        positions = [c + j for c, t in zip(context_lens, lens) for j in range(t)] + [0] * (nb - n)
        owner = [i for i, t in enumerate(lens) for _ in range(t)]
        owner += [b + i for i, t in enumerate(pad_lens) for _ in range(t)]
        table = torch.full((r, key.pages), self.spare_page, dtype=torch.int32)
        for i, row in enumerate(page_rows):
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        ints = torch.tensor(flat + positions + owner, dtype=torch.int64)
        bt = g.batch
        bt.input_ids.copy_(ints[:nb], non_blocking=True)
        bt.positions.copy_(ints[nb:2 * nb], non_blocking=True)
        bt.request_of_row.copy_(ints[2 * nb:], non_blocking=True)
        bt.cu_seqlens.copy_(torch.tensor(cu, dtype=torch.int32), non_blocking=True)
        bt.context_lens.copy_(torch.tensor(context_lens + [0] * (r - b), dtype=torch.int32), non_blocking=True)
        bt.page_table.copy_(table, non_blocking=True)
        bt.state_slots.copy_(torch.tensor(slots + [self.spare_slot] * (r - b)), non_blocking=True)
        masks = torch.zeros(r + 2 * nb, dtype=torch.bool)
        masks[:b] = torch.tensor(write, dtype=torch.bool)
        if extra_rows:
            masks[[r + i for i in extra_rows]] = True
        masks[r + nb:r + nb + n] = True
        g.write.copy_(masks[:r], non_blocking=True)
        g.extra_rows.copy_(masks[r:r + nb], non_blocking=True)
        g.row_mask.copy_(masks[r + nb:], non_blocking=True)
        if not self.capture:  # eager on the same static batch (CPU tests)
            if not dispatch.use_triton(bt.input_ids):  # the references loop over the real host lengths
                bt.query_lens = lens + pad_lens
                bt.context_lens_host = context_lens + [0] * (r - b)
            self._forward(g, self._keeps_commit(key))
        else:
            g.forward.replay()
        return StepOutputs(g.logits[:n], g.hidden[:n] if g.hidden is not None else None, g.moe, captured)

    def _padding_lens(self, b: int, r: int, pad: int, max_block: int) -> list[int]:
        """Tokens of requests b..r-1: zero for the first ones, the padding (<= max_block each) in the last."""
        lens = [0] * (r - b)
        i = len(lens) - 1
        while pad > 0:
            if i < 0:
                raise RuntimeError("graph bucket has too few padding requests")  # bucket() rules this out
            take = min(pad, max_block)
            lens[i] = take
            pad -= take
            i -= 1
        return lens

    def commit(self, key: BucketKey, keep: list[int]) -> None:
        """Replays the commit: keep[i] accepted tokens of request i (0 for requests the forward advanced)."""
        g = self.graphs[key]
        if not self._keeps_commit(key):
            raise RuntimeError(f"bucket {key} has no commit graph (plain decode, or commits=False)")
        r = g.keep.shape[0]
        g.keep.copy_(torch.tensor(keep + [0] * (r - len(keep)), dtype=torch.int64), non_blocking=True)
        if not self.capture:
            self._commit(g)
        else:
            g.commit.replay()
