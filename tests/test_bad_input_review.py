"""Bad user input at every boundary (gRPC server, client, CLI, Python API): a clear error that names the field and
its allowed range, and nothing else breaks; nothing is silently dropped or silently changed.

One tiny engine whose KV pool (8 pages of 16 tokens = 128 tokens) is smaller than its length limit (256), so a
request can fit the model's limit yet never fit the memory."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
import numpy as np
import pytest

import engine.server
import engine.validation
from clients.cli import stream_generate
from clients.client import GenerationClient, build_request
from engine import LLM, SamplingParams
from proto.hybridspec.v1 import generation_pb2 as pb
from proto.hybridspec.v1 import generation_pb2_grpc
from scheduler.types import InvalidRequest
from serving import eventually, one_torch_thread, run, serving  # noqa: F401  (fixture)

MAX_MODEL_LEN = 256
NUM_PAGES, PAGE_SIZE = 8, 16
MEMORY_TOKENS = NUM_PAGES * PAGE_SIZE  # 128: what one request can ever hold


@pytest.fixture(scope="module")
def llm(one_torch_thread) -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN, num_pages=NUM_PAGES, max_running=4, max_step_tokens=64)


def _req(prompt: str | list[int] | None = "hi", request_id: str = "", **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        r.prompt = prompt
    elif prompt is not None:
        r.prompt_token_ids.extend(prompt)
    return r


def _with_unknown(request: pb.GenerateRequest, raw: bytes) -> pb.GenerateRequest:
    """The request as a newer client would send it: `raw` (wire bytes of fields this .proto lacks) appended."""
    return pb.GenerateRequest.FromString(request.SerializeToString() + raw)


async def _status(stub, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in stub.Generate(request, timeout=30):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


# ---- gRPC: the KV memory's limit is a field's range like the model's length limit --------------------------

def test_grpc_request_beyond_the_kv_memory_names_the_field_and_its_range(llm):
    """Before: the scheduler's "prompt + max_new_tokens = 201 tokens needs 13 KV pages but the pool has 8" came
    back (no field name first, no allowed value), also when the prompt alone was the problem."""

    async def main() -> None:
        async with serving(llm.engine) as (server, target), grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            code, details = await _status(stub, _req([5] * 200, max_new_tokens=1))  # < 256, > 128
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("prompt_token_ids ") and f"at most {MEMORY_TOKENS - 1} tokens" in details
            assert "got 200 tokens" in details, details

            code, details = await _status(stub, _req("x" * 150, max_new_tokens=1))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("prompt ") and "got 150 tokens" in details, details

            code, details = await _status(stub, _req([5] * 100, max_new_tokens=100))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith(f"sampling.max_new_tokens must be at most {MEMORY_TOKENS - 100} ")
            assert "got 100" in details, details

            # the limits themselves are allowed
            ok = [m async for m in stub.Generate(_req([5] * 100, max_new_tokens=MEMORY_TOKENS - 100,
                                                       ignore_eos=True), timeout=60)]
            assert ok[-1].finish_reason == "length" and ok[-1].usage.completion_tokens == MEMORY_TOKENS - 100
            assert server.metrics.rpcs["INVALID_ARGUMENT"] == 3

    run(main())


# ---- gRPC: unknown fields are refused, not ignored --------------------------------------------------------

def test_grpc_unknown_fields_are_refused_naming_them(llm):
    """Before: a field this server lacks (a newer client's option) was dropped silently and the request ran
    without it."""

    async def main() -> None:
        async with serving(llm.engine) as (_, target), grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # GenerateRequest field 9 (varint 1)
            code, details = await _status(stub, _with_unknown(_req("hi", max_new_tokens=2), b"\x48\x01"))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("GenerateRequest ") and "field number 9" in details, details
            assert "prompt_token_ids = 3" in details  # what it does accept
            # SamplingParams field 8 (varint 1) inside `sampling` (GenerateRequest field 4, length 2)
            code, details = await _status(stub, _with_unknown(_req("hi", max_new_tokens=2), b"\x22\x02\x40\x01"))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("sampling ") and "field number 8" in details, details
            # the same requests without them run
            ok = [m async for m in stub.Generate(_req("hi", max_new_tokens=2, ignore_eos=True), timeout=30)]
            assert ok[-1].finished and ok[-1].usage.completion_tokens == 2

    run(main())


# ---- gRPC: a failure nobody foresaw is INTERNAL for that request only --------------------------------------

def test_grpc_unexpected_error_is_internal_and_the_server_serves_on(llm, monkeypatch):
    """Before: the exception escaped the handler: the client got UNKNOWN and the server counted the RPC as OK."""
    real = engine.server.check_request

    def parse(request, *args, **kwargs):
        if request.request_id == "boom":
            raise RuntimeError("tokenizer exploded")
        return real(request, *args, **kwargs)

    monkeypatch.setattr(engine.server, "check_request", parse)

    async def main() -> None:
        async with serving(llm.engine) as (server, target), grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            code, details = await _status(stub, _req("hi", request_id="boom"))
            assert code is grpc.StatusCode.INTERNAL and "tokenizer exploded" in details
            ok = [m async for m in stub.Generate(_req("hi", max_new_tokens=3, ignore_eos=True), timeout=30)]
            assert ok[-1].usage.completion_tokens == 3
            assert server.metrics.rpcs["INTERNAL"] == 1 and server.metrics.rpcs["OK"] == 1

    run(main())


# ---- gRPC: bad requests, duplicates and cancellations among good ones -------------------------------------

def _bad_requests(vocab: int) -> list[tuple[pb.GenerateRequest, str]]:
    """(request, the text its INVALID_ARGUMENT details must start with)"""
    both = _req("hi")
    both.prompt_token_ids.extend([1, 2])
    return [
        (_req(""), "prompt must not be empty"),
        (both, "exactly one of prompt"),
        (_req(None), "exactly one of prompt"),
        (_req([1, vocab]), f"prompt_token_ids[1] must be a token id in [0, {vocab})"),
        (_req([-7]), f"prompt_token_ids[0] must be a token id in [0, {vocab})"),
        (_req([5] * MAX_MODEL_LEN), "prompt_token_ids must be shorter"),
        (_req([5] * 130), "prompt_token_ids must be shorter"),
        (_req("abc", max_new_tokens=MEMORY_TOKENS), f"sampling.max_new_tokens must be at most {MEMORY_TOKENS - 3}"),
        (_req(max_new_tokens=0), "sampling.max_new_tokens must be between 1 and 8192"),
        (_req(max_new_tokens=-5), "sampling.max_new_tokens must be between 1 and 8192"),
        (_req(max_new_tokens=2**31 - 1), "sampling.max_new_tokens must be between 1 and 8192"),
        (_req(temperature=-1.0), "sampling.temperature must be a finite number >= 0"),
        (_req(temperature=math.nan), "sampling.temperature must be a finite number >= 0"),
        (_req(temperature=-math.inf), "sampling.temperature must be a finite number >= 0"),
        (_req(temperature=1e39), "sampling.temperature must be a finite number >= 0"),  # inf as a float32
        (_req(top_p=0.0), "sampling.top_p must be in (0, 1]"),
        (_req(top_p=-0.1), "sampling.top_p must be in (0, 1]"),
        (_req(top_p=math.inf), "sampling.top_p must be in (0, 1]"),
        (_req(top_p=math.nan), "sampling.top_p must be in (0, 1]"),
        (_req(top_k=-(2**31)), "sampling.top_k must be >= 0"),
        (_req(seed=-1), "sampling.seed must be an integer in [0, 2**63)"),
        (_req(seed=-(2**63)), "sampling.seed must be an integer in [0, 2**63)"),
        (_req(stop=["ok", ""]), "sampling.stop[1] must be a string of 1 to 256 characters"),
        (_req(stop=["s"] * 17), "sampling.stop must be a list of at most 16 strings"),
        (_req(stop=["é" * 257]), "sampling.stop[0] must be a string of 1 to 256 characters"),
        (_req(request_id="r" * 257), "request_id must be at most 256 characters"),
        (_with_unknown(_req("hi"), b"\x50\x01"), "GenerateRequest has field number 10"),
    ]


def test_grpc_bad_requests_interleaved_with_good_ones_leave_the_good_ones_exact(llm):
    vocab = llm.engine.model_config.vocab_size
    good = [("abc def", {"max_new_tokens": 12, "ignore_eos": True}),
            ([7, 8, 9, 10], {"max_new_tokens": 9, "ignore_eos": True}),
            ("stop here", {"max_new_tokens": 20, "stop": ["e", "a"]}),
            ("sampled", {"max_new_tokens": 10, "temperature": 0.75, "top_p": 0.875, "top_k": 2**31 - 1,
                         "seed": 2**63 - 1, "ignore_eos": True}),
            ("tiny t", {"max_new_tokens": 6, "temperature": 1e-45, "ignore_eos": True}),  # a float32 denormal
            ([1] * (MEMORY_TOKENS - 8), {"max_new_tokens": 8, "ignore_eos": True})]  # exactly the whole pool
    expected = [llm.generate(p, SamplingParams(**o))[0] for p, o in good]
    bad = _bad_requests(vocab)

    async def good_one(client: GenerationClient, i: int, round_: int) -> tuple[list[int], str, str | None]:
        prompt, options = good[i]
        c = await client.complete(prompt, request_id=f"good-{round_}-{i}", **options)
        return c.token_ids, c.text, c.finish_reason

    async def bad_one(stub, i: int) -> None:
        request, message = bad[i % len(bad)]
        code, details = await _status(stub, request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), (i, code, details)

    async def cancelled_one(stub, i: int) -> None:
        call = stub.Generate(_req(f"cancel me {i}", max_new_tokens=100, ignore_eos=True))
        if i % 2:
            await call.read()  # mid-stream
        call.cancel()

    async def duplicate_ids(stub, rid: str) -> None:
        first = stub.Generate(_req("dup", request_id=rid, max_new_tokens=100, ignore_eos=True))
        await first.read()
        code, details = await _status(stub, _req("dup", request_id=rid, max_new_tokens=2))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"request_id {rid!r} is already")
        first.cancel()

    async def main() -> None:
        async with serving(llm.engine) as (server, target), GenerationClient(target) as client:
            stub = generation_pb2_grpc.GenerationStub(client.channel)
            tasks = []
            for round_ in range(2):
                for i in range(len(good)):
                    tasks.append(good_one(client, i, round_))
                    tasks += [bad_one(stub, round_ * 100 + i * 5 + j) for j in range(5)]
                    tasks.append(cancelled_one(stub, i))
                tasks.append(duplicate_ids(stub, f"same-{round_}"))
            tasks += [bad_one(stub, i) for i in range(len(bad))]  # every one at least once
            results = await asyncio.gather(*tasks)
            served = [r for r in results if r is not None]
            assert len(served) == 2 * len(good)
            for k, (tokens, text, reason) in enumerate(served):
                ref = expected[k % len(good)]
                assert (tokens, text, reason) == (ref.token_ids, ref.text, ref.finish_reason), k

            async def free() -> bool:
                s = await client.stats()
                return s.free_pages == s.total_pages and s.free_slots == s.total_slots and s.running_requests == 0
            await eventually(free, 10.0, "every page and slot free again")
            assert server.metrics.rpcs["INTERNAL"] == 0 and server.metrics.rpcs["UNKNOWN"] == 0

    run(main(), timeout=120)


# ---- the client: nothing it cannot carry is sent changed ----------------------------------------------------

def test_client_refuses_what_it_would_send_changed():
    """Before: stop="abc" went out as three stop strings "a", "b", "c"; a bytes prompt went out as token ids;
    top_k above int32 failed with protobuf's "Value out of range" naming no field."""
    with pytest.raises(ValueError, match="stop must be a list of strings, got a single str"):
        build_request("hi", stop="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt must be a str or a sequence of token ids, got bytes"):
        build_request(b"hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sampling\.top_k must be an integer <= 2147483647, got 3000000000"):
        build_request("hi", top_k=3_000_000_000)
    with pytest.raises(ValueError, match=r"sampling\.temperature must be a number, got 'hot'"):
        build_request("hi", temperature="hot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_token_ids must be integer token ids"):
        build_request([1, 2**40])
    assert list(build_request("hi", stop=("ab", "c")).sampling.stop) == ["ab", "c"]


def test_cli_generate_with_a_value_the_wire_cannot_carry_fails_before_any_output():
    """Before: the prompt was echoed, then protobuf's ValueError escaped stream_generate."""
    async def main() -> None:
        import io

        out, err = io.StringIO(), io.StringIO()
        status = await stream_generate("127.0.0.1:1", "hi", out=out, err=err, top_k=3_000_000_000)
        assert status == 2 and out.getvalue() == ""
        assert "--top-k must be an integer <= 2147483647" in err.getvalue()

    run(main())


# ---- the CLI: every bad flag value is named, before any model is built ----------------------------------------

TIMEOUT_RANGE = "--timeout must be a finite number of seconds > 0"


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--server", "127.0.0.1:1", "--timeout", "-1"], TIMEOUT_RANGE),
    (["generate", "hi", "--server", "127.0.0.1:1", "--timeout", "0"], TIMEOUT_RANGE),
    (["generate", "hi", "--server", "127.0.0.1:1", "--timeout", "nan"], "--timeout must be"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--wait", "-5"], "--wait must be a finite number of seconds >= 0"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--wait", "nan"], "--wait must be"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--top-k", "3000000000"], "--top-k must be an integer <="),
    (["generate", "hi", "--server", "127.0.0.1:1", "--temperature", "inf"], "--temperature must be a finite number"),
    # gRPC would dial port 99999 - 65536 = 34463, and 443 without a port
    (["generate", "hi", "--server", "127.0.0.1:99999"], "--server must be HOST:PORT with a port in 1..65535"),
    (["generate", "hi", "--server", "localhost"], "--server must be HOST:PORT with a port in 1..65535"),
    (["generate", "hi", "--server", ""], "--server must be HOST:PORT"),
    (["serve", "--port", "-1"], "--port must be a port number in 0..65535 (0 = any free port), got -1"),
    (["serve", "--port", "0", "--metrics-port", "70000"], "--metrics-port must be a port number in 0..65535"),
    (["serve", "--port", "0", "--log-level", "bogus"], "--log-level must be one of DEBUG, INFO, WARNING, ERROR"),
    (["serve", "--port", "0", "--drain-timeout", "-1"], "--drain-timeout must be a number of seconds >= 0, got -1"),
    (["serve", "--port", "0", "--drain-timeout", "nan"], "--drain-timeout must be"),
])
def test_cli_bad_flag_values_exit_2_naming_the_flag(argv, message, capsys, monkeypatch):
    import engine.llm
    from engine.cli import main

    def no_model(*args, **kwargs):  # a bad flag must be refused before the engine is built (or a server started)
        raise AssertionError("the engine was built despite a bad flag")

    monkeypatch.setattr(engine.llm, "LLM", no_model)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"hybridspec: error: {message}" in captured.err, captured.err
    assert captured.out == ""


