"""Per-request records and what a run's result says about them.

Definitions (times are the client's, taken as each message arrives):
- TTFT: from sending the request to the first message that carries tokens (every stream that got one, the
  cancelled ones included).
- TPOT: (last token's arrival - first token's arrival) / (output tokens - 1), per completed request with at least
  2 tokens.
- ITL: the gap between two consecutive token-bearing messages of one stream (with speculation a message may
  carry several tokens); every stream.
- E2E: from sending to the last message, completed requests (a stream the server aborted, finish_reason "abort",
  is not one: it is counted among the errors as SERVER_ABORTED).
- output_tokens_per_s: every token received (cancelled streams' too) / the run's wall time; requests_per_s:
  completed requests / wall time.
- goodput: completed requests whose TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms (an SLO left out always
  holds; a 1-token output has no TPOT and meets any TPOT SLO), per second.
- mean accepted length: sum(usage.accepted_tokens) / sum(usage.verify_steps) over completed requests.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

OK = "OK"
# a stream the server ended with finish_reason "abort" (it drained or a step failed): the gRPC status is OK, but the
# request did not complete, so it is an error here and none of the completed requests' numbers
ABORTED = "SERVER_ABORTED"  # (not gRPC's ABORTED status: the call itself ended OK)
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    start: float  # time.perf_counter() when the call was made
    end: float = 0.0  # when the stream ended (last message, error, or our cancellation)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each message that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those messages
    status: str = OK  # OK, the gRPC status it ended with (CANCELLED: we cancelled it), or SERVER_ABORTED
    detail: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    usage: dict | None = None  # the last message's usage (completed requests)
    cancel_after_chunks: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if not self.ok or n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    def to_json(self, t0: float) -> dict:
        ms = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
        return {"index": self.index, "status": self.status, "detail": self.detail or None,
                "start_s": round(self.start - t0, 6), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "chunks": len(self.chunk_times),
                "finish_reason": self.finish_reason, "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot),
                "e2e_ms": ms(self.e2e), "cancel_after_chunks": self.cancel_after_chunks, "usage": self.usage}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: Iterable[float]) -> dict:
    """Summary in milliseconds of values in seconds: p50, p90, p99, mean, min, max, count (None when empty)."""
    xs = [v * 1e3 for v in values_s]
    out: dict = {f"p{q}": _round(percentile(xs, q)) for q in PERCENTILES}
    out.update(mean=_round(sum(xs) / len(xs)) if xs else None, min=_round(min(xs, default=None)),
               max=_round(max(xs, default=None)), count=len(xs))
    return out


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request within both SLOs (an SLO that is None always holds; no TPOT meets any TPOT SLO)."""
    if not record.ok or record.ttft is None:
        return False
    if slo_ttft_ms is not None and record.ttft * 1e3 > slo_ttft_ms:
        return False
    tpot = record.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def goodput(records: Sequence[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
            slo_tpot_ms: float | None = None) -> dict:
    good = [r for r in records if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    return {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "good_requests": len(good),
            "requests_per_s": _rate(len(good), duration_s),
            "output_tokens_per_s": _rate(sum(r.output_tokens for r in good), duration_s),
            "fraction": round(len(good) / len(records), 6) if records else None}


def summarize(records: Sequence[RequestRecord], slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The metrics part of a run's result.json."""
    start = min((r.start for r in records), default=0.0)
    end = max((r.end for r in records), default=0.0)
    duration = max(end - start, 0.0)
    done = [r for r in records if r.ok]
    errors = Counter(r.status for r in records if not r.ok)
    usages = [r.usage for r in done if r.usage]
    spec = {k: sum(u[k] for u in usages) for k in ("draft_tokens", "accepted_tokens", "verify_steps")}
    output_tokens = sum(r.output_tokens for r in records)
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": dict(sorted(errors.items())),
        "duration_s": _round(duration),
        "input_tokens": sum(r.prompt_tokens or 0 for r in records),
        "output_tokens": output_tokens,
        "output_tokens_per_s": _rate(output_tokens, duration),
        "requests_per_s": _rate(len(done), duration),
        "goodput": goodput(records, duration, slo_ttft_ms, slo_tpot_ms),
        "ttft_ms": distribution(r.ttft for r in records if r.ttft is not None),
        "tpot_ms": distribution(r.tpot for r in records if r.tpot is not None),
        "itl_ms": distribution(x for r in records for x in r.itls),
        "e2e_ms": distribution(r.e2e for r in records if r.e2e is not None),
        "finish_reasons": dict(sorted(Counter(r.finish_reason for r in done if r.finish_reason).items())),
        "mean_accepted_length": (round(spec["accepted_tokens"] / spec["verify_steps"], 4)
                                 if spec["verify_steps"] else None),
        "speculation": spec,
    }


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 4) if seconds > 0 else 0.0
