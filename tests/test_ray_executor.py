"""The `ray` executor (a local Ray with 2 CPUs on loopback): same tokens as `local`, through the Python API and
through the server; killing the worker actor fails the requests it held with UNAVAILABLE (no hang), and the
restarted actor serves the next request; killed while idle, it fails nothing. A device naming a card and a worker
the cluster cannot hold are refused before anything waits; a served process stops the Ray it started even when a
second signal makes it exit at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from clients.client import GenerationClient
from engine import LLM, SamplingParams
from serving import StderrLines, eventually, final_status, one_torch_thread, run, serving  # noqa: F401  (fixture)

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


def test_killed_while_idle_the_restarted_actor_serves_the_next_request(local, on_ray):
    """Before: the first request after an idle death failed with WorkerLost (UNAVAILABLE) though no request's
    state was lost."""
    executor = on_ray.engine.executor
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = local.generate("idle", params)[0].token_ids
    assert on_ray.generate("idle", params)[0].token_ids == expected
    old_pid = executor.worker_pid()
    ray.kill(executor.actor, no_restart=False)  # Ray restarts it (max_restarts)
    assert on_ray.generate("idle", params)[0].token_ids == expected
    assert executor.worker_pid() != old_pid
    stats = on_ray.engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["free_slots"] == stats["total_slots"]


def test_a_device_naming_a_card_is_refused_before_ray_starts(monkeypatch):
    """Ray gives each actor its GPU through CUDA_VISIBLE_DEVICES: "cuda:1" cannot be honoured. Before: the Ray
    executor quietly ran on whichever card Ray picked (the EP executor likewise)."""
    import engine.ep_executor as epx
    import engine.ray_executor as rx
    from engine.executor import WorkerSpec

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not be started for a refused device")

    monkeypatch.setattr(rx, "_init_ray", no_ray)
    monkeypatch.setattr(epx, "_init_ray", no_ray)
    for executor, ep in ((rx.RayExecutor, 1), (epx.ExpertParallelExecutor, 2)):
        spec = WorkerSpec("unused", "float32", "cuda:1", 4, 16, 2, expert_parallel=ep)
        with pytest.raises(ValueError, match=r"^device 'cuda:1' cannot be used with executor 'ray'.*use device 'cuda'"):
            executor(spec)


def test_a_worker_the_cluster_cannot_hold_is_refused_instead_of_waited_for(on_ray, monkeypatch):
    """The fixture's Ray has no GPU: a worker on "cuda" would never be placed (the engine waited for ever)."""
    import engine.ray_executor as rx
    from engine.executor import WorkerSpec

    def no_actor(*args, **kwargs):
        raise AssertionError("no actor may be started for a worker the cluster cannot hold")

    monkeypatch.setattr(rx.ray, "remote", no_actor)
    with pytest.raises(ValueError, match=r"^executor 'ray' \(device 'cuda'\) needs 1 GPU, the Ray cluster has 0$"):
        rx.RayExecutor(WorkerSpec("unused", "float32", "cuda", 4, 16, 2))
    assert ray.is_initialized()  # the fixture's Ray (joined, not started here) is left running


# ------------------------------------------------------------------------- a served process, two signals
ROOT = Path(__file__).resolve().parents[1]


class RayServer(StderrLines):
    """`python -m engine.cli serve --executor ray` in its own session, its Ray (started by the server: no
    RAY_ADDRESS) under a temp dir of its own, so that every Ray process it started names that dir."""

    def __init__(self, *args: str):
        self.ray_tmp = short_temp_dir()
        super().__init__(subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--executor", "ray", "--port", "0", *args], cwd=ROOT,
            env=ray_env(self.ray_tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True))

    def ray_processes(self) -> list:
        return ray_processes_under(self.ray_tmp)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        kill_ray_processes_under(self.ray_tmp)