def test_cli_accepts_the_edges_of_the_ranges(monkeypatch):
    """--drain-timeout 0 and inf, --wait 0, a log level in any case: accepted (reach the engine's construction)."""
    import engine.llm
    from engine.cli import main

    class Built(Exception):
        pass

    def built(*args, **kwargs):
        raise Built

    monkeypatch.setattr(engine.llm, "LLM", built)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)  # leave this process's logging alone
    for argv in (["serve", "--port", "0", "--drain-timeout", "0", "--log-level", "info"],
                 ["serve", "--port", "0", "--drain-timeout", "inf"],
                 ["generate", "hi", "--wait", "0"]):
        with pytest.raises(Built):
            main(argv)


# ---- the Python API -----------------------------------------------------------------------------------------

def test_llm_request_beyond_the_kv_memory_names_the_field_and_its_range(llm):
    with pytest.raises(InvalidRequest, match=rf"^prompt must be shorter than the KV memory's capacity of "
                                             rf"{MEMORY_TOKENS} tokens per request \(at most {MEMORY_TOKENS - 1} "
                                             r"tokens\), got 200 tokens") as err:
        llm.generate([5] * 200, SamplingParams(max_new_tokens=1))
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequest, match=rf"^max_new_tokens must be at most {MEMORY_TOKENS - 100} for this "
                                             r"prompt \(100 tokens;.*got 100$") as err:
        list(llm.stream([5] * 100, SamplingParams(max_new_tokens=100)))
    assert err.value.field == "max_new_tokens"
    # a bad prompt among good ones: nothing runs, nothing is left behind
    with pytest.raises(InvalidRequest):
        llm.generate(["fine", [5] * 300], SamplingParams(max_new_tokens=2))
    assert not llm.engine.has_work() and not llm.engine.live
    assert llm.engine.stats()["free_pages"] == NUM_PAGES


