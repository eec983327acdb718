"""Real acceptance of each drafter on the trained embedded pair (issue 9), and each policy's speedup over `ar`.

    PYTHONPATH=. python -m bench.acceptance --device cpu --out bench/results/acceptance_cpu.json
    PYTHONPATH=. python -m bench.acceptance --device cuda --dtype bfloat16 --out $OUT/acceptance_cuda.json

Prompts: the first --prompt-tokens tokens of held-out standard-library files (the ones training/train.py held out,
listed in <models>/metrics.json, read from this machine's stdlib; this machine's own held-out split if they are
not here). For every concurrency (max running requests) it runs all prompts greedily with the engine's own
Python API (engine/llm.py: scheduler, continuous batching, ModelRunner): first `ar` (no speculation: the
reference tokens and the baseline speed), then each drafter (ngram, draft, mtp) under each policy (fixed k=4 and
k=8, budget, hybridspec, and any other policy the engine offers). Reported per run: acceptance rate
(accepted / drafted), mean accepted tokens per verify step, output tokens/s, speedup over `ar`, and whether the
output equals `ar`'s (greedy speculation is lossless; in bf16 on a GPU a different batch shape may round a near
tie differently, so that is reported, not asserted). A short table is printed last; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.llm import LLM
from scheduler.types import SamplingParams
from workers.policy import POLICIES

DRAFTERS = ("ngram", "draft", "mtp")


def policy_runs(max_verify_len: int) -> list[tuple[str, str, int]]:
    """(label, engine policy, max_verify_len) of every speculative run: fixed k=4 and k=8, then the adaptive
    policies the engine has (budget, hybridspec, ...) at --max-verify-len."""
    runs = [("fixed4", "fixed", 4), ("fixed8", "fixed", 8)]
    runs += [(p, p, max_verify_len) for p in POLICIES if p not in ("ar", "fixed")]
    return runs


def heldout_files(models: Path) -> list[Path]:
    from training.train import source_files, stdlib_root

    root = stdlib_root()
    metrics = models / "metrics.json"
    if metrics.is_file():
        listed = [root / p for p in json.loads(metrics.read_text()).get("heldout_paths", [])]
        found = [p for p in listed if p.is_file()]
        if len(found) >= max(1, len(listed) // 2):
            return found
    return source_files(root)[1]


def make_prompts(tokenizer, models: Path, count: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    prompts, names = [], []
    for f in heldout_files(models):
        try:
            ids = tokenizer.encode(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) < prompt_tokens + 16:
            continue
        prompts.append(ids[:prompt_tokens])
        names.append(f.name)
        if len(prompts) == count:
            break
    if not prompts:
        raise SystemExit("no held-out file is long enough for the prompt length")
    return prompts, names


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_one(llm: LLM, prompts: list[list[int]], params: SamplingParams, device: str, repeat: int) -> dict:
    """Warm-up, then `repeat` timed runs of all prompts (the fastest counts: other load on the machine only ever
    slows a run down). Greedy: every repeat produces the same tokens and acceptance."""
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up (kernels, graphs)
    walls = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = llm.generate(prompts, params)
        sync(device)
        walls.append(time.perf_counter() - t0)
    wall = min(walls)
    drafted = sum(r.stats.draft_tokens for r in out)
    accepted = sum(r.stats.accepted_tokens for r in out)
    verify_steps = sum(r.stats.verify_steps for r in out)
    tokens = sum(len(r.token_ids) for r in out)
    return {"tokens": [r.token_ids for r in out], "output_tokens": tokens, "wall_s": wall, "walls_s": walls,
            "tokens_per_s": tokens / wall, "drafted": drafted, "accepted": accepted, "verify_steps": verify_steps,
            "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_per_verify_step": accepted / verify_steps if verify_steps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=str(ROOT / "models"), help="directory holding target/ and draft/")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated max running requests")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--max-verify-len", type=int, default=8, help="for the adaptive policies")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per configuration (the fastest counts)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a small shared machine more threads spin against other "
                         "work and slow these tiny models down many times)")
    ap.add_argument("--tiny", action="store_true", help="a few short prompts (tests; numbers mean little)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.prompts, args.prompt_tokens, args.max_new_tokens, args.repeat = 3, 24, 12, 1
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    models = Path(args.models)
    target, draft = models / "target", models / "draft"
    drafters = [d for d in args.drafters.split(",") if d]
    from workers.mtp import count_mtp_layers

    if "mtp" in drafters and count_mtp_layers(target) == 0:
        print(f"[acceptance] {target} has no MTP head: skipping mtp", flush=True)
        drafters.remove("mtp")
    if "draft" in drafters and not (draft / "config.json").is_file():
        print(f"[acceptance] no draft model in {draft}: skipping draft", flush=True)
        drafters.remove("draft")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    base = {"model": str(target), "device": args.device, "dtype": dtype, "max_model_len": 1024}
    first = LLM(**base, max_running=1)
    prompts, names = make_prompts(first.tokenizer, models, args.prompts, args.prompt_tokens)
    del first
    report: dict = {"device": args.device, "dtype": dtype, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                    "prompts": len(prompts), "prompt_files": names, "prompt_tokens": args.prompt_tokens,
                    "max_new_tokens": args.max_new_tokens, "policies": [r[0] for r in policy_runs(args.max_verify_len)],
                    "runs": []}
    metrics = models / "metrics.json"
    if metrics.is_file():
        m = json.loads(metrics.read_text())
        report["training"] = {k: m.get(k) for k in ("target", "draft", "mtp")}
    for conc in [int(c) for c in args.concurrency.split(",")]:
        ar = run_one(LLM(**base, max_running=conc, spec="off", policy="ar"), prompts, params, args.device,
                    args.repeat)
        ref = ar.pop("tokens")
        report["runs"].append(dict(ar, concurrency=conc, drafter="none", policy="ar", speedup=1.0, lossless=True))
        print(f"[acceptance] c={conc} ar: {ar['tokens_per_s']:.1f} tok/s", flush=True)
        for drafter in drafters:
            for label, policy, k in policy_runs(args.max_verify_len):
                llm = LLM(**base, max_running=conc, spec=drafter, policy=policy, max_verify_len=k,
                          draft_model=str(draft) if drafter == "draft" else None)
                r = run_one(llm, prompts, params, args.device, args.repeat)
                toks = r.pop("tokens")
                same = sum(a == b for a, b in zip(toks, ref))
                row = dict(r, concurrency=conc, drafter=drafter, policy=label, max_verify_len=k,
                           speedup=r["tokens_per_s"] / ar["tokens_per_s"], lossless=same == len(ref),
                           equal_outputs=f"{same}/{len(ref)}")
                report["runs"].append(row)
                print(f"[acceptance] c={conc} {drafter} {label}: acc {row['acceptance_rate'] or 0:.3f} "
                      f"{row['tokens_per_s']:.1f} tok/s x{row['speedup']:.2f} equal {row['equal_outputs']}",
                      flush=True)
                del llm
    summary = {}
    for d in drafters:  # per drafter: acceptance at fixed k=4, pooled over concurrencies
        rows = [r for r in report["runs"] if r["drafter"] == d and r["policy"] == "fixed4"]
        drafted, acc = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
        steps = sum(r["verify_steps"] for r in rows)
        summary[d] = {"acceptance_rate_fixed4": acc / drafted if drafted else None,
                      "accepted_per_verify_step_fixed4": acc / steps if steps else None}
    report["summary"] = summary
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{args.device} {dtype}, {len(prompts)} held-out prompts x {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens each (greedy)")
    print(f"{'conc':>4} {'drafter':>7} {'policy':>10} {'accept':>7} {'acc/step':>8} {'tok/s':>8} {'speedup':>7} "
          f"{'=ar':>6}")
    for r in report["runs"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        per = "-" if r["accepted_per_verify_step"] is None else f"{r['accepted_per_verify_step']:.2f}"
        print(f"{r['concurrency']:>4} {r['drafter']:>7} {r['policy']:>10} {acc:>7} {per:>8} "
              f"{r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f} {r.get('equal_outputs', 'ref'):>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