def ray_processes_under(ray_tmp: str) -> list:
    """Live processes of a Ray started with RAY_TMPDIR=ray_tmp (raylet, GCS, agents, workers: each names it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and ray_tmp in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    return found


def no_ray_processes_left(ray_tmp: str, timeout: float = 15.0) -> list:
    """Waits up to `timeout` for the Ray under ray_tmp to be gone; returns what is left."""
    deadline = time.monotonic() + timeout
    while (left := ray_processes_under(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [(p.pid, " ".join(p.cmdline())[:100]) for p in left]


def kill_ray_processes_under(ray_tmp: str) -> None:
    for p in ray_processes_under(ray_tmp):  # whatever a failed test left
        with contextlib.suppress(Exception):
            p.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def ray_env(ray_tmp: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_TMPDIR=ray_tmp,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    return env


def short_temp_dir() -> str:
    return tempfile.mkdtemp(prefix="hs-ray-", dir="/tmp")  # short: Ray's socket paths below it fit in 107 bytes


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_exits_at_once_and_stops_the_ray_the_server_started(signum):
    """Before: a second SIGTERM got the default action at once, leaving the server's local Ray behind (its
    dashboard agent lived on); a second SIGINT raised KeyboardInterrupt wherever the main thread was."""
    pytest.importorskip("psutil")  # (Ray ships one)
    server = RayServer("--max-model-len", "2048", "--max-running", "2", "--drain-timeout", "120")
    try:
        target = server.wait_for("listening on ", 120.0).split("listening on ")[1].split()[0]
        assert server.ray_processes(), "the server's Ray should run under its RAY_TMPDIR"

        async def main() -> tuple[int, float]:
            async with GenerationClient(target) as client:
                chunks: list = []

                async def long() -> None:  # still running when the signals come: the drain would wait for it
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        async for chunk in client.generate("long", max_new_tokens=2000, ignore_eos=True):
                            chunks.append(chunk)

                task = asyncio.create_task(long())

                async def streaming() -> bool:
                    return bool(chunks)
                await eventually(streaming, 60.0, "the long request streaming")
                server.proc.send_signal(signum)
                await asyncio.to_thread(server.wait_for, "draining", 10.0)
                assert server.proc.poll() is None and not task.done()
                server.proc.send_signal(signum)
                start = time.monotonic()
                rc = await asyncio.to_thread(server.proc.wait, 60)
                took = time.monotonic() - start
                await asyncio.wait_for(task, 10.0)
                return rc, took

        rc, took = run(main(), timeout=180.0)
        assert took < 20.0, took  # at once: not after the drain (120 s)
        left = no_ray_processes_left(server.ray_tmp)
        assert not left, (left, rc, "".join(server.stderr)[-3000:])
        assert rc == -signum, (rc, "".join(server.stderr))  # killed by the signal, as its default action would
        assert any("again: exiting now" in line for line in server.stderr), server.stderr
    finally:
        server.cleanup()


RAYLET_CRASHES_IN_SHUTDOWN = """
import time
import ray
import psutil  # (Ray's own, found once ray is imported)
import engine.ray_executor as rx

assert rx._init_ray(None, 1)
raylet = next(p for p in psutil.Process().children() if p.name() == "raylet")
deadline = time.monotonic() + 20
while len(raylet.children()) < 2 and time.monotonic() < deadline:  # its dashboard and runtime-env agents
    time.sleep(0.1)
shutdown = ray.shutdown

def raylet_dies_first():  # as one that Ray SIGKILLs after 1 s, or one that aborts while it stops
    raylet.kill()
    raylet.wait(10)
    shutdown()

ray.shutdown = raylet_dies_first
rx.shutdown_ray()
"""


def test_shutdown_ray_kills_what_a_raylet_that_died_uncleanly_left():
    """Seen in 1 of ~30 runs of the test above: the raylet aborted while stopping ("mistakenly been marked as dead
    by the GCS"), and its agents lived on for minutes after ray.shutdown()."""
    pytest.importorskip("psutil")  # (Ray ships one)
    ray_tmp = short_temp_dir()
    try:
        out = subprocess.run([sys.executable, "-c", RAYLET_CRASHES_IN_SHUTDOWN], cwd=ROOT, env=ray_env(ray_tmp),
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        assert not no_ray_processes_left(ray_tmp, 5.0)
        assert "killing a Ray process left after ray.shutdown()" in out.stderr
    finally:
        kill_ray_processes_under(ray_tmp)