@pytest.mark.parametrize("options, message", [
    ({"num_pages": 0}, "num_pages must be an integer >= 1 or None"),  # was silently the automatic size
    ({"max_model_len": 0}, "max_model_len must be an integer >= 1 or None"),  # was silently the model's
    ({"max_model_len": -5}, "max_model_len must be an integer >= 1 or None"),  # every request then failed
    ({"max_model_len": "100"}, "max_model_len must be an integer >= 1"),
    ({"max_running": 2.5}, "max_running must be an integer >= 1, got 2.5"),
    ({"max_step_tokens": True}, "max_step_tokens must be an integer >= 1, got True"),
    ({"page_size": None}, "page_size must be an integer >= 1, got None"),
])
def test_llm_engine_options_are_checked_naming_them(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(**options)


def test_llm_unknown_option_names_it_and_the_known_ones():
    with pytest.raises(TypeError, match="LLM got an unexpected option 'max_tokens'; engine options are: .*num_pages"):
        LLM(max_tokens=5)


def test_llm_interleaved_streams_and_generate_lose_no_output(llm):
    """Before: each stream kept only its own outputs of the steps it ran, so tokens of another open stream were
    dropped (a 6-token stream yielded 3), and generate() with a stream open raised KeyError."""
    p1, p2, p3 = (SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 3, 4))
    ref1, ref2, ref3 = (llm.generate(p, params)[0] for p, params in (("aaaa", p1), ("bbbb", p2), ("cc", p3)))

    s1 = llm.stream("aaaa", p1)
    first = [next(s1)]
    s2 = llm.stream("bbbb", p2)
    out2 = list(s2)
    assert [t for o in out2 for t in o.new_token_ids] == ref2.token_ids
    assert llm.last_stream_tokens == ref2.token_ids
    assert llm.generate("cc", p3)[0].token_ids == ref3.token_ids  # with s1 still open
    out1 = first + list(s1)
    assert [t for o in out1 for t in o.new_token_ids] == ref1.token_ids
    assert "".join(o.new_text for o in out1) == ref1.text
    assert out1[-1].finished and out1[-1].finish_reason == "length"
    # an abandoned stream frees its request
    s4 = llm.stream("dddd", p1)
    next(s4)
    s4.close()
    assert not llm.engine.has_work() and llm.engine.stats()["free_pages"] == NUM_PAGES


