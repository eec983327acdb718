"""The fused MoE layer's end in one launch fewer (issue 6), one command on the H200:
    PYTHONPATH=. python bench/moe_add_rmsnorm.py [--out $OUT]
kernels.moe_triton.fused_moe_add_rmsnorm_triton (fused_moe without its reduce launch, then one kernel for the
experts' sum, the residual add and the next RMSNorm) against the two-kernel path it replaces in
workers/model.py SparseMoe._forward_fused (fused_moe_triton + kernels.norm_triton.add_rmsnorm_triton): equal bit for
bit in bf16 at the bench model's shapes (256 experts top-8 + the shared expert as id E, hidden 2048, expert dim 512),
with and without a token mask, at N = 1 .. 64 tokens; then each timed in a CUDA graph of one call per weight set
(SETS sets: no L2 hits on the weights). Writes `moe_add_rmsnorm.json` and prints the table.
`--tiny` runs the equality checks on CPU under TRITON_INTERPRET=1 (fp32, E=8, H=48) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (1, 2, 4, 8, 16, 32, 64)
SETS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    import torch

    from kernels.moe import route_ref
    from kernels.moe_triton import fused_moe_add_rmsnorm_triton, fused_moe_triton
    from kernels.norm_triton import add_rmsnorm_triton

    dev = "cpu" if args.tiny else "cuda"
    dt = torch.float32 if args.tiny else torch.bfloat16
    E, K, H, I, sets = (8, 2, 48, 16, 1) if args.tiny else (256, 8, 2048, 512, SETS)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    weights = [(rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5),
                (rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5))) for _ in range(sets)]
    norm_w = rnd(H, scale=0.3)
    rows = []
    for n in (SIZES[:3] if args.tiny else SIZES):
        for masked in (False, True):
            x, res = rnd(n, H), rnd(n, H)
            w, ids = route_ref(torch.randn(n, E + 1, device=dev, generator=gen), K, True, dt, shared=True)
            mask = (torch.arange(n, device=dev) % 3 != 1) if masked else None

            def fused(wt):
                return fused_moe_add_rmsnorm_triton(x, wt[0], wt[1], w, ids, mask, wt[2], None, res, norm_w, 1e-6)

            def two(wt):
                out = fused_moe_triton(x, wt[0], wt[1], w, ids, mask, shared=wt[2])
                return add_rmsnorm_triton(res, out, norm_w, 1e-6)

            (s1, o1), (s2, o2) = fused(weights[0]), two(weights[0])
            row = {"N": n, "masked": masked, "equal": bool(torch.equal(s1, s2) and torch.equal(o1, o2)),
                   "max_abs_diff": max((s1.float() - s2.float()).abs().max().item(),
                                       (o1.float() - o2.float()).abs().max().item())}
            if not args.tiny:
                from bench.gpu_timing import graph_time
                row["fused_us"] = graph_time([lambda wt=wt: fused(wt) for wt in weights])
                row["two_kernels_us"] = graph_time([lambda wt=wt: two(wt) for wt in weights])
            rows.append(row)
            print(json.dumps(row))
    bad = [(r["N"], r["masked"]) for r in rows if not r["equal"]]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_add_rmsnorm.json").write_text(json.dumps({"rows": rows, "bad": bad}, indent=1))
    if not args.tiny:
        print(f"\n{'N':>3} {'mask':>5} {'fused us':>9} {'two us':>8} {'saved us':>9}  (per call, a graph of {sets})")
        for r in rows:
            print(f"{r['N']:>3} {str(r['masked']):>5} {r['fused_us']:9.2f} {r['two_kernels_us']:8.2f} "
                  f"{r['two_kernels_us'] - r['fused_us']:9.2f}")
    if bad:
        raise SystemExit(f"the one-launch tail differs from fused_moe + add_rmsnorm at (N, masked) = {bad}")


if __name__ == "__main__":
    main()
