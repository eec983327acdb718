"""The end of a fused MoE layer in one launch (issue 6): kernels.dispatch.fused_moe_add_rmsnorm = fused_moe, then the
residual add and the next RMSNorm. Its Triton version (fused_moe_triton(..., reduce=False), then
`_moe_reduce_rmsnorm_kernel`: the experts' sum, the add and the norm) equals the reference
(kernels.moe.fused_moe_add_rmsnorm_ref), equals the two-kernel Triton path (fused_moe_triton + add_rmsnorm_triton)
bit for bit, writes the same routing statistics, and launches one kernel fewer.

Under TRITON_INTERPRET=1 (this file run as a script): E=8 experts top-2, H=48 (not a power of two), I=16, ragged
N in {1, 3, 5}, with and without a token mask, with and without the shared expert (I_s=24) as expert id E; fp32
against the reference; fp16 against the two-kernel path (fp16 rounds where bf16 does on the GPU: a missing rounding
of the reduced sum before the add shows there; the interpreter's bf16 is not the GPU's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # fp32 max relative error (tests/test_moe_shared.py's)
E, K, H, I, I_S = 8, 2, 48, 16, 24

# case -> (tokens, token mask, shared expert, dtype, fused_moe config)
CASES = {f"N{n}{'_mask' if m else ''}{'_shared' if s else ''}": (n, m, s, "float32", None)
         for n in (1, 3, 5) for m in (False, True) for s in (False, True)}
CASES.update({
    "fp16_N5_mask_shared": (5, True, True, "float16", None),
    "fp16_N3_shared": (3, False, True, "float16", None),
    "fp16_N5_mask": (5, True, False, "float16", None),
    "N5_mask_shared_align_kernel": (5, True, True, "float32", {"fuse_align": False}),  # the separate align launch
})


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


class _LaunchCount:
    """Counts interpreted Triton launches while active."""

    def __enter__(self):
        import triton.runtime.interpreter as interpreter

        self.n, self._cls, self._run = 0, interpreter.InterpretedFunction, interpreter.InterpretedFunction.run
        run = self._run

        def counted(fn_self, *args, **kwargs):
            self.n += 1
            return run(fn_self, *args, **kwargs)

        self._cls.run = counted
        return self

    def __exit__(self, *exc):
        self._cls.run = self._run


def _case(n: int, masked: bool, shared: bool, dtype: str, config: dict | None) -> dict:
    from kernels.moe import fused_moe_add_rmsnorm_ref, route_ref
    from kernels.moe_triton import fused_moe_add_rmsnorm_triton, fused_moe_triton
    from kernels.norm_triton import add_rmsnorm_triton

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(100 * n + 10 * masked + shared)
    x, res = torch.randn(n, H, generator=gen).to(dt), torch.randn(n, H, generator=gen).to(dt)
    norm_w = (0.3 * torch.randn(H, generator=gen)).to(dt)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dt)
    w_dn = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dt)
    ws = ((torch.randn(2 * I_S, H, generator=gen) / H ** 0.5).to(dt),
          (torch.randn(H, I_S, generator=gen) / I_S ** 0.5).to(dt)) if shared else None
    w, ids = route_ref(torch.randn(n, E + 1 if shared else E, generator=gen) * 2, K, True, dt, shared=shared)
    mask = torch.arange(n) % 2 == 1 if masked else None  # N=1: every token masked (no routed work at all)

    def stats():  # garbage first: every entry must be written
        return torch.full((), -7, dtype=torch.int64), torch.full((E,), -7, dtype=torch.int64)

    st_fused, st_two, st_ref = stats(), stats(), stats()
    with _LaunchCount() as fused_launches:
        s, o = fused_moe_add_rmsnorm_triton(x, w_gu, w_dn, w, ids, mask, ws, st_fused, res, norm_w, 1e-6,
                                            config=config)
    with _LaunchCount() as two_launches:
        out = fused_moe_triton(x, w_gu, w_dn, w, ids, mask, config=config, shared=ws, stats=st_two)
        s2, o2 = add_rmsnorm_triton(res, out, norm_w, 1e-6)
    result = {
        "differs_from_two_kernels": float(not (torch.equal(s, s2) and torch.equal(o, o2))),
        "stats_differ": float(not all(torch.equal(a, b) for a, b in zip(st_fused, st_two))),
        "not_one_launch_fewer": float(fused_launches.n != two_launches.n - 1),
        "dtype_or_shape_wrong": float(s.dtype != dt or o.dtype != dt or s.shape != (n, H) or o.shape != (n, H)),
    }
    if dt == torch.float32:
        s_ref, o_ref = fused_moe_add_rmsnorm_ref(x, w_gu, w_dn, w, ids, mask, ws, st_ref, res, norm_w, 1e-6)
        result["sum_vs_ref"], result["norm_vs_ref"] = _max_rel(s, s_ref), _max_rel(o, o_ref)
        result["stats_differ_from_ref"] = float(not all(torch.equal(a, b) for a, b in zip(st_fused, st_ref)))
        if masked and not shared:  # a masked token without the shared slot: s is the residual itself
            result["masked_rows_not_residual"] = float(not torch.equal(s[~mask], res[~mask]))
    return result


def _edges() -> dict:
    """No tokens (empty outputs, zeroed statistics), a strided residual (row view of a wider tensor), and the down
    kernel's own reduction asked together with reduce=False (an error, not a silent choice)."""
    from kernels.moe import fused_moe_add_rmsnorm_ref, route_ref
    from kernels.moe_triton import fused_moe_add_rmsnorm_triton, fused_moe_triton

    gen = torch.Generator().manual_seed(7)
    w_gu, w_dn = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5, torch.randn(E, H, I, generator=gen) / I ** 0.5
    norm_w = 0.3 * torch.randn(H, generator=gen)
    st = (torch.full((), -7, dtype=torch.int64), torch.full((E,), -7, dtype=torch.int64))
    w0, ids0 = route_ref(torch.randn(0, E), K, True)
    s0, o0 = fused_moe_add_rmsnorm_triton(torch.randn(0, H), w_gu, w_dn, w0, ids0, None, None, st,
                                          torch.randn(0, H), norm_w, 1e-6)
    x = torch.randn(4, H, generator=gen)
    res = torch.randn(4, 2 * H, generator=gen)[:, :H]  # rows 2H apart
    w, ids = route_ref(torch.randn(4, E, generator=gen), K, True)
    s, o = fused_moe_add_rmsnorm_triton(x, w_gu, w_dn, w, ids, None, None, None, res, norm_w, 1e-6)
    s_ref, o_ref = fused_moe_add_rmsnorm_ref(x, w_gu, w_dn, w, ids, None, None, None, res, norm_w, 1e-6)
    try:
        fused_moe_triton(x, w_gu, w_dn, w, ids, config={"fuse_reduce": True}, reduce=False)
        raised = False
    except ValueError:
        raised = True
    return {"empty_not_empty": float(s0.shape != (0, H) or o0.shape != (0, H)),
            "empty_stats_not_zero": float(int(st[0]) != 0 or bool(st[1].any())),
            "strided_residual_vs_ref": max(_max_rel(s, s_ref), _max_rel(o, o_ref)),
            "fuse_reduce_with_reduce_false_not_refused": float(not raised)}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", [*CASES, "edges"])