def test_llm_token_ids_of_any_integer_type(llm):
    """numpy integers (and tuples) are token ids like ints. Before: [np.int64(5), ...] was taken for a list of
    prompts and refused with "prompt must be a string or a list of token ids, got int64"."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ref = llm.generate([104, 105, 33], params)[0]
    for prompt in ([np.int64(104), np.int64(105), np.int64(33)], np.array([104, 105, 33]).tolist(), (104, 105, 33),
                   list(np.array([104, 105, 33], dtype=np.int32))):
        got = llm.generate(prompt, params)[0]
        assert got.token_ids == ref.token_ids and got.prompt_token_ids == [104, 105, 33]
        assert all(type(t) is int for t in got.prompt_token_ids)
    with pytest.raises(InvalidRequest, match=r"prompt_token_ids\[1\] must be an integer token id") as err:
        llm.generate([[1, 2.0]], params)
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequest, match=r"prompt_token_ids\[0\] must be an integer token id"):
        llm.generate([True, 2], params)
    with pytest.raises(TypeError, match="params must be SamplingParams, got dict"):
        list(llm.stream("hi", {"max_new_tokens": 2}))  # type: ignore[arg-type]
    # EngineCore itself (callers other than LLM) takes numpy ids as ints too
    llm.engine.add_request("np-ids", [np.int64(104), np.int32(105)], params)
    assert all(type(t) is int for t in llm.engine.live["np-ids"].request.prompt_ids)
    llm.engine.abort("np-ids")


def test_sampling_params_numpy_bool_is_a_bool():
    """Before: ignore_eos=np.bool_(True) was refused as "got np.True_ (bool)"."""
    assert SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True
    for value in (1, "yes", None, np.array([True])):
        with pytest.raises(InvalidRequest, match="ignore_eos must be true or false"):
            SamplingParams(ignore_eos=value)


@pytest.mark.parametrize("name, value", [("num_pages", 0), ("max_model_len", 0), ("max_model_len", -5),
                                         ("num_pages", 2.5), ("page_size", True), ("max_running", "4")])
def test_engine_config_refuses_sizes_that_are_not_positive_integers(name, value):
    """EngineConfig itself (not only LLM) names a size option and its range; 0 is not read as "the default"."""
    from engine.core import EngineConfig

    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        EngineConfig(**{name: value}).validate()
    EngineConfig(num_pages=None, max_model_len=None).validate()  # None: the engine sizes them


# ---- gRPC: bytes protobuf cannot parse, and prompts too long to tokenize ------------------------------------

async def _raw_status(channel, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Generate with `data` as the request's wire bytes (what a client with another encoder may send)."""
    call = channel.unary_stream("/hybridspec.v1.Generation/Generate", request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)
    try:
        async for _ in call(data, timeout=30):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _string_field(number: int, raw: bytes) -> bytes:
    assert number < 16 and len(raw) < 128
    return bytes([number << 3 | 2, len(raw)]) + raw


