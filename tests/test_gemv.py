"""The few-row GEMV (kernels/gemv_triton.py) == kernels.gemv.linear_small_ref, and where the model uses it.

Under TRITON_INTERPRET=1 on the CPU, fp32 (the interpreter computes bf16 wrongly), tiny ragged shapes: N = 1..8
(BLOCK_N 1, 2, 4, 8 with masked rows), M and K not multiples of the blocks (M below BLOCK_M too), with and without
bias, every configuration in CONFIGS; x as a strided view (row stride > K, an odd offset) and with a non-unit column
stride; the weight as a row slice of a fused weight and as a column slice (row stride > K). The switch
(kernels.dispatch.linear): on the Triton path Linear and FusedLinears take the kernel at 1..SMALL_N_MAX rows and only
there (not for prefill rows, not for the LM head, not with SMALL_N_MAX = 0), FusedLinears reads the unpadded rows at
one row and the padded weight beyond, and the model's logits equal those of the cuBLAS path. As in the other kernel
tests, the interpreted cases run in ONE subprocess (this file as a script prints their errors as JSON); the CPU path
(F.linear, triton never imported) and the env switch run here.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-6  # relative, fp32 (observed ~5e-7: the sums' order; a dropped tile or row is >= 1e-2)


def _rel(a, b):
    if a.shape != b.shape:
        return float("inf")
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _data(n, m, k, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen),
            torch.randn(m, generator=gen) if bias else None)


def case_configs():
    """The configurations the shape table and the default pick at N = 1 and 3 on two ragged shapes, with and without
    bias; every other configuration once (N = 3, ragged, bias): the interpreter's time goes by the product."""
    from kernels.gemv import linear_small_ref
    from kernels.gemv_triton import CONFIGS, DEFAULT, SHAPE_TABLE, linear_small_triton

    used = set(SHAPE_TABLE.values()) | {DEFAULT}
    errs = {}
    for name in CONFIGS:
        for n in ((1, 3) if name in used else (3,)):
            for m, k in (((37, 600), (3, 1100)) if name in used else ((37, 600),)):  # ragged M (and M < BLOCK_M),
                # K not a multiple of BLOCK_K
                for bias in ((True, False) if name in used else (True,)):
                    x, w, b = _data(n, m, k, seed=n * 7 + m, bias=bias)
                    errs[f"{name}/n{n}/{m}x{k}/bias{int(bias)}"] = _rel(linear_small_triton(x, w, b, config=name),
                                                                       linear_small_ref(x, w, b))
    return errs


def case_rows():
    """N = 1..8 with the default pick (BLOCK_N 1, 2, 4, 8: rows masked at 3, 5, 6, 7) and a one-shot config."""
    from kernels.gemv import linear_small_ref
    from kernels.gemv_triton import linear_small_triton

    errs = {}
    for n in range(1, 9):
        for cfg in (None, "m2k2048w4s1"):
            x, w, b = _data(n, 21, 530, seed=n)
            errs[f"n{n}/{cfg}"] = _rel(linear_small_triton(x, w, b, config=cfg), linear_small_ref(x, w, b))
    x, w, b = _data(9, 21, 530, seed=0)  # beyond GEMV_MAX_ROWS: the reference
    errs["n9"] = _rel(linear_small_triton(x, w, b), linear_small_ref(x, w, b))
    return errs


def case_strides():
    """x: a strided row view (row stride > K, odd element offset) and a transposed view (non-unit column stride);
    weight: a row slice of a fused weight (FusedLinears' one-row case) and a column slice (row stride > K)."""
    from kernels.gemv import linear_small_ref
    from kernels.gemv_triton import linear_small_triton

    gen = torch.Generator().manual_seed(5)
    k, m = 300, 19
    base = torch.randn(3, k + 45, generator=gen)
    x_rows = base[:, 3:3 + k]  # [3, K], stride (K + 45, 1), offset 3
    x_t = torch.randn(k, 2, generator=gen).t()  # [2, K], stride (1, 2)
    fused = torch.randn(m + 5, k, generator=gen)
    wide = torch.randn(m, k + 33, generator=gen)
    b = torch.randn(m + 5, generator=gen)
    errs = {}
    for xn, x in (("rows", x_rows), ("transposed", x_t)):
        for wn, w in (("row_slice", fused[:m]), ("col_slice", wide[:, 7:7 + k])):
            errs[f"{xn}/{wn}"] = _rel(linear_small_triton(x, w, b[:m]), linear_small_ref(x, w, b[:m]))
    return errs


