"""Expert parallelism (issue 10), on CPU with gloo over loopback.

- the exchange: 2 spawned gloo ranks (no Ray) give the single-process SparseMoe output for the union of their
  tokens: uneven token counts, a rank with no tokens, masked tokens (explicit mask and the router correction,
  which counts the experts activated on every rank), an uneven expert placement;
- the engine: 2 Ray actors (`executor="ray", expert_parallel=2`) give the local executor's greedy tokens for
  concurrent requests, with speculation off and with ngram drafts; killing one actor fails the in-flight requests
  with UNAVAILABLE, the group is rebuilt and the next request gets the right tokens; killed while idle, it fails
  nothing; more ranks than the Ray cluster's GPUs / CPUs are refused at start-up (Ray would never place them);
- the CLI's --expert-parallel validation.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import torch
import torch.multiprocessing as mp
from serving import eventually, final_status, free_port, one_torch_thread, run, serving  # noqa: F401  (fixture)

# ------------------------------------------------------------------------------------------- the exchange
TOKENS = {  # case -> tokens per rank
    "uneven": (5, 2),
    "rank1_empty": (6, 0),
    "rank0_empty": (0, 3),
    "masked": (7, 4),
    "correction": (5, 5),
    "placement": (4, 5),
}
PLACEMENT = [0, 1, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1]  # 10 experts on rank 0, 6 on rank 1


def _moe_config():
    from engine.default_model import DEFAULT_CONFIG
    from workers.config import ModelConfig

    return ModelConfig.from_dict(DEFAULT_CONFIG)  # 16 experts, top-4, hidden 128


def _fresh_moe(state):
    from workers.model import SparseMoe

    moe = SparseMoe(_moe_config(), torch.float32, "cpu")
    moe.load_state_dict(state)
    return moe


def _rank_cases(rank: int, world: int, port: int, path: str):
    """A spawned rank's setup (its group, the cases file): yields (name, case, a fresh unsharded MoE layer)."""
    torch.set_num_threads(1)
    from workers.expert_parallel import init_group

    init_group(rank, world, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
    data = torch.load(path)
    for name, case in data["cases"].items():
        yield name, case, _fresh_moe(data["state"])


def _ep_rank(rank: int, world: int, port: int, path: str) -> None:
    """One spawned rank: every case through the exchange; its outputs saved next to the inputs."""
    from workers.expert_parallel import ExpertShard, shard_moe_
    from workers.model import MoEContext

    out = {}
    for name, case, moe in _rank_cases(rank, world, port, path):
        owner = PLACEMENT if name == "placement" else None
        shard = ExpertShard(owner, rank, world) if owner else ExpertShard.even(16, world, rank)
        shard_moe_(moe, shard, first=True)
        moe.ep.step_rows = [x_.shape[0] for x_ in case["x"]]  # the static exchange's capacities: exact here
        assert moe.experts.gate_up_proj.shape[0] == len(shard.local_experts)
        x = case["x"][rank]
        with torch.inference_mode():
            if name == "masked":
                weights, ids = moe.route(x)
                out[name] = (moe.ep.exchange(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids,
                                             case["mask"][rank]), None)
            else:
                ctx = MoEContext(extra_rows=case["extra"][rank]) if name == "correction" else None
                y = moe(x, ctx)
                out[name] = (y, ctx.token_mask if ctx is not None else None)
    torch.save(out, f"{path}.{rank}")
    torch.distributed.destroy_process_group()


def test_exchange_over_two_gloo_ranks_equals_one_process(tmp_path):
    from kernels.moe import fused_moe_ref, router_correction_ref
    from workers.model import MoEContext, SparseMoe
    from workers.random_init import init_random_  # noqa: F401  (the same scales as the default model)

    torch.manual_seed(0)
    cfg = _moe_config()
    ref = SparseMoe(cfg, torch.float32, "cpu")
    for name, p in ref.named_parameters():
        p.data.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5) if p.dim() > 1 else 0.1 * torch.randn(p.shape))
    state = ref.state_dict()
    cases = {}
    for name, (n0, n1) in TOKENS.items():
        xs = [torch.randn(n0, cfg.hidden_size), torch.randn(n1, cfg.hidden_size)]
        case = {"x": xs}
        if name == "masked":
            case["mask"] = [torch.rand(n0) < 0.6, torch.rand(n1) < 0.6]
        if name == "correction":
            case["extra"] = [torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool),
                             torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool)]
        cases[name] = case
    path = str(tmp_path / "case.pt")
    torch.save({"state": state, "cases": cases}, path)
    mp.spawn(_ep_rank, args=(2, free_port(), path), nprocs=2, join=True)
    got = [torch.load(f"{path}.{r}") for r in range(2)]

    with torch.inference_mode():
        for name, case in cases.items():
            x = torch.cat(case["x"])
            n0 = case["x"][0].shape[0]
            if name == "masked":
                mask = torch.cat(case["mask"])
                weights, ids = ref.route(x)
                want = fused_moe_ref(x, ref.experts.gate_up_proj, ref.experts.down_proj, weights, ids, mask)
                assert not mask.all() and mask.any()
            else:
                ctx = MoEContext(extra_rows=torch.cat(case["extra"])) if name == "correction" else None
                want = ref(x, ctx)
                if ctx is not None:  # the correction saw the experts of both ranks' tokens
                    assert not ctx.token_mask.all(), "pick a case where some extra token is masked"
                    assert ctx.token_mask[torch.cat(case["extra"])].any(), "and one where some is kept"
                    assert torch.equal(torch.cat([got[0][name][1], got[1][name][1]]), ctx.token_mask), name
                    local = [router_correction_ref(ref.route(xr)[1], er, 16)
                             for xr, er in zip(case["x"], case["extra"])]
                    assert not torch.equal(torch.cat(local), ctx.token_mask), "a case where the other rank matters"
            y = torch.cat([got[0][name][0], got[1][name][0]])
            assert y.shape == want.shape, name
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=name)
            assert n0 == got[0][name][0].shape[0]


