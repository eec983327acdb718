"""Warps of two latency-bound MoE kernels at few tokens (issue 6), one command on the H200:
    PYTHONPATH=. python bench/small_kernels.py [--out $OUT]
At one token an AR step runs ~250 kernels of a few us each on almost no bytes; their launch rules (warps) predate
programmatic dependent launch. For the bench model's shapes (256 experts + the shared expert's gate column, top-8,
hidden 2048) this times, in CUDA graphs of 40 calls on 40 different inputs (with PDL, as a step launches them):
- kernels.moe_triton.route_triton (softmax top-k over 257 logits, one program a token) with ROUTE_WARPS 1 / 2 / 4 / 8
  at N = 1, 4, 16, 64;
- fused_moe_add_rmsnorm_triton (the MoE's grouped GEMMs, then the experts' sum + residual add + next RMSNorm in one
  program a token) with REDUCE_NORM_WARPS 1 .. 16 at N = 1, 4, 16: the GEMMs are the same in every variant, so the
  differences are the reduce + norm kernel's;
- kernels.norm_triton's kernels (NORM_WARPS 1 .. 16): the residual add + RMSNorm over the hidden size at N = 1, 4,
  16, and the per-head RMSNorm of attention's q / k (18 rows of 256 a token) at N = 1, 16.
Each variant is checked against the default's output (route: equal ids and weights; the tail: equal bits). Writes
`small_kernels.json` and prints the table. `--tiny` runs the checks on CPU under TRITON_INTERPRET=1 (fp32, tiny
shapes) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROUTE_WARPS = (1, 2, 4, 8)
NORM_WARPS = (1, 2, 4, 8, 16)
CALLS = 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    import torch

    import kernels.moe_triton as MT
    from kernels.moe import route_ref

    dev = "cpu" if args.tiny else "cuda"
    dt = torch.float32 if args.tiny else torch.bfloat16
    E, K, H, I = (8, 2, 48, 16) if args.tiny else (256, 8, 2048, 512)
    calls = 2 if args.tiny else CALLS
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    def timed(fns) -> float | None:
        if args.tiny:
            return None
        from bench.gpu_timing import graph_time
        return graph_time(fns)

    rows = []
    for n in ((1, 3) if args.tiny else (1, 4, 16, 64)):
        logits = [torch.randn(n, E + 1, device=dev, generator=gen) * 2 for _ in range(calls)]  # fp32, as the router's
        ref_w, ref_ids = MT.route_triton(logits[0], K, True, dt, shared=True)
        assert torch.equal(ref_ids, route_ref(logits[0], K, True, dt, shared=True)[1])
        for warps in ROUTE_WARPS:
            MT.ROUTE_WARPS = warps
            w, ids = MT.route_triton(logits[0], K, True, dt, shared=True)
            same = bool(torch.equal(ids, ref_ids) and torch.equal(w, ref_w))
            us = timed([lambda lg=lg: MT.route_triton(lg, K, True, dt, shared=True) for lg in logits])
            rows.append({"kernel": "route", "N": n, "warps": warps, "us": us, "equal": same})
            print(json.dumps(rows[-1]), flush=True)
        MT.ROUTE_WARPS = None

    weights = [(rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5),
                (rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5))) for _ in range(min(calls, 8))]
    norm_w = rnd(H, scale=0.3)
    for n in ((1, 3) if args.tiny else (1, 4, 16)):
        x, res = rnd(n, H), rnd(n, H)
        w, ids = route_ref(torch.randn(n, E + 1, device=dev, generator=gen), K, True, dt, shared=True)

        def tail(wt):
            return MT.fused_moe_add_rmsnorm_triton(x, wt[0], wt[1], w, ids, None, wt[2], None, res, norm_w, 1e-6)
        ref_s, ref_o = tail(weights[0])
        for warps in NORM_WARPS:
            MT.REDUCE_NORM_WARPS = warps
            s, o = tail(weights[0])
            same = bool(torch.equal(s, ref_s) and torch.equal(o, ref_o))
            us = timed([lambda wt=wt: tail(wt) for wt in weights])
            rows.append({"kernel": "moe_tail", "N": n, "warps": warps, "us": us, "equal": same})
            print(json.dumps(rows[-1]), flush=True)
        MT.REDUCE_NORM_WARPS = None

    import kernels.norm_triton as NT

    for n in ((1, 3) if args.tiny else (1, 4, 16)):  # the residual add + norm a layer ends with, hidden H
        xs = [(rnd(n, H), rnd(n, H)) for _ in range(calls)]
        nw = rnd(H, scale=0.3)
        ref = NT.add_rmsnorm_triton(*xs[0], nw, 1e-6)
        for warps in NORM_WARPS:
            NT.NORM_WARPS = warps
            got = NT.add_rmsnorm_triton(*xs[0], nw, 1e-6)
            same = bool(all(torch.equal(a, b) for a, b in zip(got, ref)))
            us = timed([lambda x=x: NT.add_rmsnorm_triton(*x, nw, 1e-6) for x in xs])
            rows.append({"kernel": "add_rmsnorm", "N": n, "warps": warps, "us": us, "equal": same})
            print(json.dumps(rows[-1]), flush=True)
        NT.NORM_WARPS = None
    hd = 16 if args.tiny else 256  # attention's q / k norm: one row per head (16 + 2 heads a token at real shapes)
    for n in ((1, 3) if args.tiny else (1, 16)):
        xs = [rnd(n * 18, hd) for _ in range(calls)]
        nw = rnd(hd, scale=0.3)
        ref = NT.rmsnorm_triton(xs[0], nw, 1e-6)
        for warps in NORM_WARPS:
            NT.NORM_WARPS = warps
            same = bool(torch.equal(NT.rmsnorm_triton(xs[0], nw, 1e-6), ref))
            us = timed([lambda x=x: NT.rmsnorm_triton(x, nw, 1e-6) for x in xs])
            rows.append({"kernel": "rmsnorm_head", "N": n, "warps": warps, "us": us, "equal": same})
            print(json.dumps(rows[-1]), flush=True)
        NT.NORM_WARPS = None

    bad = [r for r in rows if not r["equal"]]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "small_kernels.json").write_text(json.dumps({"rows": rows, "bad": bad}, indent=1))
    if not args.tiny:
        print(f"\n{'kernel':9s} {'N':>3} " + " ".join(f"{'w' + str(w):>7s}" for w in ROUTE_WARPS) + "   (route)")
        for kernel, warps in (("route", ROUTE_WARPS), ("moe_tail", NORM_WARPS), ("add_rmsnorm", NORM_WARPS),
                              ("rmsnorm_head", NORM_WARPS)):
            for n in sorted({r["N"] for r in rows if r["kernel"] == kernel}):
                us = {r["warps"]: r["us"] for r in rows if r["kernel"] == kernel and r["N"] == n}
                print(f"{kernel:9s} {n:>3} " + " ".join(f"{us[w]:7.2f}" for w in warps) + f"   (warps {warps})")
    if bad:
        raise SystemExit(f"variants differ from the default: {bad}")


if __name__ == "__main__":
    main()
