"""Dense projections at few rows: the Triton GEMV's configurations against cuBLAS, one command on the H200 (issue 6):

    PYTHONPATH=. python bench/kernels_gemv.py [--out bench/out/kernels_gemv.json] [--ns 1,2,4,8] [--configs a,b]

For each projection of the bench model (Qwen3.6-35B-A3B shapes, bf16, no bias) and N rows: F.linear (cuBLAS) and
every configuration of kernels/gemv_triton.py (CONFIGS), each timed in one CUDA graph of calls on distinct weight
copies (at least 40, and at least 256 MB of them: nothing is served from the 50 MB L2 that a 40-layer step would not
find there), median over replays, us per call and x its HBM floor (weight + x + out bytes at 4.3 TB/s). Error: max
|out - fp32 reference| / max |fp32 reference| for cuBLAS and each configuration (bf16 rounding: ~4e-3; with a bias
too for the picked configuration at the first N). Prints a table per shape, the configuration SHAPE_TABLE picks and
the measured best, and writes the JSON to --out (default bench/out/kernels_gemv.json).
`--tiny`: CPU under TRITON_INTERPRET=1, fp32, small ragged shapes, errors only (no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_timing import graph_time  # noqa: E402

BW = 4.3e12  # bytes/s (the H200's measured copy bandwidth, as the other benches)
# name, M (rows of the weight; the shared expert's gate/up: 1025 at one row, 1032 padded beyond), K
SHAPES = [("out_proj", 2048, 4096), ("in_proj", 12352, 2048), ("qkv", 9216, 2048),
          ("shared_gate_up", 1025, 2048), ("shared_down", 2048, 512)]
TINY_SHAPES = [("ragged", 37, 1100), ("narrow", 5, 300), ("wide_k", 19, 4100)]
BAD_ERR = 2e-2  # bf16: one rounding of the output is ~4e-3 of max |ref|


def shape_m(name: str, m: int, n: int) -> int:
    return 1032 if name == "shared_gate_up" and n > 1 else m  # FusedLinears' padded width beyond one row


def max_rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "kernels_gemv.json"))
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--configs", default="", help="comma-separated CONFIGS names (default: all)")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    import torch
    import torch.nn.functional as F

    from kernels.gemv import linear_small_ref
    from kernels.gemv_triton import CONFIGS, DEFAULT, SHAPE_TABLE, linear_small_triton, pick_config

    t_start = time.time()
    dev = "cpu" if args.tiny else "cuda"
    dt = torch.float32 if args.tiny else torch.bfloat16
    configs = [c for c in args.configs.split(",") if c] or list(CONFIGS)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    ns = [int(v) for v in args.ns.split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, m0, k in shapes:
        m_max = max(shape_m(name, m0, n) for n in ns)
        nbytes = m_max * k * x_size(dt)
        copies = 1 if args.tiny else min(128, max(40, -(-256 * 2 ** 20 // nbytes)))
        weights = [(torch.randn(m_max, k, device=dev, generator=gen) * k ** -0.5).to(dt) for _ in range(copies)]
        bias = torch.randn(m_max, device=dev, generator=gen).to(dt)
        for n in ns:
            m = shape_m(name, m0, n)
            ws = [w[:m] for w in weights]
            x = torch.randn(n, k, device=dev, generator=gen).to(dt)
            ref = F.linear(x.float(), ws[0].float())
            floor_us = (m * k + n * k + n * m) * x_size(dt) / BW * 1e6
            row = {"shape": name, "M": m, "K": k, "N": n, "floor_us": floor_us, "copies": copies,
                   "picked": next(c for c, v in CONFIGS.items() if v == pick_config(m, k, triton_bn(n))),
                   "cublas_err": max_rel(F.linear(x, ws[0]), ref), "err": {}, "us": {}}
            for c in configs:
                row["err"][c] = max_rel(linear_small_triton(x, ws[0], None, config=c), ref)
            if args.tiny or n == ns[0]:  # with a bias: every config on the CPU, the picked one on the GPU (compiles)
                ref_b = linear_small_ref(x, ws[0], bias[:m])
                for c in (configs if args.tiny else [row["picked"]]):
                    err_b = max_rel(linear_small_triton(x, ws[0], bias[:m], config=c), ref_b)
                    row["err"][c] = max(row["err"].get(c, 0.0), err_b)
            if not args.tiny:
                row["cublas_us"] = graph_time([lambda w=w: F.linear(x, w) for w in ws], args.reps)
                for c in configs:
                    row["us"][c] = graph_time([lambda w=w, c=c: linear_small_triton(x, w, None, config=c)
                                               for w in ws], args.reps)
                good = {c: t for c, t in row["us"].items() if row["err"][c] <= BAD_ERR}
                row["best"] = min(good, key=good.get) if good else None
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights
        if not args.tiny:
            torch.cuda.empty_cache()
    bad = [(r["shape"], r["N"], c) for r in rows for c, e in r["err"].items() if e > (1e-5 if args.tiny else BAD_ERR)]
    report = {"configs": {c: vars(CONFIGS[c]) for c in configs}, "default": DEFAULT,
              "shape_table": {",".join(map(str, key)): v for key, v in SHAPE_TABLE.items()}, "rows": rows,
              "bad": bad, "device": None if args.tiny else torch.cuda.get_device_name(),
              "seconds": time.time() - t_start}
    if not args.tiny:
        report["best_per_shape"] = summarize(rows, configs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    if not args.tiny:
        print_table(rows, configs, report["best_per_shape"])
    print(f"wrote {out} ({time.time() - t_start:.0f} s)")
    if bad:
        raise SystemExit(f"configurations off the reference: {bad}")


def x_size(dt) -> int:
    import torch

    return torch.empty(0, dtype=dt).element_size()


def triton_bn(n: int) -> int:
    return 1 << (n - 1).bit_length()


def summarize(rows, configs) -> dict:
    """Per shape: the configuration with the least us summed over the N measured, and the best at each N."""
    out = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == name]
        ok = [c for c in configs if all(r["err"][c] <= BAD_ERR for r in rs)]
        total = {c: sum(r["us"][c] for r in rs) for c in ok}
        out[name] = {"best_summed": min(total, key=total.get) if total else None,
                     "best_by_n": {r["N"]: r["best"] for r in rs},
                     "picked_by_n": {r["N"]: r["picked"] for r in rs}}
    return out


def print_table(rows, configs, best) -> None:
    print("\nus per call (x floor), a CUDA graph of calls on distinct weight copies; * = the table's pick")
    for name in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == name]
        print(f"\n== {name} [{rs[0]['M']} x {rs[0]['K']}]  picked: {rs[0]['picked']}  "
              f"best summed over N: {best[name]['best_summed']}")
        print(f"{'config':>14} " + " ".join(f"{'N=' + str(r['N']) + ' (M=' + str(r['M']) + ')':>17}" for r in rs))
        print(f"{'floor':>14} " + " ".join(f"{r['floor_us']:>10.2f}       " for r in rs))
        print(f"{'cuBLAS':>14} " + " ".join(f"{r['cublas_us']:>8.2f} ({r['cublas_us'] / r['floor_us']:4.2f}x)"
                                            for r in rs))
        for c in configs:
            cells = []
            for r in rs:
                mark = "*" if r["picked"] == c else " "
                bad = "!" if r["err"][c] > BAD_ERR else " "
                cells.append(f"{r['us'][c]:>7.2f}{mark}({r['us'][c] / r['floor_us']:4.2f}x){bad}")
            print(f"{c:>14} " + " ".join(cells))
        print(f"{'best':>14} " + " ".join(f"{str(r['best']):>17}" for r in rs))
        print(f"{'max err':>14} cuBLAS {max(r['cublas_err'] for r in rs):.1e}, configs "
              f"{max(max(r['err'].values()) for r in rs):.1e}")


if __name__ == "__main__":
    main()