# ---------------------------------------------------- the static exchange: slack capacities, no host sync
STATIC = {  # case -> (tokens per rank, row capacity per rank (>= tokens), extra rows, row mask (False: padding))
    "rank1_empty": ((5, 0), (7, 0), ([0, 0, 1, 0, 0], []), ([1, 1, 1, 1, 0], [])),
    "rank1_one": ((5, 1), (9, 2), ([0, 0, 1, 0, 1], [1]), ([1, 1, 1, 1, 1], [1])),
    "rank0_padding": ((5, 1), (5, 3), ([0, 1, 0, 0, 0], [0]), ([1, 1, 0, 1, 0], [1])),
    "dynamic": ((5, 1), (5, 1), ([0, 0, 1, 0, 1], [1]), ([1, 1, 1, 1, 0], [1])),  # the old exchange
}


class HostSyncs:
    """Records the ops in its scope that read device data on the host (a host sync on a GPU): a scalar read
    (item / bool / int: aten._local_scalar_dense), Tensor.tolist, and ops whose output shape depends on the data
    (nonzero, boolean-mask indexing, unique, bincount, repeat_interleave without output_size). `dispatch.fused_moe`
    is exempt: its CPU reference reads its expert counts (the Triton kernel does not)."""

    def __init__(self):
        self.hits: list[str] = []
        self.paused = 0

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from kernels import dispatch

        aten = torch.ops.aten
        forbidden = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                     aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
                     aten.bincount.default, aten.is_nonzero.default, aten.equal.default}
        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not rec.paused:
                    bad = func in forbidden
                    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
                        bad = kwargs.get("output_size") is None
                    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
                        bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or [])
                    if bad:
                        rec.hits.append(str(func))
                return func(*args, **kwargs)

        self._fused_moe, self._tolist = dispatch.fused_moe, torch.Tensor.tolist

        def fused_moe(*args, **kwargs):
            self.paused += 1
            try:
                return self._fused_moe(*args, **kwargs)
            finally:
                self.paused -= 1

        def tolist(t):
            if not self.paused:
                self.hits.append("Tensor.tolist")
            return self._tolist(t)

        dispatch.fused_moe, torch.Tensor.tolist = fused_moe, tolist
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        from kernels import dispatch

        self.mode.__exit__(*exc)
        dispatch.fused_moe, torch.Tensor.tolist = self._fused_moe, self._tolist


