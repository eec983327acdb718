"""RayExecutor: the worker (ModelRunner) in a Ray actor, with the LocalExecutor interface.

Joins the cluster at RAY_ADDRESS when it is set; otherwise starts a local Ray bound to loopback (no dashboard).
Ray places the actor and restarts it when it dies (`max_restarts`); it never carries per-layer tensors, only
the plain StepRequest/StepResult data. A restarted actor has lost every request's KV and GDN state, so a call
that fails because the actor died, or that is answered by a new incarnation of it, raises WorkerLost: the
engine then fails the requests it was running and carries on with the restarted worker. A death that lost no
request's state (the worker died while the engine was idle) fails nothing: the step waits for the restarted
actor and runs there (a step is sent with the incarnation it is meant for; another one runs nothing).

Ray assigns each actor its GPU through CUDA_VISIBLE_DEVICES, so a device naming a card ("cuda:1") is refused;
so is a worker set that the cluster's GPUs / CPUs can never hold (Ray would wait for it for ever).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from engine.executor import WorkerLost, WorkerSpec, build_runner
from scheduler.types import StepRequest, StepResult
from workers.ray_actor import RunnerActor
from workers.runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_NUM_CPUS = 2  # of a local Ray started here (the actor takes one)
# starts of a local Ray node: on 2 busy cores (CI, another test worker running a model) its object store once missed
# Ray's fixed 30 s startup wait ("The current node timed out during startup")
LOCAL_START_ATTEMPTS = 3


def _init_ray(address: str | None, num_cpus: int) -> bool:
    """Connects to Ray if this process is not connected yet; returns whether it started a local instance."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                     configure_logging=False, log_to_driver=True)
            return True
        except Exception as e:  # Ray waits a fixed 30 s for its node's object store; a loaded machine can miss it
            if "timed out during startup" not in str(e) or attempt == LOCAL_START_ATTEMPTS:
                raise
            log.warning("a local Ray node timed out during startup (attempt %d of %d): starting it again",
                        attempt, LOCAL_START_ATTEMPTS)
            ray.shutdown()
    raise AssertionError("unreachable")


def check_ray_device(device: str) -> None:
    """Ray gives each worker actor its GPU through CUDA_VISIBLE_DEVICES: inside the actor that card is always
    cuda:0, so a device naming a card cannot be honoured."""
    if device.startswith("cuda:"):
        raise ValueError(f"device {device!r} cannot be used with executor 'ray': Ray picks each worker's GPU, use "
                         "device 'cuda' (to choose the cards, start Ray with CUDA_VISIBLE_DEVICES)")


def check_cluster_fits(what: str, actors: int, num_gpus: int, num_cpus: int) -> None:
    """Raises ValueError where the Ray cluster has fewer GPUs or CPUs in total than `actors` actors of `num_gpus`
    and `num_cpus` each need: Ray would never place them and the engine would wait for ever. (The cluster as it
    is now: an autoscaler's future nodes are not counted.)"""
    have = ray.cluster_resources()
    for resource, each in (("GPU", num_gpus), ("CPU", num_cpus)):
        need, has = actors * each, have.get(resource, 0)
        if need > has:
            raise ValueError(f"{what} needs {need} {resource}{'s' if need != 1 else ''}, the Ray cluster has {has:g}")


_SHUTDOWN_LOCK = threading.Lock()
STRAGGLER_WAIT_S = 1.0  # after ray.shutdown(), for the processes below the raylet to exit on their own


def shutdown_ray() -> None:
    """ray.shutdown() of the local Ray this process started, one caller at a time (the server's exit on a second
    signal may run it while the engine's own shutdown does, in another thread); then the processes below its
    raylet that outlived it are killed (see _raylet_descendants)."""
    with _SHUTDOWN_LOCK:
        if not ray.is_initialized():
            return
        below_raylet = _raylet_descendants()
        ray.shutdown()
        _kill_stragglers(below_raylet)


def _raylet_descendants() -> list[Any]:
    """The processes below a raylet that this process started (its dashboard and runtime-env agents, its
    workers). Where the raylet does not exit cleanly (Ray SIGKILLs one that takes over 1 s; one also aborted
    with "mistakenly been marked as dead by the GCS" while shutting down), its agents live on for minutes,
    reporting that death to a GCS that is gone."""
    try:
        import psutil  # (one of Ray's own dependencies)

        raylets = [p for p in psutil.Process().children() if p.name() == "raylet"]
        return [p for raylet in raylets for p in raylet.children(recursive=True)]
    except Exception as e:  # noqa: BLE001 - no psutil, or a process gone meanwhile: Ray's own cleanup only
        log.debug("the raylet's processes: %s", e)
        return []


def _kill_stragglers(processes: list[Any]) -> None:
    if not processes:
        return
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=STRAGGLER_WAIT_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):  # (exited meanwhile)
            log.warning("killing a Ray process left after ray.shutdown(): %d %s", p.pid, p.name())
            p.kill()


