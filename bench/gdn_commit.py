"""The GDN commit at the bench model's shapes, sequential vs block vs factored kernel (issue 6), one command on the
H200:
    PYTHONPATH=. python bench/gdn_commit.py --out $OUT [--impls seq,block] [--variants 64:8:1:0,...] [--sweep]
A verification step commits each request's accepted drafts + 1 of its block (T = 17 at cap 16). The block (WY)
kernel works over the whole block whatever is kept; the sequential kernel over the kept tokens only; the factored
kernel (kernels/gdn_verify_triton.py) transforms the kept tokens per (request, head), then makes one pass over each
state tile (two launches). Each factored variant BV:WARPS:TRANS:TMA_STORE (phase 2's value tile, warps, S^T layout,
the tile stored through the TMA engine) runs in its own process: its first H200 run died with an illegal memory
access (9359928), and a crashed variant must not take the others with it. Checks each against gdn_commit_ref (fp32
state, bf16 inputs; the whole pool, so a stray write shows) and times them in CUDA graphs (30 launches per graph:
the 30 GDN layers of a step) at B in {1, 16, 64}, T = 17 and kept tokens all 1 / geometric (acceptance 0.5, 0.85) /
all 17. Writes `$OUT/gdn_commit.json` and prints a table (us per launch, and per step of 30 layers in ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--tiny" in sys.argv:  # before anything imports a @triton.jit kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.e2e import git_commit  # noqa: E402
from kernels.gdn import gdn_commit_ref  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
LAYERS = 30  # GDN layers of the 40-layer bench model
STATE_BYTES = HV * DK * DV * 4
SWEEP = ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4))  # (bv, num_warps) of the sequential commit
# BV:WARPS:TRANS:TMA_STORE of the factored commit's phase 2 (the default first; ptxas at sm_90 registers / spill
# bytes: 64:8:1:0 255/0, 64:8:1:1 252/0 (crashed in 9359928), 64:4:1:0 255/292, 128:8:1:0 255/132, 64:4:0:0 255/852)
VARIANTS = "64:8:1:0,64:8:1:1,64:4:1:0,128:8:1:0,64:4:0:0"


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


def _variant_opts(name: str) -> dict:
    bv, warps, trans, tma = (int(x) for x in name.split(":"))
    return dict(bv=bv, num_warps=warps, trans=bool(trans), tma_store=bool(tma))


def run_isolated(variants: list[str], extra: list[str]) -> tuple[dict, dict]:
    """Each factored variant in a child process; a crash is reported with its last lines, not raised."""
    times, checks = {}, {}
    for name in variants:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, __file__, "--impls", "", "--variants", name, "--child",
                                   "--out", tmp, *extra], capture_output=True, text=True)
            path = Path(tmp) / "gdn_commit.json"
            if proc.returncode != 0 or not path.exists():
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                checks[f"factored_{name}"] = f"FAILED rc={proc.returncode}: " + " | ".join(tail)
                print(f"factored {name}: FAILED rc={proc.returncode}: {' | '.join(tail)}", flush=True)
                continue
            child = json.loads(path.read_text())
            checks.update(child["checks"])
            for row in child["rows"]:
                times[(row["B"], row["keep"], f"factored_{name}")] = row[f"factored_{name}"]
    return times, checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also time the sequential kernel's (bv, warps) configs")
    ap.add_argument("--impls", default="seq,block", help="comma-separated one-launch kernels (seq, block)")
    ap.add_argument("--variants", default=VARIANTS, help="factored variants BV:WARPS:TRANS:TMA_STORE, comma-"
                    "separated, each in its own process ('' for none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run the variants in this process
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run under TRITON_INTERPRET=1: tiny heads, B in "
                    "{1, 3}, checks only (no timing)")
    args = ap.parse_args()
    global HK, HV, DK, DV, STATE_BYTES
    if args.tiny:
        HK, HV, DK, DV = 1, 2, 16, 32
        STATE_BYTES = HV * DK * DV * 4
    from kernels.gdn_triton import gdn_commit_triton
    from kernels.gdn_verify_triton import gdn_commit_factored_triton

    impls = [x for x in args.impls.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    extra = ["--tiny"] if args.tiny else []
    iso_times, iso_checks = ({}, {}) if args.child or not variants else run_isolated(variants, extra)
    timer = (lambda fn: float("nan")) if args.tiny else time_graph

    dev, t = ("cpu" if args.tiny else "cuda"), 17
    gen = torch.Generator().manual_seed(0)
    rows, checks = [], {}
    for b in (1, 3) if args.tiny else (1, 16, 64):
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
            for impl in impls:
                out = pool.clone()
                gdn_commit_triton(k, v, g, beta, cu, keep, out, slots, t, impl=impl)
                err = float((out - ref).norm() / ref[slots].norm())  # the whole pool: no stray writes
                checks[f"B{b}/keep{kind}/{impl}"] = err
                work = pool.clone()
                row[impl] = timer(lambda: gdn_commit_triton(k, v, g, beta, cu, keep, work, slots, t, impl=impl))
            for name in variants if args.child else ():
                opts = _variant_opts(name)
                out = pool.clone()
                gdn_commit_factored_triton(k, v, g, beta, cu, keep, out, slots, t, **opts)
                checks[f"B{b}/keep{kind}/factored_{name}"] = float((out - ref).norm() / ref[slots].norm())
                work = pool.clone()
                row[f"factored_{name}"] = timer(
                    lambda: gdn_commit_factored_triton(k, v, g, beta, cu, keep, work, slots, t, **opts))
            for name in variants if not args.child else ():
                if (b, kind, f"factored_{name}") in iso_times:
                    row[f"factored_{name}"] = iso_times[(b, kind, f"factored_{name}")]
            if args.sweep and b > 1 and "seq" in impls:  # the sequential kernel's tile width and warps
                for bv, warps in SWEEP:
                    out = pool.clone()
                    gdn_commit_triton(k, v, g, beta, cu, keep, out, slots, t, bv=bv, num_warps=warps)
                    checks[f"B{b}/keep{kind}/seq_bv{bv}_w{warps}"] = float(
                        (out - ref).norm() / ref[slots].norm())
                    row[f"seq_bv{bv}_w{warps}"] = timer(lambda: gdn_commit_triton(
                        k, v, g, beta, cu, keep, out, slots, t, bv=bv, num_warps=warps))
            rows.append(row)
            timed = [key for key in row if key in impls or key.startswith(("factored_", "seq_bv"))]
            print(f"B={b:3d} keep={kind:>4} (mean {row['mean_keep']:5.2f}): floor {row['floor_us']:6.1f} us; " +
                  ", ".join(f"{key} {row[key]:7.1f}" for key in timed) +
                  (f" (a step of {LAYERS} layers, ms: " + ", ".join(f"{key} {row[key] * LAYERS / 1e3:.2f}"
                                                                  for key in timed) + ")" if timed else ""),
                  flush=True)
    checks.update(iso_checks)
    numeric = [val for val in checks.values() if isinstance(val, float)]
    failed = [key for key, val in checks.items() if not isinstance(val, float)]
    print(f"max relative state error vs gdn_commit_ref: {max(numeric, default=float('nan')):.2e}"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_commit.json").write_text(json.dumps({"commit": git_commit(), "rows": rows, "checks": checks},
                                                    indent=1))


if __name__ == "__main__":
    main()