def _static_rank(rank: int, world: int, port: int, path: str) -> None:
    from workers.expert_parallel import ExpertShard, shard_moe_
    from workers.model import MoEContext

    out = {}
    for name, case, moe in _rank_cases(rank, world, port, path):
        shard_moe_(moe, ExpertShard.even(16, world, rank), first=True)
        moe.ep.step_rows = list(case["rows"])
        moe.ep.static = name != "dynamic"
        x = case["x"][rank]
        ctx = MoEContext(extra_rows=case["extra"][rank], row_mask=case["row_mask"][rank])
        with torch.inference_mode(), HostSyncs() as syncs:
            y = moe(x, ctx)
        out[name] = (y, ctx.token_mask, syncs.hits)
    torch.save(out, f"{path}.{rank}")
    torch.distributed.destroy_process_group()


def test_static_exchange_uneven_capacities_masks_and_no_host_sync(tmp_path):
    """The static-split exchange (row capacities above the real rows, a rank with 0 or 1 token, the router
    correction, padding rows) gives the single-process layer output, with no host sync in the layer; the old
    exchange gives it too, and the detector sees its host read."""
    from workers.model import MoEContext, SparseMoe

    torch.manual_seed(1)
    cfg = _moe_config()
    ref = SparseMoe(cfg, torch.float32, "cpu")
    for p in ref.parameters():
        p.data.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5) if p.dim() > 1 else 0.1 * torch.randn(p.shape))
    cases = {}
    for name, (tokens, rows, extra, row_mask) in STATIC.items():
        cases[name] = {"x": [torch.randn(n, cfg.hidden_size) for n in tokens], "rows": rows,
                       "extra": [torch.tensor(e, dtype=torch.bool).reshape(-1) for e in extra],
                       "row_mask": [torch.tensor(m, dtype=torch.bool).reshape(-1) for m in row_mask]}
    path = str(tmp_path / "static.pt")
    torch.save({"state": ref.state_dict(), "cases": cases}, path)
    mp.spawn(_static_rank, args=(2, free_port(), path), nprocs=2, join=True)
    got = [torch.load(f"{path}.{r}") for r in range(2)]
    with torch.inference_mode():
        for name, case in cases.items():
            ctx = MoEContext(extra_rows=torch.cat(case["extra"]), row_mask=torch.cat(case["row_mask"]))
            want = ref(torch.cat(case["x"]), ctx)
            assert not ctx.token_mask.all(), name
            assert torch.equal(torch.cat([got[0][name][1], got[1][name][1]]), ctx.token_mask), name
            y = torch.cat([got[0][name][0], got[1][name][0]])
            assert y.shape == want.shape, name
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=name)
            for r in range(2):
                hits = got[r][name][2]
                if name == "dynamic":
                    assert "Tensor.tolist" in hits, (r, hits)  # the detector sees the old host read
                else:
                    assert hits == [], (name, r, hits)