def test_grpc_undecodable_bytes_are_invalid_argument_naming_the_field(llm, caplog):
    """Before: grpc's own deserializer raised, and the client got UNKNOWN with protobuf's DecodeError (a
    traceback in the server's log, the RPC counted nowhere)."""
    good = _req("hi", max_new_tokens=2).SerializeToString()
    stop_ok, stop_bad = _string_field(5, b"ok"), _string_field(5, b"\xff\xfe")
    cases = [
        (_string_field(2, b"\xff\xfe"), "prompt must be valid UTF-8"),
        (_string_field(1, b"id\xc3") + _string_field(2, b"hi"), "request_id must be valid UTF-8"),
        (_string_field(2, b"hi") + _string_field(4, stop_ok + stop_bad), "sampling.stop[1] must be valid UTF-8"),
        # two occurrences of `sampling`: protobuf merges them, and so does the index
        (_string_field(2, b"hi") + _string_field(4, stop_ok) + _string_field(4, stop_ok + stop_bad),
         "sampling.stop[2] must be valid UTF-8"),
        (b"\xff\xff\xff", "request could not be parsed as a hybridspec.v1.GenerateRequest"),
        (_string_field(2, b"hi")[:-1] + b"", "request could not be parsed"),  # truncated
    ]

    async def main() -> None:
        async with serving(llm.engine) as (server, target), grpc.aio.insecure_channel(target) as channel:
            for data, message in cases:
                code, details = await _raw_status(channel, data)
                assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), (data, details)
            assert await _raw_status(channel, good) == (grpc.StatusCode.OK, "")
            assert server.metrics.rpcs["INVALID_ARGUMENT"] == len(cases) and server.metrics.rpcs["OK"] == 1

    with caplog.at_level(logging.ERROR):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_grpc_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(llm, monkeypatch):
    """A text prompt that cannot fit whatever its tokens is refused without tokenizing it (4 MB took ~9.5 s of
    CPU, during which every stream stalled); a long one that may fit is tokenized in a worker thread."""
    import threading

    tokenizer = llm.engine.tokenizer
    most = (MEMORY_TOKENS - 1) * tokenizer.chars_per_token_bound
    threads: list[int] = []

    def never(text):
        raise AssertionError(f"a {len(text)}-character prompt was tokenized")

    def released(text):
        threads.append(threading.get_ident())
        return real_released(text)

    real_released = tokenizer.encode_released
    monkeypatch.setattr(engine.server, "INLINE_TOKENIZE_CHARS", 8)

    async def main() -> None:
        async with serving(llm.engine) as (server, target), grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            monkeypatch.setattr(tokenizer, "encode", never)
            monkeypatch.setattr(tokenizer, "encode_released", never)
            code, details = await _status(stub, _req("y" * (most + 1), max_new_tokens=1))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith(f"prompt must be shorter than the KV memory's capacity of {MEMORY_TOKENS} "
                                      f"tokens per request (at most {MEMORY_TOKENS - 1} tokens), got {most + 1} "
                                      f"characters"), details
            monkeypatch.setattr(tokenizer, "encode_released", released)
            ok = [m async for m in stub.Generate(_req("long enough", max_new_tokens=3, ignore_eos=True), timeout=30)]
            assert ok[-1].usage.prompt_tokens == len("long enough") and ok[-1].usage.completion_tokens == 3
            assert threads and threads[0] != threading.get_ident()  # not the event loop's thread

    run(main())


