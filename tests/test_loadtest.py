"""loadtest/: `python -m loadtest` (200 streams at concurrency 32, 10% cancelled mid-stream) against an in-process
server on the embedded model, memory all free afterwards; the percentile / goodput / summary math; workloads;
and a tiny sweep that starts and stops `hybridspec serve` itself."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from clients.client import GenerationClient
from loadtest.metrics import RequestRecord, distribution, goodput, meets_slo, percentile, summarize
from loadtest.sweep import parse_config
from loadtest.workload import LengthDist, Workload, load_prompts
from serving import eventually, one_torch_thread, run, serving  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


async def _loadtest(*args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    """`python -m loadtest ARGS` as a subprocess, without blocking the event loop the server runs on."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "loadtest", *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    from engine import LLM

    return LLM(max_model_len=2048)


def test_200_streams_at_concurrency_32_with_10_percent_cancelled(llm, tmp_path):
    out = tmp_path / "run"

    async def main() -> dict:
        async with serving(llm.engine) as (_, target), GenerationClient(target) as client:
            before = await client.stats()
            status, stdout, stderr = await _loadtest(
                "--server", target, "--concurrency", "32", "--requests", "200", "--max-new-tokens", "8",
                "--cancel-fraction", "0.1", "--prompt-len-dist", "uniform:4:32", "--slo-ttft-ms", "60000",
                "--out", str(out))
            assert status == 0, stderr
            assert "200 requests" in stdout and "200/200" in stderr  # the summary, the progress bar

            async def all_free() -> bool:
                s = await client.stats()
                return (s.free_pages == s.total_pages and s.free_slots == s.total_slots
                        and s.running_requests == 0 and s.waiting_requests == 0)

            await eventually(all_free, 10.0, "every page and slot free")
            after = await client.stats()
            assert after.requests_total - before.requests_total == 200
            return json.loads((out / "result.json").read_text())

    result = run(main(), timeout=150.0)
    assert result["requests"] == 200 and result["completed"] == 180
    assert result["errors"] == {"CANCELLED": 20}  # nothing but the streams we cancelled
    assert result["finish_reasons"] == {"length": 180}
    assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
    assert result["goodput"]["good_requests"] == 180
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = result[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert result["ttft_ms"]["count"] == 200 and result["tpot_ms"]["count"] == 180
    assert result["mean_accepted_length"] is None  # no speculation: no verify steps

    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(200))
    for r in rows:
        if r["status"] == "OK":
            assert r["output_tokens"] == 8 and r["usage"]["completion_tokens"] == 8
        else:  # cancelled mid-stream: some tokens, not all
            assert r["status"] == "CANCELLED" and 1 <= r["output_tokens"] < 8, r
            assert 1 <= r["chunks"] <= r["cancel_after_chunks"]
    assert result["output_tokens"] == sum(r["output_tokens"] for r in rows)
    for name in ("latency_cdf.png", "timeline.png"):
        assert _is_png(out / name), name


def test_cli_errors(tmp_path):
    from engine.cli import main as hybridspec

    # `hybridspec loadtest` forwards to loadtest's main: invalid options -> 2, nobody listening -> 1
    assert hybridspec(["loadtest", "--server", "127.0.0.1:1", "--cancel-fraction", "2"]) == 2
    assert hybridspec(["loadtest", "--server", "127.0.0.1:1", "--prompt-len-dist", "zipf:3"]) == 2
    assert hybridspec(["loadtest", "--server", "127.0.0.1:1", "--wait", "0", "--out", str(tmp_path)]) == 1