def test_static_exchange_checks_its_capacity():
    from scheduler.types import SamplingParams, StepRequest
    from workers.expert_parallel import ExpertParallelMoE, ExpertShard, step_rows_bound

    ep = ExpertParallelMoE(ExpertShard.even(8, 2, 0))
    with pytest.raises(RuntimeError, match="step_rows"):
        ep.capacities(3)
    ep.step_rows = [2, 5]
    with pytest.raises(RuntimeError, match="capacity"):
        ep.capacities(3)
    assert ep.capacities(2) == [2, 5]
    assert ExpertParallelMoE(ExpertShard.even(8, 1, 0)).capacities(4) == [4]  # one rank: its own rows
    decode = StepRequest("a", [5], 12, [0], 0, True, SamplingParams(), 4, [1] * 13)
    prefill = StepRequest("b", [1, 2, 3], 0, [1], 1, False, SamplingParams(), 4, [])
    assert step_rows_bound([decode, prefill]) == (1 + 4) + 3 and step_rows_bound([]) == 0


def test_placement_helpers():
    from workers.expert_parallel import ExpertShard, popularity_placement

    even = ExpertShard.even(10, 3, 1)
    assert even.local_experts == [4, 5, 6] and even.num_local == [4, 3, 3]
    owner = popularity_placement([100, 90, 5, 4, 3, 2], 2)
    assert sorted(owner) == [0, 0, 0, 1, 1, 1]  # same number of experts each
    assert owner[0] != owner[1]  # the two popular ones apart
    with pytest.raises(ValueError, match="ranks outside"):
        ExpertShard([0, 2], 0, 2)


# ------------------------------------------------------------------------------------------- the engine
ray = pytest.importorskip("ray")

LIMITS = {"max_model_len": 512, "max_running": 8, "max_step_tokens": 256}
PROMPTS = ["def fibonacci(n):", "hello world " * 5, "é日本", "x" * 90, "a", "The quick brown fox"]
MAX_NEW = [12, 20, 7, 16, 25, 9]


def _params():
    from engine import SamplingParams

    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]


@pytest.fixture(scope="module")
def local(one_torch_thread):
    from engine import LLM

    return LLM(**LIMITS)


@pytest.fixture(scope="module")
def on_ep(one_torch_thread):
    from engine import LLM

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    llm = LLM(executor="ray", expert_parallel=2, spec="ngram", policy="hybridspec", **LIMITS)
    yield llm
    llm.engine.shutdown()


def test_two_ranks_give_the_single_worker_tokens_with_and_without_speculation(local, on_ep):
    from engine.ep_executor import ExpertParallelExecutor

    executor = on_ep.engine.executor
    assert isinstance(executor, ExpertParallelExecutor) and executor.world_size == 2
    held = executor.expert_bytes()
    assert len(held) == 2 and held[0] == held[1] > 0  # even split: each rank holds half of the experts
    expected = [r.token_ids for r in local.generate(PROMPTS, _params())]

    got = on_ep.generate(PROMPTS, _params())  # ngram drafts + hybridspec (extra token, router correction)
    assert [r.token_ids for r in got] == expected
    assert sum(r.stats.draft_tokens for r in got) > 0, "ngram should have proposed drafts"
    assert len(executor.last_rank_ms) == 2

    # speculation off on the same group (no draft caps: plain one-token decoding on both ranks)
    on_ep.engine.scheduler.max_draft = 0
    try:
        got = on_ep.generate(PROMPTS, _params())
    finally:
        on_ep.engine.scheduler.max_draft = on_ep.max_verify_len
    assert [r.token_ids for r in got] == expected
    assert sum(r.stats.draft_tokens for r in got) == 0