def test_grpc_request_larger_than_grpcs_default_message_limit_is_bad_input_not_overload(llm):
    """A prompt message past gRPC's 4 MiB default came back RESOURCE_EXHAUSTED ("Received message larger than
    max"), which a client reads as overload, retry later: it is a prompt longer than the model can hold, bad input
    named by its field like any other; the server goes on serving."""

    async def main() -> None:
        async with serving(llm.engine) as (server, target), grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)  # (a client's sends are unlimited by default)
            code, details = await _status(stub, _req("a" * (5 << 20), max_new_tokens=1))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
            assert details.startswith("prompt must be shorter than"), details[:200]
            n = 5 << 20  # ids of one byte each: 5 MiB
            refused = engine.validation.check_prompt_len
            counted = []  # the count is refused before the ids are copied (it was a list and a loop over them)
            engine.validation.check_prompt_len = lambda field, k, *a: counted.append(k) or refused(field, k, *a)
            try:
                code, details = await _status(stub, _req([5] * n, max_new_tokens=1))
            finally:
                engine.validation.check_prompt_len = refused
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
            assert details.startswith("prompt_token_ids ") and f"got {n} tokens" in details, details[:200]
            assert counted == [n]
            ok = [m async for m in stub.Generate(_req("hi", max_new_tokens=2, ignore_eos=True), timeout=30)]
            assert ok[-1].usage.completion_tokens == 2

    run(main())


