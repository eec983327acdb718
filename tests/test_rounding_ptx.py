"""The kernels whose roundings follow their references op by op launch without fp fusion, and their code for the
H200 (sm_90) has no bf16 fma that would skip a product's rounding (kernels/rounding.py). CPU only: the launches
are recorded by a stand-in for the kernel (nothing runs), and triton compiles the PTX for sm_90 without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

import kernels.attention_triton as AT
import kernels.elementwise_triton as ET
import kernels.norm_triton as NT
from kernels.rounding import REFERENCE_ROUNDING
from sm90 import compile_sm90  # noqa: E402  (tests/ is on sys.path under pytest)

BF16_PTRS = ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "kc_ptr", "vc_ptr", "x_ptr",
             "o_ptr", "r_ptr", "gl_ptr", "s_ptr", "h_ptr", "sh_ptr", "w_ptr")
TYPES = {**{p: "*bf16" for p in BF16_PTRS}, "pt_ptr": "*i32", "pos_ptr": "*i64", "req_ptr": "*i64", "eps": "fp32"}
# compiling needs the real JIT functions (a whole run under TRITON_INTERPRET=1 gets the interpreter's)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90: not under "
                                "the interpreter")
KERNELS = {  # name: (module, kernel, constexprs)
    "qk_prep": (AT, "_qk_prep_kernel", {"R": 64, "HALF": 32, "BD": 256, "PAGE_SIZE": 16, "PDL": False}),
    "rope": (ET, "_rope_kernel", {"R": 64, "HALF": 32, "BD": 256, "PDL": False}),
    "moe_residual": (ET, "_moe_residual_kernel", {"BH": 1024, "PDL": False}),
    "residual_rmsnorm_moe": (NT, "_residual_rmsnorm_kernel", {"MOE": True, "BD": 2048, "PDL": False}),
}


def _ptx(kernel, constexprs: dict, fusion: bool) -> str:
    return compile_sm90(kernel, constexprs, TYPES, enable_fp_fusion=fusion).asm["ptx"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_sm90_code_rounds_every_bf16_product(name):
    module, kernel, constexprs = KERNELS[name]
    ptx = _ptx(getattr(module, kernel), constexprs, REFERENCE_ROUNDING["enable_fp_fusion"])
    assert "fma.rn.bf16" not in ptx and ("mul.rn.bf16" in ptx or name != "rope"), ptx[-2000:]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_with_fusion_a_rounding_is_skipped(name):  # what the launch option prevents (the check above can fail)
    module, kernel, constexprs = KERNELS[name]
    assert "fma.rn.bf16" in _ptx(getattr(module, kernel), constexprs, True)


class _Spy:
    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


def test_launchers_pass_the_options(monkeypatch):
    spies = {name: _Spy() for name in KERNELS}
    for name, (module, kernel, _) in KERNELS.items():
        if name != "residual_rmsnorm_moe":
            monkeypatch.setattr(module, kernel, spies[name])
    monkeypatch.setattr(NT, "_residual_rmsnorm_kernel", spies["residual_rmsnorm_moe"])
    n, hq, hkv, d = 3, 4, 2, 32
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    cos = torch.randn(n, 8)
    kc = torch.randn(4, 4, hkv, d)
    table, owner = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(n, dtype=torch.long)
    AT.qk_norm_rope_write_triton(q, k, v, torch.randn(d), torch.randn(d), 1e-6, cos, cos, 8, kc, kc.clone(), table,
                                 torch.arange(n), owner)
    ET.rope_triton(q, cos, cos, 8)
    x = torch.randn(n, 64)
    ET.moe_residual_triton(x, x, torch.randn(n, 1), x)
    NT.moe_residual_rmsnorm_triton(x, x, torch.randn(n, 1), x, torch.randn(64), 1e-6)
    for name, spy in spies.items():
        assert spy.kwargs and all(kw.get("enable_fp_fusion") is False for kw in spy.kwargs), (name, spy.kwargs)