def test_killed_rank_fails_in_flight_with_unavailable_and_the_rebuilt_group_serves(local, on_ep):
    executor = on_ep.engine.executor
    expected = local.generate("after", _params()[0])[0].token_ids

    async def stream(client, prompt: str):
        return await final_status(client, prompt, 400)

    async def main() -> None:
        from clients.client import GenerationClient

        async with serving(on_ep.engine) as (_, target), GenerationClient(target) as client:
            tasks = [asyncio.create_task(stream(client, f"doomed {i}")) for i in range(3)]

            async def all_running() -> bool:
                return (await client.stats()).running_requests == 3
            await eventually(all_running, 30.0, "three requests running")
            started = executor.groups_started
            old = await asyncio.to_thread(executor.worker_pids)
            os.kill(old[1], signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
            assert outcomes == [grpc.StatusCode.UNAVAILABLE] * 3, outcomes

            after = await asyncio.wait_for(client.complete("after", max_new_tokens=12, ignore_eos=True), 120.0)
            assert after.token_ids == expected
            assert executor.groups_started == started + 1
            new = await asyncio.to_thread(executor.worker_pids)
            assert not set(new) & set(old)
            stats = await client.stats()
            assert stats.free_pages == stats.total_pages and stats.free_slots == stats.total_slots

    run(main(), timeout=180.0)


def test_a_rank_killed_while_idle_fails_nothing_and_a_new_group_serves(local, on_ep):
    """Before: the first request after an idle rank's death failed with UNAVAILABLE though it had lost nothing."""
    executor = on_ep.engine.executor
    expected = local.generate("idle", _params()[0])[0].token_ids
    assert on_ep.generate("idle", _params()[0])[0].token_ids == expected
    started, old = executor.groups_started, executor.worker_pids()
    ray.kill(executor.actors[1])
    assert on_ep.generate("idle", _params()[0])[0].token_ids == expected
    assert executor.groups_started == started + 1 and not set(executor.worker_pids()) & set(old)


def test_more_ranks_than_the_cluster_holds_are_refused_before_any_waits(on_ep, monkeypatch):
    """The fixture's Ray has 2 CPUs: 3 ranks of one CPU each would never all be placed (the engine waited for
    them until start_timeout_s); on GPUs, each rank needs one."""
    import engine.ep_executor as epx
    from engine.executor import WorkerSpec

    def no_group(self):
        raise AssertionError("no rank may be started for a group the cluster cannot hold")

    monkeypatch.setattr(epx.ExpertParallelExecutor, "_start", no_group)
    with pytest.raises(ValueError, match=r"^expert_parallel 3 needs 3 CPUs, the Ray cluster has 2$"):
        epx.ExpertParallelExecutor(WorkerSpec("unused", "float32", "cpu", 4, 16, 2, expert_parallel=3))
    assert ray.is_initialized()  # the fixture's Ray (joined, not started here) is left running

    monkeypatch.setattr(epx, "_init_ray", lambda address, num_cpus: False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    with pytest.raises(ValueError, match=r"^expert_parallel 4 needs 4 GPUs, the Ray cluster has 1$"):
        epx.ExpertParallelExecutor(WorkerSpec("unused", "float32", "cuda", 4, 16, 2, expert_parallel=4))


# ------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv, message", [
    (["serve", "--expert-parallel", "0"], "--expert-parallel must be an integer >= 1"),
    (["serve", "--expert-parallel", "2"], "--expert-parallel 2 needs --executor ray"),
    (["generate", "hi", "--expert-parallel", "-1", "--executor", "ray"], "--expert-parallel must be an integer >= 1"),
    (["generate", "hi", "--expert-parallel", "2"], "--expert-parallel 2 needs --executor ray"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--expert-parallel", "2"], "cannot be used with --server"),
])
def test_cli_validates_expert_parallel(argv, message, capsys):
    from engine.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_api_validates_expert_parallel():
    from engine.executor import WorkerSpec, create_executor

    spec = WorkerSpec("unused", "float32", "cpu", 4, 16, 2, expert_parallel=2)
    with pytest.raises(ValueError, match="expert_parallel > 1 needs executor 'ray'"):
        create_executor("local", spec)
    with pytest.raises(ValueError, match="expert_parallel must be an integer >= 1"):
        create_executor("ray", WorkerSpec("unused", "float32", "cpu", 4, 16, 2, expert_parallel=0))


def test_cli_rejects_a_non_integer(capsys):
    from engine.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--expert-parallel", "two"])
    assert "--expert-parallel" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the bench
def test_bench_tiny_runs_on_cpu_with_gloo(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "ep.py"), "--tiny", "--concurrency", "3",
                           "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "ep.json").read_text())
    rows = {(r["world"], r["policy"]): r for r in report["rows"]}
    assert set(rows) == {(1, "ar"), (1, "hybridspec"), (2, "ar"), (2, "hybridspec")}
    assert report["meta"]["ar_greedy_match_ep_vs_single"] == {"3": 1.0}
    assert rows[(2, "hybridspec")]["greedy_match_vs_ar"] == 1.0 and rows[(2, "hybridspec")]["draft_tokens"] > 0
    assert 0.0 < rows[(2, "ar")]["comm_share"] < 1.0 and rows[(1, "ar")]["comm_share"] == 0.0
    assert "| policy | conc |" in proc.stdout


def test_requests_whose_group_was_rebuilt_between_steps_fail_instead_of_running_on_empty_state():
    """A lost rank found outside a step (e.g. by worker_pids) rebuilds the group with fresh pools; running requests
    that then arrive with cached context must fail (UNAVAILABLE), not continue on zeroed KV/GDN state."""
    from engine.ep_executor import ExpertParallelExecutor
    from engine.executor import WorkerLost
    from scheduler.types import SamplingParams, StepRequest

    ex = ExpertParallelExecutor.__new__(ExpertParallelExecutor)  # the bookkeeping only: no Ray actors
    ex.world_size, ex.actors, ex._lost, ex.owner, ex.load = 2, ["rank0", "rank1"], False, {}, [0, 0]
    running = StepRequest("r1", [5], 12, [0], 0, True, SamplingParams(), 0, [])
    with pytest.raises(WorkerLost, match="lost their state"):
        ex.execute([running])


# ---- a rank loads only its experts ----------------------------------------------------------------------------
def _expert_tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict().items() if ".mlp.experts." in n}


