"""Kernel launches of one decode step, counted on CPU: the GPU step is launch-bound (bench/NOTES.md: ~76 launches
per layer at 7.8x the bandwidth floor), so the count is guarded here. A one-token forward of the bench model's
layer mix (3 GDN + 1 attention, all MoE) on the Triton path under the interpreter: PyTorch ops that launch a
kernel (views and allocations excluded) plus Triton launches, per layer.

Run as a script by the test below (the interpreter must be set before triton is imported); prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from interp import run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]
# 13.25 now: 14.75 before an attention layer's q/k norms, rotations and KV write became one launch and its output
# gate moved into the attention kernel's epilogue (6 launches fewer in the one attention layer of 4); 15.5 before
# the fused MoE's reduction joined the residual add and the next norm (one launch fewer in each MoE layer followed
# by a norm: 3 of these 4, the last layer has none); 20.75 at an earlier count (21.75 before the router logits took
# one kernel); 26.2 before the residual adds joined the norms and the router its bias and cast, 76.0 before any
# fusion
MAX_PER_LAYER = 13.25

NO_KERNEL = {"view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "t", "transpose", "expand",
             "expand_as", "unsqueeze", "squeeze", "split", "chunk", "split_with_sizes", "narrow", "detach", "alias",
             "unbind", "permute", "_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided",
             "_local_scalar_dense", "item", "set_", "new_empty", "is_same_size", "resolve_conj", "resolve_neg"}


def main() -> None:
    import torch
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e import tiny_config

    from workers.batch import ForwardBatch
    from workers.bench_model import build_bench_model
    from workers.cache import ModelCache

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.on = Counter(), True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if self.on and name not in NO_KERNEL:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    count = Count()
    launches = [0]
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):  # the interpreter's own tensor work is not the kernel's launches
        launches[0] += 1
        count.on = False
        try:
            return run(self, *args, **kwargs)
        finally:
            count.on = True

    interpreter.InterpretedFunction.run = counted_run
    cfg = tiny_config()
    model = build_bench_model(config=cfg, dtype=torch.float32, device="cpu")
    cache = ModelCache(cfg, 8, 16, 2, torch.float32, "cpu")
    batch = ForwardBatch.build([[5]], [3], [[0]], [0], "cpu")
    model(batch, cache)  # compile every kernel first
    launches[0] = 0
    with count:
        model(batch, cache)
    layers = cfg.num_hidden_layers
    print(json.dumps({"per_layer": (sum(count.ops.values()) + launches[0]) / layers, "layers": layers,
                      "triton": launches[0], "torch": dict(count.ops.most_common())}))


def test_a_decode_step_launches_few_kernels_per_layer():
    out = run_interpreted(__file__)
    assert out["triton"] > 0 and out["torch"].get("linear", 0) > 0  # both kinds were really counted
    assert out["per_layer"] <= MAX_PER_LAYER, out


if __name__ == "__main__":
    main()
