"""`hybridspec generate PROMPT --server HOST:PORT`: streams a completion from a running server to the terminal.

engine/cli.py parses the command line and hands the options here; this side needs only proto and grpc.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from clients.client import GenerationClient, build_request


URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")  # gRPC target URIs: passed as given


def check_server(target: str) -> None:
    """`--server` is HOST:PORT (or a gRPC target URI). A port out of range is refused: gRPC would wrap it around
    (127.0.0.1:99999 dials port 34463), and without a port it would dial 443."""
    if target != target.strip() or any(c.isspace() for c in target):
        raise ValueError(f"--server must not contain spaces, got {target!r}")
    if target.startswith(URI_SCHEMES):
        return
    host, sep, port = target.rpartition(":")
    ipv6_ok = ":" not in host or (host.startswith("[") and host.endswith("]"))
    if not (sep and host and ipv6_ok and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--server must be HOST:PORT with a port in 1..65535 (an IPv6 host in brackets, e.g. "
                         f"[::1]:50051), got {target!r}")


def as_flags(message: str) -> str:
    """A message that names a field of the request (`sampling.max_new_tokens must be at most 4095`, from the client's
    checks or the server's) as the command line's option instead (`--max-new-tokens must be ...`)."""
    return re.sub(r"\bsampling\.([a-z_]+)", lambda m: "--" + m.group(1).replace("_", "-"), message)


async def stream_generate(server: str, prompt: str | Sequence[int], *, wait: float = 0.0, timeout: float | None = None,
                          out: TextIO | None = None, err: TextIO | None = None, echo_prompt: bool = True,
                          **sampling: object) -> int:
    """Streams one completion to `out` (the prompt first, when it is text); a summary line goes to `err`.
    `wait` > 0: first wait that many seconds for the server to become ready. Returns an exit status (2: bad
    input, named on `err`; 1: the server or the connection failed). `out`/`err` default to sys.stdout/sys.stderr
    as they are at the call (redirected ones included)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        check_server(server)
        build_request(prompt, **sampling)  # type: ignore[arg-type]  # bad input fails before any output
    except (TypeError, ValueError) as e:
        print(f"hybridspec: error: {as_flags(str(e))}", file=err)
        return 2
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
            print(f"hybridspec: error: {e.code().name}: {as_flags(e.details() or '')}", file=err)
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
