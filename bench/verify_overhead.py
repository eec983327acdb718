"""What hybridspec's verification graphs cost beyond budget's at the same shapes (issue 7), one command on the H200:
    PYTHONPATH=. python bench/verify_overhead.py --layers 40 --out $OUT
hybridspec's graph set is captured with the router correction's extra-token input and per-expert routing counts
(workers/graphs.py `extra_token`, `collect_counts`; both only in buckets of EXTRA_FROM = 8 requests or more since
ebd60d3, so the default shapes start there); budget's and fixed K's without. On the bench model it replays
the same verification steps (B requests x T tokens, the spare page and slot) from both sets and reports the
median forward ms of each (CUDA events around the replay), and of hybridspec's set with one extra token per
request. `--tiny` runs the plumbing on CPU (graphs' padded batches, eager).
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

from bench.e2e import git_commit, tiny_config  # noqa: E402
from workers.bench_model import build_bench_model  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
import workers.runner as runner_mod  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402


KERNELS: dict[str, dict[str, float]] = {}  # --kernels: variant -> kernel name -> GPU us per replay


def kernel_us(runner: ModelRunner, b: int, t: int, context: int, reps: int = 5) -> dict[str, float]:
    """GPU us per replay of each kernel of a B x T verification step (torch.profiler over `reps` replays)."""
    from bench.step_profile import _events

    time_steps(runner, b, t, False, 1, context)  # captured before profiling
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        time_steps(runner, b, t, False, reps - 1, context)
    return {k: us / reps for k, (us, _) in _events(prof, torch.autograd.DeviceType.CUDA).items()}


def time_steps(runner: ModelRunner, b: int, t: int, extra: bool, reps: int, context: int = 8) -> float:
    """Median ms of `reps` replays of a B x T verification step (after one warm-up that captures)."""
    graphs = runner.step_graphs()
    spare_page, spare_slot = runner.cache.num_pages - 1, runner.cache.num_slots - 1
    pages = [[spare_page] * (-(-(context + t) // runner.cache.page_size))] * b
    blocks = [[1] * t for _ in range(b)]
    key = graphs.bucket(b, b * t, t, len(pages[0]))
    extra_rows = [i * t + t - 1 for i in range(b)] if extra else []
    times = []
    for rep in range(reps + 1):
        if runner.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.run(key, blocks, [context] * b, pages, [spare_slot] * b, [False] * b, extra_rows)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            graphs.run(key, blocks, [context] * b, pages, [spare_slot] * b, [False] * b, extra_rows)
            ms = (time.perf_counter() - t0) * 1e3
        if rep:
            times.append(ms)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default="8x9,8x17,16x9,16x17")
    ap.add_argument("--max-verify", default="",
                    help="also budget's graphs for these max verification lengths (e.g. 4,8): the same B x T "
                         "steps in a bucket whose max block is K + 1 instead of 17")
    ap.add_argument("--context", type=int, default=8, help="tokens already cached per request (attention's keys)")
    ap.add_argument("--kernels", action="store_true",
                    help="per-kernel GPU time of budget's step and of its --max-verify variants (torch.profiler): "
                         "prints the kernels that differ most")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_bench_model(config=tiny_config(), dtype=dtype, device=device, decisive=True) if args.tiny else \
        build_bench_model(num_layers=args.layers, dtype=dtype, device=device, decisive=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    max_b = max(b for b, _ in shapes)
    pages_needed = -(-(args.context + max(t for _, t in shapes)) // 16)
    cache = ModelCache(model.config, max(8, pages_needed + 1), 16, max_b + 1, dtype, device)
    runner_mod.MAX_GRAPH_SETS = 8  # budget at each K and hybridspec: keep every set
    runner = ModelRunner(model, cache)
    why = runner.enable_graphs(max_b, max(4, pages_needed), warm=False, capture=device == "cuda")
    assert why is None, why
    rows = []
    for b, t in shapes:
        row = {"B": b, "T": t}
        for policy, extra in (("budget", False), ("hybridspec", False), ("hybridspec", True)):
            runner.set_policy(policy, 16)
            name = policy + ("+extra" if extra else "")
            row[name] = time_steps(runner, b, t, extra, args.reps, args.context)
        row["hybridspec_over_budget_ms"] = row["hybridspec"] - row["budget"]
        for k in (int(v) for v in args.max_verify.split(",") if v):
            if t <= k + 1:
                runner.set_policy("budget", k)
                row[f"budget/max_block{k + 1}"] = time_steps(runner, b, t, False, args.reps, args.context)
                if args.kernels and device == "cuda":
                    variant = kernel_us(runner, b, t, args.context)
                    runner.set_policy("budget", 16)
                    base = kernel_us(runner, b, t, args.context)
                    diff = sorted(((base.get(n, 0.0) - variant.get(n, 0.0), n) for n in set(base) | set(variant)),
                                  reverse=True)
                    row[f"kernels_us/max_block17_vs_{k + 1}"] = {n: [base.get(n, 0.0), variant.get(n, 0.0)]
                                                                 for _, n in diff}
                    print(f"  kernels, bucket of max block 17 vs {k + 1}: sum {sum(base.values()):.0f} vs "
                          f"{sum(variant.values()):.0f} us; most different:", flush=True)
                    for d, n in diff[:8] + diff[-3:]:
                        print(f"    {d:+8.1f} us  {base.get(n, 0.0):8.1f} vs {variant.get(n, 0.0):8.1f}  {n[:90]}",
                              flush=True)
        rows.append(row)
        print(f"B={b} T={t}: budget {row['budget']:.3f} ms, hybridspec {row['hybridspec']:.3f} ms "
              f"(+{row['hybridspec_over_budget_ms']:.3f}), with extra tokens {row['hybridspec+extra']:.3f} ms",
              flush=True)
        print("  " + ", ".join(f"{n} {v:.3f} ms" for n, v in row.items() if n.startswith("budget/")), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_overhead.json").write_text(json.dumps({"commit": git_commit(), "device": device,
                                                           "layers": model.config.num_hidden_layers,
                                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