def test_fused_moe_add_rmsnorm_on_triton_kernels(interp_results, case):
    assert_case(interp_results, case, TOL)


def test_reference_is_fused_moe_then_add_rmsnorm():
    """The reference (the CPU/eager path) is exactly the two references it replaces."""
    from kernels.moe import fused_moe_add_rmsnorm_ref, fused_moe_ref, route_ref
    from kernels.norm import add_rmsnorm_ref

    gen = torch.Generator().manual_seed(3)
    n = 5
    x, res = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
    w_gu, w_dn = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    ws = (torch.randn(2 * I_S, H, generator=gen), torch.randn(H, I_S, generator=gen))
    w, ids = route_ref(torch.randn(n, E + 1, generator=gen), K, True, shared=True)
    mask = torch.tensor([True, False, True, True, False])
    st = (torch.zeros((), dtype=torch.int64), torch.zeros(E, dtype=torch.int64))
    got = fused_moe_add_rmsnorm_ref(x, w_gu, w_dn, w, ids, mask, ws, st, res, torch.ones(H), 1e-6)
    want = add_rmsnorm_ref(res, fused_moe_ref(x, w_gu, w_dn, w, ids, mask, ws), torch.ones(H), 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(st[1].sum()) == int(mask.sum()) * K


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    cases = {name: (lambda args=args: _case(*args)) for name, args in CASES.items()}
    cases["edges"] = _edges
    run_cases(cases)
