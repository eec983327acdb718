"""RMS norms in Triton: one launch instead of the references' ~7-10 elementwise kernels per call.

Same signatures and semantics as kernels/norm.py (`rmsnorm_ref`, `gated_rmsnorm_ref`), including where the
gated reference rounds to the input dtype. One program per row of D (<= 8192) values; rows may be strided
(e.g. the query half of a fused q/gate projection), the last dimension must be contiguous. A decode step runs
four of these per layer, so on a launch-bound step they remove ~25 kernels per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from kernels.pdl import pdl_args, pdl_prologue
from kernels.rounding import REFERENCE_ROUNDING


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, D, s_x, s_o, eps, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd * (1.0 + w)
    tl.store(o_ptr + row * s_o + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, g_ptr, w_ptr, o_ptr, D, s_x0, s_x1, s_g0, s_g1, s_o, R1, eps, BD: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Row r = (r // R1, r % R1) of x and gate viewed as [M / R1, R1, D] with their own strides."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // R1, row % R1
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + outer * s_x0 + inner * s_x1 + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(g_ptr + outer * s_g0 + inner * s_g1 + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    dt = o_ptr.dtype.element_ty
    y = (x * rstd).to(dt)  # the reference rounds here ...
    y = (w.to(tl.float32) * y.to(tl.float32)).to(dt)  # ... and after the weight (a product in the input dtype)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(o_ptr + row * s_o + cols, (y.to(tl.float32) * silu).to(dt), mask=mask)


@triton.jit
def _residual_rmsnorm_kernel(x_ptr, h_ptr, gl_ptr, sh_ptr, w_ptr, s_ptr, o_ptr, D, s_x, s_h, s_gl, s_sh, s_s, s_o,
                             eps, MOE: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """s = x + h (MOE: x + (h + sigmoid(gl) * sh), h the routed experts, sh the shared one), then RMSNorm(s).
    One program per row; every op rounds to the input dtype where the references do."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    h = tl.load(h_ptr + row * s_h + cols, mask=mask, other=0.0).to(tl.float32)
    if MOE:
        sh = tl.load(sh_ptr + row * s_sh + cols, mask=mask, other=0.0).to(tl.float32)
        gl = tl.load(gl_ptr + row * s_gl).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gl))).to(dt).to(tl.float32)
        h = (h + (gate * sh).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    s = (x.to(tl.float32) + h).to(dt)
    tl.store(s_ptr + row * s_s + cols, s, mask=mask)
    sf = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / D + eps)
    tl.store(o_ptr + row * s_o + cols, (sf * rstd * (1.0 + w)).to(o_ptr.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """[..., D] -> [M, D] without a copy where the leading dims merge (strided rows allowed)."""
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, d)
    except RuntimeError:
        return x.reshape(-1, d)


# warps of the three norm kernels (None: 4 up to 1024 columns, else 8; bench/small_kernels.py sets it to sweep)
NORM_WARPS: int | None = None


def _warps(bd: int) -> int:
    return NORM_WARPS or (4 if bd <= 1024 else 8)


def rmsnorm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm (kernels.norm.rmsnorm_ref): x [..., D], weight [D] -> [..., D] in x's dtype."""
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(d)
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, d, x2.stride(0), out.stride(0), float(eps), BD=bd,
                                        num_warps=_warps(bd), **pdl_args(x2.device))
    return out.view(x.shape)


def _rows3(x: Tensor) -> Tensor:
    """[..., D] -> [M1, R1, D] (last dim contiguous, any strides for the two row dims; no copy for 2-D/3-D)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def gated_rmsnorm_triton(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """GDN output norm (kernels.norm.gated_rmsnorm_ref): weight * (x / rms(x)) * silu(gate), x/gate [..., D].
    gate may be a strided view (a column block of a fused projection: rows of [N, HV, D] with stride != HV*D)."""
    d = x.shape[-1]
    x3, g3 = _rows3(x), _rows3(gate.expand_as(x))
    rows = x3.shape[0] * x3.shape[1]
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows:
        bd = triton.next_power_of_2(d)
        _gated_rmsnorm_kernel[(rows,)](x3, g3, weight, out, d, x3.stride(0), x3.stride(1), g3.stride(0),
                                       g3.stride(1), out.stride(0), x3.shape[1], float(eps), BD=bd,
                                       num_warps=_warps(bd), **pdl_args(x3.device))
    return out.view(x.shape)


def _residual_rmsnorm(x: Tensor, h: Tensor, gate_logit: Tensor | None, shared: Tensor | None, weight: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
    n, d = x.shape
    x, h = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, h))
    moe = shared is not None
    if moe and shared.stride(-1) != 1:
        shared = shared.contiguous()
    s = torch.empty(n, d, dtype=x.dtype, device=x.device)
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        bd = triton.next_power_of_2(d)
        gl, sh = (gate_logit, shared) if moe else (x, x)
        _residual_rmsnorm_kernel[(n,)](x, h, gl, sh, weight, s, out, d, x.stride(0), h.stride(0), gl.stride(0),
                                       sh.stride(0), s.stride(0), out.stride(0), float(eps), MOE=moe, BD=bd,
                                       num_warps=_warps(bd), **(REFERENCE_ROUNDING if moe else {}),
                                       **pdl_args(x.device))  # (MOE: h + gate * sh, each op rounded)
    return s, out


def add_rmsnorm_triton(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """kernels.norm.add_rmsnorm_ref in one launch: x, h [N, D] -> (x + h, rmsnorm(x + h))."""
    return _residual_rmsnorm(x, h, None, None, weight, eps)


def moe_residual_rmsnorm_triton(x: Tensor, routed: Tensor, gate_logit: Tensor, shared: Tensor, weight: Tensor,
                                eps: float) -> tuple[Tensor, Tensor]:
    """kernels.norm.moe_residual_rmsnorm_ref in one launch: x, routed, shared [N, H], gate_logit [N, 1]."""
    return _residual_rmsnorm(x, routed, gate_logit, shared, weight, eps)
