"""Two-phase chunked prefill (kernels/gdn_chunk_triton.py) == gdn_chunk_ref / gdn_recurrent_ref.

Under TRITON_INTERPRET=1 on the CPU, fp32, tiny ragged batches (lengths 1, 37, 130: partial chunks, several chunks,
a one-token request), GQA (HK=1, HV=2), non-zero initial states in non-contiguous slots, write_state True / False /
a [B] mask. Chunks of 16 keep the interpreter fast; one case runs the default 64. As in tests/test_kernels_gdn.py
the kernels run in ONE subprocess that sets TRITON_INTERPRET=1 before triton is imported (this file run as a script
prints every case's errors as JSON); each case is one pytest test reading that result.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

from interp import assert_case, run_cases, run_interpreted  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]
NUM_SLOTS = 9
SLOTS = [7, 1, 4]  # non-contiguous, out of order
LENS = [1, 37, 130]
TOL = 2e-5  # relative (fp32; observed ~5e-7; a wrong decay or a dropped token is >= 1e-3)


def _inputs(lens, seed, hk=1, hv=2, dk=16, dv=32, correlated=False):
    """q, k, v as strided views of one [N, 2*HK*DK + HV*DV] row (as the model splits the conv output)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen)
    if correlated:  # keys near one direction, slow decay, beta near 1: the ill-conditioned UT system
        mixed[:, hk * dk:2 * hk * dk] = 0.3 * mixed[:, hk * dk:2 * hk * dk] + 3 * torch.randn(1, hk * dk,
                                                                                          generator=gen)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)  # strided views
    g = -torch.rand(n, hv, generator=gen) * (0.03 if correlated else 0.7)  # [N, HV] log decay
    beta = torch.rand(n, hv, generator=gen) * (0.5 if correlated else 1.0) + (0.5 if correlated else 0.0)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)  # [S, HV, DK, DV] fp32
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return q, k, v, g, beta, cu, state, torch.tensor(SLOTS[: len(lens)])


def _rel(a, b):
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _compare(errs, name, fn, lens=LENS, seed=0, ws=True, refs=("chunk",), shape=None, **kw):
    """Runs fn (a Triton entry point) and the references from the same pool; records o / state errors, and
    whether every slot outside the batch kept its exact value."""
    from kernels.gdn import gdn_chunk_ref, gdn_recurrent_ref

    shape = shape or {}
    correlated = kw.pop("correlated", False)
    q, k, v, g, beta, cu, state, slots = _inputs(lens, seed, correlated=correlated, **shape)
    s_tri = state.clone()
    o_tri = fn(q, k, v, g, beta, cu, s_tri, slots, max(lens), write_state=ws, **kw)
    ref_kw = {key: kw[key] for key in ("scale", "use_qk_l2norm") if key in kw}
    for ref_name in refs:
        ref = {"chunk": gdn_chunk_ref, "recurrent": gdn_recurrent_ref}[ref_name]
        s_ref = state.clone()
        o_ref = ref(q, k, v, g, beta, cu, s_ref, slots, max(lens), write_state=ws, **ref_kw)
        errs[f"{name}/{ref_name}/o"], errs[f"{name}/{ref_name}/state"] = _rel(o_tri, o_ref), _rel(s_tri, s_ref)
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[slots] = False
    errs[f"{name}/other_slots_changed"] = float(not torch.equal(s_tri[others], state[others]))


def _write_modes():
    return {"write": True, "nowrite": False, "mask": torch.tensor([True, False, True])}


def case_bt16():
    """Chunks of 16: 130 tokens = 8 full chunks + 2; 37 = 2 + 5; every write mode; the recurrent form too."""
    from kernels.gdn_chunk_triton import gdn_chunk2_triton

    errs = {}
    for wname, ws in _write_modes().items():
        _compare(errs, wname, gdn_chunk2_triton, seed=1, ws=ws, refs=("chunk", "recurrent"), bt=16, bv=16)
    return errs


