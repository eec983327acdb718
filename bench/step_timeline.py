"""Where a served step's wall time goes, per policy (issue 7), one command on the H200:
    PYTHONPATH=. python bench/step_timeline.py --layers 40 --concurrency 64 --acceptance 0.85 --out $OUT
Serves one e2e cell per policy (bench/e2e.py's loop, replay drafter with the DFlash-shaped cost, CUDA graphs, the
start-up profile and a warm-up first) under torch.profiler with the runner's parts labelled (record_function
wrappers installed here, nothing in the engine changes), then reads the trace: per decode step its wall time, the
time the GPU is busy inside it, the GPU time of the kernels each part launched (target forward, drafter cost
forward, commit, the rest) and the host time of each part. What a step loses to the host is wall - busy.
Writes `$OUT/step_timeline.json` and prints a table. `--tiny` runs the plumbing on CPU (no GPU rows there).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import workers.runner as runner_mod  # noqa: E402
from bench.cell import build_cell  # noqa: E402
from bench.e2e import git_commit  # noqa: E402
from workers.drafters import DraftModelDrafter, ReplayDrafter  # noqa: E402
from workers.graphs import StepGraphs  # noqa: E402
from workers.policy import LengthPolicy  # noqa: E402
from workers.runner import ModelRunner  # noqa: E402

STEP, PREFILL = "step", "step (prefill or mixed)"
# (label, owner, attribute) of the parts wrapped in record_function while profiling
PARTS = (("draft: propose", ReplayDrafter, "propose"),
         ("draft: cost forward", DraftModelDrafter, "spend_forward"),
         ("gate", LengthPolicy, "should_draft"),
         ("plan: lengths", LengthPolicy, "lengths"),
         ("plan: extra tokens", LengthPolicy, "extra_tokens"),
         ("graph run", StepGraphs, "run"),
         ("graph commit", StepGraphs, "commit"),
         ("accept", runner_mod, "accept"),
         ("learn: observe", LengthPolicy, "observe"),
         ("learn: outcome", LengthPolicy, "observe_outcome"),
         ("learn: cycle", LengthPolicy, "observe_cycle"))


def _labelled(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


CAPTURED: list[bool] = []  # per decode step labelled STEP, in order: did it capture a CUDA graph first


def _labelled_step(fn):
    @functools.wraps(fn)
    def wrapper(self, requests, *args, **kwargs):
        decode = all(len(r.tokens) == 1 and r.context_len > 0 for r in requests)
        with record_function(STEP if decode else PREFILL):
            out = fn(self, requests, *args, **kwargs)
        if decode:
            CAPTURED.append(bool(getattr(self, "last_step_captured", False)))
        return out
    return wrapper


@contextlib.contextmanager
def labelled_parts():
    """Wraps PARTS and ModelRunner.execute in record_function for the duration."""
    saved = [(owner, attr, getattr(owner, attr)) for _, owner, attr in PARTS]
    saved.append((ModelRunner, "execute", ModelRunner.execute))
    try:
        for label, owner, attr in PARTS:
            setattr(owner, attr, _labelled(label, getattr(owner, attr)))
        ModelRunner.execute = _labelled_step(ModelRunner.execute)
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _union_ms(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length (ms) of the union of [a, b) intervals (us) clipped to [lo, hi)."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total / 1e3


def analyse(trace: dict, labels: list[str], skip: set[int] | None = None) -> dict:
    """Per decode step (a STEP annotation): wall, GPU busy within it, GPU ms by the part that launched each kernel
    (innermost label around its launch; a graph run inside `draft: cost forward` counts as the drafter's), host
    ms per part. Means (and medians of wall and busy) over the steps not in `skip` (indices of STEP annotations
    in time order: steps that captured a graph first)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    notes = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    runtime = {e["args"]["correlation"]: e["ts"] for e in events
               if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "correlation" in e.get("args", {})}  # (eager Triton launches are driver calls)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted((e for e in notes if e["name"] == STEP), key=lambda e: e["ts"])
    starts = [e["ts"] for e in steps]

    def step_of(ts: float) -> int:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= steps[i]["ts"] + steps[i]["dur"] else -1

    inside: list[list[dict]] = [[] for _ in steps]  # each step's labelled parts
    for n in notes:
        i = step_of(n["ts"])
        if i >= 0 and n["name"] in labels:
            inside[i].append(n)

    def owner_label(i: int, ts: float) -> str:
        around = [e for e in inside[i] if e["ts"] <= ts <= e["ts"] + e["dur"]]
        if not around:
            return "other"
        if any(e["name"] == "draft: cost forward" for e in around):
            return "draft: cost forward"
        best = min(around, key=lambda e: e["dur"])["name"]
        return "target forward" if best == "graph run" else best

    per_step = [{"wall_ms": e["dur"] / 1e3, "gpu_busy_ms": 0.0, "gpu_ms": {}, "host_ms": {}} for e in steps]
    intervals: list[list[tuple[float, float]]] = [[] for _ in steps]
    for k in gpu:
        launch = runtime.get(k.get("args", {}).get("correlation"), k["ts"])
        i = step_of(launch)
        if i < 0:
            continue  # launched outside a decode step (prefill, the loop between steps)
        lab = owner_label(i, launch)
        per_step[i]["gpu_ms"][lab] = per_step[i]["gpu_ms"].get(lab, 0.0) + k["dur"] / 1e3
        intervals[i].append((k["ts"], k["ts"] + k["dur"]))
    for i, e in enumerate(steps):
        per_step[i]["gpu_busy_ms"] = _union_ms(intervals[i], e["ts"], e["ts"] + e["dur"])
    for i, parts in enumerate(inside):
        for n in parts:
            per_step[i]["host_ms"][n["name"]] = per_step[i]["host_ms"].get(n["name"], 0.0) + n["dur"] / 1e3
    gaps = [(steps[i + 1]["ts"] - steps[i]["ts"] - steps[i]["dur"]) / 1e3 for i in range(len(steps) - 1)
            if not skip or (i not in skip and i + 1 not in skip)]
    drafted = [any(n["name"] == "draft: propose" for n in parts) for parts in inside]
    kept = [i for i in range(len(steps)) if not skip or i not in skip]
    if not kept:
        return {"steps": 0}
    out = _summary([per_step[i] for i in kept])
    out["between_steps_ms"] = statistics.fmean(gaps) if gaps else 0.0
    # speculative (drafted) and plain steps apart: a gated policy mixes both, and their means hide each other
    out["by_kind"] = {kind: _summary([per_step[i] for i in kept if drafted[i] == (kind == "speculative")])
                      for kind in ("speculative", "plain")}
    return out


def _summary(per_step: list[dict]) -> dict:
    """Means (and medians of wall and busy) of per-step records; {"steps": 0} for none."""
    if not per_step:
        return {"steps": 0}
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    keys_gpu = sorted({k for s in per_step for k in s["gpu_ms"]})
    keys_host = sorted({k for s in per_step for k in s["host_ms"]})
    return {"steps": len(per_step),
            "wall_ms": mean([s["wall_ms"] for s in per_step]),
            "wall_ms_median": statistics.median([s["wall_ms"] for s in per_step]),
            "gpu_busy_ms": mean([s["gpu_busy_ms"] for s in per_step]),
            "gpu_busy_ms_median": statistics.median([s["gpu_busy_ms"] for s in per_step]),
            "gpu_ms": {k: mean([s["gpu_ms"].get(k, 0.0) for s in per_step]) for k in keys_gpu},
            "host_ms": {k: mean([s["host_ms"].get(k, 0.0) for s in per_step]) for k in keys_host}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--acceptance", type=float, default=0.85)
    ap.add_argument("--policies", default="ar,fixed4,budget,hybridspec")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cell = build_cell(args.layers, args.tiny, args.concurrency, args.prompt_len, args.max_new)
    device, conc, ar = cell.device, args.concurrency, cell.ar
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    labels = [p[0] for p in PARTS]
    report = {"commit": git_commit(), "device": device, "concurrency": conc, "acceptance": args.acceptance,
              "policies": {}}
    for policy in args.policies.split(","):
        max_draft = cell.use_policy(policy, args.acceptance)
        cell.serve(policy, 32, max_draft)  # warm-up
        CAPTURED.clear()
        with labelled_parts(), profile(activities=activities) as prof:
            res = cell.serve(policy, args.max_new, max_draft)
            if device == "cuda":
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            summary = analyse(json.loads(path.read_text()), labels, {i for i, c in enumerate(CAPTURED) if c})
        summary["capture_steps"] = sum(CAPTURED)
        summary["tokens_match_ar"] = res.tokens == ar.tokens
        summary["mean_accepted_len"] = res.accepted_tokens / res.verify_steps if res.verify_steps else 0.0
        report["policies"][policy] = summary
        print(f"== {policy}: {summary.get('steps')} decode steps (+{summary['capture_steps']} capturing, left out), "
              f"wall {summary.get('wall_ms', 0):.2f} ms (median {summary.get('wall_ms_median', 0):.2f}), GPU busy "
              f"{summary.get('gpu_busy_ms', 0):.2f} ms (median {summary.get('gpu_busy_ms_median', 0):.2f}), "
              f"between steps {summary.get('between_steps_ms', 0):.2f} ms, accepted "
              f"{summary['mean_accepted_len']:.2f}", flush=True)
        for kind in ("gpu_ms", "host_ms"):
            print(f"   {kind}: " + ", ".join(f"{lab} {ms:.2f}" for lab, ms in summary.get(kind, {}).items()),
                  flush=True)
        for kind, part in summary.get("by_kind", {}).items():
            if part["steps"] and part["steps"] < summary["steps"]:
                print(f"   {kind} steps: {part['steps']}, wall {part['wall_ms']:.2f} (median "
                      f"{part['wall_ms_median']:.2f}), GPU busy {part['gpu_busy_ms']:.2f} (median "
                      f"{part['gpu_busy_ms_median']:.2f}); host: "
                      + ", ".join(f"{lab} {ms:.2f}" for lab, ms in part["host_ms"].items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_timeline.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
