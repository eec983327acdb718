"""`hybridspec generate PROMPT --server HOST:PORT`: streams a completion from a running server to the terminal.

engine/cli.py parses the command line and hands the options here; this side needs only proto and grpc.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from clients.client import GenerationClient


async def stream_generate(server: str, prompt: str | Sequence[int], *, wait: float = 0.0, timeout: float | None = None,
                          out: TextIO = sys.stdout, err: TextIO = sys.stderr, echo_prompt: bool = True,
                          **sampling: object) -> int:
    """Streams one completion to `out` (the prompt first, when it is text); a summary line goes to `err`.
    `wait` > 0: first wait that many seconds for the server to become ready. Returns an exit status."""
    async with GenerationClient(server) as client:
        try:
            if wait > 0:
                await client.wait_ready(wait)
            if echo_prompt and isinstance(prompt, str):
                out.write(prompt)
            last = None
            tokens = 0
            async for chunk in client.generate(prompt, timeout=timeout, **sampling):  # type: ignore[arg-type]
                out.write(chunk.text)
                out.flush()
                tokens += len(chunk.token_ids)
                last = chunk
            out.write("\n")
            out.flush()
        except grpc.aio.AioRpcError as e:
            out.write("\n")
            print(f"hybridspec: error: {e.code().name}: {e.details()}", file=err)
            return 2 if e.code() is grpc.StatusCode.INVALID_ARGUMENT else 1
        except TimeoutError as e:
            print(f"hybridspec: error: {e}", file=err)
            return 1
    if last is not None:
        u = last.usage
        extra = f", prompt_tokens={u.prompt_tokens}" if u else ""
        print(f"[{tokens} tokens, finish_reason={last.finish_reason}{extra}]", file=err)
    return 0


def run_generate(server: str, prompt: str, **options: object) -> int:
    return asyncio.run(stream_generate(server, prompt, **options))  # type: ignore[arg-type]
