"""Triton compile keys stay few over a speculative serving workload (CPU, TRITON_INTERPRET=1).

Eager steps (no CUDA graphs: expert parallelism, --graphs 0) see a new shape almost every step while speculating
(ragged T_i = 1..17, token totals, batch sizes, context lengths). A kernel that takes a size-derived value as a
constexpr, or an int argument Triton specializes (== 1, % 16), compiles again for each new value: 0.3-1 s inside a
timed step on the H200 (bench/ep.py measured hybridspec c=16 at a 519 ms median step on one GPU for this reason).
tests/specializations.py records, per kernel, the distinct keys (constexprs, int specializations, dtypes, launch
options) of:
  - the tiny bench model served by the engine (policies ar, fixed16, hybridspec with the replay drafter and its
    cost model; concurrency 1, 4, 9; local MoE and expert-parallel MoE over a one-rank gloo group), and
  - a dry sweep of the decode/verify/commit kernels at the bench model's sizes (B up to 64, T up to 17,
    contexts up to 8k, 132 SMs for the KV-split plan).
Each kernel's count must stay under its bound; the message names the kernel and its keys.

Run as a script by the tests below (the interpreter must be set before triton is imported); prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from interp import run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_BOUND = 3
# the paged-attention tile plans: BLOCK_M 16/32/64/128 for decode/verify, each split or not, + the prefill tile
BOUNDS = {"attention_triton._paged_attn_kernel": 9, "attention_triton._combine_kernel": 1}
# MoE: NK (assignments) is not specialized, NK_P2 is a constant unless the align runs inside gate/up, the align
# kernel's CHUNK is 128 or 1024; what remains varies with BLOCK_M, FUSED_ALIGN and HAS_MASK
MOE_BOUND = 8


def main() -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    import kernels.attention_triton as attention_triton
    from specializations import SpecRecorder, compact_keys, run_sweep, run_workload, summary

    attention_triton.CPU_SM_COUNT = 132  # KV splits as planned on the H200
    out = {}
    with SpecRecorder() as rec:
        rec.shadow_dispatch()
        run_workload(rec, concurrencies=(1, 4, 9), prompt_len=150, max_new=12)
    out["workload"] = {"keys": {k: compact_keys(v) for k, v in rec.keys.items()}, "summary": summary(rec)}
    with SpecRecorder() as rec:
        rec.shadow_dispatch()
        run_workload(rec, concurrencies=(4,), policies=("hybridspec",), prompt_len=30, max_new=10, ep=True)
    out["workload_ep"] = {"keys": {k: compact_keys(v) for k, v in rec.keys.items()}, "summary": summary(rec)}
    for moe in ("local", "ep"):
        with SpecRecorder(execute=False) as rec:
            run_sweep(rec, batches=(1, 2, 3, 8, 16, 33, 64), moe=moe)
        out[f"sweep_{moe}"] = {"keys": {k: compact_keys(v) for k, v in rec.keys.items()},
                               "summary": summary(rec)}
    out["combine_error"] = combine_error()
    print(json.dumps(out))


def combine_error() -> float:
    """Paged attention with 37 KV splits (several chunks of the combine kernel) against the reference."""
    import torch

    from kernels.attention import paged_attention_ref
    from kernels.attention_triton import paged_attention_triton

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 16, 4
    q_lens, ctx_lens = [1, 3], [150, 97]
    pages = [-(-(c + t) // ps) for c, t in zip(ctx_lens, q_lens)]
    perm = torch.randperm(sum(pages) + 2, generator=gen)
    table = torch.zeros(2, max(pages), dtype=torch.int32)
    table[0, : pages[0]] = perm[: pages[0]].int()
    table[1, : pages[1]] = perm[pages[0]: pages[0] + pages[1]].int()
    kc = torch.randn(sum(pages) + 2, ps, hkv, d, generator=gen)
    vc = torch.randn(sum(pages) + 2, ps, hkv, d, generator=gen)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    q = torch.randn(4, hq, d, generator=gen)
    ref = paged_attention_ref(q, kc, vc, table, cu, ctx, d ** -0.5, q_lens, ctx_lens)
    out = paged_attention_triton(q, kc, vc, table, cu, ctx, d ** -0.5, q_lens, ctx_lens,
                                 plan={"splits": 37, "block_n": 16})
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def recorded():
    return run_interpreted(__file__)


def _violations(recorded, moe: bool) -> list[str]:
    bad = []
    for run in ("workload", "workload_ep", "sweep_local", "sweep_ep"):
        for name, keys in recorded[run]["keys"].items():
            if name.startswith("moe_triton.") != moe:
                continue
            bound = MOE_BOUND if moe else BOUNDS.get(name, DEFAULT_BOUND)
            if len(keys) > bound:
                vary = recorded[run]["summary"][name]["varying"]
                bad.append(f"{run}: {name} has {len(keys)} distinct compile keys (bound {bound}); they differ in "
                           f"{sorted(vary)}:\n    " + "\n    ".join(keys[:40]))
    return bad


def test_workload_reaches_the_kernels(recorded):
    names = set(recorded["workload"]["keys"])
    for k in ("attention_triton._paged_attn_kernel", "attention_triton._qk_prep_kernel", "gdn_triton._gdn_seq_kernel",
              "conv_triton._conv_commit_kernel", "moe_triton._moe_gate_up_kernel"):
        assert k in names, sorted(names)
    assert {"attention_triton._combine_kernel", "attention_triton._qk_prep_kernel"} <= set(recorded["sweep_local"]["keys"])


def test_compile_keys_are_bounded(recorded):
    bad = _violations(recorded, moe=False)
    assert not bad, "Triton kernels specialized on step shapes (each key is a JIT compile on the GPU):\n" + \
        "\n".join(bad)


def test_moe_compile_keys_are_bounded(recorded):
    bad = _violations(recorded, moe=True)
    assert not bad, "MoE kernels specialized on step shapes:\n" + "\n".join(bad)


def test_split_combine_matches_reference(recorded):
    assert recorded["combine_error"] < 1e-5, recorded["combine_error"]


if __name__ == "__main__":
    main()