def test_tiny_sweep_starts_and_stops_servers(tmp_path):
    out = tmp_path / "sweep"

    async def main() -> tuple[int, str, str]:
        return await _loadtest("sweep", "--concurrency", "1,3", "--config", "name=ar:--spec off --max-model-len 512",
                               "--requests", "6", "--max-new-tokens", "4", "--prompt-len-dist", "fixed:8",
                               "--server-env", "OMP_NUM_THREADS=1", "--no-progress", "--out", str(out))

    status, stdout, stderr = run(main(), timeout=150.0)
    assert status == 0, stderr
    sweep = json.loads((out / "sweep.json").read_text())
    assert [(r["config"], r["concurrency"]) for r in sweep["runs"]] == [("ar", 1), ("ar", 3)]
    for r in sweep["runs"]:
        assert r["memory_free_after"] and r["result"]["requests"] == 6 and r["result"]["errors"] == {}
        single = json.loads((out / r["dir"] / "result.json").read_text())
        assert single["concurrency"] == r["concurrency"] and single["output_tokens"] == 24
        assert _is_png(out / r["dir"] / "latency_cdf.png")
    assert _is_png(out / "throughput_vs_concurrency.png") and _is_png(out / "p99_vs_concurrency.png")
    assert "stopped" in (out / "ar" / "server.log").read_text()  # stopped by SIGTERM, drained
    assert stdout.splitlines()[0].split()[:2] == ["config", "conc"]


# ---------------------------------------------------------------------------------------------------- the math


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = distribution([0.001, 0.002, 0.003])  # seconds in, milliseconds out
    assert (d["p50"], d["min"], d["max"], d["count"]) == (2.0, 1.0, 3.0, 3)
    assert distribution([])["p99"] is None


def _record(i: int, ttft: float, tpot: float, n: int = 5, status: str = "OK", usage: dict | None = None
            ) -> RequestRecord:
    """A request sent at t=i, first token after `ttft` s, then one token every `tpot` s."""
    times = [i + ttft + k * tpot for k in range(n)]
    return RequestRecord(index=i, start=float(i), end=times[-1] if times else i + ttft, chunk_times=times,
                         chunk_tokens=[1] * n, status=status, finish_reason="length" if status == "OK" else None,
                         usage=usage)


def test_tpot_ttft_itl_of_a_record():
    r = _record(0, 0.5, 0.1, n=5)
    assert r.ttft == pytest.approx(0.5) and r.tpot == pytest.approx(0.1) and r.e2e == pytest.approx(0.9)
    assert r.itls == pytest.approx([0.1] * 4)
    # a message carrying 3 tokens: TPOT is over tokens, ITL over messages
    r = RequestRecord(index=0, start=0.0, end=1.0, chunk_times=[0.2, 1.0], chunk_tokens=[1, 3])
    assert r.tpot == pytest.approx(0.8 / 3) and r.itls == pytest.approx([0.8])
    assert _record(0, 0.5, 0.1, n=1).tpot is None
    cancelled = _record(0, 0.5, 0.1, n=3, status="CANCELLED")
    assert cancelled.ttft == pytest.approx(0.5) and cancelled.tpot is None and cancelled.e2e is None


def test_goodput_under_slo():
    records = [_record(0, 0.1, 0.01), _record(1, 0.3, 0.01), _record(2, 0.1, 0.05), _record(3, 0.3, 0.05),
               _record(4, 0.1, 0.01, n=1),  # no TPOT: meets any TPOT SLO
               _record(5, 0.1, 0.01, status="CANCELLED"), _record(6, 0.1, 0.01, n=0, status="UNAVAILABLE")]
    assert [meets_slo(r, 200, 20) for r in records] == [True, False, False, False, True, False, False]
    assert [meets_slo(r, None, None) for r in records] == [True] * 5 + [False, False]
    g = goodput(records, 10.0, slo_ttft_ms=200, slo_tpot_ms=20)
    assert g["good_requests"] == 2 and g["requests_per_s"] == pytest.approx(0.2)
    assert g["output_tokens_per_s"] == pytest.approx(0.6) and g["fraction"] == pytest.approx(2 / 7)
    assert goodput(records, 10.0, slo_ttft_ms=200)["good_requests"] == 3
    assert goodput(records, 10.0, slo_tpot_ms=20)["good_requests"] == 3
    assert goodput([], 0.0)["fraction"] is None