def _recording():
    """Wraps kernels.gemv_triton.linear_small_triton (dispatch.linear imports it at each call): records
    (N, M, K) of each call."""
    import kernels.gemv_triton as gt

    calls, real = [], gt.linear_small_triton

    def rec(x, weight, bias=None, config=None):
        calls.append((x.shape[0], weight.shape[0], weight.shape[1]))
        return real(x, weight, bias, config)

    gt.linear_small_triton = rec
    return calls, lambda: setattr(gt, "linear_small_triton", real)


def case_dispatch():
    """dispatch.linear: the kernel for 1..SMALL_N_MAX rows of a 2-D x, F.linear otherwise (values either way);
    FusedLinears: one row reads the unpadded rows, two rows the padded weight, each Linear's output as F.linear."""
    import kernels.gemv as gemv
    from kernels import dispatch
    from workers.model import FusedLinears, Linear

    calls, restore = _recording()
    errs = {}
    try:
        _, w, b = _data(1, 13, 40, seed=1)
        for n in range(0, gemv.SMALL_N_MAX + 2):
            x = torch.randn(n, 40)
            del calls[:]
            errs[f"linear/n{n}"] = _rel(dispatch.linear(x, w, b), F.linear(x, w, b))
            errs[f"linear/n{n}/kernel_if_small"] = float(bool(calls) != (1 <= n <= gemv.SMALL_N_MAX))
        del calls[:]
        x3 = torch.randn(2, 1, 40)
        errs["linear/3d"] = _rel(dispatch.linear(x3, w, b), F.linear(x3, w, b))
        errs["linear/3d/no_kernel"] = float(bool(calls))
        gemv.SMALL_N_MAX, saved = 0, gemv.SMALL_N_MAX
        try:
            dispatch.linear(torch.randn(1, 40), w, b)
        finally:
            gemv.SMALL_N_MAX = saved
        errs["linear/off/no_kernel"] = float(bool(calls))

        torch.manual_seed(0)
        linears = [Linear(40, s, torch.float32, "cpu", bias=True) for s in (5, 2)]  # 7 rows padded to 8
        fused = FusedLinears.of(linears)
        for lin in linears:
            lin.weight.data.normal_()
            lin.bias.data.normal_()
        saved_max = gemv.SMALL_N_MAX
        gemv.SMALL_N_MAX = max(2, saved_max)  # the padded width is read from 2 rows on
        for n, width in ((1, 7), (2, 8)):
            del calls[:]
            x = torch.randn(n, 40)
            outs = fused(x)
            for i, (out, lin) in enumerate(zip(outs, linears)):
                errs[f"fused/n{n}/out{i}"] = _rel(out, F.linear(x, lin.weight, lin.bias))
            errs[f"fused/n{n}/width"] = float(calls != [(n, width, 40)])
        gemv.SMALL_N_MAX = saved_max
    finally:
        restore()
    return errs


