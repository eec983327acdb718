"""Triton RMS norms (alone and fused with the residual add before them), rotary embedding, GDN gates and the MoE tail equal their PyTorch references (TRITON_INTERPRET=1, CPU,
fp32), on contiguous rows, strided rows (column blocks of a fused projection), odd widths and an empty batch.

Run as a script by the test below (the interpreter must be set before triton is imported); prints one JSON line
{case: max relative error}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-6


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def main() -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from kernels.norm import gated_rmsnorm_ref, rmsnorm_ref
    from kernels.norm_triton import gated_rmsnorm_triton, rmsnorm_triton

    gen = torch.Generator().manual_seed(0)
    out = {}
    for n, d in ((5, 64), (3, 40), (0, 32), (7, 256)):
        x = torch.randn(n, d, generator=gen) * 3
        w = 0.1 * torch.randn(d, generator=gen)
        out[f"rmsnorm_{n}x{d}"] = _rel(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))
    # strided rows: q of a fused [N, H, 2D] projection, as in workers/model.py Attention
    fused = torch.randn(4, 3, 2 * 32, generator=gen)
    q, _ = fused.chunk(2, dim=-1)
    w = 0.1 * torch.randn(32, generator=gen)
    out["rmsnorm_strided_heads"] = _rel(rmsnorm_triton(q, w, 1e-6), rmsnorm_ref(q, w, 1e-6))
    for n, hv, d in ((6, 4, 32), (1, 2, 48), (0, 2, 16)):
        o = torch.randn(n, hv, d, generator=gen)
        z = torch.randn(n, hv, d, generator=gen) * 2
        w = 1.0 + 0.1 * torch.randn(d, generator=gen)
        out[f"gated_{n}x{hv}x{d}"] = _rel(gated_rmsnorm_triton(o, z, w, 1e-6), gated_rmsnorm_ref(o, z, w, 1e-6))
    # strided gate: z as a column block of a fused [N, total] projection, viewed [N, HV, D]
    fused = torch.randn(5, 3 * 4 * 16 + 7, generator=gen)
    z = fused[:, 5:5 + 4 * 16].view(5, 4, 16)
    o = torch.randn(5, 4, 16, generator=gen)
    w = 1.0 + 0.1 * torch.randn(16, generator=gen)
    out["gated_strided_gate"] = _rel(gated_rmsnorm_triton(o, z, w, 1e-6), gated_rmsnorm_ref(o, z, w, 1e-6))
    from kernels.elementwise import gdn_gates_ref, rope_ref
    from kernels.elementwise_triton import gdn_gates_triton, rope_triton

    for n, heads, d, r in ((5, 3, 32, 8), (4, 2, 16, 16), (0, 2, 16, 8)):
        x = torch.randn(n, heads, d, generator=gen)
        ang = torch.randn(n, r // 2, generator=gen)
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        out[f"rope_{n}x{heads}x{d}_r{r}"] = _rel(rope_triton(x, cos, sin, r), rope_ref(x, cos, sin, r))
    proj = torch.randn(6, 40, generator=gen)  # k as a column block of a fused projection, viewed [N, 2, 16]
    k = proj[:, 4:36].view(6, 2, 16)
    ang = torch.randn(6, 4, generator=gen)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    out["rope_strided"] = _rel(rope_triton(k, cos, sin, 8), rope_ref(k, cos, sin, 8))
    proj = torch.randn(7, 20, generator=gen) * 8  # a, b as column blocks, softplus past its threshold too
    a, b = proj[:, 10:15], proj[:, 15:20]
    neg_a = -torch.rand(5, generator=gen) * 8
    dt_bias = torch.randn(5, generator=gen)
    g, beta = gdn_gates_triton(a, b, neg_a, dt_bias)
    g_ref, beta_ref = gdn_gates_ref(a, b, neg_a, dt_bias)
    out["gdn_gates_g"], out["gdn_gates_beta"] = _rel(g, g_ref), _rel(beta, beta_ref)
    from kernels.elementwise import moe_residual_ref, silu_mul_ref
    from kernels.elementwise_triton import moe_residual_triton, silu_mul_triton

    fused = torch.randn(5, 2 * 24 + 1, generator=gen) * 3  # gate, up and the gate logit of one fused GEMM
    gate, up, logit = fused[:, :24], fused[:, 24:48], fused[:, 48:]
    out["silu_mul_strided"] = _rel(silu_mul_triton(gate, up), silu_mul_ref(gate, up))
    x, routed, shared = (torch.randn(5, 40, generator=gen) for _ in range(3))
    out["moe_residual"] = _rel(moe_residual_triton(x, routed, logit, shared), moe_residual_ref(x, routed, logit, shared))
    # the residual add / the MoE layer's end fused with the next RMSNorm: both outputs checked
    from kernels.norm import add_rmsnorm_ref, moe_residual_rmsnorm_ref
    from kernels.norm_triton import add_rmsnorm_triton, moe_residual_rmsnorm_triton

    w = 0.1 * torch.randn(40, generator=gen)
    for name, got, ref in (("add_rmsnorm", add_rmsnorm_triton(x, routed, w, 1e-6), add_rmsnorm_ref(x, routed, w, 1e-6)),
                           ("moe_residual_rmsnorm", moe_residual_rmsnorm_triton(x, routed, logit, shared, w, 1e-6),
                            moe_residual_rmsnorm_ref(x, routed, logit, shared, w, 1e-6))):
        out[f"{name}_sum"], out[f"{name}_norm"] = _rel(got[0], ref[0]), _rel(got[1], ref[1])
    e0 = torch.empty(0, 40)
    out["add_rmsnorm_empty"] = float(add_rmsnorm_triton(e0, e0, w, 1e-6)[1].numel())
    print(json.dumps(out))


def test_triton_small_kernels_equal_references():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    errors = json.loads(lines[-1])
    assert len(errors) == 22
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


if __name__ == "__main__":
    main()
