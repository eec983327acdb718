"""The shared expert as one more expert of the fused MoE (issue 6): route(..., shared=True) adds a slot (id E,
sigmoid(gate logit)) after the k routed ones, fused_moe(..., shared=...) runs id E with the shared expert's own
weights, and SparseMoe up to SHARED_FUSE_MAX_N tokens uses both. Checked on CPU against the separate computation
(routed MoE + sigmoid(gate) * shared MLP): the references here, the model layer with the references, and the
layer on the Triton kernels under the interpreter (this file run as a script, fp32).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]


def tiny_moe(inter_s: int = 32, seed: int = 0, dtype=torch.float32):
    """A SparseMoe of 16 experts top-4, H=64, I=32 (I_s as given), random weights with unit-scale outputs."""
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e import tiny_config

    from workers.model import RMSNorm, SparseMoe

    cfg = dataclasses.replace(tiny_config(), shared_expert_intermediate_size=inter_s)
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoe(cfg, dtype, "cpu")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(dtype))
        moe.gate.weight.mul_(3.0)  # routing varies from token to token
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cfg.hidden_size, generator=gen) * 0.3)
    return moe, norm, cfg


def run_both(moe, fn):
    """fn() with the shared expert fused (threshold high) and separate (threshold 0)."""
    from workers.model import SparseMoe

    saved = SparseMoe.SHARED_FUSE_MAX_N
    try:
        SparseMoe.SHARED_FUSE_MAX_N = 1 << 30
        fused = fn()
        SparseMoe.SHARED_FUSE_MAX_N = 0
        separate = fn()
    finally:
        SparseMoe.SHARED_FUSE_MAX_N = saved
    return fused, separate


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ references
def test_route_ref_shared_slot_follows_the_routed_slots():
    from kernels.moe import route_ref

    gen = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(9, 17, generator=gen) * 2, torch.randn(16, generator=gen)
    w, ids = route_ref(logits, 4, True, torch.float16, bias, shared=True)
    w_routed, ids_routed = route_ref(logits[:, :16], 4, True, torch.float16, bias)
    assert ids.shape == (9, 5) and w.dtype == torch.float16
    assert torch.equal(ids[:, :4], ids_routed) and torch.equal(w[:, :4], w_routed)
    assert (ids[:, 4] == 16).all()
    assert torch.equal(w[:, 4], torch.sigmoid(logits[:, 16]).half())
    assert (w[:, :4].float().sum(-1) - 1).abs().max() < 2e-3  # renormalized over the routed slots only


@pytest.mark.parametrize("inter_s", [32, 48, 8])
def test_fused_moe_ref_shared_equals_routed_plus_gated_shared_mlp(inter_s):
    from kernels.moe import fused_moe_ref, route_ref

    gen = torch.Generator().manual_seed(2)
    e, k, h, i, n = 8, 2, 32, 16, 11
    x = torch.randn(n, h, generator=gen)
    w_gu, w_dn = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    ws = (torch.randn(2 * inter_s, h, generator=gen), torch.randn(h, inter_s, generator=gen))
    w, ids = route_ref(torch.randn(n, e + 1, generator=gen), k, True, shared=True)
    mask = torch.rand(n, generator=gen) < 0.7
    mask[0] = False
    out = fused_moe_ref(x, w_gu, w_dn, w, ids, mask, shared=ws)
    gate, up = F.linear(x, ws[0]).chunk(2, dim=-1)
    shared = F.linear(F.silu(gate) * up, ws[1])
    want = fused_moe_ref(x, w_gu, w_dn, w[:, :k], ids[:, :k], mask) + w[:, k:] * shared
    assert shared.abs().max() > 1.0  # the shared expert matters
    assert max_rel(out, want) < 1e-6
    # masked tokens: no routed work, their shared slot alone (as the shared expert computed apart)
    assert max_rel(out[~mask], w[~mask, k:] * shared[~mask]) < 1e-6


# ------------------------------------------------------------------------------------------- the model layer
@pytest.mark.parametrize("inter_s", [32, 48])
@pytest.mark.parametrize("tail", ["norm", "residual", "none"])
def test_sparse_moe_fused_equals_separate(inter_s, tail):
    moe, norm, cfg = tiny_moe(inter_s)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 6):
        x, res = torch.randn(n, cfg.hidden_size, generator=gen), torch.randn(n, cfg.hidden_size, generator=gen)
        args = {"norm": (res, norm), "residual": (res, None), "none": (None, None)}[tail]
        fused, separate = run_both(moe, lambda: moe(x, None, *args))
        fused = fused if isinstance(fused, tuple) else (fused,)
        separate = separate if isinstance(separate, tuple) else (separate,)
        assert len(fused) == len(separate)
        for a, b in zip(fused, separate):
            assert max_rel(a, b) < 1e-5, (n, tail)
    # the shared expert's part is real: without it the output moves
    with torch.no_grad():
        shared = moe.shared_output(x)
    assert shared.abs().max() > 0.1


@pytest.mark.parametrize("fused_stats", [True, False])
def test_sparse_moe_fused_with_router_correction_keeps_statistics_and_unmasked_rows(fused_stats, monkeypatch):
    """Extra rows / padding rows: the token mask, distinct experts and per-expert counts are those of the k routed
    slots (equal to the separate path's); every row equal, masked ones included (no routed work, the shared
    expert's output). The statistics from fused_moe's grouping (FUSED_STATS) or the separate kernel."""
    from workers.model import MoEContext, SparseMoe

    monkeypatch.setattr(SparseMoe, "FUSED_STATS", fused_stats)
    moe, norm, cfg = tiny_moe(48)
    gen = torch.Generator().manual_seed(4)
    n = 9
    x, res = torch.randn(n, cfg.hidden_size, generator=gen), torch.randn(n, cfg.hidden_size, generator=gen)
    extra = torch.zeros(n, dtype=torch.bool)
    extra[[2, 5, 8]] = True
    row_mask = torch.ones(n, dtype=torch.bool)
    row_mask[8] = False  # a padding row
    ctxs = []

    def call():
        ctx = MoEContext(extra_rows=extra, row_mask=row_mask, collect_counts=True)
        ctxs.append(ctx)
        return moe(x, ctx, res, None)

    fused, separate = run_both(moe, call)
    cf, cs = ctxs
    assert torch.equal(cf.token_mask, cs.token_mask)
    assert int(cf.distinct_experts[0]) == int(cs.distinct_experts[0]) > 0
    assert torch.equal(cf.expert_counts[0], cs.expert_counts[0])
    assert int(cf.expert_counts[0].sum()) == int(cf.token_mask.sum()) * moe.top_k  # routed slots only
    keep = cf.token_mask
    assert not keep[8] and keep.sum() >= 6
    assert max_rel(fused, separate) < 1e-5
    with torch.no_grad():
        assert max_rel(fused[~keep], res[~keep] + moe.shared_output(x[~keep])) < 1e-5


def test_sparse_moe_threshold_and_cached_router_rows_follow_weight_writes():
    from kernels import dispatch
    from workers.model import SparseMoe

    moe, norm, cfg = tiny_moe(32)
    gen = torch.Generator().manual_seed(5)
    calls = []
    real = dispatch.fused_moe

    def spy(*args, **kwargs):
        calls.append(kwargs.get("shared") is not None)
        return real(*args, **kwargs)

    dispatch.fused_moe = spy
    try:
        limit = SparseMoe.SHARED_FUSE_MAX_N
        moe(torch.randn(limit, cfg.hidden_size, generator=gen))
        moe(torch.randn(limit + 1, cfg.hidden_size, generator=gen))
    finally:
        dispatch.fused_moe = real
    assert calls == [True, False]
    # a weight write (as a checkpoint load does, in place) reaches the cached [E + 1, H] router rows and the
    # shared expert's gate/up view
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    before = moe(x)
    with torch.no_grad():
        moe.shared_expert_gate.weight.mul_(-2.0)
        moe.shared_expert.up_proj.weight.mul_(0.5)
        moe.gate.weight.copy_(moe.gate.weight.flip(0))
    fused, separate = run_both(moe, lambda: moe(x))
    assert max_rel(fused, before) > 1e-2
    assert max_rel(fused, separate) < 1e-5
    gu, dn = moe.shared_weights()
    assert gu.data_ptr() == moe.shared_expert.gate_proj.weight.data_ptr()  # a view, not a copy
    assert dn is moe.shared_expert.down_proj.weight


# ------------------------------------------------------------------------- the layer on the Triton kernels
def _interp_layer(inter_s: int, n: int, masked: bool) -> dict:
    import os

    from workers.model import MoEContext

    moe, norm, cfg = tiny_moe(inter_s, seed=10 + n)
    gen = torch.Generator().manual_seed(6)
    x, res = torch.randn(n, cfg.hidden_size, generator=gen), torch.randn(n, cfg.hidden_size, generator=gen)
    extra = torch.zeros(n, dtype=torch.bool)
    if masked:
        extra[1::2] = True
    out = {}
    ctxs = []
    for kernels in ("triton", "ref"):
        os.environ["HYBRIDSPEC_KERNELS"] = kernels
        ctx = MoEContext(extra_rows=extra, collect_counts=True)
        ctxs.append(ctx)
        fused, separate = run_both(moe, lambda: moe(x, ctx, res, norm))  # (the mask: from the first call)
        out[kernels] = fused
        if kernels == "ref":
            out["separate"] = separate
    (s_tri, h_tri), (s_ref, h_ref), (s_sep, h_sep) = out["triton"], out["ref"], out["separate"]
    result = {"triton_vs_ref": max(max_rel(s_tri, s_ref), max_rel(h_tri, h_ref)),
              "triton_vs_separate": max(max_rel(s_tri, s_sep), max_rel(h_tri, h_sep))}
    if masked:
        result["nothing_masked"] = float(bool(ctxs[0].token_mask.all()))
        result["mask_differs"] = float(not torch.equal(ctxs[0].token_mask, ctxs[1].token_mask))
        result["counts_differ"] = float(not torch.equal(ctxs[0].expert_counts[0], ctxs[1].expert_counts[0]))
    return result


INTERP_CASES = {"I_s==I_N1": (32, 1, False), "I_s==I_N5_masked": (32, 5, True), "I_s>I_N4_masked": (48, 4, True),
                "I_s<I_N3": (16, 3, False)}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__, kernels=None)


@pytest.mark.parametrize("case", list(INTERP_CASES))
def test_sparse_moe_fused_on_triton_kernels_equals_separate_reference(interp_results, case):
    assert_case(interp_results, case, 1e-5)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    run_cases({name: (lambda args=args: _interp_layer(*args)) for name, args in INTERP_CASES.items()})
