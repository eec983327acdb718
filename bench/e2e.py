"""End-to-end serving benchmark: policies x concurrency x replay acceptance on the bench model.

One command on the H200 (../shared/docs/benchmarking.md):
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
import gc
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.executor import freeze_heap  # noqa: E402
from scheduler.memory import MemoryManager  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.types import SamplingParams  # noqa: E402
from workers.bench_model import build_bench_model, qwen36_35b_a3b_config  # noqa: E402
from workers.cache import ModelCache  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.drafters import REPLAY_CONFIDENCE, REPLAY_DRAWS, DraftModelDrafter, ReplayDrafter  # noqa: E402
from workers.model import HybridModel  # noqa: E402
from workers.policy import LengthPolicy  # noqa: E402
from workers.random_init import init_random_  # noqa: E402
import workers.runner as runner_mod  # noqa: E402
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
    decode_tokens: int = 0  # output tokens of steps without a prefill chunk
    decode_s: float = 0.0  # their time
    captures: int = 0  # decode steps that captured a CUDA graph first (left out of decode_tokens / decode_s)
    step_tokens: list[int] = dataclasses.field(default_factory=list)  # verified tokens of each step in step_ms
    eager_steps: int = 0  # decode steps that ran eagerly with graphs on (a failed capture, a full graph set)
    draft_widths: dict[int, int] = dataclasses.field(default_factory=dict)  # drafted decode steps by drafts asked
    # output tokens and time of the decode steps that ran every request of the cell (the closed batch's tail,
    # where requests that finished early have left, is not in them)
    full_tokens: int = 0
    full_s: float = 0.0
    # host time between consecutive decode steps (the loop's scheduling and bookkeeping, outside runner.execute and
    # its sync: decode_s leaves it out) and how many such gaps
    between_s: float = 0.0
    between_gaps: int = 0
    # decode steps without drafts by the graph bucket they ran ("RxT block B pages P", "eager"): their step ms, to
    # tell a policy's plain steps from ar's in the same bucket (bench/NOTES.md, 2026-12-05 11:21 item 4)
    plain_ms_by_bucket: dict[str, list[float]] = dataclasses.field(default_factory=dict)


    def row(self) -> dict:
        return {
            "policy": self.policy, "concurrency": self.concurrency, "acceptance": self.acceptance,
            "output_tokens_per_s": self.output_tokens / self.wall_s, "steps": self.steps,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "full_batch_tokens_per_s": self.full_tokens / self.full_s if self.full_s else 0.0,
            "full_batch_step_share": self.full_s / self.decode_s if self.decode_s else 0.0,
            "between_steps_ms_mean": self.between_s * 1e3 / self.between_gaps if self.between_gaps else 0.0,
            # the decode phase with the host's time between its steps (what a serving loop's clock sees)
            "decode_with_between_tokens_per_s": (self.decode_tokens / (self.decode_s + self.between_s)
                                                 if self.decode_s else 0.0),
            "capture_steps": self.captures,
            "eager_decode_steps": self.eager_steps,
            "drafted_width_steps": dict(sorted(self.draft_widths.items())),
            "step_ms_median": statistics.median(self.step_ms) if self.step_ms else 0.0,
            "tpot_ms_median": statistics.median(self.tpot_ms) if self.tpot_ms else 0.0,
            "tpot_ms_p99": sorted(self.tpot_ms)[max(0, math.ceil(0.99 * len(self.tpot_ms)) - 1)] if self.tpot_ms else 0.0,
            "mean_accepted_len": (self.accepted_tokens / self.verify_steps) if self.verify_steps else 0.0,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "tokens_per_step_mean": statistics.fmean(self.step_tokens) if self.step_tokens else 0.0,
            "step_ms_by_tokens": step_ms_by_tokens(self.step_tokens, self.step_ms),
            "plain_step_ms_by_bucket": {k: [len(v), statistics.median(v)]
                                        for k, v in sorted(self.plain_ms_by_bucket.items())},
        }


def bucket_label(key) -> str:
    """A graph bucket as host_phases names it ("RxT block B pages P"); "eager" for a step without one."""
    if key is None:
        return "eager"
    return f"{key.requests}x{key.tokens} block {key.max_block} pages {key.pages}"


def step_ms_by_tokens(tokens: list[int], ms: list[float], max_bins: int = 24) -> dict[int, list[float]]:
    """Decode steps binned by their verified token count (bins of equal width, at most max_bins): the bin's
    lowest count -> [steps, median ms]. Policies compared at equal token counts: what a step costs apart from
    how long a block the policy chose."""
    if not tokens or len(tokens) != len(ms):
        return {}
    lo, hi = min(tokens), max(tokens)
    width = max(1, -(-(hi - lo + 1) // max_bins))
    bins: dict[int, list[float]] = {}
    for t, m in zip(tokens, ms):
        bins.setdefault(lo + (t - lo) // width * width, []).append(m)
    return {b: [len(v), statistics.median(v)] for b, v in sorted(bins.items())}


@dataclasses.dataclass
class Tally:
    """Drafted and accepted tokens and verified requests over a run."""

    draft: int = 0
    accepted: int = 0
    verified: int = 0


def apply_step(sched: Scheduler, plan, result, tally: Tally) -> list[tuple[Request, int, bool]]:
    """Commits a step's result: the scheduler learns the accepted lengths, each request takes its new tokens up to
    max_new_tokens and is finished when it has them all. -> (request, tokens taken, finished now) per request
    with new tokens (the caller releases the finished ones' worker state)."""
    sched.commit(plan, result.accepted_tokens, result.draft_cap_hint)
    tally.draft += sum(result.draft_tokens.values())
    tally.accepted += sum(result.accepted_tokens.values())
    tally.verified += len(result.draft_tokens)
    out = []
    for c in plan.chunks:
        new = result.new_tokens.get(c.request.request_id)
        if not new:
            continue
        r = c.request
        taken = new[:r.params.max_new_tokens - len(r.output_ids)]
        r.output_ids.extend(taken)
        done = len(r.output_ids) >= r.params.max_new_tokens
        if done:
            sched.finish(r, "length")
        out.append((r, len(taken), done))
    return out


def serve(runner: ModelRunner, prompts: list[list[int]], max_new: int, max_draft: int, page_size: int,
          num_pages: int, policy: str, keep_policy: bool = False) -> RunResult:
    """Runs every prompt to completion through the engine's scheduler and the runner; all arrive at once.
    `keep_policy`: continue with the runner's policy as it is (its latency model and calibration warmed by an
    earlier run, as in a server that has been running)."""
    if not keep_policy:
        runner.set_policy(policy if not policy.startswith("fixed") else "fixed", max_draft or 16)
    memory = MemoryManager(num_pages, page_size, len(prompts))
    sched = Scheduler(memory, len(prompts), max_step_tokens=8192, max_model_len=1 << 20,
                      max_draft=0 if policy == "ar" else max_draft)
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    step_ms, step_tokens, tally, steps, prefill_steps = [], [], Tally(), 0, []
    decode_tokens, captures, eager = 0, 0, 0
    full_tokens, full_steps = 0, set()  # decode steps that ran every request of the cell
    widths: dict[int, int] = {}
    plain_by_bucket: dict[str, list[float]] = {}
    first_token_s: dict[str, float] = {}
    done_s: dict[str, float] = {}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    between_s, between_gaps, last = 0.0, 0, None  # last: where the previous decode step's sync returned
    sync()
    start = time.perf_counter()
    while sched.has_work():
        plan = sched.schedule()
        work = sched.step_requests(plan)
        t0 = time.perf_counter()
        result = runner.execute(work)
        sync()
        now = time.perf_counter()
        step_ms.append((now - t0) * 1e3)
        step_tokens.append(sum(len(w.tokens) for w in work) + sum(result.draft_tokens.values()))
        if any(c.num_tokens > 1 or c.start < len(c.request.prompt_ids) for c in plan.chunks):
            prefill_steps.append(len(step_ms) - 1)
        elif getattr(runner, "last_step_captured", False):  # a one-time graph capture: not a decode step's time
            prefill_steps.append(len(step_ms) - 1)
            captures += 1
        elif getattr(runner, "last_step_eager", False):  # reported: an eager decode step is ~10x a graphed one
            eager += 1
        decode_step = prefill_steps[-1:] != [len(step_ms) - 1]
        if decode_step and last is not None:
            between_s, between_gaps = between_s + (t0 - last), between_gaps + 1
        last = now if decode_step else None
        if decode_step and getattr(runner, "last_draft_width", 0):
            widths[runner.last_draft_width] = widths.get(runner.last_draft_width, 0) + 1
        elif decode_step:
            plain_by_bucket.setdefault(bucket_label(getattr(runner, "last_step_key", None)), []).append(step_ms[-1])
        steps += 1
        full = decode_step and len(work) == len(prompts)
        if full:
            full_steps.add(len(step_ms) - 1)
        for r, taken, done in apply_step(sched, plan, result, tally):
            if decode_step:
                decode_tokens += taken
                full_tokens += taken if full else 0
            first_token_s.setdefault(r.request_id, now)
            if done:
                done_s[r.request_id] = now
                runner.release([r.request_id])
    wall = time.perf_counter() - start
    if hasattr(runner, "flush_learning"):
        runner.flush_learning()  # the last step's learning, deferred to a next step that does not come
    tpot = [(done_s[r.request_id] - first_token_s[r.request_id]) * 1e3 / max(1, len(r.output_ids) - 1) for r in reqs]
    assert memory.stats()["used_pages"] == 0 and memory.stats()["used_slots"] == 0
    pre = set(prefill_steps)
    decode_s = sum(ms for i, ms in enumerate(step_ms) if i not in pre) / 1e3
    full_s = sum(ms for i, ms in enumerate(step_ms) if i in full_steps) / 1e3  # (summed as decode_s: share <= 1)
    return RunResult(policy, len(prompts), None, sum(len(r.output_ids) for r in reqs), wall, steps,
                     [ms for i, ms in enumerate(step_ms) if i not in pre], tpot, tally.draft, tally.accepted,
                     tally.verified,
                     [r.output_ids for r in reqs], decode_tokens, decode_s, captures,
                     [t for i, t in enumerate(step_tokens) if i not in pre], eager, widths, full_tokens, full_s,
                     between_s, between_gaps, plain_by_bucket)


def measured_start(args) -> None:
    """Before a measured run: the heap frozen out of the cyclic GC as a started engine's (--freeze-heap 1), else
    one full collection (the same start, the heap left in the collector's generations)."""
    freeze_heap()
    if not args.freeze_heap:
        gc.unfreeze()  # (collected as frozen, then back in the collector's oldest generation)


def run_policy(runner: ModelRunner, policy: str, replay: ReplayDrafter, prompts: list[list[int]], conc: int,
               max_new: int, args, page_size: int, num_pages: int, learned: dict) -> RunResult:
    """One measured run of `policy` in a cell. The first run of a policy in the cell starts it as the engine does
    (the start-up profile for the learned policies, a warm-up run that captures its graph buckets and warms its
    latency model and calibration) and keeps its LengthPolicy in `learned`; later runs continue with it."""
    if policy == "ar":
        runner.drafter = None
        measured_start(args)  # every measured run starts as a started engine serves (engine/executor.py)
        return serve(runner, prompts, max_new, 0, page_size, num_pages, "ar")
    if policy == "ar-drafter":  # ar with the replay drafter attached (never asked: no drafts, no draft pages)
        runner.drafter = replay
        measured_start(args)
        res = serve(runner, prompts, max_new, 0, page_size, num_pages, "ar")
        res.policy = policy
        return res
    k = int(policy[len("fixed"):]) if policy.startswith("fixed") else 16
    runner.drafter = replay
    if policy in learned:
        runner.use_policy(learned[policy])
    else:
        runner.set_policy("fixed" if policy.startswith("fixed") else policy.split("-")[0], k)
        if policy.startswith("hybridspec-"):  # hybridspec with parts switched off (LengthPolicy.ablate)
            runner.policy.ablate(policy.split("-", 1)[1])
        if args.profile and policy.split("-")[0] in ("budget", "hybridspec"):
            runner.profile(conc)  # the engine's start-up profile (EngineConfig.startup_profile, on CUDA)
        # warm-up: captures this policy's graph buckets, refines its latency model and calibration
        serve(runner, prompts, args.warm_new, k, page_size, num_pages, policy, keep_policy=True)
        learned[policy] = runner.policy
    measured_start(args)
    res = serve(runner, prompts, max_new, k, page_size, num_pages, policy, keep_policy=True)
    res.policy = policy
    return res


def merge_runs(runs: list[RunResult]) -> RunResult:
    """One policy's runs of a cell as one: counts and times summed, step and TPOT samples pooled (tokens: the
    first run's; each run's are checked against the reference by the caller)."""
    first = runs[0]
    return dataclasses.replace(
        first, output_tokens=sum(r.output_tokens for r in runs), wall_s=sum(r.wall_s for r in runs),
        steps=sum(r.steps for r in runs), step_ms=[x for r in runs for x in r.step_ms],
        tpot_ms=[x for r in runs for x in r.tpot_ms], draft_tokens=sum(r.draft_tokens for r in runs),
        accepted_tokens=sum(r.accepted_tokens for r in runs), verify_steps=sum(r.verify_steps for r in runs),
        decode_tokens=sum(r.decode_tokens for r in runs), decode_s=sum(r.decode_s for r in runs),
        captures=sum(r.captures for r in runs), step_tokens=[x for r in runs for x in r.step_tokens],
        eager_steps=sum(r.eager_steps for r in runs),
        draft_widths={w: sum(r.draft_widths.get(w, 0) for r in runs)
                      for w in {w for r in runs for w in r.draft_widths}},
        full_tokens=sum(r.full_tokens for r in runs), full_s=sum(r.full_s for r in runs),
        between_s=sum(r.between_s for r in runs), between_gaps=sum(r.between_gaps for r in runs),
        plain_ms_by_bucket={k: [x for r in runs for x in r.plain_ms_by_bucket.get(k, [])]
                            for k in {k for r in runs for k in r.plain_ms_by_bucket}})


def run_rates(runs: list[RunResult]) -> list[float]:
    """Decode tokens/s of each run (their spread is the cell's run-to-run noise)."""
    return [r.decode_tokens / r.decode_s if r.decode_s else 0.0 for r in runs]


def policy_report(policy: LengthPolicy, name: str, conc: int) -> dict:
    """What a learned policy reports after its runs of a cell: latency-model and plan errors, the gate's share,
    the measured step overhead, the router correction's keep counts, hybridspec's cost table and profile scale."""
    row: dict = {}
    err = policy.latency.error_stats()  # prequential: each step predicted before it ran
    # over the model's last `window` (512) samples
    row["latency_model_error_pct"] = {"n": err.n, "mean": err.mean_abs_pct, "p90": err.p90_abs_pct,
                                      "max": err.max_abs_pct}
    # the worst samples of every step the model observed (the warm-up's included, beyond the window): [abs %,
    # index, predicted ms, measured ms, features]
    row["latency_model_worst"] = [[round(v, 4) if isinstance(v, float) else v for v in w[:4]] + [w[4]]
                                  for w in policy.latency.worst]
    row["latency_model_observed"] = policy.latency.observed
    if policy.latency.coefs is not None:
        row["latency_coefs"] = dataclasses.asdict(policy.latency.coefs)
    if policy.gate is not None:
        row["speculative_step_share"] = policy.gate.speculative_share()
        # per batch-size bucket: [speculative, plain] output tokens per ms per request and the samples the bucket
        # measured itself (inherited ones not counted)
        gate = policy.gate
        row["gate_rates"] = {b: [gate.rate.get((b, s)) for s in (True, False)] +
                             [gate.own.get((b, s), 0) for s in (True, False)]
                             for b in sorted({b for b, _ in gate.rate})}
        # per bucket: output / expected tokens of the drafted steps the gate counted (1: its speculative rate is
        # the cell's; above or below: the gate's side is pessimistic or optimistic) and their expected tokens
        row["gate_token_ratio"] = {b: [out / exp if exp else None, exp]
                                   for b, (out, exp) in sorted(policy.gate_tokens.items())}
        # per bucket: [speculative, plain] pooled rate over all the bucket's own cycles (sum of tokens per request /
        # sum of cycle ms: what the cell gets, where the EWMA above is what the gate decided on)
        row["gate_pooled_rates"] = {b: [tok / ms if ms else None for tok, ms in
                                        (gate.pooled.get((b, s), (0.0, 0.0)) for s in (True, False))]
                                    for b in sorted({b for b, _ in gate.pooled})}
        # the gate's recent cycles per bucket and side: [count, ms p10 / p50 / p90, mean tokens per request]
        cyc: dict[tuple[int, bool], list[tuple[float, float]]] = {}
        for b, drafted, tok, ms in gate.cycles:
            cyc.setdefault((b, drafted), []).append((tok, ms))
        row["gate_cycle_ms"] = {f"{b}{'s' if d else 'p'}": [len(v)] + [
            float(np.percentile([ms for _, ms in v], q)) for q in (10, 50, 90)] + [sum(t for t, _ in v) / len(v)]
            for (b, d), v in sorted(cyc.items())}
        row["gate_dropped_cycles"] = policy.gate_dropped  # never read: their events re-recorded first
        row["gate_hint_misses"] = policy.gate_hint_misses  # drafted by the gate after a draft-cap hint of 0
        # mean device ms after a [speculative, plain] step's end mark that no cycle holds, and their counts
        row["gate_between_ms"] = [[t[0] / t[1] if t[1] else None, t[1]] for t in
                                  (policy.gate_between.get(s, (0.0, 0)) for s in (True, False))]
    row["draft_overhead_ms"] = dict(policy.draft_overhead_ms)
    if policy.draft_costs:  # every drafting policy: the drafter's ms by rows drafted, the rest of a drafted step
        row["draft_cost_ms"] = {b: dict(zip(c.table.tokens, c.table.step_ms)) for b, c in policy.draft_costs.items()}
        row["rest_overhead_ms"] = dict(policy.rest_overhead_ms)
    if policy.planned_max:  # hybridspec: its plans' longest lengths (width_plan's choices)
        row["planned_max_recent"] = {b: list(w) for b, w in policy.planned_max.items()}
    pstats = policy.stats()
    for key in ("plan_step_bias_pct", "plan_step_abs_pct"):
        if key in pstats:
            row[key] = pstats[key]
    if policy.extra_keep:  # the router correction's (kept, sent) extra tokens, decayed, per bucket
        row["extra_keep"] = {b: list(v) for b, v in policy.extra_keep.items()}
    eg = policy.extra_gate
    if eg is not None and sum(eg.decisions):  # ExtraGate: share of extras verdicts; per bucket [rate with extras,
        # rate without (output tokens per ms per request), samples with, without]
        row["extra_verdict_share"] = eg.share()
        row["extra_gate_rates"] = {b: [eg.rate(b, True), eg.rate(b, False), eg.samples.get((b, True), 0),
                                       eg.samples.get((b, False), 0)] for b in sorted({b for b, _ in eg.samples})}
    if name.startswith("hybridspec"):  # its forward cost at the cell's batch size, profile scale
        table = policy.cost_table(conc)
        if table is not None:
            row["cost_table_ms"] = {t: table.cost_ms(t) for t in table.tokens}
        row["profile_scale"] = dict(policy.profile_scale)
    return row


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


def speedup_table(rows: list[dict], key: str = "decode_tokens_per_s") -> list[dict]:
    """One row per (concurrency, acceptance): every policy's tok/s over ar's, fixed-best = the best fixed K."""
    # ar of the cell where it ran in the cell's rounds (--repeats), else of the concurrency
    ar = {(r["concurrency"], r["acceptance"]): r[key] for r in rows if r["policy"] == "ar"}
    cells: dict[tuple, dict] = {}
    for r in rows:
        if r["policy"] == "ar" or r["acceptance"] is None:
            continue
        cell = cells.setdefault((r["concurrency"], r["acceptance"]), {"concurrency": r["concurrency"],
                                                                       "acceptance": r["acceptance"]})
        base = ar.get((r["concurrency"], r["acceptance"])) or ar.get((r["concurrency"], None))
        x = r[key] / base if base else 0.0
        cell[r["policy"]] = x
        if r["policy"].startswith("fixed") and x > cell.get("fixed-best", (0.0, ""))[0]:
            cell["fixed-best"] = (x, r["policy"])
    return [cells[k] for k in sorted(cells)]


def main() -> None:
    # warnings reach stderr: a failed graph capture names its bucket and error there (run 25 lost them)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--acceptance", default="0.5,0.7,0.85,0.95")
    ap.add_argument("--policies", default="fixed2,fixed4,fixed8,fixed16,budget,hybridspec")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=256,
                    help="output tokens per request (../shared/docs/benchmarking.md: 256)")
    ap.add_argument("--cell-tokens", type=int, default=1024,
                    help="at least this many output tokens per cell: requests get max(max-new, cell-tokens / c)")
    ap.add_argument("--warm-new", type=int, default=32, help="tokens of the warm-up run before each measured run")
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--graphs", type=int, default=1, help="CUDA graphs for decode/verify steps (1) or eager (0)")
    ap.add_argument("--time-limit-s", type=float, default=1e9, help="stop starting new cells after this long")
    ap.add_argument("--replay-confidence", default="noise", choices=REPLAY_CONFIDENCE,
                    help="noise: every draft equally likely right, confidence uninformative; beta: per-token "
                         "acceptance ~ Beta(mean acceptance), the confidence reports it (workers/drafters.py)")
    ap.add_argument("--replay-concentration", type=float, default=2.0, help="Beta concentration (beta confidence)")
    ap.add_argument("--replay-draws", default="auto", choices=("auto",) + REPLAY_DRAWS,
                    help="common: a draft's right/wrong (and with beta its p and confidence) fixed per (request, "
                         "position), the same for every policy (common random numbers); stream: drawn in turn; "
                         "auto: common")

    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every policy per cell, in alternating order, ar among them when > 1 (a row sums "
                         "its runs; runs_decode_tokens_per_s lists each)")
    ap.add_argument("--profile", type=int, default=1,
                    help="run the start-up profile before budget/hybridspec (1, as the engine does on CUDA) or not (0)")
    ap.add_argument("--freeze-heap", type=int, default=1, choices=(0, 1),
                    help="freeze the heap out of Python's cyclic GC before every measured run (1, as a started engine "
                         "on CUDA does: EngineConfig.freeze_heap) or not (0: its A/B)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if "ar" in args.policies.split(","):
        ap.error("--policies: ar always runs (it is every cell's reference); list the others")
    draws = args.replay_draws if args.replay_draws != "auto" else "common"
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    # decisive logits: greedy tokens do not flip under bf16 batch-shape rounding, so the replay reference holds
    if args.tiny:
        target = build_bench_model(config=tiny_config(), routing="zipf", dtype=dtype, device=device, decisive=True)
    else:
        target = build_bench_model(num_layers=args.layers, routing="zipf", dtype=dtype, device=device, decisive=True)
    cfg = target.config
    page_size = 16
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    policies = args.policies.split(",")
    max_c = max(concurrencies)
    max_k = max([int(p[len("fixed"):]) for p in policies if p.startswith("fixed")] + [16])
    max_new_of = {c: max(args.max_new, -(-args.cell_tokens // c)) for c in concurrencies}  # short cells are noisy
    pages_per_req = -(-(args.prompt_len + max(max_new_of.values()) + max_k + 4) // page_size)
    num_pages = max_c * pages_per_req
    cache = ModelCache(cfg, num_pages + 1, page_size, max_c + 1, dtype, device)  # + the graphs' spare page/slot
    drafter_cost = DraftModelDrafter(drafter_model(cfg, args.drafter_layers, dtype, device), num_pages, page_size,
                                     max_c)
    runner = ModelRunner(target, cache)
    # every policy's graph set stays captured between rounds (the engine keeps MAX_GRAPH_SETS: it serves one policy)
    runner_mod.MAX_GRAPH_SETS = max(runner_mod.MAX_GRAPH_SETS, len(args.policies.split(",")) + 1)
    use_graphs = bool(args.graphs) and (device == "cuda" or args.tiny)
    if use_graphs:
        capture = device == "cuda"
        why = runner.enable_graphs(max_c, pages_per_req, warm=False, capture=capture)
        assert why is None, why
        drafter_cost.enable_graphs(max_c, pages_per_req, max_k + 1, capture=capture)
    gen = torch.Generator().manual_seed(1)
    rows, meta = [], {"commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "dtype": str(dtype), "layers": cfg.num_hidden_layers, "prompt_len": args.prompt_len,
                      "max_new": max_new_of, "routing": "zipf", "graphs": use_graphs, "decisive_logits": True,
                      "startup_profile": bool(args.profile), "freeze_heap": bool(args.freeze_heap), "replay_confidence": args.replay_confidence,
                      "replay_concentration": args.replay_concentration, "replay_draws": draws,
                      "replay_common_chunk": ReplayDrafter.COMMON_CHUNK,
                      "drafter": "replay (DFlash-shaped cost: "
                      f"{args.drafter_layers} layers at hidden {cfg.hidden_size}, one forward of the drafted block)"}
    for conc in concurrencies:
        if time.perf_counter() - t_start > args.time_limit_s:
            print(f"time limit: skipping concurrency {conc}", flush=True)
            break
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(conc)]
        runner.drafter = None
        serve(runner, prompts, args.warm_new, 0, page_size, num_pages, "ar")  # warm-up (graph capture)
        max_new = max_new_of[conc]
        ar = serve(runner, prompts, max_new, 0, page_size, num_pages, "ar")
        ar_row = ar.row()
        ar_row["floor_ms"] = floor_ms(cfg, 2 if dtype == torch.bfloat16 else 4, cfg.num_experts_per_tok * 1.0, conc,
                                      args.prompt_len + max_new // 2)
        ar_row["step_over_floor"] = ar_row["step_ms_median"] / ar_row["floor_ms"]
        rows.append(ar_row)
        print(f"c={conc} ar: {ar_row['decode_tokens_per_s']:.1f} tok/s (decode), step {ar_row['step_ms_median']:.2f} "
              f"ms = {ar_row['step_over_floor']:.1f}x floor", flush=True)
        for acceptance in [float(a) for a in args.acceptance.split(",")]:
            if time.perf_counter() - t_start > args.time_limit_s:
                break
            replay = ReplayDrafter(acceptance, cfg.vocab_size, seed=7, cost_model=drafter_cost,
                                   confidence=args.replay_confidence, concentration=args.replay_concentration,
                                   draws=draws)
            for p, cont in zip(prompts, ar.tokens):
                replay.set_reference(p, cont + [0] * (max_k + 2))  # room to draft past the end (never accepted)
            # rounds: every policy once per round, in the reverse order every other round (a drift of the GPU's or
            # host's speed over the cell then lands on every policy alike); ar runs in the rounds too (each cell's
            # speedups are over its own ar: measured only once per concurrency, a drift over the cells landed on
            # the later policies alone) and each policy's row sums its runs. A policy keeps its learned state from
            # round to round.
            order = ["ar"] + policies
            runs: dict[str, list[RunResult]] = {}
            learned: dict[str, LengthPolicy] = {}
            for rep in range(args.repeats):
                for policy in (order if rep % 2 == 0 else order[::-1]):
                    runs.setdefault(policy, []).append(
                        run_policy(runner, policy, replay, prompts, conc, max_new, args, page_size, num_pages,
                                   learned))
            ar_cell = merge_runs(runs["ar"]).row() if "ar" in runs else ar_row
            if "ar" in runs:
                ar_cell["acceptance"] = acceptance
                ar_cell["runs_decode_tokens_per_s"] = run_rates(runs["ar"])
                rows.append(ar_cell)
            for policy in policies:
                res = merge_runs(runs[policy])
                res.acceptance = acceptance
                row = res.row()
                row["runs_decode_tokens_per_s"] = run_rates(runs[policy])
                row["greedy_match"] = min(sum(a == b for a, b in zip(r.tokens, ar.tokens)) / len(ar.tokens)
                                          for r in runs[policy])
                row["first_divergence_mean"] = min(statistics.mean(
                    next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    for a, b in zip(r.tokens, ar.tokens)) for r in runs[policy])
                row["speedup_vs_ar"] = row["decode_tokens_per_s"] / ar_cell["decode_tokens_per_s"]
                full_ar = ar_cell.get("full_batch_tokens_per_s")
                if full_ar and row["full_batch_tokens_per_s"]:  # the same over the steps that ran the whole batch
                    # (the closed batch's tail left out)
                    row["full_batch_speedup_vs_ar"] = row["full_batch_tokens_per_s"] / full_ar
                if ar_cell.get("decode_with_between_tokens_per_s"):  # with the host's time between steps
                    row["with_between_speedup_vs_ar"] = (row["decode_with_between_tokens_per_s"]
                                                         / ar_cell["decode_with_between_tokens_per_s"])
                if policy in learned:  # (ar-drafter keeps no policy of its own)
                    row.update(policy_report(learned[policy], policy, conc))
                rows.append(row)
                dump(args.out, meta, rows)
                print(f"c={conc} acc={acceptance} {policy}: {row['decode_tokens_per_s']:.1f} tok/s "
                      f"({row['speedup_vs_ar']:.2f}x ar; runs "
                      f"{', '.join(f'{x:.0f}' for x in row['runs_decode_tokens_per_s'])}), step "
                      f"{row['step_ms_median']:.2f} ms, mean accepted {row['mean_accepted_len']:.2f}, greedy match "
                      f"{row['greedy_match']:.2f}", flush=True)
    meta["wall_s"] = time.perf_counter() - t_start
    if use_graphs and device == "cuda":
        meta["graphs_captured"] = runner.graph_captures()
    dump(args.out, meta, rows)
    print("\n| policy | conc | replay acc | decode tok/s | x ar | step ms | tpot p50/p99 ms | mean acc len | match |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['concurrency']} | {r['acceptance'] if r['acceptance'] is not None else '-'} | "
              f"{r['decode_tokens_per_s']:.1f} | {r.get('speedup_vs_ar', 1.0):.2f} | {r['step_ms_median']:.2f} | "
              f"{r['tpot_ms_median']:.1f}/{r['tpot_ms_p99']:.1f} | {r['mean_accepted_len']:.2f} | "
              f"{r.get('greedy_match', 1.0):.2f} |")
    print("\nspeedup over ar (decode phase):")
    for c in speedup_table(rows):
        fb = c.get("fixed-best", (0.0, "-"))
        print(f"c={c['concurrency']} acc={c['acceptance']}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in c.items() if isinstance(v, float) and k not in ("acceptance",))
            + f", fixed-best {fb[0]:.2f} ({fb[1]})")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
