"""Where one decode step's time goes (issue 6), one command on the H200:
    PYTHONPATH=. python bench/step_profile.py --layers 40 --out $OUT
On the bench model (Qwen3.6-35B-A3B shapes, bf16, Zipf router, decisive logits) it times AR decode steps at B=1 and
B=16, eager and replayed from CUDA graphs, against the bandwidth floor, and runs torch.profiler over a few steps of
each: GPU kernel time per step (the sum of the kernels, what a perfect host would leave), kernels per step, the top
kernels by GPU time, and the top host-side ops of the graphed step (what the host does around a replay).
Writes `$OUT/step_profile.json` and a readable `$OUT/step_profile.txt`. `--tiny` runs the plumbing on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import floor_ms, git_commit, serve, tiny_config  # noqa: E402
from workers.bench_model import build_bench_model  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402


def _events(prof, kind) -> dict[str, tuple[float, int]]:
    """name -> (self time us, calls) of a profile's device (`kind` CUDA) or host (CPU) events."""
    out = {}
    for e in prof.key_averages():
        if e.device_type != kind:
            continue
        t = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
             if kind == torch.autograd.DeviceType.CUDA else e.self_cpu_time_total)
        if t or e.count:
            out[e.key] = (t, e.count)
    return out


def _per_step(full, base, steps: int) -> list[tuple[str, float, float]]:
    """(name, time per step, calls per step) of the decode steps: the full run's events less the prefill run's."""
    rows = []
    for k, (t, c) in full.items():
        bt, bc = base.get(k, (0, 0))
        if c - bc > 0:
            rows.append((k, (t - bt) / steps, (c - bc) / steps))
    rows.sort(key=lambda r: -r[1])
    return rows


def kernel_table(full, base, steps: int, top: int) -> dict:
    """GPU kernels of the decode steps: total time per step, count per step, the `top` kernels by time."""
    rows = _per_step(_events(full, torch.autograd.DeviceType.CUDA), _events(base, torch.autograd.DeviceType.CUDA),
                     steps)
    return {"gpu_us_per_step": sum(r[1] for r in rows), "kernels_per_step": sum(r[2] for r in rows),
            "top": [{"name": n[:90], "us_per_step": round(t, 2), "calls_per_step": round(c, 2)}
                    for n, t, c in rows[:top]]}


def host_table(full, base, steps: int, top: int) -> list[dict]:
    rows = _per_step(_events(full, torch.autograd.DeviceType.CPU), _events(base, torch.autograd.DeviceType.CPU),
                     steps)
    return [{"name": n[:90], "self_cpu_us_per_step": round(t, 1), "calls_per_step": round(c, 2)}
            for n, t, c in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--modes", default="eager,graphs", help="eager and/or graphs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t_build = time.perf_counter()
    model = build_bench_model(num_layers=args.layers, config=tiny_config() if args.tiny else None, dtype=dtype,
                              device=device, decisive=True)
    cfg, page_size, batch = model.config, 16, 16
    pages = -(-(16 + args.new + 8) // page_size)
    num_pages = batch * pages
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=gen).tolist() for _ in range(batch)]
    runner = ModelRunner(model, ModelCache(cfg, num_pages + 1, page_size, batch + 1, dtype, device))
    report: dict = {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "layers": cfg.num_hidden_layers, "build_s": time.perf_counter() - t_build}
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for mode in args.modes.split(","):
        if mode == "graphs":
            if device != "cuda":
                break
            t0 = time.perf_counter()
            why = runner.enable_graphs(batch, pages, warm=False)
            report["graphs"] = why or "captured"
            report["enable_graphs_s"] = time.perf_counter() - t0
        for b in (1, batch):
            ps = prompts[:b]
            serve(runner, ps, 4, 0, page_size, num_pages, "ar")  # warm-up: compiles, captures
            res = serve(runner, ps, args.new, 0, page_size, num_pages, "ar")
            ms = statistics.median(res.step_ms[1:])
            floor = floor_ms(cfg, 2 if dtype == torch.bfloat16 else 4,
                             min(cfg.num_experts, b * cfg.num_experts_per_tok), b, 16 + args.new // 2)
            n = 8  # decode steps profiled: a run of prefill + n decode steps less a run of the prefill alone
            with profile(activities=acts) as full:
                serve(runner, ps, n + 1, 0, page_size, num_pages, "ar")
            with profile(activities=acts) as base:
                serve(runner, ps, 1, 0, page_size, num_pages, "ar")
            kt = kernel_table(full, base, n, args.top)
            key = f"{mode}_b{b}"
            report[key] = {"step_ms_median": ms, "floor_ms": floor, "over_floor": ms / floor, **kt,
                           "host_top": host_table(full, base, n, 15)}
            log(f"== {key}: step {ms:.3f} ms (median of {len(res.step_ms) - 1}), floor {floor:.3f} ms, "
                f"{ms / floor:.2f}x; profiled over {n} decode steps: "
                f"GPU kernels {kt['gpu_us_per_step'] / 1e3:.3f} ms/step, {kt['kernels_per_step']:.0f} kernels/step")
            for r in kt["top"]:
                log(f"   {r['us_per_step']:9.1f} us  x{r['calls_per_step']:7.1f}  {r['name']}")
            log("   host (self CPU):")
            for r in report[key]["host_top"]:
                log(f"   {r['self_cpu_us_per_step']:9.1f} us  x{r['calls_per_step']:7.1f}  {r['name']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(report, indent=1))
    (out / "step_profile.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.1f}s")
