"""kernels/elementwise.py in Triton: one launch each instead of 6-8 PyTorch kernels (rotary embedding of q and of
k in every attention layer, the two GDN gates in every GDN layer). Same signatures and roundings as the
references; rows may be strided (column blocks of a fused projection), the last dimension must be contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from kernels.pdl import pdl_args, pdl_prologue
from kernels.rounding import REFERENCE_ROUNDING


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, HEADS, D, s_x0, s_x1, s_c, s_o0, s_o1,
                 R: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    pid = tl.program_id(0).to(tl.int64)
    n, h = pid // HEADS, pid % HEADS
    cols = tl.arange(0, BD)
    mask = cols < D
    base = x_ptr + n * s_x0 + h * s_x1
    x = tl.load(base + cols, mask=mask, other=0.0)
    dt = x.dtype
    in_rot = cols < R
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    xp = tl.load(base + partner, mask=in_rot, other=0.0).to(tl.float32)
    rotated = tl.where(cols < HALF, -xp, xp).to(dt)  # negation is exact
    c = tl.load(cos_ptr + n * s_c + cols, mask=in_rot, other=0.0)
    s = tl.load(sin_ptr + n * s_c + cols, mask=in_rot, other=0.0)
    t1 = (x.to(tl.float32) * c.to(tl.float32)).to(dt)  # the reference rounds after each op
    t2 = (rotated.to(tl.float32) * s.to(tl.float32)).to(dt)
    y = tl.where(in_rot, (t1.to(tl.float32) + t2.to(tl.float32)).to(dt), x)
    tl.store(o_ptr + n * s_o0 + h * s_o1 + cols, y, mask=mask)


def rope_triton(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """kernels.elementwise.rope_ref: x [N, heads, D] (any row strides), cos/sin [N, R] -> new [N, heads, D]."""
    n, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
    if n * heads:
        _rope_kernel[(n * heads,)](x, cos, sin, out, heads, d, x.stride(0), x.stride(1), cos.stride(0),
                                   out.stride(0), out.stride(1), R=rotary_dim, HALF=rotary_dim // 2,
                                   BD=triton.next_power_of_2(d),
                                   num_warps=1 if d <= 128 else 2, **REFERENCE_ROUNDING, **pdl_args(x.device))
    return out


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, na_ptr, dtb_ptr, g_ptr, beta_ptr, HV, s_a, s_b, BH: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)
    mask = h < HV
    a = tl.load(a_ptr + n * s_a + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + n * s_b + h, mask=mask, other=0.0)
    na = tl.load(na_ptr + h, mask=mask, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + h, mask=mask, other=0.0).to(tl.float32)
    z = a + dtb
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold 20
    tl.store(g_ptr + n * HV + h, na * softplus, mask=mask)
    bf = b.to(tl.float32)
    tl.store(beta_ptr + n * HV + h, (1.0 / (1.0 + tl.exp(-bf))).to(b.dtype), mask=mask)


def gdn_gates_triton(a: Tensor, b: Tensor, neg_a: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """kernels.elementwise.gdn_gates_ref: a, b [N, HV] (any row stride) -> (g fp32, beta in b's dtype)."""
    n, hv = a.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    g = torch.empty(n, hv, dtype=torch.float32, device=a.device)
    beta = torch.empty(n, hv, dtype=b.dtype, device=b.device)
    if n:
        _gdn_gates_kernel[(n,)](a, b, neg_a, dt_bias, g, beta, hv, a.stride(0), b.stride(0),
                                BH=triton.next_power_of_2(hv), num_warps=1, **pdl_args(a.device))
    return g, beta


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, I, s_g, s_u, s_o, BI: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = cols < I
    g = tl.load(g_ptr + n * s_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + n * s_u + cols, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt)  # F.silu rounds to the dtype, then the product does
    tl.store(o_ptr + n * s_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(dt), mask=mask)


def silu_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """kernels.elementwise.silu_mul_ref: gate, up [N, I] (any row strides) -> new [N, I]."""
    n, inner = gate.shape
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    out = torch.empty(n, inner, dtype=gate.dtype, device=gate.device)
    if n:
        bi = min(1024, triton.next_power_of_2(inner))
        _silu_mul_kernel[(n, triton.cdiv(inner, bi))](gate, up, out, inner, gate.stride(0), up.stride(0),
                                                       out.stride(0), BI=bi, num_warps=4, **pdl_args(gate.device))
    return out


@triton.jit
def _moe_residual_kernel(x_ptr, r_ptr, gl_ptr, s_ptr, o_ptr, H, s_x, s_r, s_gl, s_s, s_o, BH: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    x = tl.load(x_ptr + n * s_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    r = tl.load(r_ptr + n * s_r + cols, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(s_ptr + n * s_s + cols, mask=mask, other=0.0).to(tl.float32)
    gl = tl.load(gl_ptr + n * s_gl).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-gl))).to(dt).to(tl.float32)  # the reference rounds after every op
    m = (r + (gate * sh).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(o_ptr + n * s_o + cols, (x.to(tl.float32) + m).to(dt), mask=mask)


def moe_residual_triton(x: Tensor, routed: Tensor, gate_logit: Tensor, shared: Tensor) -> Tensor:
    """kernels.elementwise.moe_residual_ref: x + (routed + sigmoid(gate_logit) * shared) in one launch."""
    n, h = x.shape
    x, routed, shared = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, routed, shared))
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n:
        bh = min(1024, triton.next_power_of_2(h))
        _moe_residual_kernel[(n, triton.cdiv(h, bh))](x, routed, gate_logit, shared, out, h, x.stride(0),
                                                      routed.stride(0), gate_logit.stride(0), shared.stride(0),
                                                      out.stride(0), BH=bh, num_warps=4, **REFERENCE_ROUNDING,
                                                      **pdl_args(x.device))
    return out
