"""A/B of one module setting on the graphed AR decode step (issue 6), one command on the H200:
    PYTHONPATH=. python bench/step_ab.py --layers 40 --set kernels.moe_triton.MOE_GEMV_MAX_N=0,1 [--out $OUT]
Builds the bench model once (Qwen3.6-35B-A3B shapes, bf16, Zipf router, decisive logits), then for each round and
each value of the setting (alternating, `--rounds` times; `--set` repeated: the settings move together, configuration
i being each one's i-th value) a fresh runner with CUDA graphs (a setting read at launch
time is what its captures hold) serves `--batch` requests for `--new` tokens: the median step ms, the floor, and the
greedy tokens against the first value's (bf16: the kernels' summation orders may break ties differently). The step
moves by up to 6% between repeats in one call: read the rounds, not one run. Writes `step_ab.json`. `--tiny` runs
the plumbing on CPU (eager, the PyTorch references: a kernel setting changes nothing there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import floor_ms, git_commit, serve, tiny_config  # noqa: E402
from workers.bench_model import build_bench_model  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402


def parse_setting(text: str) -> tuple[object, str, list[int]]:
    """`module.NAME=v1,v2,...` -> (module, NAME, [int values]); a named error for anything else."""
    target, _, values = text.partition("=")
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        vals = [int(v) for v in values.split(",")]
    except (ImportError, ValueError) as e:
        raise SystemExit(f"--set {text!r}: want module.NAME=int,int,... ({e})")
    if not hasattr(module, attr) or len(vals) < 2:
        raise SystemExit(f"--set {text!r}: {module_name} has no {attr}, or fewer than two values")
    return module, attr, vals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--set", required=True, action="append",
                    help="module.NAME=v1,v2 (integers), e.g. kernels.moe_triton.MOE_GEMV_MAX_N=0,1; repeated, the "
                    "settings move together (every one the same number of values: configuration i is each one's "
                    "i-th value)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    settings = [parse_setting(text) for text in args.set]
    if len({attr for _, attr, _ in settings}) != len(settings):
        raise SystemExit(f"--set: each setting once, and no two of the same name (rows are keyed by it): {args.set}")
    configs = list(range(len(settings[0][2])))
    if any(len(vals) != len(configs) for _, _, vals in settings):
        raise SystemExit(f"--set: every setting needs the same number of values, got {args.set}")
    label = ", ".join(attr for _, attr, _ in settings)

    def apply(i: int) -> dict:
        for module, attr, vals in settings:
            setattr(module, attr, vals[i])
        return {attr: vals[i] for _, attr, vals in settings}

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_bench_model(num_layers=args.layers, config=tiny_config() if args.tiny else None, dtype=dtype,
                              device=device, decisive=True)
    cfg, page_size, prompt_len = model.config, 16, 16
    pages = -(-(prompt_len + args.new + 8) // page_size)
    num_pages = args.batch * pages
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    floor = floor_ms(cfg, 2 if dtype == torch.bfloat16 else 4,
                     min(cfg.num_experts, args.batch * cfg.num_experts_per_tok), args.batch, prompt_len + args.new // 2)
    originals = [getattr(module, attr) for module, attr, _ in settings]
    rows, first_tokens = [], None
    try:
        for rnd in range(args.rounds):
            for i in (configs if rnd % 2 == 0 else configs[::-1]):
                applied = apply(i)
                runner = ModelRunner(model, ModelCache(cfg, num_pages + 1, page_size, args.batch + 1, dtype, device))
                if device == "cuda":
                    why = runner.enable_graphs(args.batch, pages, warm=False)
                    assert why is None, why
                t0 = time.perf_counter()
                serve(runner, prompts, 4, 0, page_size, num_pages, "ar")  # warm-up: compiles, captures
                res = serve(runner, prompts, args.new, 0, page_size, num_pages, "ar")
                ms = statistics.median(res.step_ms[1:])
                if first_tokens is None:
                    first_tokens = res.tokens
                match = sum(a == b for a, b in zip(res.tokens, first_tokens)) / len(first_tokens)
                row = {"round": rnd, "config": i, **applied, "step_ms_median": ms, "floor_ms": floor,
                       "over_floor": ms / floor, "greedy_match_vs_first": match, "wall_s": time.perf_counter() - t0}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del runner
    finally:
        for (module, attr, _), original in zip(settings, originals):
            setattr(module, attr, original)
    summary = {i: statistics.median([r["step_ms_median"] for r in rows if r["config"] == i]) for i in configs}
    names = {i: ", ".join(f"{attr}={vals[i]}" for _, attr, vals in settings) for i in configs}
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "layers": cfg.num_hidden_layers, "batch": args.batch, "setting": args.set, "rows": rows,
              "median_step_ms": {names[i]: ms for i, ms in summary.items()},
              "restored": all(getattr(m, a) == o for (m, a, _), o in zip(settings, originals))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_ab.json").write_text(json.dumps(report, indent=1))
    print(f"{label}: " + " | ".join(f"{names[i]}: {ms:.3f} ms ({ms / floor:.2f}x floor)"
                                    for i, ms in summary.items()))


if __name__ == "__main__":
    main()