@pytest.mark.parametrize("layout", ["per_expert", "fused", "random"])
def test_a_rank_loads_only_its_experts_with_the_whole_models_values(tmp_path, layout):
    """ModelRunner.create(local_experts=...) (what an expert-parallel rank builds): every MoE layer's experts are
    those rows of the whole model's, nothing else differs, and no tensor is left on the meta device: the full
    expert tensors never reach the rank's device (before, a rank loaded them all and then dropped the others)."""
    from bench.bench_model_dir import tiny_config, write_bench_model_dir
    from checkpoints import fuse_experts, make_qwen35_moe
    from workers.config import ModelConfig
    from workers.expert_parallel import plan_shards
    from workers.runner import ModelRunner

    if layout == "random":
        model_dir = write_bench_model_dir(tmp_path / "m", routing="zipf", seed=2, config=tiny_config(4))
    else:
        model_dir = make_qwen35_moe(tmp_path / "m")
        if layout == "fused":
            model_dir = fuse_experts(model_dir, tmp_path / "fused")
    cfg = ModelConfig.from_dir(model_dir)
    whole = ModelRunner.create(cfg, model_dir, torch.float32, "cpu", 4, 16, 2).model
    experts_per_layer = [cfg.num_experts for moe in cfg.moe_layers if moe]
    placement = [[(e * 7 + j) % 3 for e in range(n)] for j, n in enumerate(experts_per_layer)]  # uneven, per layer
    placement_none = [[0] * n if j == 0 else list(p) for j, (n, p) in enumerate(zip(experts_per_layer, placement))]
    for rank, owners in [(0, placement), (1, placement), (2, placement), (1, placement_none)]:
        # (placement_none: rank 1 keeps no expert of the first MoE layer)
        shards = plan_shards(experts_per_layer, rank, 3, owners)
        local = [s.local_experts for s in shards]
        part = ModelRunner.create(cfg, model_dir, torch.float32, "cpu", 4, 16, 2, local_experts=local).model
        assert not any(t.is_meta for t in part.state_dict().values())
        ref = whole.state_dict()
        keep = iter(local)
        for name, t in part.state_dict().items():
            if ".mlp.experts." in name:
                rows = next(keep) if name.endswith("gate_up_proj") else rows
                assert torch.equal(t, ref[name][rows]), name
            else:
                assert torch.equal(t, ref[name]), name
        assert sum(t.numel() for t in _expert_tensors(part).values()) < sum(
            t.numel() for t in _expert_tensors(whole).values())


