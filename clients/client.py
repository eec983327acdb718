"""Async Python client for the hybridspec.v1.Generation service.

    async with GenerationClient("127.0.0.1:50051") as client:
        async for chunk in client.generate("def fibonacci(n):", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Errors are grpc.aio.AioRpcError (`.code()`, `.details()`): INVALID_ARGUMENT (bad field, named in the
details), RESOURCE_EXHAUSTED (queue full: retry later), UNAVAILABLE, DEADLINE_EXCEEDED. Leaving the `async for`
early, or cancelling the task, cancels the call and the server frees the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from proto.standard import health_pb2, health_pb2_grpc
from proto.hybridspec.v1 import generation_pb2 as pb
from proto.hybridspec.v1 import generation_pb2_grpc


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the tokens and text generated since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" on the last chunk
    usage: Usage | None  # on the last chunk


@dataclass
class Completion:
    """A whole generation (GenerationClient.complete)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


INT32_MAX = 2**31 - 1


def build_request(prompt: str | Sequence[int], *, request_id: str = "", max_new_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  stop: Sequence[str] = (), seed: int | None = None, ignore_eos: bool = False) -> pb.GenerateRequest:
    """A GenerateRequest; options left as None take the server's defaults. A value the message cannot carry (of
    the wrong type, or out of its wire type's range) raises ValueError naming the field; the server checks the
    ranges that depend on the model."""
    if isinstance(stop, (str, bytes)):  # list("ab") would silently become two stop strings, "a" and "b"
        raise ValueError(f"stop must be a list of strings, got a single {type(stop).__name__} {stop!r:.60}; "
                         "pass [that string]")
    for i, s in enumerate(stop):
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"sampling.stop[{i}] is not valid Unicode text, so it cannot be sent ({e})") from None
    try:
        sampling = pb.SamplingParams(stop=list(stop), ignore_eos=ignore_eos)
    except (TypeError, ValueError) as e:
        raise ValueError(f"stop must be a list of strings and ignore_eos true or false ({e})") from None
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (TypeError, ValueError) as e:
                kind = ("an integer in [0, 2**63)" if name == "seed" else "a number" if name in ("temperature", "top_p")
                        else f"an integer <= {INT32_MAX}")
                raise ValueError(f"sampling.{name} must be {kind}, got {value!r:.60} ({e})") from None
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        try:
            request.prompt = prompt
        except ValueError as e:  # a lone surrogate (bytes that were not UTF-8, read with surrogateescape)
            raise ValueError(f"prompt is not valid Unicode text, so it cannot be sent ({e})") from None
    elif isinstance(prompt, (bytes, bytearray)):  # its bytes would go out as token ids
        raise ValueError("prompt must be a str or a sequence of token ids, got bytes; decode it to a str first")
    else:
        try:
            request.prompt_token_ids.extend(prompt)
        except (TypeError, ValueError) as e:
            raise ValueError(f"prompt_token_ids must be integer token ids in [0, vocab_size) "
                             f"(at most {INT32_MAX}), got {prompt!r:.60} ({e})") from None
    return request


def _chunk(msg: pb.GenerateResponse) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.draft_tokens, u.accepted_tokens, u.verify_steps)
    return Chunk(msg.request_id, list(msg.token_ids), msg.text, msg.finished, msg.finish_reason or None, usage)


class GenerationClient:
    def __init__(self, target: str, *, options: Sequence[tuple[str, object]] = ()):
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=list(options))
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> "GenerationClient":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: str | Sequence[int], *, request_id: str = "", max_new_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       stop: Sequence[str] = (), seed: int | None = None, ignore_eos: bool = False,
                       timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Streams the completion of `prompt` (text, or a list of token ids) chunk by chunk. `timeout` is the
        call's deadline in seconds."""
        request = build_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
                                ignore_eos=ignore_eos)
        call = self._stub.Generate(request, timeout=timeout)
        try:
            async for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()  # no-op once the call has ended; frees the server side when we leave early

    async def complete(self, prompt: str | Sequence[int], **options: object) -> Completion:
        """Runs `generate` to the end and joins the chunks."""
        out = Completion()
        texts: list[str] = []
        async for chunk in self.generate(prompt, **options):  # type: ignore[arg-type]
            out.request_id = chunk.request_id
            out.token_ids += chunk.token_ids
            texts.append(chunk.text)
            if chunk.finished:
                out.finish_reason, out.usage = chunk.finish_reason, chunk.usage
        out.text = "".join(texts)
        return out

    async def stats(self, timeout: float | None = 10.0) -> pb.GetStatsResponse:
        """Engine occupancy (free/used pages and slots, queues) and counters."""
        return await self._stub.GetStats(pb.GetStatsRequest(), timeout=timeout)

    async def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """The server's (or one service's) health status name: "SERVING", "NOT_SERVING", ..."""
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Waits until the server answers health checks with SERVING; raises TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"server at {self.target} not ready after {timeout:g}s (last: {last})")
            try:
                if await self.health(timeout=min(left, 2.0)) == "SERVING":
                    return
                last = "NOT_SERVING"
            except grpc.aio.AioRpcError as e:
                last = e.code().name
            await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
