"""GPU check of the whole engine path (one command on the H200):
    PYTHONPATH=. python bench/gpu_check.py --layers 4
Builds the bench model (Qwen3.6-35B-A3B shapes, `--layers` layers, bf16, Zipf router), then
1. greedy generation through the engine's scheduler + runner with the Triton kernels vs the PyTorch references
   (HYBRIDSPEC_KERNELS=ref) on the same GPU: tokens equal, or the first-divergence position (bf16 ties);
2. speculative (replay drafter, fixed 8) vs plain greedy with the kernels: tokens equal;
3. one AR decode step at B=1 timed (eager, median of 20) against its bandwidth floor.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import floor_ms, git_commit, serve  # noqa: E402
from workers.bench_model import build_bench_model  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.drafters import ReplayDrafter  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    model = build_bench_model(num_layers=args.layers, routing="zipf", dtype=torch.bfloat16, device="cuda")
    cfg = model.config
    num_pages, page_size = args.requests * 64, 16
    cache = ModelCache(cfg, num_pages + 1, page_size, args.requests + 1, torch.bfloat16, "cuda")  # + spares
    runner = ModelRunner(model, cache)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
               for n in [17, 130, 64, 300][:args.requests]]
    report: dict = {"commit": git_commit(), "layers": args.layers, "device": torch.cuda.get_device_name()}

    os.environ["HYBRIDSPEC_KERNELS"] = "ref"
    ref = serve(runner, prompts, args.max_new, 0, page_size, num_pages, "ar").tokens
    os.environ["HYBRIDSPEC_KERNELS"] = "auto"
    fast = serve(runner, prompts, args.max_new, 0, page_size, num_pages, "ar").tokens
    divergence = []
    for a, b in zip(ref, fast):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        divergence.append(first)
    report["kernels_vs_reference_first_divergence"] = divergence
    replay = ReplayDrafter(0.8, cfg.vocab_size, seed=1)
    for p, cont in zip(prompts, fast):
        replay.set_reference(p, cont)
    runner.drafter = replay
    spec = serve(runner, prompts, args.max_new, 8, page_size, num_pages, "fixed8").tokens
    report["speculative_equals_greedy"] = spec == fast
    runner.drafter = None
    # one AR decode step at B=1, eager, median
    times = []
    for _ in range(3):
        serve(runner, prompts[:1], 2, 0, page_size, num_pages, "ar")
    res = serve(runner, prompts[:1], 24, 0, page_size, num_pages, "ar")
    times = res.step_ms[2:]
    step = statistics.median(times)
    floor = floor_ms(cfg, 2, cfg.num_experts_per_tok, 1, 40)
    report.update(ar_step_ms_b1=step, floor_ms_b1=floor, step_over_floor=step / floor)
    # 4. the same with decode steps replayed from CUDA graphs
    t0 = time.time()
    why = runner.enable_graphs(args.requests, 64)
    report["graph_capture_s"] = time.time() - t0
    report["graphs"] = why or "captured"
    if why is None:
        graphed = serve(runner, prompts, args.max_new, 0, page_size, num_pages, "ar").tokens
        report["graphs_vs_eager_first_divergence"] = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(fast, graphed)]
        res = serve(runner, prompts[:1], 24, 0, page_size, num_pages, "ar")
        report["graph_ar_step_ms_b1"] = statistics.median(res.step_ms[2:])
        report["graph_step_over_floor"] = report["graph_ar_step_ms_b1"] / floor
        res = serve(runner, prompts, 24, 0, page_size, num_pages, "ar")
        report[f"graph_ar_step_ms_b{len(prompts)}"] = statistics.median(res.step_ms[2:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.1f}s")
