"""The graphs' staging array (workers/graphs.py StepGraphs._stage) holds exactly a step's inputs after every step of a
sequence, page-table rows it skips as unchanged included: checked against a plain layout of the same inputs built
from scratch each step (the straightforward numpy version _stage replaced)."""

from __future__ import annotations

import random
import types

import numpy as np
import torch

from workers.graphs import BucketKey, StepGraphs, _Layout, token_buckets

SPARE_PAGE, SPARE_SLOT = 999, 77


def expected(o: _Layout, lens, pad_lens, blocks, context_lens, page_rows, slots, write, extra_rows) -> np.ndarray:
    st = np.zeros(o.size, dtype=np.int64)
    b, n = len(blocks), sum(lens)
    all_lens = np.asarray(lens + pad_lens)
    cu = np.concatenate([[0], np.cumsum(all_lens)])
    st[o.ids:o.ids + n] = [t for blk in blocks for t in blk]
    pos = [c + j for c, ln in zip(context_lens, lens) for j in range(ln)]
    st[o.positions:o.positions + n] = pos
    st[o.owner:o.owner + o.nb] = np.repeat(np.arange(o.r), all_lens)
    for row in extra_rows:
        st[o.extra + row] = 1
    st[o.row_mask:o.row_mask + n] = 1
    st[o.cu:o.cu + o.r + 1] = cu
    st[o.context:o.context + b] = context_lens
    st[o.slots:o.slots + o.r] = slots + [SPARE_SLOT] * (o.r - b)
    st[o.write:o.write + b] = write
    table = st[o.table:o.size].reshape(o.r, o.pages)
    table[:] = SPARE_PAGE
    for i, row in enumerate(page_rows):
        table[i, :len(row)] = row
    return st


def new_graph(key: BucketKey, graphs: StepGraphs):
    r = key.requests + graphs._pad_requests(key)
    layout = _Layout(r, key.tokens, key.pages)
    g = types.SimpleNamespace(layout=layout, staged=None, stage_host=torch.zeros(layout.size, dtype=torch.int64),
                              stage_dev=torch.zeros(layout.size, dtype=torch.int64))
    graphs._attach_staging(g)
    return g


def test_staging_holds_every_steps_inputs_across_a_sequence_of_steps():
    rng = random.Random(0)
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.spare_page, graphs.spare_slot, graphs.max_block = SPARE_PAGE, SPARE_SLOT, 5
    graphs.tokens, graphs.width, graphs.failed, graphs.blocks = token_buckets(8 * 5), 16, {}, [5]
    staged: dict[BucketKey, types.SimpleNamespace] = {}  # each bucket keeps its array from step to step
    reused = 0
    for max_block in (1, 5):  # plain decode and verification steps
        pages = {s: [rng.randrange(500) for _ in range(rng.randint(1, 6))] for s in range(10)}
        for step in range(150):
            live = rng.sample(range(10), rng.randint(1, 8))  # requests come and go (their slots: 0..9)
            for s in live:  # a request's pages grow, now and then it is replaced (other pages, maybe fewer)
                if rng.random() < 0.3:
                    pages[s].append(rng.randrange(500))
                if rng.random() < 0.1:
                    pages[s] = [rng.randrange(500) for _ in range(rng.randint(1, 3))]
                pages[s] = pages[s][:16]
            blocks = [[rng.randrange(1000) for _ in range(rng.randint(1, max_block))] for _ in live]
            ctx = [rng.randrange(1, 200) for _ in live]
            page_rows = [list(pages[s]) for s in live]
            write = [rng.random() < 0.5 for _ in live]
            n = sum(len(x) for x in blocks)
            extra = sorted(rng.sample(range(n), rng.randint(0, min(3, n)))) if max_block > 1 else []
            key = graphs.bucket(len(live), n, max(len(x) for x in blocks), max(len(p) for p in page_rows))
            reused += key in staged
            g = staged.get(key) or staged.setdefault(key, new_graph(key, graphs))
            lens, pad_lens = graphs._stage(g, key, blocks, ctx, page_rows, live, write, extra)
            assert sum(lens) + sum(pad_lens) == key.tokens
            want = expected(g.layout, lens, pad_lens, blocks, ctx, page_rows, live, write, extra)
            np.testing.assert_array_equal(g.stage_host.numpy(), want, err_msg=f"step {step}, {key}")
            np.testing.assert_array_equal(g.stage_dev.numpy(), want)  # the one copy to the device went out
    assert reused > 150  # most steps met a bucket's array as an earlier step left it


