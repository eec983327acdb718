"""AsyncEngine: EngineCore behind asyncio, for the server.

One engine thread owns the EngineCore: it applies queued commands (add, abort) between steps, runs steps
back to back while there is work, and sleeps when there is none. Each step's outputs go back to the event
loop in one `call_soon_threadsafe`, where they are put on the per-request queues that `generate` streams from.
So the core is only ever touched by one thread, and an abort (a cancelled or disconnected client) is applied
before the next step starts: the request's pages and slot are free within one step.

Overload: a request that finds `max_waiting` requests already queued in the engine fails with EngineOverloaded
(RESOURCE_EXHAUSTED). Shutdown: `drain()` stops admitting (EngineUnavailable), lets in-flight requests
finish until a timeout, then aborts the rest (they end with finish_reason "abort").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.core import EngineCore, StepOutput
from engine.executor import WorkerLost
from engine.metrics import EngineMetrics
from scheduler.request import RequestStats
from scheduler.types import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 512


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the request was not admitted (RESOURCE_EXHAUSTED)."""


class EngineUnavailable(RuntimeError):
    """The engine is draining or stopped, or the worker that held the request died (UNAVAILABLE)."""


class EngineFailed(RuntimeError):
    """A step failed for a reason other than a lost worker (INTERNAL)."""


@dataclass
class _Stream:
    client_id: str
    queue: asyncio.Queue[StepOutput | BaseException]
    done: bool = False  # the engine is done with it (finished or failed)


@dataclass
class _Add:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    rid: str


@dataclass
class _Delivery:
    """What one pass of the engine thread sends to the event loop."""

    outputs: list[StepOutput] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    policy_stats: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (rid, prompt tokens)


