"""One CUDA-graph timer for the kernel benches (bench/kernels_*.py): the median microseconds per call of a list of
calls captured in one graph and replayed. Imports torch only when called (the benches' --tiny runs stay on CPU)."""

from __future__ import annotations

import statistics


def graph_time(calls, reps: int = 30, warmup: int = 5) -> float:
    """Median microseconds per call: one CUDA graph runs all `calls` in order (compiled and warmed on a side stream
    first, outside the capture), replayed `reps` times after `warmup` replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(calls))
    del g
    return statistics.median(times)
