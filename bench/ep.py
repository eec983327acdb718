"""Expert-parallel benchmark: EP=N GPUs vs one GPU on the bench model (Qwen3.6-35B-A3B shapes, random bf16
weights, Zipf router), `ar` vs `hybridspec` (replay drafter), concurrency 16 and 64.

    PYTHONPATH=. python bench/ep.py --gpus 2 --layers 16 --out $OUT        (2 H200s, a few minutes)
    PYTHONPATH=. python bench/ep.py --tiny --out /tmp/ep                     (CPU + gloo, toy sizes: tests)

Processes: torch.multiprocessing spawn with NCCL (gloo on CPU), not Ray: Ray's start-up costs seconds per actor
and the bench only needs the collectives; the engine's EP path (engine/ep_executor.py) runs the same per-rank code
(workers/expert_parallel.py: shard_model_, execute_rank). Phase 1: one process, the whole model on GPU 0, no EP.
Phase 2: N processes, each builds the same random weights from the same seed, then keeps its experts (even split,
or `--placement popularity`: rank 0 measures routed-token counts per layer on the prompts' prefill and the
placement balances them). Every rank runs the engine's scheduler over all requests (it is deterministic), executes
its own requests (request i on rank i % N; an idle rank only takes part in the exchanges), and the step results
are all-gathered over a side gloo group; every rank also computes every rank's row bound for the step
(`step_rows_bound`), which sizes the MoE exchanges' static all-to-alls (no host sync in the layers). Eager (no
CUDA graphs) in both phases: graphs under EP are not done (`--single-graphs` gives the single GPU its CUDA graphs,
the engine's best there).

Warm-up covers what is timed: before each timed (phase, policy, concurrency) cell the same workload runs once
untimed (same prompts, policy, draft cap and --max-new; `--warm-new N` shortens it). Eager steps see the
speculative shapes (ragged T_i = 1..17, token totals, batch sizes, contexts); a Triton kernel meets each of its
compile keys first in the warm-up, not in a timed step (a JIT compile costs 0.3-1 s on the H200: with a 16-token
warm-up, hybridspec c=16 measured a 519 ms median step on one GPU). The hybridspec timed run continues the
warm-up's latency model and calibration (keep_policy), as a server that has been running. Its lengths are chosen
online, so the warm-up covers the timed shapes in distribution, not step for step: each row reports
`jit_compiles`, the Triton kernels compiled (or loaded from the on-disk cache) in the process during the timed run
(Triton's jit_cache_hook; 0 when the warm-up covered it; the kernels' compile keys are bounded,
tests/test_specializations.py), and a warning is logged when it is not 0.

Reported per (phase, policy, concurrency): output tokens/s over the run, median step ms, and the share of step
time in the MoE collectives (CUDA events around each all-to-all / all-reduce; it includes waiting for the slowest
rank). JSON goes to --out/ep.json after every row (a run cut short keeps its rows); a table is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[ep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JitCounter:
    """Triton kernels this process compiles from now on: Triton calls `knobs.runtime.jit_cache_hook` once per
    kernel key that is not yet in the process's in-memory cache (a compile, or a load from the on-disk cache),
    before it compiles. Chains to a hook set before it. Without triton it counts nothing."""

    def __init__(self):
        self.count = 0
        self.kernels: dict[str, int] = {}
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no triton (references only)
            return
        prev = knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.count += 1
            name = str(kwargs.get("repr", "?")).split("[", 1)[0]
            self.kernels[name] = self.kernels.get(name, 0) + 1
            return prev(*args, **kwargs) if prev is not None else None

        knobs.runtime.jit_cache_hook = hook


def tiny_config():
    from workers.bench_model import qwen36_35b_a3b_config

    cfg = qwen36_35b_a3b_config(4, vocab_size=512)
    return dataclasses.replace(cfg, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32)


def build_model(args, device: str, dtype: torch.dtype):
    from workers.bench_model import build_bench_model

    kwargs = {"routing": "zipf", "dtype": dtype, "device": device, "seed": 0}
    if "decisive" in inspect.signature(build_bench_model).parameters:
        kwargs["decisive"] = True  # greedy tokens robust to bf16 batch-shape rounding (the replay reference holds)
    if args.tiny:
        return build_bench_model(config=tiny_config(), **kwargs)
    return build_bench_model(num_layers=args.layers, **kwargs)


def drafter_model(cfg, layers: int, dtype, device):
    """DFlash-shaped drafter cost (as bench/e2e.py): a few layers at the target's hidden size, dense MLPs."""
    from workers.model import HybridModel
    from workers.random_init import init_random_

    dcfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=["full_attention"] * layers,
                               moe_layers=[False] * layers, intermediate_size=4 * cfg.hidden_size)
    return init_random_(HybridModel(dcfg, dtype, device), seed=99)