def case_bt64():
    """The default chunk of 64 (130 = 2 full chunks + 2), DK = DV = 32, two value tiles; the key dimension in two
    pieces (phase 1's k k^T / q k^T / w, phase 2's state tile) and u in two column tiles; phase 1's inverse by rows
    (the default, blocks, is case_blocks')."""
    from kernels.gdn_chunk_triton import gdn_chunk2_triton

    errs = {}
    for wname, ws in (("write", True), ("mask", _write_modes()["mask"])):
        _compare(errs, wname, gdn_chunk2_triton, seed=2, ws=ws, refs=("chunk", "recurrent"),
                 shape=dict(dk=32, dv=32), bv=16, bvu=16, ks=16, kc=16, inverse="rows")
    return errs


def case_options():
    """scale given without l2norm; DK = DV = 24 (masked key / value columns, the second key piece half masked)
    with HK = HV = 2; GQA with HK = 2, HV = 4; a request of no tokens between two others (its slot is neither read
    nor written); ill-conditioned (correlated) keys."""
    from kernels.gdn_chunk_triton import gdn_chunk2_triton

    errs = {}
    _compare(errs, "scale_nonorm", gdn_chunk2_triton, seed=3, bt=16, scale=0.3, use_qk_l2norm=False)
    _compare(errs, "d24_mha", gdn_chunk2_triton, seed=4, shape=dict(hk=2, hv=2, dk=24, dv=24), bt=16, bv=16,
             ks=16, kc=16)
    _compare(errs, "idle", gdn_chunk2_triton, lens=[40, 0, 17], seed=5, bt=16)
    # two key heads of two value heads each: value head h reads key head h // 2 (h % 2 would pass with HK = 1)
    _compare(errs, "gqa_hk2_hv4", gdn_chunk2_triton, seed=12, shape=dict(hk=2, hv=4), bt=16,
             refs=("chunk", "recurrent"))
    _compare(errs, "correlated", gdn_chunk2_triton, seed=6, bt=16, correlated=True, refs=("chunk", "recurrent"))
    return errs


def case_blocks():
    """Phase 1's block inverse (inverse="blocks": the 16x16 diagonal blocks by forward substitution, merged 16 -> 32
    -> 64 by products). Chunks of 64, DK = DV = 32: 130 = 2 full chunks + 2 rows (one row block partial, three
    empty), 37 = one chunk of 2 full row blocks, one of 5 rows and an empty one, 1 = one row; two write modes and the
    recurrent form too. Chunks of 64 with ill-conditioned (correlated) keys; chunks of 32 (one merge); chunks of 16
    (the diagonal block alone) with a request of no tokens."""
    from kernels.gdn_chunk_triton import gdn_chunk2_triton

    errs = {}
    for wname, ws in (("write", True), ("mask", _write_modes()["mask"])):
        _compare(errs, f"bt64_{wname}", gdn_chunk2_triton, seed=9, ws=ws, refs=("chunk", "recurrent"),
                 shape=dict(dk=32, dv=32), bv=16, bvu=16, ks=16, kc=16, inverse="blocks")
    _compare(errs, "bt64_correlated", gdn_chunk2_triton, seed=10, correlated=True, refs=("chunk", "recurrent"),
             inverse="blocks")
    _compare(errs, "bt32", gdn_chunk2_triton, seed=11, bt=32, bv=16, inverse="blocks")
    _compare(errs, "bt16_idle", gdn_chunk2_triton, lens=[40, 0, 17], seed=12, bt=16, inverse="blocks")
    return errs


