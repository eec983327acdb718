"""PNG plots (matplotlib, Agg backend): a run's latency CDFs and timeline, a sweep's throughput and p99 latency
against concurrency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.metrics import RequestRecord, percentile


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and end-to-end latency, p50/p90/p99 marked."""
    plt = _pyplot()
    series = [
        ("TTFT", [r.ttft for r in records if r.ttft is not None]),
        ("TPOT", [r.tpot for r in records if r.tpot is not None]),
        ("ITL", [x for r in records for x in r.itls]),
        ("end-to-end", [r.e2e for r in records if r.e2e is not None]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series):
        xs = sorted(v * 1e3 for v in values)
        ax.set_title(f"{name} ({len(xs)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        if not xs:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post")
        for q, style in ((50, ":"), (90, "--"), (99, "-.")):
            p = percentile(xs, q)
            ax.axvline(p, color="gray", linestyle=style, linewidth=1, label=f"p{q} {p:.1f} ms")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "latency CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline(records: Sequence[RequestRecord], path: Path, title: str = "", max_bins: int = 60) -> Path:
    """Output tokens/s (in bins of at least 0.5 s, at most `max_bins`) and requests in flight over the run."""
    plt = _pyplot()
    t0 = min((r.start for r in records), default=0.0)
    t1 = max((r.end for r in records), default=t0)
    span = max(t1 - t0, 1e-6)
    bins = max(5, min(max_bins, int(span / 0.5)))
    width = span / bins
    tokens = [0.0] * bins
    for r in records:
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            tokens[min(int((t - t0) / width), bins - 1)] += n
    mids = [(i + 0.5) * width for i in range(bins)]
    events = sorted([(r.start - t0, 1) for r in records] + [(r.end - t0, -1) for r in records])
    xs, ys, level = [0.0], [0], 0
    for t, d in events:
        level += d
        xs.append(t)
        ys.append(level)
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a.plot(mids, [n / width for n in tokens])
    a.set_ylabel("output tokens/s")
    a.grid(alpha=0.3)
    b.step(xs, ys, where="post")
    b.set_ylabel("requests in flight")
    b.set_xlabel("seconds since the first request")
    b.grid(alpha=0.3)
    fig.suptitle(title or "timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _by_config(runs: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        if "result" in run:
            out.setdefault(run["config"], []).append(run)
    for series in out.values():
        series.sort(key=lambda r: r["concurrency"])
    return out


def _concurrency_axis(ax, runs: Sequence[dict]) -> None:
    cs = sorted({r["concurrency"] for r in runs if "result" in r})
    if len(cs) > 1 and cs[0] > 0 and cs[-1] / cs[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(cs)
    ax.set_xticklabels([str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.grid(alpha=0.3)


def sweep_throughput(runs: Sequence[dict], path: Path, title: str = "") -> Path:
    """Output tokens/s and goodput (requests/s within the SLO) against concurrency, a line per config."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, series in _by_config(runs).items():
        cs = [r["concurrency"] for r in series]
        a.plot(cs, [r["result"]["output_tokens_per_s"] for r in series], marker="o", label=name)
        b.plot(cs, [r["result"]["goodput"]["requests_per_s"] for r in series], marker="o", label=name)
    a.set_ylabel("output tokens/s")
    b.set_ylabel("goodput, requests/s")
    slo = next((r["result"]["goodput"] for r in runs if "result" in r), {})
    limits = [f"{k} <= {slo[f'slo_{k.lower()}_ms']:g} ms" for k in ("TTFT", "TPOT") if slo.get(f"slo_{k.lower()}_ms")]
    b.set_title("SLO: " + ", ".join(limits) if limits else "no SLO given: every completed request", fontsize=10)
    for ax in (a, b):
        _concurrency_axis(ax, runs)
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_p99(runs: Sequence[dict], path: Path, title: str = "") -> Path:
    """p99 TTFT, TPOT and ITL against concurrency, a line per config."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for key, ax in zip(("ttft_ms", "tpot_ms", "itl_ms"), axes):
        for name, series in _by_config(runs).items():
            pts = [(r["concurrency"], r["result"][key]["p99"]) for r in series if r["result"][key]["p99"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_ylabel(f"p99 {key[:-3].upper()}, ms")
        _concurrency_axis(ax, runs)
        ax.legend(fontsize=8)
    fig.suptitle(title or "p99 latency vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
