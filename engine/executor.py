"""Executors: where the worker (ModelRunner) runs. `local` = in the engine process; `ray` = in a Ray actor
(engine/ray_executor.py). Every executor has the same interface: execute / release / shutdown."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from scheduler.types import StepRequest, StepResult
from workers.config import ModelConfig
from workers.drafters import DraftModelDrafter, Drafter, NgramDrafter, ReplayDrafter
from workers.runner import ModelRunner


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its model and state storage (plain data)."""

    model_dir: str
    dtype: str  # "float32" | "bfloat16"
    device: str
    num_pages: int
    page_size: int
    num_slots: int
    spec: str = "off"  # drafter: off | ngram | draft | replay
    policy: str = "fixed"  # verification-length policy run by the worker: ar | fixed | budget | hybridspec
    max_verify_len: int = 16
    draft_model: str | None = None  # directory of the draft model (spec "draft"; the replay drafter's cost)
    replay_acceptance: float = 0.85  # spec "replay": probability that each proposed token is right
    seed: int = 0
    graph_pages_per_request: int = 0  # > 0 on CUDA: capture decode graphs for page tables this wide
    expert_parallel: int = 1  # > 1 (executor "ray"): experts sharded over this many workers (engine/ep_executor.py)
    startup_profile: bool = False  # fit the latency model on synthetic steps before serving (ModelRunner.profile)
    freeze_heap: bool = False  # after start-up, freeze the process's objects out of the cyclic GC (freeze_heap)


def build_runner(spec: WorkerSpec, local_experts=None) -> ModelRunner:
    """The worker's runner, drafter, graphs and profile. `local_experts`: an expert-parallel rank's share of each
    MoE layer's experts, the only ones it loads (ExpertParallelActor)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    runner = ModelRunner.create(ModelConfig.from_dir(spec.model_dir), Path(spec.model_dir), dtype, spec.device,
                                spec.num_pages, spec.page_size, spec.num_slots, local_experts=local_experts)
    runner.set_policy(spec.policy, spec.max_verify_len)
    if spec.spec == "mtp":
        from workers.mtp import MTPDrafter

        runner.drafter = MTPDrafter(runner.model, spec.model_dir, spec.num_pages, spec.page_size, spec.num_slots)
    else:
        runner.drafter = build_drafter(spec, runner.model.config.vocab_size, dtype)
    if spec.graph_pages_per_request > 0 and runner.device.type == "cuda":  # after the drafter: graphs depend on it
        why = runner.enable_graphs(spec.num_slots, spec.graph_pages_per_request)
        if why is not None:
            log.warning("steps stay eager: %s", why)
        elif hasattr(runner.drafter, "enable_graphs"):  # a draft model's / MTP head's / replay cost's own steps
            runner.drafter.enable_graphs(spec.num_slots, spec.graph_pages_per_request, spec.max_verify_len + 1)
    if spec.startup_profile:
        fitted = runner.profile(spec.num_slots)
        log.info("start-up profile: %s", fitted)
    if spec.freeze_heap:  # start-up is done: what lives now lives for the process
        freeze_heap()
    return runner


def freeze_heap() -> int:
    """One full collection of the cyclic GC, then every object alive now is moved out of its generations
    (gc.freeze; unfrozen first, so what was frozen before and has become cyclic garbage since is collected).
    A later full collection walks only what was made after: during serving one walked the ~170k objects of a
    started worker (the model's modules, graphs, tables) in ~50-60 ms on a CPU core, a pause inside one served
    step (bench/NOTES.md, 2026-12-02). Frozen objects freed by reference counting are still freed. -> the
    objects frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_drafter(spec: WorkerSpec, vocab_size: int, dtype: torch.dtype) -> Drafter | None:
    def draft_model() -> DraftModelDrafter:
        from workers.model import HybridModel
        from workers.weights import load_weights

        try:  # its errors name the draft model's option, not the target's (`--model directory ...: no config.json`)
            cfg = ModelConfig.from_dir(spec.draft_model)
            if cfg.vocab_size != vocab_size:
                raise ValueError(f"vocab_size must equal the target's ({vocab_size}), got {cfg.vocab_size}")
            model = HybridModel(cfg, dtype, spec.device)
            load_weights(model, spec.draft_model)
        except (OSError, ValueError) as e:
            raise ValueError(f"draft_model {spec.draft_model}: {e}") from e
        return DraftModelDrafter(model, spec.num_pages, spec.page_size, spec.num_slots)

    if spec.spec == "off":
        return None
    if spec.spec == "ngram":
        return NgramDrafter()
    if spec.spec == "draft":
        if not spec.draft_model:
            raise ValueError("draft_model is needed with spec 'draft' (a model directory with the target's tokenizer)")
        return draft_model()
    if spec.spec == "replay":
        return ReplayDrafter(spec.replay_acceptance, vocab_size, seed=spec.seed,
                             cost_model=draft_model() if spec.draft_model else None)
    raise ValueError(f"spec {spec.spec!r} is not available in this build (off, ngram, draft, replay)")


log = logging.getLogger("hybridspec.executor")


class WorkerLost(RuntimeError):
    """The worker died or was restarted and lost every request's cached state: the engine must fail the
    requests it was running (queued ones are unaffected), then carry on with the (restarted) worker."""


class Executor(Protocol):
    def execute(self, requests: list[StepRequest]) -> StepResult: ...

    def release(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, spec: WorkerSpec):
        self.runner = build_runner(spec)

    def execute(self, requests: list[StepRequest]) -> StepResult:
        return self.runner.execute(requests)

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def shutdown(self) -> None:
        pass


EXECUTORS = ("local", "ray")


def create_executor(kind: str, spec: WorkerSpec) -> Executor:
    ep = spec.expert_parallel
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_parallel must be an integer >= 1, got {ep!r}")
    if ep > 1 and kind != "ray":
        raise ValueError(f"expert_parallel > 1 needs executor 'ray' (got executor {kind!r}, expert_parallel {ep})")
    if ep > 1:
        from engine.ep_executor import ExpertParallelExecutor  # imports ray only when asked for

        return ExpertParallelExecutor(spec)
    if kind == "local":
        return LocalExecutor(spec)
    if kind == "ray":
        from engine.ray_executor import RayExecutor  # imports ray only when asked for

        return RayExecutor(spec)
    raise ValueError(f"executor must be one of {EXECUTORS}, got {kind!r}")