def test_a_plain_decode_stretch_writes_only_its_per_request_inputs():
    """Plain decode of as many requests as the bucket's array already holds takes _stage's shortcut (one write of
    ids, positions, contexts, slots and write flags; owners, masks, cu and the padding stay), and the array still
    equals a from-scratch layout at every step: through a stretch of one batch size, a smaller batch in the same
    bucket, a verification step in another, and back."""
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.spare_page, graphs.spare_slot, graphs.max_block = SPARE_PAGE, SPARE_SLOT, 5
    graphs.tokens, graphs.width, graphs.failed, graphs.blocks = token_buckets(8 * 5), 16, {}, [5]
    full = {"n": 0}
    padding_lens = graphs._padding_lens

    def counted(*a):
        full["n"] += 1  # the full path computes the padding; the shortcut keeps the array's
        return padding_lens(*a)
    graphs._padding_lens = counted
    staged: dict[BucketKey, types.SimpleNamespace] = {}
    ctx = {s: 40 + 7 * s for s in range(6)}
    pages = {s: [100 + s] for s in range(6)}
    # 6 and 5 requests share the 8-request, 6-token bucket (5 with a padding row); the verification runs elsewhere
    schedule = [(6, 1)] * 20 + [(5, 1)] * 10 + [(6, 5)] * 2 + [(6, 1)] * 10
    steps_of = []
    for step, (b, block) in enumerate(schedule):
        live = list(range(b))
        if step % 7 == 3:  # a request finished, another took its place at the same batch size: other slots
            live[step % b] = 6 + step % 3
            ctx.setdefault(live[step % b], 30)
            pages.setdefault(live[step % b], [300 + step])
        blocks = [[(step * 31 + s) % 1000] * (block if j == 0 else 1) for j, s in enumerate(live)]
        if step % 6 == 5:
            for s in live:
                pages[s].append(200 + step + s)
        page_rows = [list(pages[s]) for s in live]
        write = [(step + j) % 3 != 0 if block == 1 else j != 0 for j in range(b)]  # flags vary step to step
        n = sum(len(x) for x in blocks)
        key = graphs.bucket(b, n, max(len(x) for x in blocks), max(len(p) for p in page_rows))
        g = staged.get(key) or staged.setdefault(key, new_graph(key, graphs))
        before = full["n"]
        lens, pad_lens = graphs._stage(g, key, blocks, [ctx[s] for s in live], page_rows, live, write, [])
        steps_of.append(full["n"] - before)
        want = expected(g.layout, lens, pad_lens, blocks, [ctx[s] for s in live], page_rows, live, write, [])
        np.testing.assert_array_equal(g.stage_host.numpy(), want, err_msg=f"step {step}, {key}")
        np.testing.assert_array_equal(g.stage_dev.numpy(), want)  # and the copy to the device went out
        for s in live:
            ctx[s] += 1
    assert len(staged) == 2  # the plain bucket and the verification's
    # the full path at a stretch's first step (the batch of 5 too), the shortcut after; the verification steps in
    # their own bucket leave the plain bucket's array as the batch of 5 left it: the full path again for 6
    assert steps_of[:20] == [1] + [0] * 19 and steps_of[20:30] == [1] + [0] * 9
    assert steps_of[30:32] == [1, 1] and steps_of[32:] == [1] + [0] * 9