def test_local_experts_for_another_model_are_refused(tmp_path):
    from checkpoints import make_qwen35_moe
    from workers.config import ModelConfig
    from workers.runner import ModelRunner

    model_dir = make_qwen35_moe(tmp_path / "m")
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"local_experts has 1 lists, the model \d+ MoE layers"):
        ModelRunner.create(cfg, model_dir, torch.float32, "cpu", 4, 16, 2, local_experts=[[0]])


def test_each_rank_holds_only_its_share_of_the_pools(on_ep):
    """The engine's pages and slots are partitioned, one partition per rank; a rank allocates only its own."""
    memory = on_ep.engine.memory
    assert memory.partitions == 2 and memory.slots.num_slots == LIMITS["max_running"]
    per_rank = (memory.pages.pages_per_part, memory.slots.slots_per_part)
    assert per_rank[1] == LIMITS["max_running"] // 2
    assert on_ep.engine.executor.pool_sizes() == [per_rank, per_rank]
    assert on_ep.engine.memory_tokens == per_rank[0] * memory.pages.page_size  # one request's most: one rank's


def test_tight_rank_pools_preempt_within_a_rank_and_move_requests_without_changing_tokens(local, on_ep):
    """Pools of 40 tokens a rank for four requests of 24-37 tokens: requests are preempted (a victim from the short
    rank's own requests) and some are admitted again on the other rank; the tokens are the single worker's."""
    from engine import LLM, SamplingParams

    on_ep.engine.executor._teardown()  # its two ranks give their CPUs back (the local Ray has two); its next call
    # starts a new group

    prompts = ["def fibonacci(n):", "import os\n", "class A:\n    pass", list(range(5, 18))]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    expected = [r.token_ids for r in local.generate(prompts, params)]
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    tight = LLM(executor="ray", expert_parallel=2, num_pages=20, page_size=4, max_running=4, max_model_len=512)
    try:
        assert tight.engine.executor.pool_sizes() == [(10, 2), (10, 2)]
        out = tight.generate(prompts, params)
        assert [r.token_ids for r in out] == expected
        assert sum(r.stats.preemptions for r in out) > 0
        assert tight.engine.executor.moves > 0
        stats = tight.engine.memory.stats()
        assert stats["used_pages"] == 0 and stats["used_slots"] == 0 and tight.engine.executor.owner == {}
        with pytest.raises(ValueError, match="expert-parallel ranks' pools has 10"):
            tight.engine.scheduler.check_fits(_request_of(41))
    finally:
        tight.engine.shutdown()


def _request_of(num_tokens: int):
    from scheduler.request import Request
    from scheduler.types import SamplingParams

    return Request("big", list(range(num_tokens - 1)), SamplingParams(max_new_tokens=1))


def test_fewer_pages_or_running_requests_than_ranks_are_refused_naming_the_option():
    from engine import LLM

    with pytest.raises(ValueError, match=r"num_pages must be at least expert_parallel \(2: each rank holds its own"):
        LLM(executor="ray", expert_parallel=2, num_pages=1, **LIMITS)
    with pytest.raises(ValueError, match=r"max_running must be at least expert_parallel \(2: each rank runs its own"):
        LLM(executor="ray", expert_parallel=2, **{**LIMITS, "max_running": 1})
