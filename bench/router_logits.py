"""The MoE router's logits kernels by token count, one command on the H200 (issue 6):
    PYTHONPATH=. python bench/router_logits.py [--out $OUT]
Checks both Triton kernels (kernels/moe_triton.py: the CUDA-core one, 2 experts a program, and the tl.dot one, 16
experts a program) against kernels.moe.router_logits_ref in bf16 at the bench model's shapes (256 experts, hidden
2048), then times each in a CUDA graph of 40 calls on 40 different weight matrices (a step's 40 MoE layers: no L2
hits) at N = 1 .. 64 tokens, beside the reference (fp32 copy of x + cuBLAS GEMV over an fp32 weight copy). Writes
`router_logits.json` and prints the table; the routing chooses the CUDA-core kernel up to ROUTER_GEMV_MAX_N tokens.
`--tiny` checks both kernels on CPU under TRITON_INTERPRET=1 (fp32, E=40, H=200) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 17, 32, 64)
# (BLOCK_E, BLOCK_K, warps) of the CUDA-core kernel for --sweep: a whole 2048-wide row a step (the weight read
# before the PDL wait in one go) against the 512 of the default
SWEEP_TILES = [(2, 512, 4), (2, 1024, 4), (2, 2048, 4), (2, 2048, 8), (1, 2048, 4), (1, 2048, 2), (4, 1024, 4),
               (4, 2048, 8), (2, 1024, 2), (1, 1024, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    ap.add_argument("--sweep", action="store_true", help="time the CUDA-core kernel's tiles (SWEEP_TILES) at N=1, 2, 4")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    import torch
    import triton

    import kernels.moe_triton as MT
    from kernels.moe import router_logits_ref

    dev = "cpu" if args.tiny else "cuda"
    dt = torch.float32 if args.tiny else torch.bfloat16
    E, H, layers = (40, 200, 2) if args.tiny else (256, 2048, 40)
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(E, H, device=dev, generator=gen).to(dt) for _ in range(layers)]

    def gemv(x, w, tiles=None, early=0, pdl=False):
        out = torch.empty(x.shape[0], E, dtype=torch.float32, device=dev)
        bn = triton.next_power_of_2(x.shape[0])
        be, bk, warps = tiles or MT.ROUTER_GEMV_TILES.get(bn, (2, 256 if bn <= 8 else 128, 4))
        MT._router_logits_kernel[(triton.cdiv(E, be),)](
            x, w, out, x.shape[0], E, H, x.stride(0), w.stride(0), early, BLOCK_N=bn, BLOCK_E=be,
            BLOCK_K=min(bk, triton.next_power_of_2(H)), DOT=False, IEEE=False, num_warps=warps,
            **(pdl_args(x.device) if pdl else {}))
        return out

    if args.sweep:  # the CUDA-core kernel's tiles at 1, 2, 4 tokens as a step launches it (PDL, early weight reads)
        from bench.gpu_timing import graph_time
        from kernels.pdl import pdl_args

        sweep = []
        for n in (1, 2, 4):
            x = torch.randn(n, H, device=dev, generator=gen).to(dt)
            ref = router_logits_ref(x, weights[0]).double()
            for tiles in SWEEP_TILES:
                if n == 4 and tiles[1] > 1024 and tiles[0] > 2:
                    continue  # [4, BE, BK] fp32 products beyond the registers
                out = gemv(x, weights[0], tiles, 1, True).double()
                err = ((out - ref).norm() / ref.norm()).item()
                us = graph_time([lambda w=w: gemv(x, w, tiles, 1, True) for w in weights])
                sweep.append({"N": n, "tiles": tiles, "us": us, "rel_err": err})
                print(f"N={n} BE={tiles[0]} BK={tiles[1]} warps={tiles[2]}: {us:6.2f} us  err {err:.1e}", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "router_logits_sweep.json").write_text(json.dumps(sweep, indent=1))
        for n in (1, 2, 4):
            best = min((r for r in sweep if r["N"] == n and r["rel_err"] < 1e-3), key=lambda r: r["us"])
            print(f"best N={n}: {best['tiles']} {best['us']:.2f} us")
        return

    def dot(x, w):
        out = torch.empty(x.shape[0], E, dtype=torch.float32, device=dev)
        MT._router_logits_kernel[(triton.cdiv(E, 16),)](
            x, w, out, x.shape[0], E, H, x.stride(0), w.stride(0), 0,
            BLOCK_N=max(16, triton.next_power_of_2(x.shape[0])),
            BLOCK_E=16, BLOCK_K=128, DOT=True, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4)
        return out

    rows = []
    for n in (SIZES[:5] if args.tiny else SIZES):
        x = torch.randn(n, H, device=dev, generator=gen).to(dt)
        ref = router_logits_ref(x, weights[0]).double()
        row = {"N": n, "routed_to": "gemv" if n <= MT.ROUTER_GEMV_MAX_N else "dot"}
        for name, fn in (("gemv", gemv), ("dot", dot), ("routed", MT.router_logits_triton)):
            out = fn(x, weights[0]).double()
            row[f"{name}_rel_err"] = ((out - ref).norm() / ref.norm()).item()
        if not args.tiny:
            from bench.kernels_moe_attn import graph_time
            row["gemv_us"] = graph_time([lambda w=w: gemv(x, w) for w in weights])
            row["dot_us"] = graph_time([lambda w=w: dot(x, w) for w in weights])
            row["torch_us"] = graph_time([lambda w=w: router_logits_ref(x, w) for w in weights])
        rows.append(row)
        print(json.dumps(row))
    tol = 1e-5 if args.tiny else 1e-3
    bad = [r["N"] for r in rows if max(v for k, v in r.items() if k.endswith("rel_err")) > tol]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "router_logits.json").write_text(json.dumps({"rows": rows, "bad": bad}, indent=1))
    if not args.tiny:
        print(f"\n{'N':>3} {'gemv us':>8} {'dot us':>8} {'torch us':>9}  (per call, a graph of {layers})")
        for r in rows:
            print(f"{r['N']:>3} {r['gemv_us']:8.2f} {r['dot_us']:8.2f} {r['torch_us']:9.2f}  {r['routed_to']}")
    if bad:
        raise SystemExit(f"router logits differ from the reference at N = {bad}")


if __name__ == "__main__":
    main()