def case_split():
    """Phase 2 as a state walk + a parallel output pass (state_pass="split"): chunks of 16 over the ragged batch
    (the chunk-start states' index bos // BT + b + c fills its N // BT + B rows exactly here), every write mode, the
    recurrent form too; chunks of 64 with DK = DV = 32 (two key pieces, two value tiles in both passes); DK = DV = 24
    (masked key / value columns) with HK = HV = 2; a request of no tokens between two others (write mask)."""
    from kernels.gdn_chunk_triton import gdn_chunk2_triton

    errs = {}
    for wname, ws in _write_modes().items():
        _compare(errs, wname, gdn_chunk2_triton, seed=13, ws=ws, refs=("chunk", "recurrent")[:2 if ws is True else 1],
                 bt=16, bv=16, bvo=16, state_pass="split")
    _compare(errs, "bt64_d32", gdn_chunk2_triton, seed=14, shape=dict(dk=32, dv=32), bv=16, bvo=16, ks=16, kc=16,
             bvu=16, state_pass="split")
    _compare(errs, "d24_mha", gdn_chunk2_triton, seed=15, shape=dict(hk=2, hv=2, dk=24, dv=24), bt=16, bv=16,
             bvo=16, ks=16, kc=16, state_pass="split")
    _compare(errs, "idle_mask", gdn_chunk2_triton, lens=[40, 0, 17], seed=16, ws=_write_modes()["mask"], bt=16,
             state_pass="split")
    return errs


def case_wiring():
    """gdn_triton / gdn_chunk_triton / dispatch.gdn take the two-phase kernel for prefill under
    HYBRIDSPEC_GDN_PREFILL=two_phase (spy on gdn_chunk2_triton), the block kernel otherwise."""
    import kernels.gdn_chunk_triton as gct
    from kernels import dispatch
    from kernels import gdn_triton as gt

    calls = []
    real = gct.gdn_chunk2_triton

    @functools.wraps(real)  # (gdn_chunk_triton checks its options against the kernel's signature)
    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    errs = {}
    gct.gdn_chunk2_triton = spy
    try:
        os.environ["HYBRIDSPEC_GDN_PREFILL"] = "two_phase"
        _compare(errs, "gdn_triton_env", gt.gdn_triton, seed=7, bt=16)
        _compare(errs, "chunk_triton_env", gt.gdn_chunk_triton, seed=7, bt=16)
        _compare(errs, "dispatch_env", dispatch.gdn, seed=7)
        errs["env_routes_to_two_phase"] = float(len(calls) != 3 or calls[0].get("bt") != 16 or "bt" in calls[2])
        del os.environ["HYBRIDSPEC_GDN_PREFILL"]
        calls.clear()
        _compare(errs, "chunk_triton_impl", gt.gdn_chunk_triton, seed=7, bt=16, impl="two_phase")
        errs["impl_routes_to_two_phase"] = float(len(calls) != 1)
        calls.clear()
        gt.gdn_chunk_triton(*_inputs(LENS, 8)[:8], max(LENS), bt=16)  # default: the two-phase kernel
        gt.gdn_triton(*_inputs([40, 3], 8)[:8], 40)
        gt.gdn_triton(*_inputs([17, 3], 8)[:8], 17)  # verification blocks (<= 32 tokens) never take it
        errs["default_is_two_phase"] = float(len(calls) != 2 or gt.PREFILL_IMPL != "two_phase")
        calls.clear()
        os.environ["HYBRIDSPEC_GDN_PREFILL"] = "block"
        _compare(errs, "chunk_triton_env_block", gt.gdn_chunk_triton, seed=7, bt=16)
        errs["env_routes_to_block"] = float(len(calls) != 0)
    finally:
        gct.gdn_chunk2_triton = real
        os.environ.pop("HYBRIDSPEC_GDN_PREFILL", None)
    return errs


CASES = {"bt16": case_bt16, "bt64": case_bt64, "options": case_options, "blocks": case_blocks,
         "split": case_split, "wiring": case_wiring}


# -------------------------------------------------------------------------------------- the pytest side

@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_two_phase_chunk_equals_reference(interpreted, name):
    assert_case(interpreted, name, TOL)


# ------------------------------------------------------------------------------------ the interpreter side

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    run_cases(CASES)
