"""Drives the load: a closed loop (N clients, each sending its next request when the previous one ends) or an
open loop (Poisson arrivals at a rate, optionally capped in flight), bounded by a request count and/or a time
limit (after which no new request starts; those in flight finish)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from clients.client import GenerationClient
from loadtest.metrics import ABORTED, RequestRecord
from loadtest.progress import Progress
from loadtest.workload import RequestSpec, Workload


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = True
    timeout: float | None = None  # each call's deadline, seconds


async def run_one(client: GenerationClient, spec: RequestSpec, sampling: Sampling, request_id: str = ""
                  ) -> RequestRecord:
    """Sends one request and records its stream; leaves the stream (cancelling the call) after
    `spec.cancel_after_chunks` messages if it has not finished by then."""
    rec = RequestRecord(index=spec.index, start=time.perf_counter(), cancel_after_chunks=spec.cancel_after_chunks,
                        prompt_tokens=None if isinstance(spec.prompt, str) else len(spec.prompt))
    stream = client.generate(spec.prompt, request_id=request_id, max_new_tokens=spec.max_new_tokens,
                             temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                             seed=spec.seed, ignore_eos=sampling.ignore_eos, timeout=sampling.timeout)
    try:
        async with contextlib.aclosing(stream):  # leaving early closes the generator, which cancels the call
            chunks = 0
            async for chunk in stream:
                now = time.perf_counter()
                chunks += 1
                if chunk.token_ids:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(len(chunk.token_ids))
                if chunk.finished:
                    rec.finish_reason = chunk.finish_reason
                    if chunk.finish_reason == "abort":  # the server ended it (draining, a failed step): no completion
                        rec.status, rec.detail = ABORTED, "the server aborted the stream (finish_reason abort)"
                    if chunk.usage is not None:
                        u = chunk.usage
                        rec.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                     "draft_tokens": u.draft_tokens, "accepted_tokens": u.accepted_tokens,
                                     "verify_steps": u.verify_steps}
                        rec.prompt_tokens = u.prompt_tokens
                elif spec.cancel_after_chunks is not None and chunks >= spec.cancel_after_chunks:
                    rec.status, rec.detail = grpc.StatusCode.CANCELLED.name, f"cancelled after {chunks} chunks"
                    break
    except grpc.aio.AioRpcError as e:
        rec.status, rec.detail = e.code().name, e.details() or ""
    except (ConnectionError, OSError, RuntimeError, ValueError) as e:  # a client-side failure, not the server's
        rec.status, rec.detail = grpc.StatusCode.UNKNOWN.name, f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter()
    return rec


async def drive(clients: Sequence[GenerationClient], workload: Workload, sampling: Sampling, *,
                concurrency: int | None, rate: float | None = None, requests: int | None = None,
                duration: float | None = None, seed: int = 0, progress: Progress | None = None,
                stop: asyncio.Event | None = None) -> list[RequestRecord]:
    """Runs the load and returns one record per request sent, in the order they ended. `rate` set: open loop
    (`concurrency` caps the requests in flight, None = no cap); otherwise closed loop with `concurrency`
    clients. At least one of `requests` and `duration` must be given."""
    if requests is None and duration is None:
        raise ValueError("bound the run with a number of requests or a duration")
    if rate is None and not concurrency:
        raise ValueError("a closed loop needs a concurrency >= 1")
    stop = stop or asyncio.Event()
    run_id = uuid.uuid4().hex[:8]
    deadline = None if duration is None else time.perf_counter() + duration
    records: list[RequestRecord] = []

    def more(i: int) -> bool:
        return (not stop.is_set() and (requests is None or i < requests)
                and (deadline is None or time.perf_counter() < deadline))

    async def one(i: int) -> None:
        if progress:
            progress.request_started()
        rec = await run_one(clients[i % len(clients)], workload.request(i), sampling, f"lt-{run_id}-{i}")
        records.append(rec)
        if progress:
            progress.request_ended(rec.status, rec.output_tokens)

    async def ticker() -> None:
        while progress:
            await asyncio.sleep(0.5)
            progress.render()

    tick = asyncio.create_task(ticker())
    try:
        if rate is None:
            counter = itertools.count()

            async def client_loop() -> None:
                while more(i := next(counter)):
                    await one(i)

            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        else:
            await _open_loop(one, more, rate, concurrency, seed)
    finally:
        tick.cancel()
        if progress:
            progress.close()
    return records


async def _open_loop(one, more, rate: float, cap: int | None, seed: int) -> None:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(f"{seed}/arrivals")
    gate = asyncio.Semaphore(cap) if cap else None
    tasks: set[asyncio.Task] = set()

    async def gated(i: int) -> None:
        if gate is None:
            await one(i)
            return
        async with gate:
            await one(i)

    t = time.perf_counter()
    for i in itertools.count():
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        if not more(i):
            break
        task = asyncio.create_task(gated(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