class AsyncEngine:
    def __init__(self, core: EngineCore, max_waiting: int = DEFAULT_MAX_WAITING,
                 metrics: EngineMetrics | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.core, self.max_waiting = core, max_waiting
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.accepting = False
        self._streams: dict[str, _Stream] = {}  # internal id -> stream (event loop thread only)
        self._client_ids: set[str] = set()  # request ids in flight, as the clients named them
        self._ids = itertools.count()
        self._commands: list[_Add | _Abort] = []
        self._stop_thread = False
        self._wake = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = asyncio.Event()
        self.last_stats: dict[str, int] = core.stats()
        self.metrics.observe_occupancy(self.last_stats)  # (the gauges read the pools before the first step too)

    # ---- lifecycle (event loop) -------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self.accepting = True
        self._thread = threading.Thread(target=self._run, name="hybridspec-engine", daemon=True)
        self._thread.start()

    async def drain(self, timeout: float) -> int:
        """Stops admitting, waits up to `timeout` seconds for in-flight requests, aborts the rest.
        Returns how many were aborted."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            pass
        aborted_before = self.metrics.requests_finished["abort"]
        self._submit(*[_Abort(rid) for rid in self._streams])
        try:
            await asyncio.wait_for(self._idle.wait(), 10.0)
        except asyncio.TimeoutError:
            log.warning("%d requests did not end after their abort", len(self._streams))
        return self.metrics.requests_finished["abort"] - aborted_before

    async def shutdown(self, shutdown_core: bool = True) -> None:
        """Stops the engine thread (aborting whatever is left in the core) and, with shutdown_core, the core's
        executor."""
        self.accepting = False
        if self._thread is not None:
            with self._wake:
                self._stop_thread = True
                self._wake.notify()
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineUnavailable("the server is shutting down"))
        if shutdown_core:
            await asyncio.get_running_loop().run_in_executor(None, self.core.shutdown)

    # ---- requests (event loop) ----------------------------------------------------------------------------
    def check_admissible(self, client_id: str) -> None:
        """Raises what `generate` would raise at once (draining, duplicate id) without submitting anything."""
        if not self.accepting:
            raise EngineUnavailable("the server is not accepting requests (shutting down)")
        if client_id in self._client_ids:
            raise InvalidRequest(f"request_id {client_id!r} is already in flight; request ids must be unique "
                                 "among the requests in flight", "request_id")

    async def generate(self, client_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Streams one request's outputs; the last has finished=True. Leaving early (an exception, a cancel,
        or closing the generator) aborts the request. Raises InvalidRequest, EngineOverloaded or
        EngineUnavailable when it is not admitted, EngineUnavailable/EngineFailed when its worker fails."""
        self.check_admissible(client_id)
        rid = f"{next(self._ids)}"
        stream = _Stream(client_id, asyncio.Queue())
        self._streams[rid] = stream
        self._client_ids.add(client_id)
        self._idle.clear()
        self._submit(_Add(rid, list(prompt_ids), params))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.done = True
                    raise item
                stream.done = item.finished
                yield item
                if item.finished:
                    return
        finally:
            if not stream.done:  # the consumer left early: abort (applied before the next step)
                self._submit(_Abort(rid))
            self._forget(rid)  # internal ids are never reused, so late outputs for it are simply dropped

    def _forget(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._client_ids.discard(stream.client_id)
        if not self._streams:
            self._idle.set()

    def stats(self) -> dict[str, int]:
        """The latest occupancy snapshot (taken by the engine thread after its last step or command)."""
        return dict(self.last_stats, max_waiting=self.max_waiting, accepting=int(self.accepting))

    # ---- engine thread ------------------------------------------------------------------------------------
    def _submit(self, *commands: _Add | _Abort) -> None:
        with self._wake:
            self._commands.extend(commands)
            self._wake.notify()

    def _run(self) -> None:
        core = self.core
        while True:
            with self._wake:
                while not self._commands and not self._stop_thread and not core.has_work():
                    self._wake.wait()
                commands, self._commands = self._commands, []
                stopping = self._stop_thread
            delivery = _Delivery()
            for command in commands:
                self._apply(command, delivery)
            if stopping:  # leave the core empty: abort whatever is still in it
                for rid in list(core.live):
                    self._apply(_Abort(rid), delivery)
            elif core.has_work():
                start = time.perf_counter()
                try:
                    delivery.outputs += core.step()
                except WorkerLost as e:
                    log.warning("worker lost: %s; failing the requests it was running", e)
                    self._fail_running(EngineUnavailable(f"{e}; the request was aborted, retry it"), delivery)
                except Exception as e:  # a bug: fail what ran, keep serving the rest
                    log.exception("engine step failed")
                    self._fail_running(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"), delivery)
                delivery.step_s = time.perf_counter() - start
            delivery.stats = core.stats()
            delivery.policy_stats = core.policy_stats
            self._deliver_threadsafe(delivery)
            if stopping:
                return

    def _apply(self, command: _Add | _Abort, delivery: _Delivery) -> None:
        core = self.core
        if isinstance(command, _Abort):
            live = core.live.get(command.rid)
            if live is not None:
                stats = live.request.stats
                core.abort(command.rid)
                delivery.outputs.append(StepOutput(command.rid, [], "", True, "abort", stats))
            return  # finished or failed already
        if core.stats()["waiting_requests"] >= self.max_waiting:
            delivery.errors[command.rid] = EngineOverloaded(
                f"the waiting queue is full ({self.max_waiting} requests, --max-waiting); retry later")
            return
        try:
            core.add_request(command.rid, command.prompt_ids, command.params)
            delivery.admitted.append((command.rid, len(command.prompt_ids)))
        except InvalidRequest as e:
            delivery.errors[command.rid] = e
        except Exception as e:
            log.exception("add_request failed")
            delivery.errors[command.rid] = EngineFailed(f"could not add the request: {type(e).__name__}: {e}")

    def _fail_running(self, error: BaseException, delivery: _Delivery) -> None:
        for rid in self.core.fail_running():  # (at least no stream may hang)
            delivery.errors[rid] = error

    def _deliver_threadsafe(self, delivery: _Delivery) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, delivery)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # ---- back on the event loop ------------------------------------------------------------------------
    def _deliver(self, delivery: _Delivery) -> None:
        self.last_stats = delivery.stats
        m = self.metrics
        m.observe_occupancy(delivery.stats)
        m.policy = delivery.policy_stats
        if delivery.step_s is not None:
            m.observe_step(delivery.step_s)
        for rid, prompt_tokens in delivery.admitted:
            m.request_admitted(prompt_tokens)
        for out in delivery.outputs:
            m.tokens_generated(len(out.new_token_ids))
            if out.draft_tokens:
                m.observe_verification(out.accepted_tokens)
            if out.finished:
                m.request_finished(out.finish_reason or "stop", out.stats or RequestStats())
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
        for rid, error in delivery.errors.items():
            m.request_failed(type(error).__name__)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(error)

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Waits until no request is in flight."""
        await asyncio.wait_for(self._idle.wait(), timeout)
