"""Host time by part of a served step, per policy and step kind, without a profiler (issue 7), one command on the H200:
    PYTHONPATH=. python bench/host_phases.py --phases-out $OUT/phases.json [--force-plain] <bench/e2e.py arguments>
Runs bench/e2e.py with thin perf_counter wrappers around the runner's parts (ModelRunner.execute and, inside it,
the graphs' staging and replay, the drafter, the plan, the gate's bookkeeping, the deferred learning) and writes,
per (policy, plain|spec, part), [total ms, steps, mean ms per step, median ms per step] of the decode steps (no
prefill chunk, no graph capture) that ran 1 or 64 requests (--batches; a kind of B > 1 requests is `plain@B` /
`spec@B`), a part's calls within a step summed
(`execute+sync` is the step until the device is done, as e2e times it; `gate: resumed` holds one of the step's two
`gate: mark`s). The wrappers cost ~1 us a call, where torch.profiler (bench/step_timeline.py) and cProfile
(bench/host_profile.py) inflate every Python call; the steps include the warm-up run's and the profile's (until
2026-12-01 the graph captures too: their means were ~3x the served steps'). `--force-plain`: hybridspec's gate
always answers plain decoding, so its plain steps can be compared with ar's in one cell (bench/NOTES.md,
2026-11-30 21:00-). `--tiny` (an e2e argument) runs the plumbing on CPU.

The step's critical path is also cut by timestamps (`cp: ...` parts): `cp: pre-launch` from the execute's start to
the return of the target graph's replay call (staging, the gate, the plan: the device idles unless the drafter's
work is queued), `cp: wait` from there to the first acceptance (the read-back of the greedy rows' argmax: the
device's forward; a step with sampling rows only reads back inside its acceptance, so `cp: post` holds that wait),
`cp: post` from there to the execute's return, `cp: between` from the last execute's return to this one's start
(the engine's loop), and `gpu: replay` the CUDA-event time of the target graph's replay alone (its GPU time; on
CUDA only); `bucket R x T block B pages P` counts the steps that ran that graph (no time).

`<policy>|threads|<thread name>` rows: the CPU time the process's threads used during the policy's last serve
([cpu ms, threads, cpu ms / wall ms, wall ms]; `main` is the serving thread): worker threads of OpenMP or a BLAS
that spin after a parallel region run on the serving thread's hyperthread sibling and slow every host part of it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.e2e as e2e  # noqa: E402
import workers.drafters as drafters  # noqa: E402
import workers.graphs as graphs  # noqa: E402
import workers.policy as policy  # noqa: E402
import workers.runner as runner  # noqa: E402

# (class, method, label) timed inside a step
PARTS = ((runner.ModelRunner, "flush_learning", "flush_learning"), (graphs.StepGraphs, "run", "graphs.run"),
         (graphs.StepGraphs, "_stage", "graphs._stage"), (graphs.StepGraphs, "commit", "graphs.commit"),
         (policy.LengthPolicy, "should_draft", "should_draft"), (policy.LengthPolicy, "lengths", "lengths"),
         (policy.LengthPolicy, "extra_tokens", "extra_tokens"), (policy.LengthPolicy, "observe", "observe"),
         (policy.LengthPolicy, "observe_outcome", "observe_outcome"), (policy.LengthPolicy, "stats", "stats"),
         (policy.LengthPolicy, "fold_counts", "fold_counts"), (policy.LengthPolicy, "wants_cycle", "wants_cycle"),
         (policy.LengthPolicy, "draft_cap", "draft_cap"),
         (policy.LengthPolicy, "next_step", "next_step"),
         (policy.LengthPolicy, "keep_counts", "keep_counts"), (runner._StepEnds, "mark", "gate: mark"),
         (runner._StepEnds, "step_ended", "gate: step_ended"), (runner._StepEnds, "resumed", "gate: resumed"),
         (runner._StepEnds, "end_mark", "gate: end_mark"), (runner.ModelRunner, "_read_distinct", "read_distinct"),
         (policy.DeviceReadback, "__init__", "DeviceReadback"), (policy.LengthPolicy, "observe_extra", "observe_extra"))
KINDS_OF_BATCH = [1, 64]  # batch sizes whose steps are reported (the full batch of the usual cells; --batches)


class Phases:
    def __init__(self) -> None:
        self.policy: str | None = None
        self.run: runner.ModelRunner | None = None  # the runner inside execute (its graph sets are the target's)
        self.stamps: dict[str, float] = {}  # this step's critical-path times (perf_counter s)
        self.replay_events: tuple | None = None  # CUDA events around the target graph's replay (this step's)
        self.replay_pair: tuple | None = None  # the one pair every step records (made on first use)
        self.last_exit: float | None = None
        self.step: dict[str, float] = collections.defaultdict(float)  # label -> ms in the current step
        self.acc: dict[tuple[str | None, str, str], list[float]] = collections.defaultdict(list)  # per-step ms
        self.threads: dict[str, list[float]] = {}  # add_threads' rows (the last serve of each policy)

    def wrap(self, owner: type, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.step[label] += (time.perf_counter() - t) * 1e3
        setattr(owner, name, timed)

    def install(self) -> None:
        for owner, name, label in PARTS:
            self.wrap(owner, name, label)
        for cls in vars(drafters).values():  # every drafter class's own propose / commit
            if isinstance(cls, type) and cls.__module__ == drafters.__name__:
                for name in ("propose", "commit"):
                    if name in cls.__dict__:
                        self.wrap(cls, name, f"{cls.__name__}.{name}")
        self.install_critical_path()
        execute = runner.ModelRunner.execute

        def timed_execute(run: runner.ModelRunner, requests):
            self.step.clear()
            self.stamps.clear()
            self.replay_events = None
            self.run = run
            t = time.perf_counter()
            result = execute(run, requests)
            done = time.perf_counter()
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            self.step["execute+sync"] = (time.perf_counter() - t) * 1e3
            self.critical_path(t, done)
            self.run = None
            self.record(run, requests)
            self.last_exit = time.perf_counter()
            return result
        runner.ModelRunner.execute = timed_execute
        serve = e2e.serve

        def labelled_serve(run, prompts, max_new, max_draft, page_size, num_pages, name, keep_policy=False):
            self.policy = name
            before, t = thread_cpu_ms(), time.perf_counter()
            try:
                return serve(run, prompts, max_new, max_draft, page_size, num_pages, name, keep_policy)
            finally:
                self.add_threads(name, before, thread_cpu_ms(), (time.perf_counter() - t) * 1e3)
        e2e.serve = labelled_serve

    def install_critical_path(self) -> None:
        """Timestamps of the target graph's replay (StepGraphs.run inside execute, on the runner's own sets) and of
        the step's first acceptance (the runner's `accept`: right after the read-back)."""
        run_graph = graphs.StepGraphs.run
        replay = torch.cuda.CUDAGraph.replay
        timing: list = []  # the event pair to record around the next replay (set inside a target graph's run)

        def timed_replay(graph):
            if not timing:
                return replay(graph)
            begin, end = timing
            begin.record()
            replay(graph)
            end.record()
        torch.cuda.CUDAGraph.replay = timed_replay

        def stamped_run(g, *a, **k):
            target = self.run is not None and g in self.run._graphs.values()
            first = target and "replay" not in self.stamps
            if first and g.capture:
                if self.replay_pair is None:  # one pair for every step: read before the next step records it
                    self.replay_pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing[:] = self.replay_pair
                try:
                    out = run_graph(g, *a, **k)
                finally:
                    timing.clear()
                self.replay_events = self.replay_pair
            else:
                out = run_graph(g, *a, **k)
            if first:
                self.stamps["replay"] = time.perf_counter()
                key = a[0] if a else k.get("key")
                if key is not None:  # which graph ran: a part of no time, counted (its steps: the row's count)
                    self.step[f"bucket {e2e.bucket_label(key)}"] = 0.0
            return out
        graphs.StepGraphs.run = stamped_run
        accept = runner.accept

        def stamped_accept(*a, **k):
            t = time.perf_counter()
            self.stamps.setdefault("accept", t)
            try:
                return accept(*a, **k)
            finally:
                self.step["accept"] += (time.perf_counter() - t) * 1e3
        runner.accept = stamped_accept

    def critical_path(self, start: float, done: float) -> None:
        """The `cp: ...` parts of the step that ran from `start` to `done` (host times) and its `gpu: replay`."""
        if self.last_exit is not None:
            self.step["cp: between"] = (start - self.last_exit) * 1e3
        replay, first_accept = self.stamps.get("replay"), self.stamps.get("accept")
        if replay is not None and first_accept is not None:
            self.step["cp: pre-launch"] = (replay - start) * 1e3
            self.step["cp: wait"] = (first_accept - replay) * 1e3
        if first_accept is not None:
            self.step["cp: post"] = (done - first_accept) * 1e3
        if self.replay_events is not None:
            begin, end = self.replay_events
            self.step["gpu: replay"] = begin.elapsed_time(end)

    def add_threads(self, name: str, before: dict, after: dict, wall_ms: float) -> None:
        """A serve's CPU time by thread name (utime + stime from /proc, 10 ms ticks): the main thread and every
        other one (OpenMP / BLAS workers that spin after a parallel region take the cycles of the main thread's
        hyperthread sibling), as `threads|<name>` rows [cpu ms, threads, cpu ms / wall ms, wall ms]."""
        by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        main = threading.get_native_id()
        for tid, (comm, ms) in after.items():
            used = ms - before.get(tid, (comm, 0.0))[1]
            key = "main" if tid == main else comm
            by[key][0] += used
            by[key][1] += 1
        for key, (ms, n) in by.items():
            self.threads[f"{name}|threads|{key}"] = [ms, n, ms / max(wall_ms, 1e-9), wall_ms]

    def record(self, run, requests) -> None:
        """Adds the current step's parts (self.step) if it is a served decode step of a reported batch size: no
        prefill chunk, and no graph captured in it (a capture is ~10-100x a step)."""
        decode = all(len(r.tokens) == 1 and r.context_len > 0 for r in requests)
        if decode and len(requests) in KINDS_OF_BATCH and not getattr(run, "last_step_captured", False):
            kind = "spec" if getattr(run, "last_draft_width", 0) else "plain"
            if len(requests) > 1:  # e.g. plain@4: the steps of 4 requests (batch 1 keeps the bare kind)
                kind += f"@{len(requests)}"
            for label, ms in self.step.items():
                self.acc[(self.policy, kind, label)].append(ms)

    def table(self) -> dict[str, list[float]]:
        return {f"{p}|{k}|{label}": [sum(ms), len(ms), sum(ms) / len(ms), statistics.median(ms)]
                for (p, k, label), ms in sorted(self.acc.items(), key=lambda kv: tuple(str(x) for x in kv[0]))}


def thread_cpu_ms() -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU ms used so far) for this process's threads (Linux /proc; {} elsewhere)."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*") if Path("/proc/self/task").exists() else []:
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread exited
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) * 1e3 / tick)
    return out


def add_shadow_work(kind: str) -> None:
    """ar's flush_learning followed by host work of `kind` (--ar-shadow-work), on ar's steps only."""
    flush = runner.ModelRunner.flush_learning
    buf = np.zeros(8 << 20, dtype=np.uint8)  # [8 MB]: more than the serving core's L2
    junk: list = []

    def with_work(run: runner.ModelRunner, fold: bool = True) -> None:
        flush(run, fold)
        if getattr(getattr(run, "policy", None), "name", None) != "ar":
            return
        if kind == "mem":
            buf[::64] += 1  # one write per cache line
        else:
            junk.clear()
            t = time.perf_counter()
            while time.perf_counter() - t < 1.2e-4:
                junk.append({"a": len(junk), "b": [1.0, 2.0]})
    runner.ModelRunner.flush_learning = with_work


def plan_twice(phases: Phases) -> None:
    """--plan-twice: LengthPolicy.lengths runs twice, the second call timed as `lengths (again)` (install() then
    times the pair as `lengths`: subtract)."""
    lengths = policy.LengthPolicy.lengths

    def twice(pol, *a, **k):
        lengths(pol, *a, **k)
        t = time.perf_counter()
        try:
            return lengths(pol, *a, **k)
        finally:
            phases.step["lengths (again)"] += (time.perf_counter() - t) * 1e3
    policy.LengthPolicy.lengths = twice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases-out", required=True,
                    help="JSON: per policy|kind|part [total ms, steps, mean ms per step, median ms per step]")
    ap.add_argument("--force-plain", action="store_true", help="hybridspec's gate always decodes plain")
    ap.add_argument("--batches", default="1,64", help="batch sizes whose decode steps are reported")
    ap.add_argument("--ar-shadow-work", choices=("none", "mem", "py"), default="none",
                    help="after ar's deferred learning (in the forward's shadow): mem = touch 8 MB (the caches "
                         "evicted), py = 0.12 ms of Python allocation; does host work there slow the critical path?")
    ap.add_argument("--pin-cpu", type=int, default=None,
                    help="pin every thread of the process to this CPU (torch's intra-op threads: 1)")
    ap.add_argument("--plan-twice", action="store_true",
                    help="every plan is made twice in a row, the second timed as `lengths (again)`: its time with "
                         "the code and data just used (the first's in place is ~3x on this repo's CPU at c=16: a "
                         "cold cache?). A diagnostic: the plan's side effects (rate EWMA, recent plans) count twice")
    args, rest = ap.parse_known_args()
    KINDS_OF_BATCH[:] = [int(b) for b in args.batches.split(",")]
    if args.force_plain:
        policy.SpeculationGate.should_draft = lambda self, *args, **kwargs: False
    if args.ar_shadow_work != "none":
        add_shadow_work(args.ar_shadow_work)
    if args.pin_cpu is not None:  # every thread of the process (BLAS pools exist by now), torch's to one
        torch.set_num_threads(1)
        for task in Path("/proc/self/task").iterdir():
            os.sched_setaffinity(int(task.name), {args.pin_cpu})
    phases = Phases()
    if args.plan_twice:
        plan_twice(phases)
    phases.install()
    sys.argv = ["e2e.py"] + rest
    e2e.main()
    table = phases.table()
    Path(args.phases_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.phases_out).write_text(json.dumps({**table, **phases.threads}, indent=1))
    for key, (ms, n, per, median) in table.items():
        print(f"{key}: {per:.3f} ms (median {median:.3f}) x {int(n)}")
    for key, (ms, n, share, wall) in phases.threads.items():  # (also in the JSON, beside the parts)
        print(f"{key}: {ms:.0f} cpu ms in {int(n)} threads = {share:.2f} of the serve's {wall:.0f} ms")


if __name__ == "__main__":
    main()
