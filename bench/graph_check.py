"""GPU check of the CUDA-graph step path (one command on the H200, issue 6's correctness test):
    PYTHONPATH=. python bench/graph_check.py --layers 4
On the bench model (Qwen3.6-35B-A3B shapes, `--layers` layers, bf16, Zipf router, decisive logits so that bf16
batch-shape rounding cannot flip a greedy token), greedy output through the engine's scheduler + runner must be
identical for: PyTorch references eager (HYBRIDSPEC_KERNELS=ref), Triton kernels eager, and Triton kernels with
CUDA graphs, each without speculation and with the replay drafter under fixed16 and hybridspec. Prints one
JSON line; `--tiny` runs the same on CPU (graphs' static batches run eagerly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import git_commit, serve, tiny_config  # noqa: E402
from workers.bench_model import build_bench_model  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.drafters import ReplayDrafter  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="fp32 with --decisive 0: tokens depend on every layer's state, and fp32 rounding rarely "
                         "flips a greedy token, so a wrong state or input shows as a divergence (CPU / small "
                         "shapes: on the H200 at the bench shapes a Triton kernel needs more shared memory in "
                         "fp32 than there is, bench/NOTES.md)")
    ap.add_argument("--decisive", type=int, default=1)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and args.dtype == "bf16" else torch.float32
    model = build_bench_model(num_layers=args.layers, config=tiny_config() if args.tiny else None, dtype=dtype,
                              device=device, decisive=bool(args.decisive))
    cfg, page_size = model.config, 16
    pages = -(-(args.prompt_len + args.max_new + 20) // page_size)
    num_pages = args.concurrency * pages
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len + 5 * i,), generator=gen).tolist()
               for i in range(args.concurrency)]

    def runner(graphs: bool) -> ModelRunner:
        r = ModelRunner(model, ModelCache(cfg, num_pages + 1, page_size, args.concurrency + 1, dtype, device))
        if graphs:
            assert r.enable_graphs(args.concurrency, pages, warm=False, capture=device == "cuda") is None
        return r

    out = {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "layers": cfg.num_hidden_layers, "dtype": str(dtype), "decisive": bool(args.decisive)}
    os.environ["HYBRIDSPEC_KERNELS"] = "ref"
    reference = serve(runner(False), prompts, args.max_new, 0, page_size, num_pages, "ar").tokens
    os.environ["HYBRIDSPEC_KERNELS"] = "auto"
    t0 = time.perf_counter()
    for name, graphs in (("triton_eager", False), ("triton_graphs", True)):
        r = runner(graphs)
        for policy, k in (("ar", 0), ("fixed16", 16), ("hybridspec", 16)):
            if policy != "ar":
                replay = ReplayDrafter(0.7, cfg.vocab_size, seed=5)
                for p, cont in zip(prompts, reference):
                    replay.set_reference(p, cont + [0] * 20)
                r.drafter = replay
            res = serve(r, prompts, args.max_new, k, page_size, num_pages, policy)
            first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(res.tokens, reference)]
            out[f"{name}/{policy}"] = {"equal": res.tokens == reference, "first_divergence": first,
                                       "drafted": res.draft_tokens, "accepted": res.accepted_tokens}
            print(name, policy, out[f"{name}/{policy}"], flush=True)
        if graphs and device == "cuda":
            out["graphs_captured"] = r.graph_captures()
    out["all_equal"] = all(v["equal"] for k, v in out.items() if isinstance(v, dict))
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
