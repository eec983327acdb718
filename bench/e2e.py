"""End-to-end serving benchmark: policies x concurrency x replay acceptance on the bench model.

One command on the H200 (docs/benchmarking.md):
    PYTHONPATH=. python bench/e2e.py --layers 40 --out $OUT
It builds the Qwen3.6-35B-A3B-shaped model (random bf16 weights, Zipf router), runs every request greedily
without speculation first (the reference continuation, and the `ar` row), then each policy with the `replay`
drafter ("replay acceptance": each proposed token is the reference's with probability `acceptance`; a real
DFlash-shaped drafter forward is spent every step), and checks that every run's tokens equal the reference.
The loop is the engine's own: scheduler (continuous batching, draft caps, page accounting) + ModelRunner.
On CPU, `--tiny` runs the same code on a toy model (for tests; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler.memory import MemoryManager  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.types import SamplingParams, StepRequest  # noqa: E402
from workers.bench_model import build_bench_model, qwen36_35b_a3b_config  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.drafters import DraftModelDrafter, ReplayDrafter  # noqa: E402
from workers.model import HybridModel  # noqa: E402
from workers.random_init import init_random_  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402

HBM_BYTES_PER_S = 4.3e12


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return os.environ.get("HYBRIDSPEC_COMMIT", "unknown")


def tiny_config() -> ModelConfig:
    cfg = qwen36_35b_a3b_config(4, vocab_size=512)
    return dataclasses.replace(cfg, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32)


def drafter_model(cfg: ModelConfig, layers: int, dtype, device) -> HybridModel:
    """DFlash-shaped cost: a few layers at the target's hidden size (dense MLPs, no experts)."""
    dcfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
                               moe_layers=[False] * layers, intermediate_size=4 * cfg.hidden_size)
    return init_random_(HybridModel(dcfg, dtype, device), seed=99)


@dataclasses.dataclass
class RunResult:
    policy: str
    concurrency: int
    acceptance: float | None
    output_tokens: int
    wall_s: float
    steps: int
    step_ms: list[float]
    tpot_ms: list[float]
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    tokens: list[list[int]]

    def row(self) -> dict:
        return {
            "policy": self.policy, "concurrency": self.concurrency, "acceptance": self.acceptance,
            "output_tokens_per_s": self.output_tokens / self.wall_s, "steps": self.steps,
            "step_ms_median": statistics.median(self.step_ms) if self.step_ms else 0.0,
            "tpot_ms_median": statistics.median(self.tpot_ms) if self.tpot_ms else 0.0,
            "tpot_ms_p99": sorted(self.tpot_ms)[max(0, math.ceil(0.99 * len(self.tpot_ms)) - 1)] if self.tpot_ms else 0.0,
            "mean_accepted_len": (self.accepted_tokens / self.verify_steps) if self.verify_steps else 0.0,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
        }


def serve(runner: ModelRunner, prompts: list[list[int]], max_new: int, max_draft: int, page_size: int,
          num_pages: int, policy: str) -> RunResult:
    """Runs every prompt to completion through the engine's scheduler and the runner; all arrive at once."""
    runner.set_policy(policy if not policy.startswith("fixed") else "fixed", max_draft or 16)
    memory = MemoryManager(num_pages, page_size, len(prompts))
    sched = Scheduler(memory, len(prompts), max_step_tokens=8192, max_model_len=1 << 20,
                      max_draft=0 if policy == "ar" else max_draft)
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    step_ms, draft, acc, vsteps, steps = [], 0, 0, 0, 0
    first_token_s: dict[str, float] = {}
    done_s: dict[str, float] = {}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    while sched.has_work():
        plan = sched.schedule()
        work = []
        for c in plan.chunks:
            t = memory.table(c.request.request_id)
            work.append(StepRequest(c.request.request_id, c.request.all_ids[c.start:c.start + c.num_tokens], c.start,
                                    list(t.pages), t.slot, c.completes, c.request.params, c.draft_cap,
                                    c.request.all_ids if c.draft_cap else []))
        t0 = time.perf_counter()
        result = runner.execute(work)
        sync()
        now = time.perf_counter()
        step_ms.append((now - t0) * 1e3)
        steps += 1
        sched.commit(plan, result.accepted_tokens)
        draft += sum(result.draft_tokens.values())
        acc += sum(result.accepted_tokens.values())
        vsteps += len(result.draft_tokens)
        for c in plan.chunks:
            new = result.new_tokens.get(c.request.request_id)
            if not new:
                continue
            r = c.request
            room = r.params.max_new_tokens - len(r.output_ids)
            r.output_ids.extend(new[:room])
            first_token_s.setdefault(r.request_id, now)
            if len(r.output_ids) >= r.params.max_new_tokens:
                done_s[r.request_id] = now
                sched.finish(r, "length")
                runner.release([r.request_id])
    wall = time.perf_counter() - start
    tpot = [(done_s[r.request_id] - first_token_s[r.request_id]) * 1e3 / max(1, len(r.output_ids) - 1) for r in reqs]
    assert memory.stats()["used_pages"] == 0 and memory.stats()["used_slots"] == 0
    return RunResult(policy, len(prompts), None, sum(len(r.output_ids) for r in reqs), wall, steps, step_ms, tpot,
                     draft, acc, vsteps, [r.output_ids for r in reqs])


