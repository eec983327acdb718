"""The GDN commit at the bench model's shapes, sequential vs block kernel (issue 6), one command on the H200:
    PYTHONPATH=. python bench/gdn_commit.py --out $OUT
A verification step commits each request's accepted drafts + 1 of its block (T = 17 at cap 16). The block (WY)
kernel works over the whole block whatever is kept; the sequential kernel over the kept tokens only. Checks both
against gdn_commit_ref (fp32 state, bf16 inputs) and times them in CUDA graphs (30 launches per graph: the 30 GDN
layers of a step) at B in {1, 16, 64}, T = 17 and kept tokens all 1 / geometric (acceptance 0.5, 0.85) / all 17.
Writes `$OUT/gdn_commit.json` and prints a table (us per launch, and per step of 30 layers in ms).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import git_commit  # noqa: E402
from kernels.gdn import gdn_commit_ref  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
LAYERS = 30  # GDN layers of the 40-layer bench model
STATE_BYTES = HV * DK * DV * 4
SWEEP = ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4))  # (bv, num_warps) of the sequential commit


def inputs(lens, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    n = sum(lens)
    k = torch.randn(n, HK, DK, generator=gen, device=device).to(torch.bfloat16)
    v = torch.randn(n, HV, DV, generator=gen, device=device).to(torch.bfloat16)
    g = -torch.rand(n, HV, generator=gen, device=device)
    beta = torch.rand(n, HV, generator=gen, device=device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lens, device=device).cumsum(0)
    return k, v, g, beta, cu


def keeps(kind: str, b: int, t: int, gen: torch.Generator) -> list[int]:
    """Kept tokens per request: accepted drafts + 1 under per-draft acceptance p (geometric, capped at t)."""
    if kind == "1":
        return [1] * b
    if kind == str(t):
        return [t] * b
    p = float(kind)
    out = []
    for _ in range(b):
        a = 0
        while a < t - 1 and torch.rand(1, generator=gen).item() < p:
            a += 1
        out.append(a + 1)
    return out


def time_graph(fn, reps: int = 20) -> float:
    """us per fn() call: LAYERS calls captured in one CUDA graph, replayed reps times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also time the sequential kernel's (bv, warps) configs")
    args = ap.parse_args()
    from kernels.gdn_triton import gdn_commit_triton

    dev, t = "cuda", 17
    gen = torch.Generator().manual_seed(0)
    rows, checks = [], {}
    for b in (1, 16, 64):
        lens = [t] * b
        k, v, g, beta, cu = inputs(lens, dev, b)
        pool = 0.1 * torch.randn(b + 1, HV, DK, DV, device=dev)
        slots = torch.randperm(b + 1, device=dev)[:b]
        for kind in ("1", "0.5", "0.85", str(t)):
            keep = torch.tensor(keeps(kind, b, t, gen), device=dev)
            ref = pool.clone()
            gdn_commit_ref(k, v, g, beta, cu, keep, ref, slots, t)
            row = {"B": b, "T": t, "keep": kind, "mean_keep": keep.float().mean().item(),
                   "floor_us": 2 * b * STATE_BYTES / 4.3e12 * 1e6}
            for impl in ("seq", "block"):
                out = pool.clone()
                gdn_commit_triton(k, v, g, beta, cu, keep, out, slots, t, impl=impl)
                err = float((out - ref).norm() / ref[slots].norm())  # the whole pool: no stray writes
                checks[f"B{b}/keep{kind}/{impl}"] = err
                work = pool.clone()
                row[impl] = time_graph(lambda: gdn_commit_triton(k, v, g, beta, cu, keep, work, slots, t, impl=impl))
            if args.sweep and b > 1:  # the sequential kernel's tile width and warps
                for bv, warps in SWEEP:
                    out = pool.clone()
                    gdn_commit_triton(k, v, g, beta, cu, keep, out, slots, t, bv=bv, num_warps=warps)
                    checks[f"B{b}/keep{kind}/seq_bv{bv}_w{warps}"] = float(
                        (out - ref).norm() / ref[slots].norm())
                    row[f"seq_bv{bv}_w{warps}"] = time_graph(lambda: gdn_commit_triton(
                        k, v, g, beta, cu, keep, out, slots, t, bv=bv, num_warps=warps))
            rows.append(row)
            print(f"B={b:3d} keep={kind:>4} (mean {row['mean_keep']:5.2f}): seq {row['seq']:7.1f} us, block "
                  f"{row['block']:7.1f} us, floor {row['floor_us']:6.1f} us; a step of {LAYERS} layers: seq "
                  f"{row['seq'] * LAYERS / 1e3:.2f} ms, block {row['block'] * LAYERS / 1e3:.2f} ms" +
                  "".join(f"; {key} {val:.1f}" for key, val in row.items() if key.startswith("seq_bv")), flush=True)
    worst = max(checks.values())
    print(f"max relative state error vs gdn_commit_ref: {worst:.2e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_commit.json").write_text(json.dumps({"commit": git_commit(), "rows": rows, "checks": checks},
                                                    indent=1))


if __name__ == "__main__":
    main()
