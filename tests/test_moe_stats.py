"""Routing statistics from the MoE's own grouping (issue 7): a forward with MoEContext(collect_counts=True) records
the same distinct_experts / expert_counts lists (per MoE layer, in layer order) when fused_moe's grouping writes
them (SparseMoe.FUSED_STATS) as with the separate statistics kernel per layer (MoEContext.mask_for), and on the
local path that kernel is no longer launched. The tiny bench model (4 layers, all MoE, 16 experts top-4) over a
verification-shaped step: extra rows (router correction) and a padding row; few tokens (the shared expert fused,
the grouping inside the gate/up kernel), more (the separate align kernel) and the shared expert apart
(SHARED_FUSE_MAX_N = 0). On the references here; on the Triton kernels under the interpreter (this file run as a
script, fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]

# case -> (new tokens per request, SHARED_FUSE_MAX_N): 8 tokens = 32 routed assignments (grouping inside gate/up),
# 23 tokens = 92 (the align kernel); threshold 0: the routed MoE alone, the shared expert's own GEMMs
CASES = {"few_shared_fused": ([3, 1, 4], 64), "more_shared_fused": ([9, 6, 8], 64),
         "few_shared_apart": ([3, 1, 4], 0), "more_shared_apart": ([9, 6, 8], 0)}


def _model():
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e import tiny_config

    from workers.bench_model import build_bench_model

    torch.manual_seed(0)
    return build_bench_model(config=tiny_config(), routing="zipf", dtype=torch.float32, device="cpu")


def _forward(model, lens: list[int], fused_stats: bool, shared_max_n: int, collect_counts: bool = True,
             collect_distinct: bool = True, forbid_kernel: bool = False, static_rows: int | None = None):
    """One prefill-shaped step from a fresh cache: (logits, MoEContext). Each request's last token is an extra
    row; the last token of the step is a padding row. `forbid_kernel`: the separate statistics kernel raises."""
    from kernels import dispatch
    from workers.batch import ForwardBatch
    from workers.cache import ModelCache
    from workers.model import MoEContext, SparseMoe

    cfg = model.config
    cache = ModelCache(cfg, 16, 16, 4, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(sum(lens))
    blocks = [torch.randint(0, cfg.vocab_size, (t,), generator=gen).tolist() for t in lens]
    batch = ForwardBatch.build(blocks, [0] * len(lens), [[i] for i in range(len(lens))], list(range(len(lens))),
                               "cpu")
    n = sum(lens)
    ends = torch.tensor(lens).cumsum(0) - 1
    extra = torch.zeros(n, dtype=torch.bool)
    extra[ends] = True
    row_mask = torch.ones(n, dtype=torch.bool)
    row_mask[-1] = False
    static = {} if static_rows is None else {  # a captured graph's static outputs (StepGraphs), NaN-free sentinels
        "distinct_out": torch.full((static_rows,), -1, dtype=torch.int64),
        "counts_out": torch.full((static_rows, cfg.num_experts), -1, dtype=torch.int64)}
    ctx = MoEContext(extra_rows=extra, row_mask=row_mask, collect_counts=collect_counts,
                     collect_distinct=collect_distinct, **static)
    saved = (SparseMoe.FUSED_STATS, SparseMoe.SHARED_FUSE_MAX_N, dispatch.expert_counts, dispatch.distinct_experts)

    def forbidden(*args, **kwargs):
        raise AssertionError("the separate routing-statistics kernel ran on the local path")

    try:
        SparseMoe.FUSED_STATS, SparseMoe.SHARED_FUSE_MAX_N = fused_stats, shared_max_n
        if forbid_kernel:
            dispatch.expert_counts = dispatch.distinct_experts = forbidden
        with torch.inference_mode():
            logits = model(batch, cache, moe=ctx)
    finally:
        SparseMoe.FUSED_STATS, SparseMoe.SHARED_FUSE_MAX_N, dispatch.expert_counts, dispatch.distinct_experts = saved
    return logits, ctx


def _compare(model, lens, shared_max_n, launches=None) -> dict:
    """Fused statistics (separate kernel forbidden) against the separate kernel: {check: 0 when it holds}.
    `launches` (the interpreter's counter of statistics-kernel launches): those of each path are checked, and the
    collect_distinct-only / nothing-collected forms are left to the references (two forwards a case)."""
    before = dict(launches or {})
    out_f, fused = _forward(model, lens, True, shared_max_n, forbid_kernel=True)
    mid = dict(launches or {})
    out_s, sep = _forward(model, lens, False, shared_max_n)
    layers = sum(1 for m in model.config.moe_layers if m)
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    res = {
        "layers": float(not (len(fused.distinct_experts) == len(sep.distinct_experts) == layers
                             and len(fused.expert_counts) == len(sep.expert_counts) == layers)),
        "distinct": float(not torch.equal(torch.stack(fused.distinct_experts), torch.stack(sep.distinct_experts))),
        "counts": float(not torch.equal(torch.stack(fused.expert_counts), torch.stack(sep.expert_counts))),
        "dtypes": float(not all(d.dtype == torch.int64 and d.shape == () for d in fused.distinct_experts)
                        or not all(c.dtype == torch.int64 and c.shape == (experts,) for c in fused.expert_counts)),
        "mask": float(not torch.equal(fused.token_mask, sep.token_mask)),
        # routed slots of the unmasked tokens only (the shared slot, masked tokens' slots not counted)
        "routed_only": float(not all(int(c.sum()) == int(fused.token_mask.sum()) * top_k
                                     for c in fused.expert_counts)),
        "something_masked": float(bool(fused.token_mask.all())),
        "logits": ((out_f - out_s).abs().max() / out_s.abs().max()).item(),
    }
    if launches is not None:
        res["no_stats_kernel"] = float(mid["stats"] != before["stats"])
        res["old_path_one_a_layer"] = float(launches["stats"] - mid["stats"] != layers)
        return res
    # only the distinct experts (the graphs' and runner's collect_distinct without collect_counts)
    _, d_only = _forward(model, lens, True, shared_max_n, collect_counts=False, forbid_kernel=True)
    res["distinct_only"] = float(d_only.expert_counts != [] or not torch.equal(torch.stack(d_only.distinct_experts),
                                                                                torch.stack(sep.distinct_experts)))
    _, none = _forward(model, lens, True, shared_max_n, collect_counts=False, collect_distinct=False,
                       forbid_kernel=True)
    res["none"] = float(none.expert_counts != [] or none.distinct_experts != [])
    return res


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.mark.parametrize("case", list(CASES))
def test_fused_statistics_equal_the_separate_kernel_on_the_references(model, case):
    result = _compare(model, *CASES[case])
    assert all(v <= 1e-6 for v in result.values()), result


def test_static_statistics_outputs_are_the_step_tensors(model):
    """With a graph's static outputs (MoEContext.distinct_out [layers], counts_out [layers, E]) layer i writes row
    i: stacked_distinct() / counts_view() are those tensors themselves (no stack of small tensors), with the
    values of the per-layer lists; where a layer's statistics did not go there (the separate kernel, or too few
    rows) they fall back to a stack / the list, with the same values."""
    lens, layers = [3, 1, 4], sum(1 for m in model.config.moe_layers if m)
    _, ref = _forward(model, lens, True, 64)
    _, fused = _forward(model, lens, True, 64, forbid_kernel=True, static_rows=layers)
    assert fused.stacked_distinct() is fused.distinct_out and fused.counts_view() is fused.counts_out
    assert torch.equal(fused.distinct_out, torch.stack(ref.distinct_experts))
    assert torch.equal(fused.counts_out, torch.stack(ref.expert_counts))
    assert all(d.data_ptr() == fused.distinct_out[i].data_ptr() for i, d in enumerate(fused.distinct_experts))
    _, sep = _forward(model, lens, False, 64, static_rows=layers)  # the separate kernel: its own tensors
    assert sep.stacked_distinct() is not sep.distinct_out and isinstance(sep.counts_view(), list)
    assert torch.equal(sep.stacked_distinct(), fused.distinct_out) and int(sep.distinct_out.max()) == -1
    _, short = _forward(model, lens, True, 64, forbid_kernel=True, static_rows=layers - 1)  # too few rows
    assert short.stacked_distinct() is not short.distinct_out and isinstance(short.counts_view(), list)
    assert torch.equal(short.stacked_distinct(), fused.distinct_out)
    assert torch.equal(torch.stack(short.counts_view()), fused.counts_out)
    _, only = _forward(model, lens, True, 64, collect_counts=False, forbid_kernel=True, static_rows=layers)
    assert only.stacked_distinct() is only.distinct_out and only.counts_view() == []
    assert torch.equal(only.distinct_out, fused.distinct_out)


def test_expert_parallel_path_keeps_the_separate_kernel():
    """SparseMoe.ep set: the layer hands the context to the exchange, which records the statistics through
    MoEContext.mask_for (its kernel), not through fused_moe."""
    from kernels import dispatch
    from workers.model import MoEContext

    model = _model()
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "ep"))
    calls = []

    def fake_ep(layer, x, weights, ids, ctx):
        ctx.mask_for(ids, layer.experts.gate_up_proj.shape[0])
        return torch.zeros_like(x)

    real = dispatch.expert_counts

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    moe.ep, dispatch.expert_counts = fake_ep, spy
    try:
        ctx = MoEContext(collect_counts=True)
        with torch.inference_mode():
            moe(torch.randn(5, model.config.hidden_size), ctx)
    finally:
        moe.ep, dispatch.expert_counts = None, real
    assert calls == [1] and len(ctx.expert_counts) == len(ctx.distinct_experts) == 1


# ------------------------------------------------------------------------- on the Triton kernels (interpreter)
def _interp_case(lens, shared_max_n) -> dict:
    import kernels.moe_triton as MT

    model = _model()
    launches = {"stats": 0}
    real = MT._distinct_experts_kernel

    class Spy:  # counts launches of the separate statistics kernel
        def __getitem__(self, grid):
            launches["stats"] += 1
            return real[grid]

    MT._distinct_experts_kernel = Spy()
    try:
        return _compare(model, lens, shared_max_n, launches)
    finally:
        MT._distinct_experts_kernel = real


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__)


# under the interpreter (~18 s a case): the grouping inside gate/up with the shared slot, and the align kernel
# without it (the references run all four)
INTERP_CASES = ("few_shared_fused", "more_shared_apart")


@pytest.mark.parametrize("case", INTERP_CASES)
def test_fused_statistics_equal_the_separate_kernel_on_triton(interp_results, case):
    assert_case(interp_results, case, 1e-5)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    run_cases({name: (lambda args=args: _interp_case(*args)) for name, args in CASES.items() if name in INTERP_CASES})
