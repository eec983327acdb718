"""Serving metrics, and an opt-in Prometheus text endpoint (`hybridspec serve --metrics-port N`).

EngineMetrics is updated on the event loop only (the engine thread hands its numbers over with each step's
outputs), so it needs no lock. `start_metrics_server` is a tiny asyncio HTTP/1.0 server answering
`GET /metrics` with the text exposition format (version 0.0.4); no client library needed.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import Counter
from dataclasses import dataclass, field

from scheduler.request import RequestStats

ACCEPTED_LENGTH_BUCKETS = tuple(float(n) for n in range(17))  # accepted drafts in one verification, 0..16
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class EngineMetrics:
    requests_admitted: int = 0
    requests_finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    requests_failed: Counter[str] = field(default_factory=Counter)  # by engine error
    rpcs: Counter[str] = field(default_factory=Counter)  # Generate calls by gRPC status code
    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    step_seconds: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    accepted_length: Histogram = field(default_factory=lambda: Histogram(ACCEPTED_LENGTH_BUCKETS))
    occupancy: dict[str, int] = field(default_factory=dict)
    policy: dict[str, float] = field(default_factory=dict)  # latency-model / calibration errors (workers/policy.py)

    # ---- updates -------------------------------------------------------------------------------------
    def request_admitted(self, prompt_tokens: int) -> None:
        self.requests_admitted += 1
        self.prompt_tokens += prompt_tokens

    def tokens_generated(self, n: int) -> None:
        self.generated_tokens += n

    def request_finished(self, reason: str, stats: RequestStats) -> None:
        self.requests_finished[reason] += 1
        self.draft_tokens += stats.draft_tokens
        self.accepted_tokens += stats.accepted_tokens

    def request_failed(self, error: str) -> None:
        self.requests_failed[error] += 1

    def rpc_finished(self, code: str) -> None:
        self.rpcs[code] += 1

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def observe_verification(self, accepted: int) -> None:
        """One request's verification in one step: how many of its drafts were accepted."""
        self.accepted_length.observe(float(accepted))

    def observe_occupancy(self, stats: dict[str, int]) -> None:
        self.occupancy = stats

    # ---- exposition ----------------------------------------------------------------------------------
    def render(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP hybridspec_{name} {help_text}")
            lines.append(f"# TYPE hybridspec_{name} {kind}")
            for labels, value in samples:
                lines.append(f"hybridspec_{name}{labels} {_num(value)}")

        occ = self.occupancy
        metric("rpcs_total", "counter", "Generate calls by final gRPC status code.",
               [(f'{{code="{c}"}}', n) for c, n in sorted(self.rpcs.items())])
        metric("requests_admitted_total", "counter", "Requests admitted into the engine.",
               [("", self.requests_admitted)])
        metric("requests_finished_total", "counter", "Requests that ended, by finish reason.",
               [(f'{{reason="{r}"}}', n) for r, n in sorted(self.requests_finished.items())])
        metric("requests_failed_total", "counter", "Requests rejected or failed inside the engine, by error.",
               [(f'{{error="{e}"}}', n) for e, n in sorted(self.requests_failed.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", self.prompt_tokens)])
        metric("generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
        metric("draft_tokens_total", "counter", "Draft tokens verified (finished requests).",
               [("", self.draft_tokens)])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted (finished requests).",
               [("", self.accepted_tokens)])
        metric("queue_depth", "gauge", "Requests waiting in the engine (new or preempted).",
               [("", occ.get("waiting_requests", 0))])
        metric("running_requests", "gauge", "Requests holding a state slot and KV pages.",
               [("", occ.get("running_requests", 0))])
        metric("free_pages", "gauge", "Free KV pages.", [("", occ.get("free_pages", 0))])
        metric("total_pages", "gauge", "KV pages in the pool.", [("", occ.get("total_pages", 0))])
        metric("free_slots", "gauge", "Free GDN state slots.", [("", occ.get("free_slots", 0))])
        metric("total_slots", "gauge", "GDN state slots in the pool.", [("", occ.get("total_slots", 0))])
        pol = self.policy
        for key, name, help_text in (
                ("latency_mean_abs_pct", "latency_model_error_mean_pct",
                 "Latency model: mean absolute error of step-time predictions made before each step, % of measured."),
                ("latency_p90_abs_pct", "latency_model_error_p90_pct", "Latency model: p90 absolute error, %."),
                ("calibration_ece_raw", "drafter_confidence_ece", "Drafter confidence vs acceptance: expected "
                 "calibration error of the raw confidences."),
                ("calibration_ece", "calibrated_acceptance_ece", "Expected calibration error after calibration.")):
            if key in pol and pol[key] == pol[key]:  # present and not NaN
                metric(name, "gauge", help_text, [("", pol[key])])
        for name, h, help_text in (
                ("step_seconds", self.step_seconds, "Wall time of one engine step."),
                ("accepted_length", self.accepted_length, "Drafts accepted per verification (one request, one step).")):
            lines.append(f"# HELP hybridspec_{name} {help_text}")
            lines.append(f"# TYPE hybridspec_{name} histogram")
            cumulative = 0
            for bound, n in zip(h.buckets, h.counts):
                cumulative += n
                lines.append(f'hybridspec_{name}_bucket{{le="{_num(bound)}"}} {cumulative}')
            lines.append(f'hybridspec_{name}_bucket{{le="+Inf"}} {h.count}')
            lines.append(f"hybridspec_{name}_sum {_num(h.total)}")
            lines.append(f"hybridspec_{name}_count {h.count}")
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


async def start_metrics_server(metrics: EngineMetrics, host: str, port: int) -> asyncio.AbstractServer:
    """Serves `GET /metrics` (and `/`) on host:port; returns the asyncio server (close() to stop)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # skip headers
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] in ("GET", "HEAD") and parts[1].split("?")[0] in ("/metrics", "/"):
                status, body = "200 OK", metrics.render().encode()
                if parts[0] == "HEAD":
                    writer.write(_head(status, len(body)))
                else:
                    writer.write(_head(status, len(body)) + body)
            else:
                body = b"not found; try GET /metrics\n"
                writer.write(_head("404 Not Found", len(body)) + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


def _head(status: str, length: int) -> bytes:
    return (f"HTTP/1.0 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode()
