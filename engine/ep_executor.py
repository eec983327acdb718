"""ExpertParallelExecutor: `--executor ray --expert-parallel N`. N Ray actors (one GPU each, or one CPU each in
tests) joined in one torch.distributed group (NCCL on GPUs, gloo on CPU; rendezvous on 127.0.0.1 at a free port
the driver picks, so a deployment is one host). Routed experts are sharded across the ranks
(workers/expert_parallel.py); attention/GDN layers run data-parallel: each request runs on the rank its GDN slot
comes from (the engine's memory is partitioned, one partition per rank, scheduler/memory.py: a request's slot and
pages all lie in one rank's range), which holds its KV pages, GDN state, sampling and drafting state; each rank
allocates only its own pools (the spec's num_pages / num_slots), and the ids it gets are made local to them. A
preempted request admitted again may land on another rank (the old one forgets it). Ray places the actors and
carries only StepRequest/StepResult; the per-layer tensors go through the collectives.

Every engine step calls every rank (an empty list included: an idle rank still takes part in each MoE layer's
all-to-all), with every rank's row bound for the step (`step_rows_bound` of what each rank gets: the
exchanges' static split sizes), and waits for all; the step's StepResult is the union of the ranks', and its
`step_ms` the slowest rank's (`last_rank_ms` keeps each rank's target forward time).

Each rank loads only its share of the routed experts (ModelRunner.create's `local_experts`) and every other
weight.

Failure: a gloo/NCCL group cannot lose a member. When any rank dies (or a step fails on one), every actor is
killed, the call raises WorkerLost (the engine fails its running requests with UNAVAILABLE), and the next call
builds a new group of N actors and serves again. Where no request had state on the group (a rank died while the
engine was idle), the step is not failed: it runs again, once, on a new group.

Start-up refuses what Ray could never place (N actors of one GPU, or one CPU, each: more than the cluster has)
and a device naming a card ("cuda:1": Ray picks each rank's GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from engine.executor import WorkerLost, WorkerSpec, build_runner
from engine.ray_executor import DEFAULT_NUM_CPUS, _init_ray, check_cluster_fits, check_ray_device, shutdown_ray
from scheduler.types import StepRequest, StepResult
from workers.config import ModelConfig
from workers.expert_parallel import ExpertParallelActor, step_rows_bound

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExpertParallelExecutor:
    def __init__(self, spec: WorkerSpec, *, address: str | None = None,
                 placement: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 start_timeout_s: float = 300.0, group_timeout_s: float = 120.0):
        self.world_size = int(spec.expert_parallel)
        if self.world_size < 1:
            raise ValueError(f"expert_parallel must be an integer >= 1, got {spec.expert_parallel!r}")
        check_ray_device(spec.device)
        self._shutdown_lock = threading.Lock()
        self._owns_ray = _init_ray(address, max(DEFAULT_NUM_CPUS, self.world_size))
        self.on_gpu = spec.device.startswith("cuda")
        try:  # each rank: one GPU (or one CPU), as _start asks Ray for
            check_cluster_fits(f"expert_parallel {self.world_size}", self.world_size, 1 if self.on_gpu else 0, 1)
        except ValueError:
            if self._owns_ray:
                shutdown_ray()
            raise
        # Ray gives each actor one GPU through CUDA_VISIBLE_DEVICES ("cuda" inside it); no CUDA graphs (not done
        # under EP yet: the exchange's shapes follow each step's row bounds); no start-up profile (it would run
        # the exchange outside the lockstep of engine steps): the learned policies explore for their first steps
        # instead
        self.spec = dataclasses.replace(spec, graph_pages_per_request=0, startup_profile=False)
        self.placement = placement
        self.start_timeout_s, self.group_timeout_s = start_timeout_s, group_timeout_s
        self.actors: list[Any] = []
        self.owner: dict[str, int] = {}  # request id -> rank (of the requests with state on the group)
        self.moves = 0  # preempted requests admitted again on another rank
        self.last_rank_ms: list[float] = [0.0] * self.world_size  # each rank's last target forward (ms)
        self.groups_started = 0
        self._lost = False
        self._start()

    # ---- the group ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        actor_cls = ray.remote(ExpertParallelActor).options(
            max_restarts=0, max_task_retries=0, num_cpus=1, num_gpus=1 if self.on_gpu else 0)
        factory = functools.partial(build_runner, self.spec)
        # each rank loads only its share of the routed experts (their numbers per MoE layer, from config.json)
        cfg = ModelConfig.from_dir(self.spec.model_dir)
        experts_per_layer = [cfg.num_experts for moe in cfg.moe_layers if moe]
        self.actors = [actor_cls.remote(factory, rank, self.world_size, init_method, self.spec.device,
                                        self.placement, self.group_timeout_s, None if self.on_gpu else 1,
                                        experts_per_layer)
                       for rank in range(self.world_size)]
        try:
            ready = ray.get([a.ready.remote() for a in self.actors], timeout=self.start_timeout_s)
        except (RayError, GetTimeoutError) as e:
            self._teardown()
            raise WorkerLost(f"could not start the expert-parallel group: {type(e).__name__}: {e}") from e
        self.pids = [pid for _, pid in ready]
        self.owner = {}
        self.groups_started += 1
        self._lost = False

    def _teardown(self) -> None:
        actors, self.actors = self.actors, []
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("ray.kill: %s", e)
        self.owner = {}

    def _lose(self, why: str, cause: BaseException | None = None) -> None:
        self._teardown()
        self._lost = True
        raise WorkerLost(f"an expert-parallel rank failed ({why}); the group is rebuilt for the next requests") \
            from cause

    def _ensure(self) -> None:
        if self._lost or not self.actors:
            self._start()

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's reply; the first failure (an actor died, or a step raised) tears the group down."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayError as e:
                    text = str(e).strip()
                    self._lose(text.splitlines()[0] if text else type(e).__name__, e)
        return ray.get(refs)

    # ---- the Executor interface ------------------------------------------------------------------------------
    def _local(self, r: StepRequest) -> tuple[int, StepRequest]:
        """The rank that runs a request (the partition of its slot) and the request with that rank's own page and
        slot ids. Raises ValueError for ids outside the rank's range (the engine's memory was not partitioned for
        this group)."""
        pages_per_rank, slots_per_rank = self.spec.num_pages, self.spec.num_slots
        rank = r.slot // slots_per_rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"request {r.request_id!r}: slot {r.slot} is outside the {self.world_size} ranks' "
                             f"{self.world_size * slots_per_rank} slots")
        known = self.owner.setdefault(r.request_id, rank)
        if known != rank:
            if r.context_len:
                raise ValueError(f"request {r.request_id!r} moved from rank {known} to rank {rank} (slot {r.slot}) "
                                 f"with {r.context_len} tokens cached")
            # preempted and admitted again (its prompt computed afresh) into another rank's partition: the old
            # rank forgets its sampling/drafting state (seeded sampling is keyed by position: nothing to carry)
            self.actors[known].release.remote([r.request_id])
            self.owner[r.request_id] = rank
            self.moves += 1
        base = rank * pages_per_rank
        # (the memory keeps every page of a request in its slot's partition; the ends are checked, O(1) a step)
        end = base + pages_per_rank
        if r.pages and not (base <= r.pages[0] < end and base <= r.pages[-1] < end):
            raise ValueError(f"request {r.request_id!r} on rank {rank} holds pages outside the rank's range "
                             f"[{base}, {end})")
        if rank == 0:
            return 0, r
        return rank, dataclasses.replace(r, pages=[p - base for p in r.pages], slot=r.slot - rank * slots_per_rank)

    def execute(self, requests: list[StepRequest]) -> StepResult:
        self._ensure()
        orphans = [r.request_id for r in requests if r.context_len > 0 and r.request_id not in self.owner]
        if orphans:  # their KV/GDN state was on a group that is gone (lost while the engine was between steps)
            raise WorkerLost(f"{len(orphans)} running request(s) lost their state with a rebuilt expert-parallel "
                             "group")
        if self.owner:  # requests have state on the group: losing a rank fails them
            return self._execute(requests)
        try:
            return self._execute(requests)
        except WorkerLost as e:  # lost while it held no request's state (a rank died while the engine was idle)
            log.warning("%s; no request had state on it: the step runs again on a new group", e)
            self._start()
            return self._execute(requests)

    def _execute(self, requests: list[StepRequest]) -> StepResult:
        per_rank: list[list[StepRequest]] = [[] for _ in range(self.world_size)]
        for r in requests:
            rank, local = self._local(r)
            per_rank[rank].append(local)
        # every rank's row bound this step, to every rank: the MoE exchanges size their all-to-alls from it
        # (host-known split sizes: no host sync in the layers)
        rows = [step_rows_bound(work) for work in per_rank]
        replies = self._gather([a.execute.remote(work, rows) for a, work in zip(self.actors, per_rank)])
        merged = StepResult.merged([result for result, _ in replies])
        self.last_rank_ms = [ms for _, ms in replies]
        return merged

    def release(self, request_ids: list[str]) -> None:
        # fire and forget to the owning rank (an actor runs one caller's calls in order)
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.owner.pop(rid, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        if self._lost or not self.actors:
            return  # the group that held them is gone
        for rank, ids in by_rank.items():
            self.actors[rank].release.remote(ids)

    def worker_pids(self) -> list[int]:
        """Each rank's actor process id (new ones after a rebuild)."""
        self._ensure()
        return [pid for _, pid in self._gather([a.ready.remote() for a in self.actors])]

    def expert_bytes(self) -> list[int]:
        """Bytes of routed-expert weights held by each rank."""
        self._ensure()
        return self._gather([a.expert_bytes.remote() for a in self.actors])

    def pool_sizes(self) -> list[tuple[int, int]]:
        """(KV pages, GDN slots) allocated by each rank."""
        self._ensure()
        return self._gather([a.pool_sizes.remote() for a in self.actors])

    def shutdown(self) -> None:
        """Kills the ranks and stops the local Ray this executor started. Any thread, any number of times (the
        server's exit on a second signal may call it while the engine's shutdown does)."""
        with self._shutdown_lock:
            if not self.actors and getattr(self, "_shut", False):
                return
            self._shut = True
            self._teardown()
            if self._owns_ray:
                shutdown_ray()
                self._owns_ray = False