def floor_ms(cfg: ModelConfig, dtype_bytes: int, distinct_experts: float, requests: int, context: int) -> float:
    """Bytes that must cross HBM once in a decode/verify step, over 4.3 TB/s."""
    h, e_inner = cfg.hidden_size, cfg.moe_intermediate_size
    moe_layers = sum(cfg.moe_layers)
    expert_bytes = 3 * h * e_inner * dtype_bytes
    head = cfg.vocab_size * h  # the LM head is read once; the embedding is only a gather
    per_layer_dense = 3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts + 4 * h
    gdn = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    gdn_proj = h * (cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) + cfg.linear_value_dim * h
    attn_proj = h * (cfg.num_attention_heads * cfg.head_dim * 2 + 2 * cfg.num_key_value_heads * cfg.head_dim) \
        + cfg.num_attention_heads * cfg.head_dim * h
    weights = (head + cfg.num_hidden_layers * per_layer_dense + len(cfg.gdn_layers) * gdn_proj
               + len(cfg.attention_layers) * attn_proj) * dtype_bytes
    states = requests * len(cfg.gdn_layers) * gdn * 4 * 2
    kv = requests * context * ModelCache.kv_bytes_per_token(cfg, torch.bfloat16)
    return (weights + moe_layers * distinct_experts * expert_bytes + states + kv) / HBM_BYTES_PER_S * 1e3


def dump(out_dir: str, meta: dict, rows: list[dict]) -> None:
    """Written after every row, so a run cut short by its time limit still leaves its results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--acceptance", default="0.5,0.7,0.85,0.95")
    ap.add_argument("--policies", default="fixed4,fixed16,budget,hybridspec")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.tiny:
        target = build_bench_model(config=tiny_config(), routing="zipf", dtype=dtype, device=device)
    else:
        target = build_bench_model(num_layers=args.layers, routing="zipf", dtype=dtype, device=device)
    cfg = target.config
    page_size = 16
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    max_c = max(concurrencies)
    pages_per_req = -(-(args.prompt_len + args.max_new + 20) // page_size)
    num_pages = max_c * pages_per_req
    cache = ModelCache(cfg, num_pages, page_size, max_c, dtype, device)
    drafter_cost = DraftModelDrafter(drafter_model(cfg, args.drafter_layers, dtype, device), num_pages, page_size,
                                     max_c)
    runner = ModelRunner(target, cache)
    gen = torch.Generator().manual_seed(1)
    rows, meta = [], {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "dtype": str(dtype), "layers": cfg.num_hidden_layers, "prompt_len": args.prompt_len,
                      "max_new": args.max_new, "routing": "zipf", "drafter": "replay (DFlash-shaped cost: "
                      f"{args.drafter_layers} layers at hidden {cfg.hidden_size})"}
    for conc in concurrencies:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(conc)]
        runner.drafter = None
        serve(runner, prompts[:1], 4, 0, page_size, num_pages, "ar")  # warm-up
        ar = serve(runner, prompts, args.max_new, 0, page_size, num_pages, "ar")
        ar_row = ar.row()
        ar_row["floor_ms"] = floor_ms(cfg, 2 if dtype == torch.bfloat16 else 4, cfg.num_experts_per_tok * 1.0, conc,
                                      args.prompt_len + args.max_new // 2)
        rows.append(ar_row)
        print(f"c={conc} ar: {ar_row['output_tokens_per_s']:.1f} tok/s, step {ar_row['step_ms_median']:.2f} ms",
              flush=True)
        for acceptance in [float(a) for a in args.acceptance.split(",")]:
            replay = ReplayDrafter(acceptance, cfg.vocab_size, seed=7, cost_model=drafter_cost)
            for p, cont in zip(prompts, ar.tokens):
                replay.set_reference(p, cont)
            for policy in args.policies.split(","):
                k = int(policy[len("fixed"):]) if policy.startswith("fixed") else 16
                runner.drafter = replay
                res = serve(runner, prompts, args.max_new, k, page_size, num_pages, policy)
                res.policy, res.acceptance = policy, acceptance
                row = res.row()
                # lossless in fp32 (tests); in bf16 a verified block and a one-token decode round differently and
                # a near-tie can flip a token: record how often the output equals the greedy reference
                row["greedy_match"] = sum(a == b for a, b in zip(res.tokens, ar.tokens)) / len(ar.tokens)
                row["first_divergence_mean"] = statistics.mean(
                    next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(res.tokens, ar.tokens))
                row["speedup_vs_ar"] = row["output_tokens_per_s"] / ar_row["output_tokens_per_s"]
                rows.append(row)
                dump(args.out, meta, rows)
                print(f"c={conc} acc={acceptance} {policy}: {row['output_tokens_per_s']:.1f} tok/s "
                      f"({row['speedup_vs_ar']:.2f}x ar), mean accepted {row['mean_accepted_len']:.2f}", flush=True)
    dump(args.out, meta, rows)
    print("\n| policy | conc | replay acc | tok/s | x ar | step ms | tpot p50/p99 ms | mean acc len |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['concurrency']} | {r['acceptance'] if r['acceptance'] is not None else '-'} | "
              f"{r['output_tokens_per_s']:.1f} | {r.get('speedup_vs_ar', 1.0):.2f} | {r['step_ms_median']:.2f} | "
              f"{r['tpot_ms_median']:.1f}/{r['tpot_ms_p99']:.1f} | {r['mean_accepted_len']:.2f} |")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