def case_model():
    """A tiny bench model (GDN + attention layers, MoE) on the Triton path: a one-token decode step sends the GDN
    in_proj / out_proj and the attention qkv / o_proj through the kernel (one row each), the LM head never; a
    6-token prefill nothing; the decode step's logits equal those with SMALL_N_MAX = 0 (cuBLAS / F.linear)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import kernels.gemv as gemv
    from e2e import tiny_config
    from workers.batch import ForwardBatch
    from workers.bench_model import build_bench_model
    from workers.cache import ModelCache

    torch.manual_seed(0)
    cfg = tiny_config()
    model = build_bench_model(config=cfg, dtype=torch.float32, device="cpu")
    layer_types = set(cfg.layer_types)
    h = cfg.hidden_size
    expect = set()
    if "linear_attention" in layer_types:
        expect |= {(1, cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads, h),
                   (1, h, cfg.linear_value_dim)}
    if "full_attention" in layer_types:
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        expect |= {(1, hq * d * 2 + 2 * hkv * d, h), (1, h, hq * d)}

    def run(tokens, ctx):
        cache = ModelCache(cfg, 8, 16, 2, torch.float32, "cpu")
        prefill = ForwardBatch.build([list(range(3, 3 + ctx))], [0], [[0]], [0], "cpu")
        model(prefill, cache)
        return model(ForwardBatch.build([tokens], [ctx], [[0]], [0], "cpu"), cache)

    calls, restore = _recording()
    errs = {}
    try:
        logits = run([5], 3)  # prefill of 3 rows (the kernel only where SMALL_N_MAX >= 3) then one decode row
        del calls[:]
        logits = run([5], 6)  # a prefill of 6 rows (> SMALL_N_MAX): no kernel; then the decode step
        decode_calls = set(calls)
        errs["decode/expected_projections"] = float(not expect <= decode_calls)
        errs["decode/one_row_only"] = float(any(c[0] != 1 for c in calls))
        errs["lm_head_never"] = float(any(c[1] == cfg.vocab_size for c in calls))
        del calls[:]
        cache = ModelCache(cfg, 8, 16, 2, torch.float32, "cpu")
        model(ForwardBatch.build([list(range(3, 9))], [0], [[0]], [0], "cpu"), cache)
        errs["prefill6/no_kernel"] = float(bool(calls))
        gemv.SMALL_N_MAX, saved = 0, gemv.SMALL_N_MAX
        try:
            del calls[:]
            ref = run([5], 6)
            errs["off/no_kernel"] = float(bool(calls))
        finally:
            gemv.SMALL_N_MAX = saved
        errs["decode/logits"] = _rel(logits, ref)
    finally:
        restore()
    return errs


CASES = {"configs": case_configs, "rows": case_rows, "strides": case_strides, "dispatch": case_dispatch,
         "model": case_model}


# -------------------------------------------------------------------------------------- the pytest side

@functools.lru_cache(maxsize=1)
def _interpreted():
    return run_interpreted(__file__, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_gemv_interpreted(name):
    assert_case(_interpreted(), name, TOL)


def test_cpu_path_is_f_linear_without_triton(monkeypatch):
    """Default mode on CPU tensors: Linear and FusedLinears give F.linear's exact values; the Triton module is
    never reached."""
    from workers.model import FusedLinears, Linear

    def boom(*args, **kwargs):
        raise AssertionError("the Triton GEMV ran on the CPU path")

    monkeypatch.delenv("HYBRIDSPEC_KERNELS", raising=False)
    monkeypatch.setitem(sys.modules, "kernels.gemv_triton", types.SimpleNamespace(linear_small_triton=boom))
    torch.manual_seed(0)
    lin = Linear(24, 10, torch.float32, "cpu", bias=True)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    parts = [Linear(24, s, torch.float32, "cpu") for s in (5, 2)]
    fused = FusedLinears.of(parts)
    for p in parts:
        p.weight.data.normal_()
    for n in (1, 2, 4):
        x = torch.randn(n, 24)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        # one row: the unpadded rows (as before the kernel); more: the padded product's slices
        w, sizes = (fused.weight[:7], [5, 2]) if n == 1 else (fused.weight, [5, 2, 1])
        for out, want in zip(fused(x), torch.split(F.linear(x, w), sizes, dim=-1)):
            assert torch.equal(out, want)


@pytest.mark.parametrize("env,expected", [(None, 1), ("0", 0), ("2", 2)])
def test_env_switch_sets_small_n_max(env, expected):
    """HYBRIDSPEC_GEMV_MAX_N, read at import: 0 keeps every projection on F.linear (A/B on the device)."""
    e = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_GEMV_MAX_N"}
    if env is not None:
        e["HYBRIDSPEC_GEMV_MAX_N"] = env
    out = subprocess.run([sys.executable, "-c", "import kernels.gemv as g; print(g.SMALL_N_MAX)"], cwd=ROOT,
                         env=dict(e, PYTHONPATH=str(ROOT)), capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == expected


def test_bench_tiny_checks_every_config(tmp_path):
    """bench/kernels_gemv.py --tiny (interpreter, fp32, no timing) runs and finds every configuration exact."""
    import json

    out = tmp_path / "gemv.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_gemv.py"), "--tiny", "--ns", "1,3", "--shapes",
                    "ragged", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=600,
                   env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    report = json.loads(out.read_text())
    assert report["bad"] == [] and len(report["rows"]) == 2
    assert all(set(r["err"]) == set(report["configs"]) for r in report["rows"])


# ------------------------------------------------------------------------------------ the interpreter side

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    run_cases(CASES)
