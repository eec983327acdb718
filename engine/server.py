"""The gRPC server: `hybridspec serve`.

grpc.aio on uvloop. Services: hybridspec.v1.Generation (Generate, GetStats), grpc.health.v1.Health and server
reflection (v1, v1alpha). Optional Prometheus text metrics on their own port. SIGTERM (or Ctrl-C): health goes
NOT_SERVING, new requests get UNAVAILABLE, in-flight requests may finish until the drain timeout and are then
aborted (their streams end with finish_reason "abort"), and the process exits 0. A second signal exits at once,
killed by that signal, after shutting down the executor (a local Ray this process started would otherwise leave
its raylet, GCS and agents behind); a third one does not wait for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from engine.async_engine import DEFAULT_MAX_WAITING, AsyncEngine, EngineFailed, EngineOverloaded, EngineUnavailable
from engine.core import EngineCore, StepOutput
from engine.health import NOT_SERVING, SERVING, HealthServicer
from engine.metrics import EngineMetrics, start_metrics_server
from engine.reflection import add_reflection
from engine.validation import check_request, finish_request, undecodable_request
from proto.standard import health_pb2, health_pb2_grpc
from proto.hybridspec.v1 import generation_pb2 as pb
from proto.hybridspec.v1 import generation_pb2_grpc
from scheduler.types import InvalidRequest

log = logging.getLogger("hybridspec.server")

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 50051
# text prompts longer than this (characters) are tokenized in a worker thread, with the GIL released: a long one
# would otherwise stall every stream (~0.2 s for 120k tokens); a shorter one costs less than the thread hop
INLINE_TOKENIZE_CHARS = 16384
# the largest request message the server reads (gRPC's own default is 4 MiB): a longer prompt than the model can
# hold is bad input, refused by validation as INVALID_ARGUMENT naming the field and its limit (a text's length and
# an id list's count are checked before anything is copied or tokenized); only past this size does gRPC itself
# answer RESOURCE_EXHAUSTED. (One such message costs its bytes and their parse, ~0.1 s per 16 MiB of ids here.)
MAX_REQUEST_BYTES = 64 << 20


@dataclass
class Undecodable:
    """A Generate request whose bytes protobuf could not parse (the deserializer's stand-in: grpc answers a
    deserializer's exception with UNKNOWN, and bad input gets INVALID_ARGUMENT naming the field)."""

    error: InvalidRequest


def decode_generate_request(data: bytes) -> "pb.GenerateRequest | Undecodable":
    try:
        return pb.GenerateRequest.FromString(data)
    except Exception as e:  # (protobuf's DecodeError; with the upb backend a bad UTF-8 string is one too)
        return Undecodable(undecodable_request(data, e))


def add_generation_service(servicer: "GenerationService", server: grpc.aio.Server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server with Generate's requests parsed by
    decode_generate_request."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=pb.GetStatsRequest.FromString,
            response_serializer=pb.GetStatsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # (grpcio >= 1.63, as the generated code does)
        server.add_registered_method_handlers(GENERATION_SERVICE, handlers)


@dataclass
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 = any free port (the bound one is printed and returned by Server.start)
    metrics_port: int | None = None  # Prometheus text endpoint; None = off
    max_waiting: int = DEFAULT_MAX_WAITING
    drain_timeout: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    reflection: bool = True


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        core = engine.core
        self.tokenizer, self.vocab_size, self.max_model_len = (core.tokenizer, core.model_config.vocab_size,
                                                               core.max_model_len)
        # the most tokens one request can ever hold: the whole KV pool (a longer one would be refused by the
        # scheduler; checked here so the error names the field and its range like every other)
        self.memory_tokens = core.memory_tokens

    async def Generate(self, request: "pb.GenerateRequest | Undecodable", context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        code, message = grpc.StatusCode.OK, ""
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request started"
            else:
                if isinstance(request, Undecodable):
                    raise request.error
                checked = check_request(request, self.tokenizer, self.vocab_size, self.max_model_len,
                                        self.memory_tokens)
                self.engine.check_admissible(checked.request_id)  # (a draining server answers before tokenizing)
                text = checked.text
                if text is None:
                    ids = checked.ids
                elif len(text) > INLINE_TOKENIZE_CHARS:
                    ids = await asyncio.to_thread(self.tokenizer.encode_released, text)
                else:
                    ids = self.tokenizer.encode(text)
                parsed = finish_request(checked, ids, self.max_model_len, self.memory_tokens)
                rid = parsed.request_id or f"req-{uuid.uuid4().hex}"
                self.engine.check_admissible(rid)
                completion = 0
                stream = self.engine.generate(rid, parsed.prompt_ids, parsed.params)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        completion += len(out.new_token_ids)
                        yield self._response(rid, out, len(parsed.prompt_ids), completion)
        except InvalidRequest as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except EngineOverloaded as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except EngineUnavailable as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except EngineFailed as e:
            code, message = grpc.StatusCode.INTERNAL, str(e)
        except (asyncio.CancelledError, GeneratorExit):
            # the client cancelled, or its deadline passed: grpc cancels the handler while it waits for the engine
            # (CancelledError), or closes this generator while it is suspended at a yield (GeneratorExit: it was
            # counted OK). The server's deadline runs from the request's arrival, so it ends after the client's:
            # a cancel that comes within DEADLINE_SLACK_S of it is the client's deadline (on 2 busy cores, one
            # counted CANCELLED)
            remaining = context.time_remaining()
            code = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= DEADLINE_SLACK_S else \
                grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # a bug: this request fails with INTERNAL (and is counted so); the server serves on
            log.exception("Generate failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        finally:
            self.engine.metrics.rpc_finished(code.name)
        if code is not grpc.StatusCode.OK:
            # abort raises: its traceback holds this frame, which would keep a refused request's prompt (up to
            # MAX_REQUEST_BYTES, and its ids as a list) alive until the cyclic GC ran
            request = checked = ids = text = parsed = None  # noqa: F841
            await context.abort(code, message)

    @staticmethod
    def _response(rid: str, out: StepOutput, prompt_tokens: int, completion: int) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.new_text,
                                       finished=out.finished)
        if out.finished:
            response.finish_reason = out.finish_reason or "stop"
            s = out.stats
            response.usage.CopyFrom(pb.Usage(
                prompt_tokens=prompt_tokens, completion_tokens=completion,
                draft_tokens=s.draft_tokens if s else 0, accepted_tokens=s.accepted_tokens if s else 0,
                verify_steps=s.verify_steps if s else 0))
        return response

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetStatsResponse:
        s, m = self.engine.stats(), self.engine.metrics
        return pb.GetStatsResponse(
            total_pages=s["total_pages"], free_pages=s["free_pages"], used_pages=s["used_pages"],
            page_size=s["page_size"], total_slots=s["total_slots"], free_slots=s["free_slots"],
            used_slots=s["used_slots"], waiting_requests=s["waiting_requests"],
            running_requests=s["running_requests"], max_waiting=s["max_waiting"], accepting=bool(s["accepting"]),
            requests_total=m.requests_admitted, prompt_tokens_total=m.prompt_tokens,
            generated_tokens_total=m.generated_tokens, draft_tokens_total=m.draft_tokens,
            accepted_tokens_total=m.accepted_tokens, steps_total=m.step_seconds.count,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size)


class Server:
    """The engine plus its gRPC (and metrics) endpoints; start() and stop() on one event loop. With owns_core,
    stop() also shuts the core's executor down (a Ray actor, ...); otherwise the core stays usable."""

    def __init__(self, core: EngineCore, options: ServeOptions | None = None, owns_core: bool = False):
        self.core, self.options, self.owns_core = core, options or ServeOptions(), owns_core
        self.metrics = EngineMetrics()
        self.engine = AsyncEngine(core, self.options.max_waiting, self.metrics)
        self.health = HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._metrics_server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        """Binds, starts serving and returns the gRPC port."""
        opts = self.options
        self.engine.start()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
        add_generation_service(GenerationService(self.engine), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if opts.reflection:
            add_reflection(server, [GENERATION_SERVICE, HEALTH_SERVICE])
        address = host_port(opts.host, opts.port)
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from e
        if not self.port:
            raise OSError(f"cannot listen on {address} (in use?)")
        await server.start()
        self._grpc = server
        for service in ("", GENERATION_SERVICE):
            self.health.set(service, SERVING)
        if opts.metrics_port is not None:
            self._metrics_server = await start_metrics_server(self.metrics, opts.host, opts.metrics_port)
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, drain_timeout: float | None = None) -> int:
        """Graceful stop: NOT_SERVING, no new requests, drain (then abort), close. Returns how many requests
        were aborted."""
        timeout = self.options.drain_timeout if drain_timeout is None else drain_timeout
        self.health.set_all(NOT_SERVING)
        aborted = await self.engine.drain(timeout)
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        await self.engine.shutdown(shutdown_core=self.owns_core)
        return aborted


DEADLINE_SLACK_S = 1.0  # a cancel this close to the server's view of the deadline counts as DEADLINE_EXCEEDED


def say(line: str) -> None:
    """A status line on stderr. Once nobody reads stderr (its pipe closed: `serve 2>&1 | head -1`, a log reader
    gone) stderr goes to /dev/null instead: a BrokenPipeError in a signal handler would leave the server deaf to
    SIGTERM, and one at exit would change the exit status."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # BrokenPipeError, or stderr closed
        _lost_stderr.append(sys.stderr)  # kept alive: collecting it would close fd 2
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # grpc's and Ray's own writes to fd 2 too
            os.close(devnull)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process


_lost_stderr: list = []


def exit_at_once(core: EngineCore, signum: int) -> None:
    """A second SIGTERM / SIGINT: shuts the executor down (its Ray actors, and the local Ray this process started:
    the default action of the signal would leave that Ray's raylet, GCS and agents running), then dies of the
    signal. A further signal meanwhile gets the default action at once."""
    say(f"hybridspec: {signal.Signals(signum).name} again: exiting now")
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    try:
        core.shutdown()  # (each executor's shutdown may run beside the one a draining server started)
    except Exception:  # noqa: BLE001 - exiting regardless
        log.exception("shutting the executor down failed")
    finally:
        os.kill(os.getpid(), signum)


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Runs `main` on uvloop when it is installed (asyncio otherwise)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve_until_signal(core: EngineCore, options: ServeOptions, description: str = "") -> int:
    server = Server(core, options, owns_core=True)
    port = await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        say(f"hybridspec: {signal.Signals(signum).name}: draining (up to {options.drain_timeout:g}s)")
        for s in (signal.SIGTERM, signal.SIGINT):  # a second signal exits at once
            loop.add_signal_handler(s, exit_at_once, core, s)
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, on_signal, s)
    extra = f", metrics on http://{host_port(options.host, server.metrics_port)}/metrics" \
        if server.metrics_port is not None else ""
    say(f"hybridspec: listening on {host_port(options.host, port)}{description}{extra}")
    await stop.wait()
    aborted = await server.stop()
    say(f"hybridspec: stopped ({aborted} in-flight requests aborted)")
    return 0