def test_summary():
    usage = lambda a, v: {"prompt_tokens": 4, "completion_tokens": 5, "draft_tokens": 2 * v,  # noqa: E731
                          "accepted_tokens": a, "verify_steps": v}
    records = [_record(0, 0.5, 0.1, usage=usage(6, 2)), _record(1, 0.5, 0.1, usage=usage(2, 2)),
               _record(2, 0.5, 0.1, n=2, status="CANCELLED"), _record(3, 0.5, 0.1, n=0, status="UNAVAILABLE")]
    s = summarize(records, slo_ttft_ms=1000)
    assert s["requests"] == 4 and s["completed"] == 2
    assert s["errors"] == {"CANCELLED": 1, "UNAVAILABLE": 1}
    assert s["output_tokens"] == 12 and s["duration_s"] == pytest.approx(3.5)  # from t=0 to the last end, 3.5
    assert s["output_tokens_per_s"] == pytest.approx(12 / 3.5, rel=1e-4)
    assert s["requests_per_s"] == pytest.approx(2 / 3.5, rel=1e-4)
    assert s["mean_accepted_length"] == pytest.approx(2.0)  # (6 + 2) / (2 + 2)
    assert s["ttft_ms"]["count"] == 3 and s["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 4 + 4 + 1
    assert s["goodput"]["good_requests"] == 2 and s["finish_reasons"] == {"length": 2}


# ---------------------------------------------------------------------------------------------------- workloads


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("fixed:64").sample(rng) == 64
    u = LengthDist.parse("uniform:16:128")
    xs = [u.sample(rng) for _ in range(2000)]
    assert min(xs) == 16 and max(xs) == 128
    n = LengthDist.parse("normal:50:10")
    assert abs(np.mean([n.sample(rng) for _ in range(4000)]) - 50) < 1.5
    e = LengthDist.parse("exp:20")
    assert min(e.sample(rng) for _ in range(1000)) >= 1
    for bad in ("zipf:2", "uniform:5", "uniform:9:3", "fixed:0", "fixed:2.5", "normal:-1:3", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_workload_is_deterministic_and_cancels_exactly_the_fraction():
    kw = dict(vocab_size=100, max_model_len=64, prompt_len=LengthDist.parse("uniform:10:200"),
              output_len=LengthDist.parse("uniform:1:16"), cancel_fraction=0.1, num_requests=200, seed=3)
    a, b = Workload(**kw), Workload(**kw)
    specs = [a.request(i) for i in range(200)]
    assert specs == [b.request(i) for i in range(200)]
    assert specs != [Workload(**{**kw, "seed": 4}).request(i) for i in range(200)]
    chosen = [s for s in specs if s.cancel_after_chunks is not None]
    assert 15 <= len(chosen) <= 20  # exactly 20 picked; a 1-token output cannot be cancelled mid-stream
    for s in specs:
        assert all(0 <= t < 100 for t in s.prompt)
        assert len(s.prompt) + s.max_new_tokens <= 64  # within the model's limit
        if s.cancel_after_chunks is not None:
            assert 1 <= s.cancel_after_chunks < s.max_new_tokens
    unbounded = Workload(**{**kw, "num_requests": None, "cancel_fraction": 0.5, "output_len": None})
    assert 350 < sum(unbounded.request(i).cancel_after_chunks is not None for i in range(1000)) < 650


def test_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt_token_ids": [1, 2, 3], "other": 1}\n')
    assert load_prompts(path) == ["hello", [1, 2, 3]]
    w = Workload(vocab_size=10, max_model_len=100, prompts=load_prompts(path), max_new_tokens=7)
    assert [w.request(i).prompt for i in range(3)] == ["hello", [1, 2, 3], "hello"]
    assert w.request(0).max_new_tokens == 7
    for bad in ('{"text": "x"}\n', '{"prompt": ""}\n', "not json\n", '{"prompt_token_ids": ["a"]}\n', ""):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_prompts(path)


def test_parse_config():
    c = parse_config("name=ngram:--spec ngram --policy fixed")
    assert (c.name, c.args) == ("ngram", ["--spec", "ngram", "--policy", "fixed"])
    assert parse_config("--spec off", 2).name == "config2"
    assert parse_config("name=ar:").args == []
    for bad in ("name=ngram", "name=a/b:--spec off", "name=:--spec off"):
        with pytest.raises(ValueError):
            parse_config(bad)


# ---------------------------------------------------------------------- review: bad options, aborts, a lost server

@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency must be a finite number > 0, got 0"),  # was silently 1
    (["--rate", "nan"], "--rate must be a finite number > 0, got nan"),  # every arrival at once, NaN in the JSON
    (["--duration", "inf"], "--duration must be a finite number > 0, got inf"),
    (["--warmup", "-1"], "--warmup must be a finite number >= 0, got -1"),
    (["--wait", "nan"], "--wait must be a finite number >= 0, got nan"),
    (["--prompt-len-dist", "exp:inf"], "--prompt-len-dist: length distribution 'exp:inf': the numbers must be finite"),
    (["--prompt-len-dist", "uniform:5:2"], "--prompt-len-dist: length distribution 'uniform:5:2': LO > HI"),
    (["--max-new-tokens-dist", "fixed:0"], "--max-new-tokens-dist: length distribution 'fixed:0'"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2"),
    (["--top-k", "-5"], "--top-k must be an integer in [0, 2147483647] (0 disables it), got -5"),
    (["--top-k", "3000000000"], "--top-k must be an integer in [0, 2147483647]"),
])
def test_bad_load_options_exit_2_naming_the_option(argv, message, capsys):
    """Before: these were accepted, and every request then failed on the server (rc 0), or ran a different load."""
    from loadtest.cli import main

    assert main(["--server", "127.0.0.1:1", "--wait", "0", *argv]) == 2
    assert message in capsys.readouterr().err


class _Chunk:
    def __init__(self, tokens: list[int], finished: bool = False, reason: str | None = None):
        self.token_ids, self.finished, self.finish_reason, self.usage = tokens, finished, reason, None


class _AbortingClient:
    """A stream that the server ends with finish_reason "abort" (it drained, or a step failed)."""

    def generate(self, prompt, **kwargs):
        async def chunks():
            yield _Chunk([1])
            yield _Chunk([2, 3])
            yield _Chunk([], finished=True, reason="abort")
        return chunks()


def test_a_stream_the_server_aborted_is_an_error_not_a_completion():
    """Before: gRPC status OK, so it counted as completed (requests_per_s, TPOT, E2E, goodput)."""
    from loadtest.metrics import ABORTED
    from loadtest.runner import Sampling, run_one
    from loadtest.workload import RequestSpec

    spec = RequestSpec(index=0, prompt=[1, 2], max_new_tokens=8, cancel_after_chunks=None, seed=None)
    rec = run(run_one(_AbortingClient(), spec, Sampling()))
    assert rec.status == ABORTED and rec.finish_reason == "abort" and rec.output_tokens == 3
    assert not rec.ok and rec.tpot is None and rec.e2e is None
    summary = summarize([rec, _record(1, 0.01, 0.002)])
    assert summary["completed"] == 1 and summary["errors"] == {ABORTED: 1}
    assert summary["goodput"]["good_requests"] == 1 and summary["tpot_ms"]["count"] == 1


def test_a_server_lost_during_the_load_keeps_the_records_and_exits_1(tmp_path, monkeypatch, capsys):
    """Before: the GetStats after the load raised, and nothing was written (rc 1, an empty directory)."""
    import grpc

    import loadtest.cli
    import loadtest.run
    from proto.hybridspec.v1 import generation_pb2 as pb

    class Gone:
        calls = 0

        async def stats(self):
            Gone.calls += 1
            if Gone.calls > 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "failed to connect to all addresses")
            return pb.GetStatsResponse(vocab_size=100, max_model_len=64, requests_total=5)

        async def close(self):
            pass

    async def drive(*args, **kwargs):
        lost = RequestRecord(index=1, start=1.0, end=1.5, status="UNAVAILABLE", detail="the server went away")
        return [_record(0, 0.01, 0.002), lost]

    monkeypatch.setattr(loadtest.run, "_clients", lambda target, n: [Gone()])
    monkeypatch.setattr(loadtest.run, "drive", drive)
    out = tmp_path / "lost"
    assert loadtest.cli.main(["--server", "127.0.0.1:1", "--wait", "0", "--requests", "2", "--no-plots",
                              "--no-progress", "--out", str(out)]) == 1
    assert "the server could not be reached after the load (UNAVAILABLE" in capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    assert result["completed"] == 1 and result["errors"] == {"UNAVAILABLE": 1}
    assert result["server_stats"]["after"] is None and result["server_stats"]["delta"] is None
    assert result["server_stats"]["after_error"].startswith("UNAVAILABLE: failed to connect")
    assert len((out / "requests.jsonl").read_text().splitlines()) == 2
