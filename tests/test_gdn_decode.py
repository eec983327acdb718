"""The fused GDN decode step (kernels/gdn_decode_triton.py) == the unfused chain of references (conv, gates, delta
rule, gated norm), and a model's decode step through it == the same step through the four kernels.

Kernel cases run under TRITON_INTERPRET=1 in one subprocess (this file run as a script prints every case's errors as
JSON), fp32, tiny shapes: HK=2, HV=4 (GQA 2; one case HK=HV), DK=16, DV=16 or 32; B = 1 and 3 (+ a graph bucket's
idle request of no token and a padding request on the spare slot); fresh (zero) and continued states and windows;
write True / False / a [B] mask; every value tile (BV = DV: the norm in the program; BV < DV: the last program of
a key head's group normalises) and the separate-norm variant; with and without the commit's block inputs. The
interpreter runs programs one after another, so a q/k window written by the first program of a key head (instead
of the last) would be read shifted by the next: the window checks catch that ordering. Model cases compare logits,
every GDN state, conv window and the kept block inputs, fused vs unfused, on the Triton path (interpreter) and on the
reference path (in-process, exact).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]
NUM_SLOTS, SPARE = 8, 7
TOL = 2e-5  # relative (fp32; observed ~1e-7: the kernel sums in another order; a wrong tap or token is >= 1e-2)


def _rel(a, b):
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(lens, slots, seed, hk=2, hv=4, dk=16, dv=16, kernel=4, fresh=()):
    """In_proj-like strided views (conv input, z, b, a of one [N, ...] row), weights, pools. `fresh` slots start
    from zero state and window (a new request after ModelCache.reset_slots)."""
    gen = torch.Generator().manual_seed(seed)
    n, c = sum(lens), 2 * hk * dk + hv * dv
    proj = torch.randn(n, c + hv * dv + 2 * hv + 3, generator=gen)  # 3 padding columns, as FusedLinears pads
    x, z, b, a = torch.split(proj[:, :c + hv * dv + 2 * hv], [c, hv * dv, hv, hv], dim=-1)
    weight = (torch.randn(c, 1, kernel, generator=gen) * 0.6)[:, 0, :]  # [C, K] strided view, as the model's
    neg_a = -torch.rand(hv, generator=gen).exp()
    dt_bias, norm_w = torch.randn(hv, generator=gen), 1 + 0.3 * torch.randn(dv, generator=gen)
    conv_state = torch.randn(NUM_SLOTS, c, kernel - 1, generator=gen)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    for s in fresh:
        conv_state[s], state[s] = 0, 0
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return [x, z, a, b, weight, neg_a, dt_bias, norm_w, 1e-6, cu, conv_state, state, torch.tensor(slots)]


def _chain(args, write_state):
    """The unfused path of GatedDeltaNet.forward, reference by reference: (o, mixed, g, beta)."""
    from kernels.conv import causal_conv1d_ref
    from kernels.elementwise import gdn_gates_ref
    from kernels.gdn import gdn_recurrent_ref
    from kernels.norm import gated_rmsnorm_ref

    x, z, a, b, w, neg_a, dt_bias, norm_w, eps, cu, conv_state, state, slots = args
    n, hv, dk, dv = x.shape[0], a.shape[1], state.shape[2], state.shape[3]
    hk = (x.shape[1] - hv * dv) // (2 * dk)
    mixed = causal_conv1d_ref(x, w, cu, conv_state, slots, 1, write_state)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = gdn_gates_ref(a, b, neg_a, dt_bias)
    o = gdn_recurrent_ref(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta, cu, state,
                          slots, 1, write_state=write_state)
    return gated_rmsnorm_ref(o, z.reshape(n, hv, dv), norm_w, eps).reshape(n, hv * dv), mixed, g, beta


def _compare(errs, name, fn, lens, slots, ws, seed=0, fresh=(), shape=None, o_only=False, **kw):
    """fn (the fused entry) vs the chain from the same pools: outputs, kept inputs, state and windows after the
    step, slots outside the batch untouched, counters left at zero."""
    from kernels import gdn_decode_triton as gdt

    args = _inputs(lens, slots, seed, fresh=fresh, **(shape or {}))
    ref_args, fn_args = list(args), list(args)
    ref_args[10], ref_args[11] = args[10].clone(), args[11].clone()
    fn_args[10], fn_args[11] = args[10].clone(), args[11].clone()
    o_ref, mixed_ref, g_ref, beta_ref = _chain(ref_args, ws)
    o, mixed, g, beta = fn(*fn_args, write_state=ws, keep_inputs=True, **kw)
    errs[f"{name}/o"] = _rel(o, o_ref)  # every row belongs to a request of one token
    errs[f"{name}/mixed"] = _rel(mixed, mixed_ref)
    errs[f"{name}/g"], errs[f"{name}/beta"] = _rel(g, g_ref), _rel(beta, beta_ref)
    errs[f"{name}/state"] = _rel(fn_args[11], ref_args[11])
    errs[f"{name}/conv_state"] = _rel(fn_args[10], ref_args[10])
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[torch.tensor(slots)] = False
    errs[f"{name}/other_slots_changed"] = float(not (torch.equal(fn_args[11][others], args[11][others])
                                                     and torch.equal(fn_args[10][others], args[10][others])))
    errs[f"{name}/counters_nonzero"] = float(any(bool(c.any()) for c in gdt._COUNTERS.values()))
    if o_only:  # the launch without the block inputs (KEEP off)
        o = fn(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args], write_state=ws, **kw)
        errs[f"{name}/o_without_inputs"] = _rel(o, o_ref)
    return fn_args


def case_kernel():
    from kernels.gdn_decode import gdn_decode_ref
    from kernels.gdn_decode_triton import gdn_decode_triton

    errs = {}
    mask = torch.tensor([True, False, True])
    variants = {"bv16": dict(bv=16), "bv8": dict(bv=8), "bv4": dict(bv=4), "bv16_sep": dict(bv=16, norm="separate"),
                "bv8_sep": dict(bv=8, norm="separate")}
    plan = (  # (lens, slots, fresh slots, (write mode, variant) pairs): every write mode, tile and norm placement
        # at least once with one and with three requests (the interpreter's time goes by the calls)
        ([1], [3], (), (("write", "bv16"), ("nowrite", "bv4"), ("mask", "bv4"))),
        ([1], [5], (5,), (("write", "bv8"), ("write", "bv8_sep"))),
        ([1, 1, 1], [6, 0, 2], (0,), (("write", "bv16"), ("nowrite", "bv8"), ("mask", "bv8"), ("mask", "bv16_sep"))),
    )
    for lens, slots, fresh, pairs in plan:
        for wname, vname in pairs:
            ws = {"write": True, "nowrite": False, "mask": mask[:len(lens)]}[wname]
            name = f"B{len(lens)}{'/fresh' if fresh else ''}/{wname}/{vname}"
            _compare(errs, name, gdn_decode_triton, lens, slots, ws, seed=len(errs), fresh=fresh,
                     o_only=wname == "write", **variants[vname])
    # the reference with the fused signature is the chain
    _compare(errs, "ref", gdn_decode_ref, [1, 1, 1], [6, 0, 2], True)
    # DV = 32 != DK, auto tiles (4 programs per head at B = 1: last-program norm), 2 warps
    _compare(errs, "dv32/auto", gdn_decode_triton, [1], [2], True, shape=dict(dv=32))
    _compare(errs, "dv32/bv8_w2", gdn_decode_triton, [1, 1], [2, 4], True, shape=dict(dv=32), bv=8, num_warps=2)
    # HK = HV (no shared q/k channels): BV = DV writes every window directly, BV < DV through the counter
    for bv in (16, 8):
        _compare(errs, f"gqa1/bv{bv}", gdn_decode_triton, [1, 1, 1], [1, 3, 5], True, shape=dict(hk=4), bv=bv)
    # the delta rule's other order (DECODE_SHORT_CHAIN's other value): the same values
    import kernels.gdn_decode_triton as gdt
    gdt.DECODE_SHORT_CHAIN = not gdt.DECODE_SHORT_CHAIN
    try:
        for bv in (16, 8):
            _compare(errs, f"other_order/bv{bv}", gdn_decode_triton, [1, 1, 1], [6, 0, 2], mask, bv=bv)
    finally:
        gdt.DECODE_SHORT_CHAIN = not gdt.DECODE_SHORT_CHAIN
    return errs


def case_padding():
    """A graph bucket's layout: real requests, an idle request of no token on the spare slot, then a padding request
    with a token on the spare slot, write mask False for both; then a second step from the states the first left
    (continued), where request 0 is fresh."""
    from kernels.gdn_decode_triton import gdn_decode_triton

    errs = {}
    lens, slots = [1, 1, 0, 1], [4, 1, SPARE, SPARE]
    ws = torch.tensor([True, True, False, False])
    for bv in (16, 8):
        after = _compare(errs, f"bv{bv}", gdn_decode_triton, lens, slots, ws, seed=bv, bv=bv)
        # step 2 from the pools step 1 left (fused) vs the chain from the same pools
        args = _inputs(lens, slots, seed=bv + 100)
        args[10], args[11] = after[10].clone(), after[11].clone()
        args[10][4], args[11][4] = 0, 0  # request 0 starts fresh
        ref = list(args)
        ref[10], ref[11] = args[10].clone(), args[11].clone()
        o_ref = _chain(ref, ws)[0]
        o = gdn_decode_triton(*args, write_state=ws, bv=bv)
        errs[f"bv{bv}/step2/o"] = _rel(o, o_ref)  # rows: requests 0, 1 and the padding request
        errs[f"bv{bv}/step2/state"] = _rel(args[11], ref[11])
        errs[f"bv{bv}/step2/conv_state"] = _rel(args[10], ref[10])
    return errs


def _tiny_model():
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e import tiny_config

    from workers.bench_model import build_bench_model

    cfg = tiny_config()  # 3 GDN layers (HK=2, HV=4, DK=DV=16) + 1 attention, MoE
    return cfg, build_bench_model(config=cfg, dtype=torch.float32, device="cpu")


def _model_steps(model, cfg):
    """Prefill three requests (the chain: blocks > 1), then decode steps from copies of that cache, fused and unfused:
    a plain step (one of them a fresh one-token prompt) and a graph-like padded step with a write mask and scratch.
    -> {check: relative error}."""
    from workers.batch import ForwardBatch
    from workers.cache import ModelCache, StepScratch
    from workers.model import GatedDeltaNet

    cache = ModelCache(cfg, 16, 16, NUM_SLOTS, torch.float32, "cpu")
    cache.reset_slots([4, 1, 2])
    model(ForwardBatch.build([[5, 6, 7], [9, 3, 1, 4, 4], [2, 8]], [0, 0, 0], [[0], [1], [2]], [4, 1, 2], "cpu"), cache)

    def copy(c):
        new = ModelCache(cfg, 16, 16, NUM_SLOTS, torch.float32, "cpu")
        for dst, src in zip(new.layers, c.layers):
            for name in vars(src):
                getattr(dst, name).copy_(getattr(src, name))
        return new

    def run(fused, fn):
        c = copy(cache)
        old = GatedDeltaNet.DECODE_FUSED
        GatedDeltaNet.DECODE_FUSED = fused
        try:
            return fn(c), c
        finally:
            GatedDeltaNet.DECODE_FUSED = old

    def plain(c):
        c.reset_slots([3])  # a fresh request: a one-token prompt
        batch = ForwardBatch.build([[11], [12], [13], [14]], [3, 5, 2, 0], [[0], [1], [2], [3]], [4, 1, 2, 3], "cpu")
        return model(batch, c), None

    def padded(c):  # graphs.py's layout: 3 real requests, an idle one, a padding request (spare slot and page)
        i64, i32 = torch.int64, torch.int32
        batch = ForwardBatch(
            input_ids=torch.tensor([11, 12, 13, 0], dtype=i64), positions=torch.tensor([3, 5, 2, 0], dtype=i64),
            request_of_row=torch.tensor([0, 1, 2, 4], dtype=i64),
            cu_seqlens=torch.tensor([0, 1, 2, 3, 3, 4], dtype=i32),
            context_lens=torch.tensor([3, 5, 2, 0, 0], dtype=i32),
            page_table=torch.tensor([[0], [1], [2], [15], [15]], dtype=i32),
            state_slots=torch.tensor([4, 1, 2, SPARE, SPARE], dtype=i64), query_lens=[1, 1, 1, 0, 1],
            context_lens_host=[3, 5, 2, 0, 0])
        scratch = StepScratch({})
        write = torch.tensor([True, True, True, False, False])
        return model(batch, c, torch.arange(4), write=write, scratch=scratch), scratch

    errs = {}
    for name, fn in (("plain", plain), ("padded", padded)):
        (lf, sf), cf = run(True, fn)
        (lu, su), cu = run(False, fn)
        rows = slice(0, 3) if name == "padded" else slice(None)
        errs[f"{name}/logits"] = _rel(lf[rows], lu[rows])
        for i, (a, b) in enumerate(zip(cf.layers, cu.layers)):
            for field in vars(a):
                errs[f"{name}/layer{i}/{field}"] = _rel(getattr(a, field), getattr(b, field))
        if sf is not None:
            errs[f"{name}/scratch_layers"] = float(sorted(sf.layers) != sorted(su.layers) or not sf.layers)
            for i in sf.layers:
                for field in ("conv_in", "k", "v", "g", "beta"):
                    a, b = getattr(sf.layers[i], field)[:3], getattr(su.layers[i], field)[:3]  # the real rows
                    errs[f"{name}/scratch{i}/{field}"] = _rel(a, b)
    return errs


def case_model():
    """Fused vs unfused decode steps of the bench model's layer mix on the Triton path."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from kernels import dispatch

    cfg, model = _tiny_model()
    assert dispatch.use_triton(torch.zeros(1)), "HYBRIDSPEC_KERNELS=triton is set by the runner"
    return _model_steps(model, cfg)


