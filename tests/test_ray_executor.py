"""The `ray` executor (a local Ray with 2 CPUs on loopback): same tokens as `local`, through the Python API and
through the server; killing the worker actor fails the requests it held with UNAVAILABLE (no hang), and the
restarted actor serves the next request."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from clients.client import GenerationClient
from engine import LLM, SamplingParams
from serving import eventually, final_status, one_torch_thread, run, serving  # noqa: F401  (fixture)

ray = pytest.importorskip("ray")

LIMITS = {"max_model_len": 1024, "max_running": 8, "max_step_tokens": 256}
PROMPTS = ["def fibonacci(n):", "hello world " * 5, "é日本", "x" * 150, "a", "The quick brown fox"]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0) for i, n in enumerate([12, 20, 7, 16, 25, 9])]


@pytest.fixture(scope="module")
def local(one_torch_thread) -> LLM:
    return LLM(**LIMITS)


@pytest.fixture(scope="module")
def on_ray(one_torch_thread):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    llm = LLM(executor="ray", **LIMITS)
    yield llm
    llm.engine.shutdown()


def test_ray_gives_the_same_tokens_as_local(local, on_ray):
    from engine.ray_executor import RayExecutor

    assert isinstance(on_ray.engine.executor, RayExecutor)
    expected = local.generate(PROMPTS, PARAMS)
    got = on_ray.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]

    async def main() -> list[list[int]]:
        async with serving(on_ray.engine) as (server, target), GenerationClient(target) as client:
            done = await asyncio.gather(*(client.complete(p, max_new_tokens=q.max_new_tokens, ignore_eos=q.ignore_eos)
                                          for p, q in zip(PROMPTS, PARAMS)))
            return [c.token_ids for c in done]

    assert run(main()) == [r.token_ids for r in expected]


def test_killed_actor_fails_in_flight_with_unavailable_and_the_next_request_succeeds(local, on_ray):
    executor = on_ray.engine.executor
    expected = local.generate("after", SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids

    async def stream(client, prompt: str):
        return await final_status(client, prompt, 900)

    async def main() -> None:
        async with serving(on_ray.engine) as (server, target), GenerationClient(target) as client:
            tasks = [asyncio.create_task(stream(client, f"doomed {i}")) for i in range(3)]

            async def all_running() -> bool:
                return (await client.stats()).running_requests == 3
            await eventually(all_running, 30.0, "three requests running on the actor")
            old_pid = await asyncio.to_thread(executor.worker_pid)
            os.kill(old_pid, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
            assert outcomes == [grpc.StatusCode.UNAVAILABLE] * 3, outcomes

            after = await asyncio.wait_for(client.complete("after", max_new_tokens=10, ignore_eos=True), 120.0)
            assert after.token_ids == expected
            assert await asyncio.to_thread(executor.worker_pid) != old_pid
            stats = await client.stats()
            assert stats.free_pages == stats.total_pages and stats.free_slots == stats.total_slots

    run(main(), timeout=180.0)


def test_a_local_ray_node_that_times_out_at_startup_is_started_again(monkeypatch):
    """CI once saw Ray's fixed 30 s wait for a new node's object store run out on 2 busy cores."""
    import engine.ray_executor as rx

    calls, shutdowns = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(rx.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rx.ray, "init", init)
    monkeypatch.setattr(rx.ray, "shutdown", lambda: shutdowns.append(1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert rx._init_ray(None, 2) is True and len(calls) == 2 and len(shutdowns) == 1
    calls.clear()

    def always(**kwargs):
        calls.append(kwargs)
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(rx.ray, "init", always)
    with pytest.raises(Exception, match="timed out during startup"):
        rx._init_ray(None, 2)
    assert len(calls) == rx.LOCAL_START_ATTEMPTS
    monkeypatch.setattr(rx.ray, "init", lambda **kwargs: (_ for _ in ()).throw(ValueError("bad address")))
    with pytest.raises(ValueError, match="bad address"):  # any other failure: at once
        rx._init_ray(None, 2)
