"""RayExecutor: the worker (ModelRunner) in a Ray actor, with the LocalExecutor interface.

Joins the cluster at RAY_ADDRESS when it is set; otherwise starts a local Ray bound to loopback (no dashboard).
Ray places the actor and restarts it when it dies (`max_restarts`); it never carries per-layer tensors, only
the plain StepRequest/StepResult data. A restarted actor has lost every request's KV and GDN state, so a call
that fails because the actor died, or that is answered by a new incarnation of it, raises WorkerLost: the
engine then fails the requests it was running and carries on with the restarted worker.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
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


class RayExecutor:
    def __init__(self, spec: WorkerSpec, *, address: str | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 num_cpus: int = DEFAULT_NUM_CPUS, restart_timeout_s: float = 120.0):
        self._owns_ray = _init_ray(address, num_cpus)
        on_gpu = spec.device.startswith("cuda")
        if on_gpu:  # Ray gives the actor one GPU through CUDA_VISIBLE_DEVICES; inside it that GPU is "cuda"
            spec = dataclasses.replace(spec, device="cuda")
        actor_cls = ray.remote(RunnerActor).options(
            max_restarts=max_restarts, max_task_retries=0, num_cpus=1, num_gpus=1 if on_gpu else 0)
        self.actor = actor_cls.remote(functools.partial(build_runner, spec))
        self.incarnation, self.pid = ray.get(self.actor.ready.remote())
        self._lost = False  # a call failed because the actor died; the next call first waits for its restart
        self.restart_timeout_s = restart_timeout_s

    def _get(self, ref: ray.ObjectRef) -> Any:
        try:
            incarnation, value = ray.get(ref)
        except RayActorError as e:
            self._lost = True
            text = str(e).strip()
            raise WorkerLost(f"the Ray worker actor died ({text.splitlines()[0] if text else type(e).__name__})") from e
        if incarnation != self.incarnation:  # died and was restarted between two calls
            self.incarnation = incarnation
            raise WorkerLost("the Ray worker actor was restarted and lost its requests' state")
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
        return self._get(self.actor.execute.remote(requests))

    def release(self, request_ids: list[str]) -> None:
        # Fire and forget: a Ray actor runs one caller's calls in order, so the release lands before the next
        # step; waiting for it would add a round trip per finished request.
        self.actor.release.remote(request_ids)

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
        actor = self.__dict__.pop("actor", None)
        if actor is None:
            return  # already shut down
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already gone
            log.debug("ray.kill: %s", e)
        if self._owns_ray:
            ray.shutdown()
