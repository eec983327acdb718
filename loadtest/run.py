"""One load-test run against a running server: connect, read the model's limits (GetStats), warm up, drive the
load, and write DIR/result.json, DIR/requests.jsonl and the plots."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from clients.client import GenerationClient
from loadtest import metrics, plots
from loadtest.progress import Progress
from loadtest.runner import Sampling, drive
from loadtest.workload import LengthDist, Workload, load_prompts

RESULT_VERSION = 1
INT32_MAX = 2**31 - 1  # the wire's top_k (int32)


@dataclass
class LoadConfig:
    """Everything that shapes a run (the command line's options)."""

    concurrency: int | None = 1  # closed loop: clients; open loop (rate set): cap on requests in flight
    rate: float | None = None  # open loop: Poisson arrivals per second
    requests: int | None = None  # None with duration None: DEFAULT_REQUESTS
    duration: float | None = None  # seconds after which no new request starts
    prompts: str | None = None  # JSONL file
    prompt_len_dist: str = "uniform:16:128"
    max_new_tokens: int = 64
    max_new_tokens_dist: str | None = None
    cancel_fraction: float = 0.0
    seed: int = 0
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = True
    timeout: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    warmup: int = 0
    wait: float = 60.0
    channels: int = 1
    progress: bool = True
    plots: bool = True

    DEFAULT_REQUESTS = 100

    def check(self) -> None:
        """Raises ValueError naming the first bad option (NaN and infinities are bad values too)."""
        def positive(name: str, value, allow_none: bool = True) -> None:
            if (value is None and not allow_none) or (value is not None and not 0 < value < math.inf):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")

        positive("concurrency", self.concurrency, allow_none=self.rate is not None)
        for name in ("rate", "requests", "duration", "timeout", "slo_ttft_ms", "slo_tpot_ms", "max_new_tokens",
                     "channels"):
            positive(name, getattr(self, name))
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"--cancel-fraction must be in [0, 1], got {self.cancel_fraction}")
        for name in ("warmup", "wait"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"--{name} must be a finite number >= 0, got {value}")
        # the server's sampling ranges (scheduler.types.SamplingParams), checked before any load is sent
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"--top-k must be an integer in [0, {INT32_MAX}] (0 disables it), got {self.top_k}")
        for option, spec in (("--prompt-len-dist", self.prompt_len_dist),
                             ("--max-new-tokens-dist", self.max_new_tokens_dist)):
            if spec is not None:
                try:
                    LengthDist.parse(spec)
                except ValueError as e:
                    raise ValueError(f"{option}: {e}") from None
        if self.prompts and not Path(self.prompts).is_file():
            raise ValueError(f"--prompts: no such file: {self.prompts}")

    @property
    def num_requests(self) -> int | None:
        return self.DEFAULT_REQUESTS if self.requests is None and self.duration is None else self.requests

    def workload(self, vocab_size: int, max_model_len: int, *, seed: int | None = None,
                 cancel: bool = True, num_requests: int | None = None) -> Workload:
        return Workload(vocab_size=vocab_size, max_model_len=max_model_len,
                        prompts=load_prompts(self.prompts) if self.prompts else None,
                        prompt_len=LengthDist.parse(self.prompt_len_dist), max_new_tokens=self.max_new_tokens,
                        output_len=LengthDist.parse(self.max_new_tokens_dist) if self.max_new_tokens_dist else None,
                        cancel_fraction=self.cancel_fraction if cancel else 0.0,
                        num_requests=num_requests, seed=self.seed if seed is None else seed,
                        sampling_seeds=self.temperature > 0)

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        ignore_eos=self.ignore_eos, timeout=self.timeout)


