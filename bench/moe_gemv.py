"""The MoE at a few tokens as per-assignment GEMVs (issue 6), one command on the H200:
    PYTHONPATH=. python bench/moe_gemv.py [--out $OUT]
kernels.moe_triton's two paths for the experts of a step at the bench model's shapes (256 experts top-8 + the shared
expert as id E, hidden 2048, expert dim 512, bf16): the grouped kernels (`gemv: False`) and the per-assignment
GEMVs (`gemv: True`, tile variants), each as the MoE layer's tail the model runs (router logits, route,
fused_moe_add_rmsnorm_triton), timed in a CUDA graph of one tail per weight set (SETS sets: no L2 hits on the
weights), at N = 1, 2, 4 tokens (route of Zipf-biased logits). Checks every variant against the grouped path in bf16
(max abs difference of the normalized output: the two paths sum in different orders) and against the PyTorch
reference. Floor: the bytes of the distinct experts' weights (+ the shared expert's and the router's) at 4.8 TB/s.
Writes `moe_gemv.json` and prints the table. `--tiny` runs the checks on CPU under TRITON_INTERPRET=1 (fp32, E=8,
H=48, N = 1, 2) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (1, 2, 4)
SETS = 8
# (gate/up columns a program, warps, down rows a program, warps)
VARIANTS = {"g1w4_d4w4": (1, 4, 4, 4), "g2w4_d4w4": (2, 4, 4, 4), "g4w4_d4w4": (4, 4, 4, 4),
            "g2w8_d8w4": (2, 8, 8, 4), "g2w4_d2w2": (2, 4, 2, 2), "g4w8_d8w8": (4, 8, 8, 8),
            "g1w8_d8w4": (1, 8, 8, 4), "g2w8_d16w8": (2, 8, 16, 8), "g2w16_d8w4": (2, 16, 8, 4),
            "g4w16_d8w4": (4, 16, 8, 4), "g2w8_d8w8": (2, 8, 8, 8)}
HBM_TB_S = 4.8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    import torch

    from kernels.moe import fused_moe_add_rmsnorm_ref
    from kernels.moe_triton import fused_moe_add_rmsnorm_triton, route_triton, router_logits_triton

    dev = "cpu" if args.tiny else "cuda"
    dt = torch.float32 if args.tiny else torch.bfloat16
    E, K, H, I, sets = (8, 2, 48, 16, 1) if args.tiny else (256, 8, 2048, 512, SETS)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    weights = [(rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5),
                (rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5)), rnd(E + 1, H, scale=H ** -0.5))
               for _ in range(sets)]
    # popular experts first: the route's logit bias (the route kernel adds it: no launch of its own in the tail)
    zipf = torch.log(1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float32))
    norm_w = rnd(H, scale=0.3)
    rows = []
    variants = {"grouped": None, **VARIANTS}
    for n in (SIZES[:2] if args.tiny else SIZES):
        x, res = rnd(n, H), rnd(n, H)

        def tail(wt, cfg, x=x, res=res):
            w, ids = route_triton(router_logits_triton(x, wt[3]), K, True, dt, bias=zipf, shared=True)
            return fused_moe_add_rmsnorm_triton(x, wt[0], wt[1], w, ids, None, wt[2], None, res, norm_w, 1e-6,
                                                config=cfg)

        w, ids = route_triton(router_logits_triton(x, weights[0][3]), K, True, dt, bias=zipf, shared=True)
        distinct = len(set(ids[:, :K].reshape(-1).tolist()))
        floor_bytes = (distinct * 3 * I * H + 3 * I * H + (E + 1) * H) * (2 if dt == torch.bfloat16 else 4)
        s_ref, o_ref = fused_moe_add_rmsnorm_ref(x, weights[0][0], weights[0][1], w, ids, None, weights[0][2], None,
                                                 res, norm_w, 1e-6)
        base = None
        for name, tiles in variants.items():
            cfg = {"gemv": False} if tiles is None else {"gemv": True, "gemv_tiles": tiles}
            s, o = tail(weights[0], cfg)
            if base is None:
                base = (s, o)
            row = {"N": n, "variant": name, "distinct_experts": distinct,
                   "max_abs_diff_vs_grouped": max((s.float() - base[0].float()).abs().max().item(),
                                                  (o.float() - base[1].float()).abs().max().item()),
                   "max_abs_diff_vs_ref": max((s.float() - s_ref.float()).abs().max().item(),
                                              (o.float() - o_ref.float()).abs().max().item()),
                   "floor_us": floor_bytes / (HBM_TB_S * 1e6)}
            if not args.tiny:
                from bench.gpu_timing import graph_time
                row["tail_us"] = graph_time([lambda wt=wt, cfg=cfg: tail(wt, cfg) for wt in weights])
                row["over_floor"] = row["tail_us"] / row["floor_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_gemv.json").write_text(json.dumps({"rows": rows, "variants": VARIANTS}, indent=1))
    if not args.tiny:
        print(f"\n{'N':>3} {'variant':>10} {'tail us':>8} {'floor':>6} {'x floor':>7} {'diff':>8}  (a graph of {sets})")
        for r in rows:
            print(f"{r['N']:>3} {r['variant']:>10} {r['tail_us']:8.2f} {r['floor_us']:6.2f} {r['over_floor']:7.2f} "
                  f"{r['max_abs_diff_vs_grouped']:8.4f}")
    bad = [(r["N"], r["variant"]) for r in rows if r["max_abs_diff_vs_ref"] > (1e-3 if args.tiny else 0.25)]
    if bad:
        raise SystemExit(f"variants far from the reference: {bad}")


if __name__ == "__main__":
    main()
