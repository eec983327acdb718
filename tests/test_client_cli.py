"""`hybridspec serve` as a real process, the async client and `hybridspec generate --server` against it, and a
clean exit on SIGTERM (in-flight requests finish or end with finish_reason "abort", exit status 0)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from clients.cli import stream_generate
from clients.client import GenerationClient
from engine import LLM, SamplingParams
from serving import StderrLines, one_torch_thread, run  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048


class ServerProcess(StderrLines):
    """`python -m engine.cli serve --port 0 ...` with its stderr collected line by line."""

    def __init__(self, *args: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        super().__init__(subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN), *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        self.target = self.wait_for("listening on ", 120.0).split("listening on ")[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--drain-timeout", "1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(one_torch_thread) -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN)


def test_cli_generate_streams_from_the_server(server, llm):
    prompt = "def fibonacci(n):"
    expected = llm.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", prompt, "--server", server.target,
                          "--max-new-tokens", "16", "--ignore-eos"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == prompt + expected.text + "\n"
    assert "[16 tokens, finish_reason=length" in out.stderr


def test_client_api_matches_in_process(server, llm):
    prompts: list[str | list[int]] = ["hello", [104, 105, 33, 200, 17], "é日本語"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = llm.generate(prompts, params)

    async def main() -> None:
        async with GenerationClient(server.target) as client:
            await client.wait_ready(10)
            assert await client.health() == "SERVING"
            for prompt, ref in zip(prompts, expected):
                chunks = [c async for c in client.generate(prompt, max_new_tokens=12, ignore_eos=True)]
                assert [t for c in chunks for t in c.token_ids] == ref.token_ids
                assert "".join(c.text for c in chunks) == ref.text
                last = chunks[-1]
                assert last.finished and last.finish_reason == "length" and last.usage is not None
                assert last.usage.prompt_tokens == len(ref.prompt_token_ids) and last.usage.completion_tokens == 12
            stats = await client.stats()
            assert stats.max_model_len == MAX_MODEL_LEN and stats.free_pages == stats.total_pages

    run(main())


def test_cli_errors(server):
    async def main() -> None:
        out, err = io.StringIO(), io.StringIO()
        # the server rejects it (the client cannot know the model's limit)
        status = await stream_generate(server.target, "hi", out=out, err=err, max_new_tokens=MAX_MODEL_LEN)
        # ... naming the command line's option, not the message's field (sampling.max_new_tokens)
        assert status == 2 and "INVALID_ARGUMENT: --max-new-tokens must be" in err.getvalue(), err.getvalue()
        # nobody listening there
        err = io.StringIO()
        status = await stream_generate("127.0.0.1:1", "hi", out=io.StringIO(), err=err, timeout=5)
        assert status == 1 and "UNAVAILABLE" in err.getvalue()

    run(main())
    from engine.cli import main as cli_main

    assert cli_main(["generate", "hi", "--server", server.target, "--device", "cpu"]) == 2
    assert cli_main(["generate", "hi", "--server", server.target, "--top-k", "-1"]) == 2


def test_cli_generate_ctrl_c_ends_with_a_line_not_a_traceback(server):
    """Before: Ctrl-C printed a CancelledError / KeyboardInterrupt traceback and the process died of SIGINT."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "def f(x):", "--server", server.target,
                             "--max-new-tokens", "1500", "--ignore-eos"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(12)  # the prompt and the first tokens: the stream is running
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"hybridspec: interrupted" in err and b"Traceback" not in err, err