class Rank:
    """One process: its model (sharded when world > 1), runner, and the loop."""

    def __init__(self, rank: int, world: int, port: int, args):
        self.rank, self.world, self.args = rank, world, args
        gpu = torch.cuda.is_available() and not args.tiny
        self.device = f"cuda:{rank}" if gpu else "cpu"
        if not gpu:
            torch.set_num_threads(1)
        self.dtype = torch.bfloat16 if gpu else torch.float32
        self.ep = world > 1
        self.objects = None
        self.jit = JitCounter()
        if self.ep:
            import torch.distributed as dist

            from workers.expert_parallel import init_group

            init_group(rank, world, f"tcp://127.0.0.1:{port}", self.device, timeout_s=300)
            self.objects = dist.new_group(backend="gloo")  # host objects (step results) beside NCCL
        t0 = time.perf_counter()
        self.model = build_model(args, self.device, self.dtype)
        self.cfg = self.model.config
        if rank == 0:
            log(f"world {world}: model built in {time.perf_counter() - t0:.1f}s "
                f"({self.cfg.num_hidden_layers} layers, {self.cfg.num_experts} experts)")

    def setup(self, prompts_by_conc: dict[int, list[list[int]]]) -> None:
        from workers.cache import ModelCache
        from workers.drafters import DraftModelDrafter
        from workers.runner import ModelRunner

        args = self.args
        self.page_size = 16
        max_c = max(prompts_by_conc)
        pages_per_req = -(-(args.prompt_len + args.max_new + 16 + 4) // self.page_size)
        self.num_pages = max_c * pages_per_req
        cache = ModelCache(self.cfg, self.num_pages + 1, self.page_size, max_c + 1, self.dtype, self.device)
        self.runner = ModelRunner(self.model, cache)
        self.graphs = False
        if not self.ep and args.single_graphs and self.device.startswith("cuda"):  # the single GPU at its best
            why = self.runner.enable_graphs(max_c, pages_per_req, warm=False)
            self.graphs = why is None
            log(f"single GPU: CUDA graphs {'on' if self.graphs else 'off: ' + str(why)}")
        self.placement = None
        if self.ep:
            import torch.distributed as dist

            from workers.expert_parallel import popularity_placement, set_timing, shard_model_

            if args.placement == "popularity":
                counts = [None]
                if self.rank == 0:
                    counts[0] = self.measure_popularity(prompts_by_conc[max_c])
                dist.broadcast_object_list(counts, src=0, group=self.objects)
                self.placement = [popularity_placement(c, self.world) for c in counts[0]]
            shard_model_(self.model, placement=self.placement)
            if args.exchange == "dynamic":  # the previous exchange: split sizes read on the host in every layer
                from workers.expert_parallel import moe_layers
                for mlp in moe_layers(self.model):
                    mlp.ep.static = False
            set_timing(self.model, True)
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        self.drafter_cost = DraftModelDrafter(drafter_model(self.cfg, args.drafter_layers, self.dtype, self.device),
                                              self.num_pages, self.page_size, max_c)

    def measure_popularity(self, prompts: list[list[int]]) -> list[list[float]]:
        """Routed tokens per expert and MoE layer over one prefill of `prompts` (the full model, before sharding)."""
        from scheduler.types import SamplingParams, StepRequest
        from workers.expert_parallel import moe_layers

        layers = moe_layers(self.model)
        counts = [torch.zeros(self.cfg.num_experts, dtype=torch.float64) for _ in layers]
        originals = [m.route for m in layers]
        for m, c, route in zip(layers, counts, originals):
            def counted(x, _route=route, _c=c):
                w, ids = _route(x)
                _c += torch.bincount(ids.reshape(-1), minlength=self.cfg.num_experts).double().cpu()
                return w, ids
            m.route = counted
        try:
            per = -(-self.args.prompt_len // self.page_size)
            work = [StepRequest(f"p{i}", p, 0, list(range(i * per, (i + 1) * per)), i, False, SamplingParams())
                    for i, p in enumerate(prompts)]
            self.runner.execute(work)
        finally:
            for m in layers:
                del m.route
        return [c.tolist() for c in counts]

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def serve(self, prompts: list[list[int]], max_new: int, max_draft: int, policy: str, keep_policy: bool = False):
        """The engine's scheduler over every request; this rank executes request i when i % world == rank."""
        import torch.distributed as dist

        from scheduler.memory import MemoryManager
        from scheduler.request import Request
        from scheduler.scheduler import Scheduler
        from bench.e2e import Tally, apply_step
        from scheduler.types import SamplingParams, StepResult
        from workers.expert_parallel import comm_ms, execute_rank, step_rows_bound

        runner = self.runner
        if not keep_policy:
            runner.set_policy(policy, max_draft or 16)
        memory = MemoryManager(self.num_pages, self.page_size, len(prompts))
        sched = Scheduler(memory, len(prompts), max_step_tokens=8192, max_model_len=1 << 20,
                          max_draft=0 if policy == "ar" else max_draft)
        reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
        owner = {r.request_id: i % self.world for i, r in enumerate(reqs)}
        for r in reqs:
            sched.add(r)
        step_ms, comm, tally, out_tokens = [], [], Tally(), 0
        if self.ep:
            comm_ms(self.model)  # drop what earlier runs left
        self.sync()
        jit0, jit_kernels0 = self.jit.count, dict(self.jit.kernels)
        start = time.perf_counter()
        while sched.has_work():
            plan = sched.schedule()
            work = sched.step_requests(plan)
            t0 = time.perf_counter()
            if self.ep:
                per_rank = [[w for w in work if owner[w.request_id] == r] for r in range(self.world)]
                rows = [step_rows_bound(p) for p in per_rank]  # every rank runs this scheduler: same list
                mine, _ = execute_rank(runner, per_rank[self.rank], rows)
                self.sync()
                parts: list = [None] * self.world
                dist.all_gather_object(parts, mine, group=self.objects)
                result = StepResult.merged(parts)  # (from every rank: each rank's scheduler copy stays the same)
                comm.append(comm_ms(self.model))
            else:
                result = runner.execute(work)
                self.sync()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            for r, taken, done in apply_step(sched, plan, result, tally):
                out_tokens += taken
                if done and (owner[r.request_id] == self.rank or not self.ep):
                    runner.release([r.request_id])
        wall = time.perf_counter() - start
        jit_new = {k: v - jit_kernels0.get(k, 0) for k, v in self.jit.kernels.items() if v > jit_kernels0.get(k, 0)}
        return {
            "policy": policy, "concurrency": len(prompts), "world": self.world, "output_tokens": out_tokens,
            "wall_s": wall, "output_tokens_per_s": out_tokens / wall, "steps": len(step_ms),
            "step_ms_median": statistics.median(step_ms), "comm_ms_total": sum(comm),
            "comm_share": sum(comm) / sum(step_ms) if comm else 0.0,
            "mean_accepted_len": tally.accepted / tally.verified if tally.verified else 0.0,
            "draft_tokens": tally.draft, "accepted_tokens": tally.accepted,
            "graphs": self.graphs, "jit_compiles": self.jit.count - jit0, "jit_kernels": jit_new,
        }, [r.output_ids for r in reqs]


def check_warm(rank: int, row: dict) -> None:
    if row["jit_compiles"]:
        log(f"rank {rank}: WARNING {row['jit_compiles']} Triton JIT compile(s) inside the timed {row['policy']} "
            f"c={row['concurrency']} run (not covered by the warm-up): {row['jit_kernels']}")


def rank_main(rank: int, world: int, port: int, args, result_path: str) -> None:
    try:
        _rank_main(rank, world, port, args, result_path)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        raise


def _rank_main(rank: int, world: int, port: int, args, result_path: str) -> None:
    from workers.drafters import ReplayDrafter

    t_start = time.perf_counter()
    me = Rank(rank, world, port, args)
    gen = torch.Generator().manual_seed(1)
    concs = [int(c) for c in args.concurrency.split(",")]
    prompts_by_conc = {c: [torch.randint(0, me.cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
                           for _ in range(c)] for c in concs}
    me.setup(prompts_by_conc)
    rows, tokens = [], {}
    for conc in concs:
        over = [time.perf_counter() - t_start > args.time_limit_s]
        if me.objects is not None:  # one decision for all ranks (rank 0's clock), else they would leave apart
            import torch.distributed as dist

            dist.broadcast_object_list(over, src=0, group=me.objects)
        if over[0]:
            if rank == 0:
                log(f"world {world}: time limit, skipping concurrency {conc}")
            break
        prompts = prompts_by_conc[conc]
        warm_new = args.warm_new or args.max_new  # the timed workload itself (module docstring)
        me.runner.drafter = None
        me.serve(prompts, warm_new, 0, "ar")  # warm-up: every compile key of the timed ar run
        ar, ar_tokens = me.serve(prompts, args.max_new, 0, "ar")
        check_warm(rank, ar)
        tokens[conc] = ar_tokens
        rows.append(ar)
        if rank == 0:
            log(f"world {world} c={conc} ar: {ar['output_tokens_per_s']:.1f} tok/s, step {ar['step_ms_median']:.2f} "
                f"ms, collectives {100 * ar['comm_share']:.1f}%")
        replay = ReplayDrafter(args.acceptance, me.cfg.vocab_size, seed=7, cost_model=me.drafter_cost)
        for p, cont in zip(prompts, ar_tokens):
            replay.set_reference(p, cont + [0] * 18)
        me.runner.drafter = replay
        # warm-up: the same workload (its compile keys; it also fits the latency model and the calibration)
        me.serve(prompts, warm_new, 16, "hybridspec")
        hs, hs_tokens = me.serve(prompts, args.max_new, 16, "hybridspec", keep_policy=True)
        check_warm(rank, hs)
        hs["greedy_match_vs_ar"] = sum(a == b for a, b in zip(hs_tokens, ar_tokens)) / len(ar_tokens)
        rows.append(hs)
        if rank == 0:
            log(f"world {world} c={conc} hybridspec: {hs['output_tokens_per_s']:.1f} tok/s "
                f"({hs['output_tokens_per_s'] / ar['output_tokens_per_s']:.2f}x ar), step {hs['step_ms_median']:.2f}"
                f" ms, mean accepted {hs['mean_accepted_len']:.2f}, collectives {100 * hs['comm_share']:.1f}%")
            Path(result_path).write_text(json.dumps({"rows": rows, "ar_tokens": {str(k): v for k, v in tokens.items()},
                                                     "placement": me.placement}))
    if rank == 0:
        Path(result_path).write_text(json.dumps({"rows": rows, "ar_tokens": {str(k): v for k, v in tokens.items()},
                                                 "placement": me.placement, "done": True}))
    if me.ep:
        import torch.distributed as dist

        dist.barrier(group=me.objects)
        dist.destroy_process_group()


def run_phase(world: int, args, out: Path) -> dict:
    import torch.multiprocessing as mp

    path = str(out / f"ep_world{world}.partial.json")
    if os.path.exists(path):
        os.remove(path)
    log(f"phase: world {world}")
    t0 = time.perf_counter()
    try:
        mp.spawn(rank_main, args=(world, free_port(), args, path), nprocs=world, join=True)
    except Exception as e:  # noqa: BLE001 - keep what the phase wrote
        log(f"world {world} failed: {type(e).__name__}: {e}")
    log(f"world {world}: {time.perf_counter() - t0:.1f}s")
    return json.loads(Path(path).read_text()) if os.path.exists(path) else {"rows": [], "ar_tokens": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="expert-parallel world size (default 2)")
    ap.add_argument("--layers", type=int, default=16, help="bench model layers (40 = the full model)")
    ap.add_argument("--tiny", action="store_true", help="CPU + gloo, toy sizes (tests)")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--warm-new", type=int, default=0,
                    help="tokens per request of the untimed warm-up before each timed cell (0: --max-new, the "
                    "timed workload itself)")
    ap.add_argument("--acceptance", type=float, default=0.85, help="replay drafter acceptance")
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--placement", default="even", choices=["even", "popularity"])
    ap.add_argument("--exchange", default="static", choices=["static", "dynamic"],
                    help="static: host-known capacities, no sync in the layers; dynamic: exact splits read per layer")
    ap.add_argument("--skip-single", action="store_true", help="only the expert-parallel phase")
    ap.add_argument("--single-graphs", action="store_true",
                    help="CUDA graphs in the single-GPU phase (its best; EP stays eager). Default: both eager")
    ap.add_argument("--time-limit-s", type=float, default=200.0, help="per phase: no new concurrency after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.tiny:
        args.concurrency = args.concurrency if args.concurrency != "16,64" else "3,5"
        args.prompt_len, args.max_new = min(args.prompt_len, 12), min(args.max_new, 8)
        args.drafter_layers = 1
    elif not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        sys.exit(f"--gpus {args.gpus} needs that many CUDA devices (found "
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); use --tiny on CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    single = {"rows": [], "ar_tokens": {}} if args.skip_single else run_phase(1, args, out)
    ep = run_phase(args.gpus, args, out)
    match = {}
    for conc, toks in ep["ar_tokens"].items():
        ref = single["ar_tokens"].get(conc)
        if ref:
            match[conc] = sum(a == b for a, b in zip(toks, ref)) / len(ref)
    meta = {"gpus": args.gpus, "layers": 4 if args.tiny else args.layers, "tiny": args.tiny,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
            "prompt_len": args.prompt_len, "max_new": args.max_new, "acceptance": args.acceptance,
            "placement": args.placement, "exchange": args.exchange, "ar_greedy_match_ep_vs_single": match, "wall_s": time.perf_counter() - t0,
            "warm_new": args.warm_new or args.max_new,
            "single_gpu_graphs": args.single_graphs, "ep_graphs": False}
    rows = single["rows"] + ep["rows"]
    (out / "ep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| policy | conc | 1 GPU tok/s | EP tok/s | EP / 1 GPU | EP step ms | EP collectives share | JIT in timed "
          "run (1 GPU / EP) |", flush=True)
    print("|---|---|---|---|---|---|---|---|")
    one = {(r["policy"], r["concurrency"]): r for r in single["rows"]}
    for r in ep["rows"]:
        s = one.get((r["policy"], r["concurrency"]))
        base = f"{s['output_tokens_per_s']:.1f}" if s else "-"
        ratio = f"{r['output_tokens_per_s'] / s['output_tokens_per_s']:.2f}" if s else "-"
        print(f"| {r['policy']} | {r['concurrency']} | {base} | {r['output_tokens_per_s']:.1f} | {ratio} | "
              f"{r['step_ms_median']:.2f} | {100 * r['comm_share']:.1f}% | "
              f"{s.get('jit_compiles', '-') if s else '-'} / {r.get('jit_compiles', '-')} |")
    print(json.dumps(meta), flush=True)


if __name__ == "__main__":
    main()