CASES = {"kernel": case_kernel, "padding": case_padding, "model": case_model}


# -------------------------------------------------------------------------------------- the pytest side

@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_equals_chain(interpreted, name):
    assert_case(interpreted, name, TOL)


def test_model_decode_fused_equals_unfused_reference_path(monkeypatch):
    """The model's wiring on the reference path (CPU default): fused entry == chain, exactly."""
    monkeypatch.setenv("HYBRIDSPEC_KERNELS", "ref")
    cfg, model = _tiny_model()
    errs = _model_steps(model, cfg)
    assert all(e == 0.0 for e in errs.values()), {k: e for k, e in errs.items() if e != 0.0}


def test_bench_script_runs_tiny(tmp_path):
    """bench/kernels_gdn_decode.py end to end in its --tiny mode (interpreter): every variant ran, matched the chain,
    left the counters at zero, and the JSON has its table."""
    import json
    import subprocess

    out = tmp_path / "gdn_decode.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_gdn_decode.py"), "--tiny", "--batches", "1",
                    "--layers", "1", "--out", str(out)], check=True, cwd=ROOT, env=env, capture_output=True,
                   timeout=600)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["B"] == 1 and row["counters_zero"] and row["chain"] > 0
    for name, err in row["errors"].items():
        assert "failed" not in err and err["o_max_rel"] < 1e-5 and err["conv_state_diff"] == 0, (name, err)
        assert row[name] > 0, name