def test_tokenizer_encode_released_equals_encode(llm):
    tokenizer = llm.engine.tokenizer
    for text in ("", "hi", "<|endoftext|> and more", "ünïcödé " * 50):
        assert tokenizer.encode_released(text) == tokenizer.encode(text)
    assert tokenizer.chars_per_token_bound == len("<|endoftext|>")  # the byte tokenizer: 1, and its added token


def _tokenizer(model, normalizer=None, pre_tokenizer=None, added=()):
    import tokenizers

    from engine.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    for token in added:
        tok.add_special_tokens([token])
    return Tokenizer(tok)


def test_the_untokenized_length_check_holds_only_where_the_tokenizer_keeps_every_character():
    """Where a part of the tokenizer may drop or merge characters without limit (a WordPiece word of any length is
    one [UNK], BERT's pre-tokenizer drops whitespace, a Replace normalizer collapses runs of spaces, an added token
    with lstrip swallows whitespace), a prompt of many characters can be a few tokens: no bound, no refusal."""
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3, "<mask>": 4}
    byte_level = _tokenizer(models.BPE({"a": 0, "b": 1, "abab": 2}, []), pre_tokenizer=pre_tokenizers.ByteLevel())
    assert byte_level.chars_per_token_bound == 4  # its longest token, no normalizer
    nfc = _tokenizer(models.BPE({"a": 0, "b": 1, "abab": 2}, []), normalizer=normalizers.NFC(),
                     pre_tokenizer=pre_tokenizers.ByteLevel())
    assert nfc.chars_per_token_bound == 16  # x4: NFC merges a letter and its marks
    lossy = [
        _tokenizer(models.WordPiece(vocab, unk_token="[UNK]"), pre_tokenizer=pre_tokenizers.BertPreTokenizer()),
        _tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True), pre_tokenizer=pre_tokenizers.Metaspace()),
        _tokenizer(models.BPE(vocab, []), pre_tokenizer=pre_tokenizers.Whitespace()),
        _tokenizer(models.BPE({"a": 0, "b": 1, " ": 2}, []), normalizer=normalizers.Replace("  ", " ")),
        _tokenizer(models.BPE({"a": 0, "b": 1}, []), normalizer=normalizers.Strip()),
        _tokenizer(models.BPE(vocab, []), pre_tokenizer=pre_tokenizers.ByteLevel(),
                   added=[AddedToken("<mask>", lstrip=True)]),
        _tokenizer(models.BPE(vocab, []), pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")),
    ]
    for tok in lossy:
        assert tok.chars_per_token_bound is None, tok.hf.to_str()[:200]
    word = lossy[0]
    assert len(word.encode("x" * 50_000)) == 1  # 50k characters, one token: a bound would have refused it
    check_text_size = engine.validation.check_text_size
    check_text_size("prompt", "x" * 50_000, word, max_model_len=64)  # no refusal where no bound holds
    with pytest.raises(InvalidRequest, match=r"^prompt must be shorter .* got 50000 characters"):
        check_text_size("prompt", "x" * 50_000, byte_level, max_model_len=64)


