"""Helpers for the server, client and executor tests: an in-process server on a free loopback port, one
thread for torch, the reference generations from the in-process LLM."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny default model is far faster on one intra-op thread on a small shared machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
    """Runs a test coroutine on a fresh event loop, with an overall timeout (a hang fails, not blocks)."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(core, **options: Any) -> AsyncIterator[tuple[Any, str]]:
    """An in-process Server for `core` on a free loopback port: yields (server, "127.0.0.1:PORT")."""
    from engine.server import ServeOptions, Server

    server = Server(core, ServeOptions(host="127.0.0.1", port=0, **options))
    port = await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(drain_timeout=0.0)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


async def final_status(client, prompt: str, max_new_tokens: int) -> Any:
    """Streams one request to its end: the final chunk's finish reason, or the gRPC status code it failed with
    (a request on a worker that died must end with UNAVAILABLE, not hang)."""
    import grpc

    try:
        async for chunk in client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True):
            if chunk.finished:
                return chunk.finish_reason or ""
    except grpc.aio.AioRpcError as e:
        return e.code()
    return "no final chunk"


class StderrLines:
    """A started process's stderr, read line by line on a thread: `stderr` holds every line so far, wait_for
    returns the first new one containing a text."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"the process never printed {text!r}; stderr:\n{''.join(self.stderr)}")