class RayExecutor:
    def __init__(self, spec: WorkerSpec, *, address: str | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 num_cpus: int = DEFAULT_NUM_CPUS, restart_timeout_s: float = 120.0):
        check_ray_device(spec.device)
        self._shutdown_lock = threading.Lock()
        self._owns_ray = _init_ray(address, num_cpus)
        on_gpu = spec.device.startswith("cuda")
        try:
            check_cluster_fits(f"executor 'ray' (device {spec.device!r})", 1, 1 if on_gpu else 0, 1)
        except ValueError:
            if self._owns_ray:
                shutdown_ray()
            raise
        actor_cls = ray.remote(RunnerActor).options(
            max_restarts=max_restarts, max_task_retries=0, num_cpus=1, num_gpus=1 if on_gpu else 0)
        self.actor = actor_cls.remote(functools.partial(build_runner, spec))
        self.incarnation, self.pid = ray.get(self.actor.ready.remote())
        self._lost = False  # a call failed because the actor died; the next call first waits for its restart
        self._held: set[str] = set()  # requests with state on the actor's current incarnation (ran, not released)
        self.restart_timeout_s = restart_timeout_s

    def _get(self, ref: ray.ObjectRef) -> Any:
        """The reply's value. Where the actor died, or a new incarnation answered, the requests it held lost their
        state: WorkerLost; a new incarnation's answer is kept where the actor held none (it lost nothing)."""
        try:
            incarnation, value = ray.get(ref)
        except RayActorError as e:
            self._lost = True
            self._held.clear()
            text = str(e).strip()
            raise WorkerLost(f"the Ray worker actor died ({text.splitlines()[0] if text else type(e).__name__})") from e
        if incarnation != self.incarnation:  # died and was restarted between two calls
            self.incarnation = incarnation
            lost, self._held = self._held, set()
            if lost:
                raise WorkerLost("the Ray worker actor was restarted and lost its requests' state")
            log.warning("the Ray worker actor was restarted while it held no request's state")
        return value

    def _await_restart(self) -> None:
        """After a reported loss: wait until Ray has the actor back (or give up), and learn its incarnation."""
        if not self._lost:
            return
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            try:
                self.incarnation, self.pid = ray.get(self.actor.ready.remote(),
                                                     timeout=max(deadline - time.monotonic(), 0.1))
                break
            except ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise WorkerLost(f"the Ray worker actor is not back after {self.restart_timeout_s:g}s") from None
                time.sleep(0.1)
            except (RayActorError, GetTimeoutError) as e:  # dead for good (restarts used up), or stuck
                raise WorkerLost(f"the Ray worker actor is gone: {type(e).__name__}") from e
        self._lost = False

    def execute(self, requests: list[StepRequest]) -> StepResult:
        self._await_restart()
        orphans = [r.request_id for r in requests if r.context_len > 0 and r.request_id not in self._held]
        if orphans:  # their KV/GDN state was on an incarnation that is gone (a loss found outside a step)
            raise WorkerLost(f"{len(orphans)} running request(s) lost their state with a restarted Ray worker actor")
        result = self._execute_once(requests)
        if result is None:  # the actor died while it held no request's state: the restarted one runs the step
            self._await_restart()
            result = self._execute_once(requests)
            if result is None:
                raise WorkerLost("the Ray worker actor was restarted again while the step was retried")
        self._held.update(r.request_id for r in requests)
        return result

    def _execute_once(self, requests: list[StepRequest]) -> StepResult | None:
        """One try of a step. None: the actor died (or a new incarnation answered without running the step) while
        it held no request's state, so nothing was lost and the step can run again."""
        idle = not self._held
        try:
            return self._get(self.actor.execute.remote(requests, self.incarnation))
        except WorkerLost as e:
            if not idle:
                raise
            log.warning("%s while it held no request's state: the step runs on the restarted actor", e)
            return None

    def release(self, request_ids: list[str]) -> None:
        # Fire and forget: a Ray actor runs one caller's calls in order, so the release lands before the next
        # step; waiting for it would add a round trip per finished request.
        self._held.difference_update(request_ids)
        actor = self.__dict__.get("actor")
        if actor is not None:  # (None: shut down, e.g. by a server's exit on a second signal while a step ran)
            actor.release.remote(request_ids)

    def worker_pid(self) -> int:
        """The actor's current process id (changes when Ray restarts it)."""
        return ray.get(self.actor.ready.remote())[1]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Forwards any other public ModelRunner method to the runner in the actor (same name, same arguments),
        so an executor method added for the local runner works here too."""
        if name.startswith("_") or "actor" not in self.__dict__ or not callable(getattr(ModelRunner, name, None)):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            self._await_restart()
            return self._get(self.actor.call.remote(name, args, kwargs))

        return call

    def shutdown(self) -> None:
        """Kills the actor and stops the local Ray this executor started. Any thread, any number of times (the
        server's exit on a second signal may call it while the engine's shutdown does)."""
        with self._shutdown_lock:
            actor = self.__dict__.pop("actor", None)
            if actor is None:
                return  # already shut down
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already gone
                log.debug("ray.kill: %s", e)
            if self._owns_ray:
                shutdown_ray()