def test_fused_decode_is_the_default_and_the_env_switch():
    import subprocess

    code = "from workers.model import GatedDeltaNet as G; print(G.DECODE_FUSED)"
    outs = []
    for value in (None, "0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_GDN_DECODE_FUSED"}
        if value is not None:
            env["HYBRIDSPEC_GDN_DECODE_FUSED"] = value
        env["PYTHONPATH"] = str(ROOT)
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout.strip())
    assert outs == ["True", "False", "True"]


# ------------------------------------------------------------------------------------ the interpreter side

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    run_cases(CASES)


def test_unsupported_shapes_take_the_four_kernels_or_fail_clearly():
    """GatedDeltaNet fuses only a power-of-two value head dim with an fp32 state (else the four-kernel chain), and
    the kernel itself names what it cannot take instead of failing inside the compiler."""
    from kernels.gdn_decode_triton import gdn_decode_triton
    from workers.model import _decode_fusable

    assert _decode_fusable(128, torch.float32) and _decode_fusable(16, torch.float32)
    assert not _decode_fusable(96, torch.float32) and not _decode_fusable(128, torch.bfloat16)
    hk, hv, dk, dv, n = 1, 2, 4, 6, 1  # DV = 6: not a power of two
    x = torch.zeros(n, 2 * hk * dk + hv * dv)
    z, a, b = torch.zeros(n, hv * dv), torch.zeros(n, hv), torch.zeros(n, hv)
    args = (x, z, a, b, torch.zeros(x.shape[1], 4), torch.zeros(hv), torch.zeros(hv), torch.ones(dv), 1e-6,
            torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, x.shape[1], 3), torch.zeros(2, hv, dk, dv),
            torch.tensor([0]))
    with pytest.raises(ValueError, match="power of two"):
        gdn_decode_triton(*args)
    bad_state = list(args)
    bad_state[11] = torch.zeros(2, hv, dk, dv, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        gdn_decode_triton(*bad_state)
