"""CUDA graphs for decode and verification steps (no prefill chunk in the step).

A graph is captured lazily for each bucket (Bb requests, Nb tokens, max block 1 or a block bucket up to
`max_block`) over static input buffers; a step writes its ragged batch into the bucket's pinned host staging
buffer (one int64 array), copies it to the device in one transfer and replays: the graph itself unpacks the
staging array into the typed inputs. One graph runs the forward (GDN/conv state advanced only for the requests
in the write mask, block inputs kept for the commit, router correction of extra tokens, distinct experts per MoE
layer) and a second one the commit of the accepted tokens. Nothing inside a step synchronizes with the host: attention and GDN take the bucket's sizes as hints and
read the real lengths from device tensors.

Buckets also differ by page-table width (a power of two covering the longest context), since attention plans
its KV splits for the table's full width.

Padding, for a step of B requests and N tokens in bucket (Bb, Nb):
  rows 0..N-1          the real tokens, request by request (cu_seqlens as in the eager batch);
  requests B..Bb-1     zero tokens (their slots and pages are the spare ones no request owns);
  requests Bb..Bb+P-1  the Nb - N padding tokens, on the spare page and slot, never written to GDN state, masked
                       out of every MoE layer (no expert work, not counted).
P is fixed per bucket: enough for the largest padding the bucket can see in blocks of PAD_BLOCK. A step packs its
padding into the last requests in blocks of max(its longest real block, the padding over the requests it has
(B..Bb+P-1)): the sequential GDN kernel and attention walk a request's tokens in order, so a padding block longer
than every real block could be the step's critical path (measured no change: 64 x 5 tokens in the 384-token bucket
took 14.6 ms with padding in blocks of 17 and 14.5 ms in blocks of 5; the padding rows' cost is elsewhere, see
token_buckets). Requests of zero tokens read no GDN state. On CPU (or with `capture=False`) the same static batches
run eagerly: that path checks the padding on machines without CUDA.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import traceback
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kernels import dispatch
from workers.batch import ForwardBatch
from workers.cache import ModelCache, StepScratch
from workers.model import HybridModel, MoEContext

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EVICT_EVERY = 32  # runs of a full graph set between two evictions (more often: new buckets run eagerly)
# ... unless the load has changed: the buckets of the last STALE_RUNS_PER_GRAPH x max_graphs runs (384 at 96) fit in
# the set and the graph to drop is not one of them (a bucket of an earlier load: another batch size, other block
# lengths). Without it a set filled by earlier loads took new buckets one per EVICT_EVERY runs: in one e2e process
# running c=1, 4 and 16 before c=64, 18 of the 35 steps of hybridspec's c=64 / 0.95 cell ran eagerly at 88 ms (run
# 25, 44cd073). The working-set condition keeps the rate limit where it matters: an idle-time rule alone let working
# sets larger than the set re-capture 2-10x as often (a simulation of this logic, review of 0f6cf68: uniform access
# to 150-400 buckets, cyclic access to 400), since under the rate limit the set's graphs idle long.
STALE_RUNS_PER_GRAPH = 4
PAD_BLOCK = 4  # a bucket has padding requests for its largest padding in blocks of this many tokens (or max block)
MIN_TABLE_PAGES = 16  # narrowest page table of a graph (contexts up to 16 pages share one)
# verification buckets' block (the most tokens a request verifies) below the set's max_block: the kernels size
# their tiles by a graph's block, which is their hint for every step in it (GDN verification: 32-token tiles past 16
# tokens, attention: a query tile per 8 tokens of a request at GQA 8). With one verification block (17) hybridspec's
# steps of <= 6 tokens a request at c=64 / 0.7 replayed in 17.64 ms against fixed4's 16.55 in its block-5 graph
# (bench/host_phases.py at c72c819). HYBRIDSPEC_BLOCK_BUCKETS: a comma list of blocks, "0" for none (A/B)
BLOCK_BUCKETS = (8, 16)
_EXTRA0_MASK1 = np.array([[0], [1]], dtype=np.int64)  # staging: a real row is no extra token and unmasked
log = logging.getLogger(__name__)


def block_buckets() -> tuple[int, ...]:
    """BLOCK_BUCKETS, or HYBRIDSPEC_BLOCK_BUCKETS (a comma list of blocks >= 2; "0": none, one verification block)."""
    raw = os.environ.get("HYBRIDSPEC_BLOCK_BUCKETS")
    if raw is None:
        return BLOCK_BUCKETS
    if raw.strip() == "0":
        return ()
    try:
        blocks = tuple(int(x) for x in raw.split(","))
    except ValueError:
        blocks = ()
    if not blocks or min(blocks) < 2:
        raise ValueError(f"HYBRIDSPEC_BLOCK_BUCKETS must be '0' or a comma list of integers >= 2, got {raw!r}")
    return blocks


block_buckets()  # a bad HYBRIDSPEC_BLOCK_BUCKETS fails at import, not at the first verification step


def extra_token_buckets() -> tuple[int, ...]:
    """HYBRIDSPEC_TOKEN_BUCKETS_EXTRA: token buckets added to token_buckets' own (a comma list of integers >= 1;
    unset or "0": none). For A/B of single buckets where full batches' uniform blocks land: at c=64 a plan of 4
    drafts a request is 320 tokens, padded to the 384-token bucket (the forward table of hybridspec at c=64 / 0.7,
    f16ef77: 15.5 ms at 256 tokens, 17.2-17.8 from 257 to 384), so its plans stayed at 3 drafts where fixed4, whose
    graph set ends at exactly 64 x 5 = 320 tokens, verified 4 (bench/NOTES.md, 2026-12-05)."""
    raw = os.environ.get("HYBRIDSPEC_TOKEN_BUCKETS_EXTRA")
    if raw is None or raw.strip() == "0":
        return ()
    try:
        extra = tuple(sorted({int(x) for x in raw.split(",")}))
    except ValueError:
        extra = ()
    if not extra or extra[0] < 1:
        raise ValueError(f"HYBRIDSPEC_TOKEN_BUCKETS_EXTRA must be '0' or a comma list of integers >= 1, got {raw!r}")
    return extra


EXTRA_TOKEN_BUCKETS = extra_token_buckets()  # (a bad value fails at import, not at the first graph)


def token_buckets(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ... (steps of 1/2 and 1/3) up to >= limit: few graphs to
    capture; padded rows cost dense GEMM rows (masked out of the MoE) and padding requests' GDN / conv work (at
    64 x 5 tokens the 384-row bucket took 15.0 ms against 13.8 in a 325-row one). Quarter steps from 64 tokens on
    were measured end to end and gained nothing, with twice the graphs there: out of GPU memory at c=64
    (bench/NOTES.md, 49c70bf). EXTRA_TOKEN_BUCKETS below the limit join them (HYBRIDSPEC_TOKEN_BUCKETS_EXTRA)."""
    out = [1, 2, 3]
    base = 4
    while out[-1] < limit:
        out.extend(b for b in (base, base + base // 2) if b > out[-1])
        base *= 2
    while len(out) > 1 and out[-2] >= limit:  # no bucket past the first one that holds the limit ...
        out.pop()
    out[-1] = max(limit, 1)  # ... and that one exactly the limit (the shared output buffers are this tall)
    if EXTRA_TOKEN_BUCKETS:
        out = sorted(set(out[:-1]).union(t for t in EXTRA_TOKEN_BUCKETS if t < out[-1])) + [out[-1]]
    return out


@dataclass(frozen=True)
class BucketKey:
    requests: int  # Bb
    tokens: int  # Nb
    max_block: int  # 1 (plain decode), or a verification block: one of BLOCK_BUCKETS below the set's, or its own
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
    stage_host: Tensor  # [M] int64 (pinned on CUDA): every input of a step, laid out as `layout` says
    stage_dev: Tensor  # [M] int64 on the device; the graph copies its slices into the typed inputs
    layout: "_Layout"
    plain: bool = False  # a plain-decode bucket (max block 1): no router correction, no routing counts
    corrects: bool = False  # the router correction runs in this bucket (extra tokens may come)
    counts: bool = False  # routing statistics (distinct experts, per-expert counts) are collected in this bucket
    forward: torch.cuda.CUDAGraph | None = None
    commit: torch.cuda.CUDAGraph | None = None
    staged: torch.cuda.Event | None = None  # the last host -> device copy of the staging buffer
    # host views of stage_host and what _stage keeps between steps (set by StepGraphs._new)
    stage_np: np.ndarray | None = None  # [M] int64
    stage_rows: np.ndarray | None = None  # [5, Nb] ids, positions, owner, extra, row_mask
    table_np: np.ndarray | None = None  # [R, P] the page table
    table_rows: list[list[int]] = field(default_factory=list)  # page rows the table holds (spare past them)
    row_index: np.ndarray | None = None  # [Nb] 0..Nb-1
    request_index: np.ndarray | None = None  # [R] 0..R-1
    staged_as: tuple | None = None  # (b, padding lengths): the array holds a plain decode of b requests
    # the routing statistics' static outputs where `counts`: distinct [MoE layers] and counts [MoE layers, E] int64
    distinct_out: Tensor | None = None
    counts_out: Tensor | None = None
    plain_index: dict = field(default_factory=dict)  # b -> [5 b] offsets of a plain decode's per-step inputs


class _Layout:
    """Offsets of a bucket's inputs in its int64 staging array (R requests incl. padding, Nb rows, P pages):
    ids, positions, owner, extra, row_mask [Nb] each, cu [R+1], context, slots, write [R] each, table [R x P]."""

    def __init__(self, r: int, nb: int, pages: int):
        self.r, self.nb, self.pages = r, nb, pages
        self.ids, self.positions, self.owner, self.extra, self.row_mask = (i * nb for i in range(5))
        self.cu = 5 * nb
        self.context = self.cu + r + 1
        self.slots = self.context + r
        self.write = self.slots + r
        self.table = self.write + r
        self.size = self.table + r * pages


class StepGraphs:
    """Lazily captured graphs for decode/verify steps of one model and cache."""

    def __init__(self, model: HybridModel, cache: ModelCache, *, max_block: int, spare_page: int, spare_slot: int,
                 page_table_width: int, max_tokens: int, return_hidden: bool = False, extra_token: bool = False,
                 collect_counts: bool = False, capture: bool | None = None, max_graphs: int = 96,
                 extra_from: int = 1,
                 commits: bool = True):
        self.model, self.cache = model, cache
        self.max_block = max_block
        self.spare_page, self.spare_slot = spare_page, spare_slot
        self.width = page_table_width
        self.return_hidden, self.extra_token, self.collect_counts = return_hidden, extra_token, collect_counts
        self.extra_from = extra_from  # the router correction and routing statistics only in buckets this large
        self.capture = model.device.type == "cuda" if capture is None else capture
        if max_graphs < 2:  # eviction keeps at least one graph holding the shared memory pool
            raise ValueError(f"max_graphs must be >= 2, got {max_graphs}")
        self.max_graphs = max_graphs
        # commits=False (a drafter's graphs): no commit graph and no block inputs kept; nor for plain decode
        # buckets (nothing to commit there): each kept scratch costs ~Nb x GDN layers x 28 KB at real shapes
        self.commits = commits
        self.tokens = token_buckets(max_tokens)
        self.blocks = sorted(b for b in block_buckets() if b < max_block) + [max_block]  # verification's blocks
        self.graphs: OrderedDict[BucketKey, _Graph] = OrderedDict()  # least recently used first
        self.evictions = 0  # graphs dropped to make room (max_graphs) for a new bucket
        self._runs_since_evict = EVICT_EVERY
        self._recent: deque[BucketKey] = deque()  # the buckets of the last STALE_RUNS_PER_GRAPH x max_graphs runs
        self._recent_count: Counter[BucketKey] = Counter()  # ... and how often each ran there
        self.failed: dict[BucketKey, str] = {}  # buckets whose capture failed: those steps run eagerly
        self.pool = None
        device, vocab = model.device, model.config.vocab_size
        self.logits_out = torch.empty(self.tokens[-1], vocab, dtype=torch.float32, device=device)  # shared
        self.hidden_out = (torch.empty(self.tokens[-1], model.config.hidden_size, dtype=model.dtype, device=device)
                           if return_hidden else None)
        self.captures = 0
        # called first when a capture runs out of memory: frees memory this set does not hold (the runner drops its
        # other configurations' sets) -> whether it freed any
        self.reclaim: Callable[[], bool] | None = None

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
        block = 1 if max_block == 1 else next(b for b in self.blocks if b >= max_block)
        key = BucketKey(reqs, toks, block, pages)
        if key in self.failed:
            return None
        return key

    def _keeps_commit(self, key: BucketKey) -> bool:
        return self.commits and key.max_block > 1

    def _pad_requests(self, key: BucketKey) -> int:
        """P: padding requests for the largest padding this bucket can see (N just above the bucket below)."""
        i = self.tokens.index(key.tokens)
        smallest = self.tokens[i - 1] + 1 if i > 0 else 1
        return -(-(key.tokens - smallest) // min(key.max_block, PAD_BLOCK))

    # ------------------------------------------------------------------------------------------ capture
    def _try_new(self, key: BucketKey) -> "_Graph | str":
        """_new, or the message of its out-of-memory error. The error's traceback holds the failed attempt's frames:
        its graph (a capture that failed still holds a use of the set's pool, whose segments go back to the device
        only once nothing uses it) and its tensors. They are cleared here, and the retries run outside any except
        block (a retry's error chained to the earlier ones and kept every attempt alive until a cyclic GC)."""
        try:
            return self._new(key)
        except torch.OutOfMemoryError as e:
            message = f"{type(e).__name__}: {e}"
            traceback.clear_frames(e.__traceback__)  # (this frame is running: skipped; _new's and below cleared)
            e.__traceback__ = e.__context__ = e.__cause__ = None
            return message

    def _new(self, key: BucketKey) -> _Graph:
        """Captures bucket `key` (CUDA; elsewhere its static batch only). (torch.cuda.graph synchronizes and empties
        the allocator's cache before the capture begins: the warm-up forwards' blocks go back first.)"""
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
        layout = _Layout(r, nb, key.pages)
        pinned = device.type == "cuda"
        g = _Graph(batch=batch, write=torch.zeros(r, dtype=torch.bool, device=device),
                   extra_rows=torch.zeros(nb, dtype=torch.bool, device=device),
                   row_mask=torch.zeros(nb, dtype=torch.bool, device=device),
                   keep=torch.zeros(r, dtype=i64, device=device), moe=MoEContext(), scratch=StepScratch({}),
                   logits=self.logits_out[:nb], hidden=self.hidden_out[:nb] if self.hidden_out is not None else None,
                   stage_host=torch.zeros(layout.size, dtype=i64, pin_memory=pinned),
                   stage_dev=torch.zeros(layout.size, dtype=i64, device=device), layout=layout,
                   plain=key.max_block == 1, staged=torch.cuda.Event() if pinned else None,
                   corrects=self.extra_token and key.max_block > 1 and key.requests >= self.extra_from,
                   counts=self.collect_counts and key.max_block > 1 and key.requests >= self.extra_from)
        if g.counts:  # one row per MoE layer (MoEContext: the step's statistics are one tensor each)
            cfg = self.model.config
            layers = sum(cfg.moe_layers)
            g.distinct_out = torch.zeros(layers, dtype=i64, device=device)
            g.counts_out = torch.zeros(layers, cfg.num_experts, dtype=i64, device=device)
        self._attach_staging(g)
        # any valid layout for the capture (a used bucket always has nb <= r * max_block): all rows on padding
        # requests, on the spare page and slot
        self._stage(g, key, [], [], [], [], [], [])
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

    @staticmethod
    def _unpack(g: _Graph) -> None:
        """The staging array into the typed static inputs (device copies: inside the captured graph)."""
        sd, o, bt = g.stage_dev, g.layout, g.batch
        bt.input_ids.copy_(sd[o.ids:o.ids + o.nb])
        bt.positions.copy_(sd[o.positions:o.positions + o.nb])
        bt.request_of_row.copy_(sd[o.owner:o.owner + o.nb])
        g.extra_rows.copy_(sd[o.extra:o.extra + o.nb])
        g.row_mask.copy_(sd[o.row_mask:o.row_mask + o.nb])
        bt.cu_seqlens.copy_(sd[o.cu:o.cu + o.r + 1])
        bt.context_lens.copy_(sd[o.context:o.context + o.r])
        bt.state_slots.copy_(sd[o.slots:o.slots + o.r])
        g.write.copy_(sd[o.write:o.write + o.r])
        bt.page_table.copy_(sd[o.table:o.size].view(o.r, o.pages))

    def _forward(self, g: _Graph, keep_scratch: bool = True) -> None:
        self._unpack(g)
        # plain decode (hybridspec's gate chose no drafts): no extra token to correct, and the routing counts come
        # from verification steps (a plain step in hybridspec's set costs what one in ar's does); below extra_from
        # requests neither: no router correction to feed there, the plans price those steps from their measured
        # token costs, and the statistics kernels were ~0.15 ms of a c=1 step's GPU time (step timeline at
        # 9b94ea4); the start-up profile gathers those batch sizes' statistics eagerly (ModelRunner.profile)
        g.moe = MoEContext(extra_rows=g.extra_rows if g.corrects else None,
                           row_mask=g.row_mask, collect_counts=g.counts, collect_distinct=g.counts,
                           distinct_out=g.distinct_out, counts_out=g.counts_out)
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
        that cannot be captured...): the caller runs the step eagerly, and this bucket stays eager; None too for a
        new bucket while the set is full and its last eviction was less than EVICT_EVERY runs ago."""
        g = self.graphs.get(key)
        captured = g is None and self.capture
        self._runs_since_evict += 1
        self._note_recent(key)
        if g is not None:
            self.graphs.move_to_end(key)
        else:
            if len(self.graphs) >= self.max_graphs:
                # a working set larger than the set would re-capture at every step (two warm-up forwards and a
                # capture each): at most one eviction per EVICT_EVERY runs, new buckets run eagerly in between;
                # after a change of load (_load_changed) the earlier load's graphs go at once
                if self._runs_since_evict < EVICT_EVERY and not self._load_changed():
                    return None
                while len(self.graphs) >= self.max_graphs:
                    self._evict()
            try:
                g = self._try_new(key)
            except Exception as e:  # noqa: BLE001 - eager still works; remember why
                self._failed(key, e)
                return None
            if isinstance(g, str):  # out of memory (outside the except: nothing of the attempt is kept alive)
                g = self._capture_after_oom(key, g)
                if g is None:
                    return None
            self.graphs[key] = g
        lens, pad_lens = self._stage(g, key, blocks, context_lens, page_rows, slots, write, extra_rows)
        bt, b, r, n = g.batch, len(blocks), g.layout.r, sum(lens)
        if not self.capture:  # eager on the same static batch (CPU tests)
            if not dispatch.use_triton(bt.input_ids):  # the references loop over the real host lengths
                bt.query_lens = lens + pad_lens
                bt.context_lens_host = context_lens + [0] * (r - b)
            self._forward(g, self._keeps_commit(key))
        else:
            g.forward.replay()
        return StepOutputs(g.logits[:n], g.hidden[:n] if g.hidden is not None else None, g.moe, captured)

    def _attach_staging(self, g: _Graph) -> None:
        """The host views _stage writes through (numpy views of the pinned staging array, made once)."""
        o = g.layout
        st = g.stage_np = g.stage_host.numpy()
        g.stage_rows = st[:5 * o.nb].reshape(5, o.nb)
        g.table_np = st[o.table:o.size].reshape(o.r, o.pages)
        g.table_np[:] = self.spare_page  # every row spare until a request's pages are staged
        g.table_rows = []
        g.row_index = np.arange(o.nb, dtype=np.int64)
        g.request_index = np.arange(o.r, dtype=np.int64)
        g.staged_as, g.plain_index = None, {}  # (_stage's plain-decode shortcut; the test's graphs set them here)

    def _stage(self, g: _Graph, key: BucketKey, blocks: list[list[int]], context_lens: list[int],
               page_rows: list[list[int]], slots: list[int], write: list[bool],
               extra_rows: list[int]) -> tuple[list[int], list[int]]:
        """Writes a step's inputs into the bucket's staging array and starts its one copy to the device.
        -> (real lengths, padding requests' lengths).

        Host time on every graphed step's critical path, so few numpy calls (each ~1.5-5 us on the CPU):
        the five per-row inputs as one [5, Nb] view, the per-request ones as one list, and only the page-table
        rows that differ from what the array holds (a request's pages change once per page of tokens). It was
        ~25 calls plus one per request (76 us at one request, 191 us at 64 on this repo's CPU). A plain decode of as
        many requests as the array already holds writes its per-request inputs in one call (the staging was ~0.11 ms
        of the ~0.3 ms of H200 host time before a plain step's launch, bench/host_phases.py at 2a27610)."""
        o = g.layout
        b, r, nb = len(blocks), o.r, o.nb
        lens = [len(x) for x in blocks]
        n = sum(lens)
        plain = n == b > 0 and not extra_rows and max(lens) == 1  # one token a request at its context length
        if g.staged is not None:
            g.staged.synchronize()  # the last copy out of the pinned buffer is done before it is rewritten
        st = g.stage_np
        if plain and g.staged_as is not None and g.staged_as[0] == b:
            # the array holds a plain decode of b requests: owners, masks, cu and the padding are this step's too;
            # the per-request inputs in one numpy call (ids, positions = contexts, contexts, slots, write)
            st[g.plain_index[b]] = list(itertools.chain.from_iterable(blocks)) + context_lens + context_lens + \
                slots + write
            self._stage_table(g, b, page_rows)
            g.stage_dev.copy_(g.stage_host, non_blocking=True)
            if g.staged is not None:
                g.staged.record()
            return lens, list(g.staged_as[1])
        pad_lens = self._padding_lens(b, r, nb - n, key.max_block, max(lens, default=1))
        rows = g.stage_rows  # [5, Nb] ids, positions, owner, extra, row_mask
        all_lens = lens + pad_lens  # [R], sums to Nb
        cu = list(itertools.accumulate(all_lens, initial=0))  # [R + 1]
        rows[:, n:] = 0  # padding rows: token 0, position 0, not extra, masked (owner below)
        rows[3:, :n] = _EXTRA0_MASK1  # real rows: not extra (extra_rows below), unmasked
        if n:
            rows[0, :n] = list(itertools.chain.from_iterable(blocks))
            if n == b and max(lens) == 1:  # plain decode: one token a request at its context length
                rows[1, :n] = context_lens
            else:  # context + offset inside the block
                rows[1, :n] = np.repeat(np.subtract(context_lens, cu[:b]), lens) + g.row_index[:n]
        rows[2] = np.repeat(g.request_index, all_lens)
        if extra_rows:
            rows[3, extra_rows] = 1
        pad = r - b
        st[o.cu:o.table] = (cu + context_lens + [0] * pad + slots + [self.spare_slot] * pad + write
                            + [False] * pad)  # cu [R + 1], context, slots, write [R] each (contiguous)
        self._stage_table(g, b, page_rows)
        g.stage_dev.copy_(g.stage_host, non_blocking=True)
        if g.staged is not None:
            g.staged.record()
        g.staged_as = (b, tuple(pad_lens)) if plain else None
        if plain and b not in g.plain_index:
            span = np.arange(b, dtype=np.int64)
            g.plain_index[b] = np.concatenate([o.ids + span, o.positions + span, o.context + span, o.slots + span,
                                               o.write + span])
        return lens, pad_lens

    def _stage_table(self, g: _Graph, b: int, page_rows: list[list[int]]) -> None:
        """The page-table rows that differ from what the staging array holds (a request's pages change once per
        page of tokens); rows past b go back to the spare page."""
        table, held = g.table_np, g.table_rows  # [R, P]; the page rows the array holds (spare past each)
        for i in range(max(b, len(held))):
            row = page_rows[i] if i < b else []
            old = held[i] if i < len(held) else []
            if row != old:
                table[i, :len(row)] = row
                if len(old) > len(row):
                    table[i, len(row):len(old)] = self.spare_page
                if i < len(held):
                    held[i] = list(row)
                else:
                    held.append(list(row))

    @staticmethod
    def _padding_lens(b: int, r: int, pad: int, max_block: int, longest: int) -> list[int]:
        """Tokens of requests b..r-1: zero for the first ones, the padding in the last, in blocks of
        max(longest real block, pad / (r - b)) (no longer than a real block where the requests suffice)."""
        lens = [0] * (r - b)
        if pad <= 0:
            return lens
        block = min(max_block, max(longest, -(-pad // max(r - b, 1))))
        i = len(lens) - 1
        while pad > 0:
            if i < 0:
                raise RuntimeError("graph bucket has too few padding requests")  # bucket() rules this out
            take = min(pad, block)
            lens[i] = take
            pad -= take
            i -= 1
        return lens

    def _note_recent(self, key: BucketKey) -> None:
        """Counts `key` in the window of the last STALE_RUNS_PER_GRAPH x max_graphs runs."""
        self._recent.append(key)
        self._recent_count[key] += 1
        if len(self._recent) > STALE_RUNS_PER_GRAPH * self.max_graphs:
            old = self._recent.popleft()
            self._recent_count[old] -= 1
            if not self._recent_count[old]:
                del self._recent_count[old]

    def _load_changed(self) -> bool:
        """The buckets of the recent window fit in the set and its least recently used graph is none of them."""
        lru = next(iter(self.graphs))
        return lru not in self._recent_count and len(self._recent_count) <= self.max_graphs

    def _failed(self, key: BucketKey, e: BaseException | str) -> None:
        self.failed[key] = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        log.warning("CUDA graph capture of %s failed, its steps run eagerly: %s", key, self.failed[key])

    def _capture_after_oom(self, key: BucketKey, reason: str) -> _Graph | None:
        """A capture ran out of memory (`reason`: its message). First `reclaim` (the runner's other graph sets) frees
        what this set does not hold, and the capture is tried again; then the least recently used graphs go back
        (their pool's blocks, and on CUDA the allocator's unused cache) one at a time, the capture tried again after
        each, until it fits; the set then keeps at most the graphs memory held (max_graphs, at least 2). The last
        graph goes with its pool: a private pool's segments return to the device only once no graph uses it, so the
        one graph kept before held the whole pool (2.5 GiB on an H100 at c=16 where the capture lacked 20 MiB:
        bench/NOTES.md 2026-12-07 22:06); the capture then starts a new pool, and max_graphs stays as it was (2 would
        make every new bucket run eagerly between evictions). Only a set with no graph left gives the bucket up (it
        runs eagerly). Each failed attempt is dropped whole (_try_new). Before fdee01e the bucket ran eagerly for good
        (~10x a graphed step)."""
        if self.reclaim is not None and self.reclaim():  # other sets' graphs first (StepGraphs.reclaim)
            log.warning("CUDA graph capture of %s ran out of memory: the other graph sets were dropped", key)
            g = self._retry(key)
            if not isinstance(g, str):
                return g
            reason = g
        if not self.graphs:
            self._failed(key, reason)
            return None
        log.warning("CUDA graph capture of %s ran out of memory with %d graphs held: dropping the least recently used "
                    "until it fits", key, len(self.graphs))
        while self.graphs:
            self._evict()
            if not self.graphs:
                self.pool = None  # no graph uses it: its segments go back with the cache; the capture makes a new one
            g = self._retry(key)
            if isinstance(g, str):
                reason = g
                continue
            if g is None:
                return None
            if self.graphs:
                self.max_graphs = max(2, len(self.graphs) + 1)
                log.warning("CUDA graph set keeps at most %d graphs from now on (memory)", self.max_graphs)
            else:
                log.warning("CUDA graph capture of %s fitted once the set's pool was given back", key)
            return g
        self._failed(key, reason)
        return None

    def _retry(self, key: BucketKey) -> "_Graph | str | None":
        """One more capture after memory was given back: the graph, the out-of-memory message, or None (another
        error: the bucket is given up)."""
        if self.capture:
            gc.collect()  # (anything of the earlier attempts a cycle still holds; a rare path)
            torch.cuda.empty_cache()
        try:
            return self._try_new(key)
        except Exception as e:  # noqa: BLE001 - eager still works; remember why
            self._failed(key, e)
            return None

    def _evict(self) -> None:
        """Drops the least recently used graph (a long-running server meets more buckets than it keeps: batch x
        tokens x block x page-table width). Its memory goes back to the shared pool for the next capture, so the
        GPU must be done with it first: one host sync, at a step that captures anyway."""
        if self.capture:
            torch.cuda.current_stream().synchronize()
        key, _ = self.graphs.popitem(last=False)
        self.evictions += 1
        self._runs_since_evict = 0
        log.info("CUDA graph bucket %s dropped to make room (max_graphs=%d)", key, self.max_graphs)

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