def stats_dict(msg) -> dict:
    """Every field of a GetStatsResponse (zeros included)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def _clients(target: str, n: int) -> list[GenerationClient]:
    # a local subchannel pool per channel: separate TCP connections instead of one shared one
    options = [("grpc.use_local_subchannel_pool", 1)] if n > 1 else []
    return [GenerationClient(target, options=options) for _ in range(n)]


async def run_load(target: str, cfg: LoadConfig, out_dir: str | Path, *, label: str = "loadtest",
                   stop: asyncio.Event | None = None) -> dict:
    """Runs `cfg` against the server at `target`, writes the result files into `out_dir` and returns the result."""
    cfg.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clients = _clients(target, cfg.channels)
    try:
        if cfg.wait > 0:
            await clients[0].wait_ready(cfg.wait)
        before = stats_dict(await clients[0].stats())
        vocab, max_len = before["vocab_size"], before["max_model_len"]
        sampling = cfg.sampling()
        if cfg.warmup:
            warm = cfg.workload(vocab, max_len, seed=cfg.seed + 7919, cancel=False)
            await drive(clients, warm, sampling, concurrency=cfg.concurrency or cfg.warmup, requests=cfg.warmup,
                        progress=Progress(cfg.warmup, None, label=f"{label} warmup", enabled=cfg.progress))
            before = stats_dict(await clients[0].stats())
        n = cfg.num_requests
        workload = cfg.workload(vocab, max_len, num_requests=n)
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        progress = Progress(n, cfg.duration, label=label, enabled=cfg.progress)
        records = await drive(clients, workload, sampling, concurrency=cfg.concurrency, rate=cfg.rate, requests=n,
                              duration=cfg.duration, seed=cfg.seed, progress=progress, stop=stop)
        try:
            after, after_error = stats_dict(await clients[0].stats()), None
        except grpc.aio.AioRpcError as e:  # the server died or stopped during the run: its requests' records stay
            after, after_error = None, f"{e.code().name}: {e.details() or ''}"
    finally:
        for c in clients:
            await c.close()

    result = {
        "version": RESULT_VERSION,
        "label": label,
        "server": target,
        "mode": "open" if cfg.rate is not None else "closed",
        "concurrency": cfg.concurrency,
        "rate": cfg.rate,
        "started_at": started_at,
        "interrupted": bool(stop and stop.is_set()),
        **metrics.summarize(records, cfg.slo_ttft_ms, cfg.slo_tpot_ms),
        "server_stats": {"before": before, "after": after,
                         "delta": None if after is None else
                         {k: after[k] - before[k] for k in after if k.endswith("_total")},
                         **({"after_error": after_error} if after_error else {})},
        "config": dataclasses.asdict(cfg),
        "files": ["result.json", "requests.jsonl"],
    }
    t0 = min((r.start for r in records), default=0.0)
    with open(out / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in sorted(records, key=lambda r: r.index):
            f.write(json.dumps(r.to_json(t0)) + "\n")
    if cfg.plots:
        title = f"{label}: {result['mode']} loop, " + (f"rate {cfg.rate}/s" if cfg.rate else f"concurrency {cfg.concurrency}")
        plots.latency_cdf(records, out / "latency_cdf.png", title)
        plots.timeline(records, out / "timeline.png", title)
        result["files"] += ["latency_cdf.png", "timeline.png"]
    write_json(out / "result.json", result)
    return result


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summary_line(result: dict) -> str:
    e = ", ".join(f"{k} {v}" for k, v in result["errors"].items()) or "none"
    acc = result["mean_accepted_length"]
    return (f"{result['requests']} requests ({result['completed']} completed; errors: {e}) in "
            f"{result['duration_s']:.2f}s: {result['output_tokens_per_s']:.1f} output tok/s, "
            f"{result['requests_per_s']:.2f} req/s, goodput {result['goodput']['requests_per_s']:.2f} req/s; "
            f"TTFT p50/p90/p99 {_ms(result['ttft_ms'])}; TPOT {_ms(result['tpot_ms'])}; ITL {_ms(result['itl_ms'])}"
            + (f"; mean accepted length {acc:.2f}" if acc is not None else ""))


def _ms(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99")) + " ms"
