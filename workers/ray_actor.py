"""RunnerActor: a ModelRunner inside a Ray actor (the `ray` executor's worker).

Plain class: the engine wraps it with `ray.remote(...)` and its options (restarts, CPUs/GPUs), so this module
needs neither ray nor the engine. The runner is built by a picklable zero-argument factory, which Ray calls
again when it restarts a dead actor: a restarted worker has empty caches and a new `incarnation`, which every
reply carries so the engine can tell that the requests it was running lost their state.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from scheduler.types import StepRequest, StepResult
from workers.runner import ModelRunner


class RunnerActor:
    def __init__(self, factory: Callable[[], ModelRunner]):
        self.runner = factory()
        self.incarnation = uuid.uuid4().hex

    def ready(self) -> tuple[str, int]:
        """(incarnation, process id) once the runner is built."""
        return self.incarnation, os.getpid()

    def execute(self, requests: list[StepRequest], incarnation: str | None = None) -> tuple[str, StepResult | None]:
        """Runs a step meant for `incarnation` (None: for any): a restarted actor, meant for none of the
        requests' state, runs nothing and answers None with its own incarnation."""
        if incarnation is not None and incarnation != self.incarnation:
            return self.incarnation, None
        return self.incarnation, self.runner.execute(requests)

    def release(self, request_ids: list[str]) -> str:
        self.runner.release(request_ids)
        return self.incarnation

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
        """Any other runner method, for executor methods added after this actor (see RayExecutor.__getattr__)."""
        return self.incarnation, getattr(self.runner, method)(*args, **kwargs)