def test_llm_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(llm, monkeypatch):
    most = (MEMORY_TOKENS - 1) * llm.engine.tokenizer.chars_per_token_bound
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text: pytest.fail("tokenized"))
    with pytest.raises(InvalidRequest, match=rf"^prompt must be shorter .* got {most + 1} characters") as err:
        llm.generate("z" * (most + 1), SamplingParams(max_new_tokens=1))
    assert err.value.field == "prompt"


# ---- engine options the model or the other options contradict ------------------------------------------------

def test_llm_max_model_len_beyond_the_models_positions_is_refused():
    """Before: accepted, and positions the model was never trained for were served."""
    with pytest.raises(ValueError, match=r"^max_model_len must be at most the model's max_position_embeddings "
                                         r"\(4096, .*config.json\) or None, got 100000$"):
        LLM(max_model_len=100000)


def test_llm_device_of_another_type_is_named():
    """Before: AttributeError 'int' object has no attribute 'startswith'."""
    with pytest.raises(ValueError, match=r"^device must be one of \('cpu', 'cuda'\) \(or cuda:N\), got 0$"):
        LLM(device=0)


@pytest.mark.parametrize("field,value", [("model", ""), ("model", "  "), ("draft_model", ""), ("model", 3)])
def test_llm_empty_or_non_path_model_directory_is_refused(field, value):
    """Before: LLM(model="") (an unset environment variable, say) silently served the embedded default model."""
    options = {field: value, **({"spec": "draft"} if field == "draft_model" else {})}
    with pytest.raises(ValueError, match=rf"^{field} must be a model directory path or None, got {value!r}$"):
        LLM(**options)


def test_a_drafter_under_policy_ar_is_announced(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridspec.engine"):
        LLM(spec="ngram", policy="ar", max_running=1)
    assert any("policy 'ar' verifies no drafts: the 'ngram' drafter is loaded but never drafts" in r.getMessage()
               for r in caplog.records)


def test_cli_names_the_flag_where_the_engine_names_its_parameter(capsys):
    from engine.cli import main

    assert main(["serve", "--port", "0", "--max-verify-len", "17"]) == 2
    err = capsys.readouterr().err
    assert "hybridspec: error: --max-verify-len must be an integer between 1 and 16, got 17" in err, err