def test_cli_generate_into_a_closed_pipe_exits_quietly(server):
    """`generate ... | head -c 20`: before, `hybridspec: error: [Errno 32] Broken pipe` and exit 2 (bad usage)."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "def f(x):", "--server", server.target,
                             "--max-new-tokens", "1500", "--ignore-eos"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(20)
    proc.stdout.close()
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 141 and b"error" not in err and b"Traceback" not in err, err


@pytest.mark.parametrize("where", [[], ["--server", "127.0.0.1:1"]])
def test_cli_prompt_bytes_that_are_not_utf8_are_named(where):
    """Before: in process a TypeError traceback from the tokenizer; with --server a codec error naming no field."""
    out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", b"ab\xffcd", *where],
                         cwd=ROOT, capture_output=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert (b"hybridspec: error: PROMPT is not valid Unicode text: a lone surrogate U+DCFF at character 2 (the byte "
            b"0xff, which is not UTF-8)") in out.stderr, out.stderr


def test_cli_names_the_draft_models_option_and_refuses_a_server_with_spaces(capsys):
    from engine.cli import main as cli_main

    assert cli_main(["generate", "hi", "--spec", "draft", "--draft-model", "/nonexistent"]) == 2
    assert "hybridspec: error: --draft-model /nonexistent: " in capsys.readouterr().err  # was `--model directory`
    assert cli_main(["generate", "hi", "--server", " 127.0.0.1:1"]) == 2
    assert "--server must not contain spaces" in capsys.readouterr().err


def test_python_api_names_a_prompt_or_stop_that_is_not_unicode(llm):
    from clients.client import build_request
    from engine import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"^prompt is not valid Unicode text: a lone surrogate U\+DCFF"):
        llm.generate("ab\udcffcd")
    with pytest.raises(InvalidRequest, match=r"^stop\[1\] is not valid Unicode text"):
        SamplingParams(stop=["ok", "\ud800"])
    with pytest.raises(ValueError, match=r"^prompt is not valid Unicode text"):
        build_request("\udcff")
    with pytest.raises(ValueError, match=r"^sampling.stop\[0\] is not valid Unicode text"):
        build_request("hi", stop=["\udcff"])


def test_serve_checks_speculation_options_like_the_python_api():
    from engine.llm import AVAILABLE_SPEC, SPEC_METHODS

    unavailable = [s for s in SPEC_METHODS if s not in AVAILABLE_SPEC]
    # a method this build lacks if there is one; else an option combination the Python API rejects
    args, kwargs = ((["--spec", unavailable[0]], {"spec": unavailable[0]}) if unavailable
                    else (["--spec", "draft"], {"spec": "draft"}))  # draft without --draft-model
    from engine.cli import as_flags, build_parser

    with pytest.raises(ValueError) as err:
        LLM(**kwargs)
    out = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert as_flags(str(err.value), build_parser(), "serve") in out.stderr


def test_sigterm_drains_and_exits_cleanly():
    proc = ServerProcess("--drain-timeout", "1.5")
    try:
        async def main() -> tuple[list, grpc.StatusCode | None]:
            async with GenerationClient(proc.target) as client:
                long_chunks: list = []

                async def long() -> None:
                    async for chunk in client.generate("long", max_new_tokens=MAX_MODEL_LEN - 10, ignore_eos=True):
                        long_chunks.append(chunk)

                task = asyncio.create_task(long())
                while not long_chunks:
                    await asyncio.sleep(0.02)
                short = asyncio.create_task(client.complete("short", max_new_tokens=5, ignore_eos=True))
                while (await client.stats()).requests_total < 2:  # both admitted before the signal
                    await asyncio.sleep(0.02)
                proc.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.wait_for, "SIGTERM", 10.0)
                late_code = None
                try:
                    await client.complete("late", max_new_tokens=2, timeout=5)
                except grpc.aio.AioRpcError as e:
                    late_code = e.code()
                await task
                assert (await short).finish_reason == "length"
                return long_chunks, late_code

        long_chunks, late_code = run(main())
        assert long_chunks[-1].finished and long_chunks[-1].finish_reason == "abort"
        assert late_code is grpc.StatusCode.UNAVAILABLE
        assert proc.proc.wait(30) == 0
        assert any("stopped (1 in-flight requests aborted)" in line for line in proc.stderr), proc.stderr
    finally:
        proc.stop()


def test_sigterm_stops_a_server_whose_stderr_reader_is_gone():
    """Before: the SIGTERM handler's "draining" line raised BrokenPipeError on a closed stderr pipe (`serve 2>&1 |
    head -1`, a dead log reader), so neither that signal nor any later one stopped the server."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--max-model-len",
                             str(MAX_MODEL_LEN)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        while "listening on " not in proc.stderr.readline():
            assert proc.poll() is None and time.monotonic() < deadline, "the server never listened"
        proc.stderr.close()  # nobody reads the server's stderr any more
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
