"""GDN + conv kernels on the GPU: bf16 checks against the references, then CUDA-graph timings.

    PYTHONPATH=. python bench/kernels_gdn.py          (on the H200; writes $OUT/kernels_gdn.json)
    PYTHONPATH=. python bench/kernels_gdn.py prefill  (prefill only: parallel precompile, bf16 checks of the block
                                                       and two-phase kernels, then block vs two-phase vs fla, 1k-8k)

Qwen3.6-35B-A3B GDN shapes: HK=16, HV=32, DK=DV=128, conv_dim 8192, conv kernel 4; bf16 q/k/v/beta, fp32 g and
fp32 state pool [S, HV, DK, DV]. Every timed call runs inside one torch.cuda.CUDAGraph that holds R launches,
each on a different set of state slots (R * B states >= ~190 MB, several times the 50 MB L2), timed by
triton.testing.do_bench (median of graph replays, L2 flushed before each) and divided by R.
Floor: bytes that must cross HBM once at 4.3 TB/s: the fp32 states (read, and written where the kernel writes),
plus q/k/v/g/beta reads and o writes.
fla-core (fused_recurrent_gated_delta_rule, chunk_gated_delta_rule) is the baseline when importable.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

# the repository root first (run as a script, bench/ is sys.path[0]): the packages are the repository's, with or
# without PYTHONPATH (tests/test_bench_scripts.py checks every script)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.conv import causal_conv1d_ref, conv_commit_ref
from kernels.conv_triton import causal_conv1d_triton, conv_commit_triton
from kernels.gdn import gdn_chunk_ref, gdn_commit_ref, gdn_recurrent_ref
from kernels import gdn_triton as gt
from kernels.gdn_chunk_triton import gdn_chunk2_triton

HK, HV, DK, DV = 16, 32, 128, 128
CONV_DIM, CONV_K = 2 * HK * DK + HV * DV, 4
BW = 4.3e12  # bytes/s, measured copy bandwidth of the H200 (docs/benchmarking.md)
STATE_BYTES = HV * DK * DV * 4  # one request's fp32 state, 2 MiB
DEV = "cuda"
OUT = os.environ.get("OUT", "bench_out")
T0 = time.time()
RESULTS: dict = {"shapes": dict(HK=HK, HV=HV, DK=DK, DV=DV, conv_dim=CONV_DIM, conv_k=CONV_K),
                 "checks": {}, "sweep": {}, "table": [], "prefill": [], "prefill_sweep": {}, "conv": [],
                 "errors": []}

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    HAVE_FLA = True
except Exception as exc:  # noqa: BLE001 - optional baseline
    HAVE_FLA = False
    RESULTS["fla"] = f"not importable: {exc!r}"


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def section(fn):
    """Runs one part; a failure is recorded and the rest still runs."""
    def run(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            log(f"FAILED {fn.__name__}:\n{tb}")
            RESULTS["errors"].append({"section": fn.__name__, "traceback": tb})
    return run


# ------------------------------------------------------------------------------------------------ inputs

def cu_of(lens):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(lens, device=DEV).cumsum(0)
    return cu  # [B+1]


def make_block(lens, seed, correlated=False):
    """q, k, v: strided views of one bf16 [N, conv_dim] tensor (the model's split of the conv output)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n = sum(lens)
    mixed = torch.randn(n, CONV_DIM, generator=gen, device=DEV, dtype=torch.float32)
    if correlated:  # keys near one direction, slow decay, beta near 1: the ill-conditioned UT system
        mixed[:, HK * DK:2 * HK * DK] = 0.3 * mixed[:, HK * DK:2 * HK * DK] + 3 * torch.randn(
            1, HK * DK, generator=gen, device=DEV)
    mixed = mixed.to(torch.bfloat16)
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV)
    a = torch.randn(n, HV, generator=gen, device=DEV)
    g = -0.5 * torch.nn.functional.softplus(a - 1.0)  # [N, HV] fp32 log decay, ~ -0.15 median
    if correlated:
        g = 0.05 * g
    beta = torch.sigmoid(torch.randn(n, HV, generator=gen, device=DEV) + (3.0 if correlated else 0.0))
    return q, k, v, g, beta.to(torch.bfloat16), cu_of(lens)


def make_pool(num_slots, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return 0.1 * torch.randn(num_slots, HV, DK, DV, generator=gen, device=DEV)  # [S, HV, DK, DV] fp32


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def srel(pool_tri, pool_ref, slots):
    """Relative error over the requests' slots; inf if any other slot of the pool changed."""
    other = torch.ones(pool_ref.shape[0], dtype=torch.bool, device=pool_ref.device)
    other[slots] = False
    if not torch.equal(pool_tri[other], pool_ref[other]):
        return float("inf")
    return rel(pool_tri[slots], pool_ref[slots])


# ------------------------------------------------------------------------------------------------ timing

def graph_us(make_call, R):
    """Median time of one call, from CUDA-graph replays of R calls (make_call(r) gives the r-th call)."""
    calls = [make_call(r) for r in range(R)]
    for c in calls:  # compile + warm
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / R


def eager_us(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def rotations(bsz):
    return max(4, math.ceil(192 * 2 ** 20 / (bsz * STATE_BYTES)))


def floors_us(n_tokens, bsz):
    io = n_tokens * (2 * HK * DK * 2 + HV * DV * 2 + HV * DV * 2 + HV * (4 + 2))  # q k v o g beta
    st = bsz * STATE_BYTES
    return {"floor_r_us": (st + io) / BW * 1e6, "floor_rw_us": (2 * st + io) / BW * 1e6}


# ------------------------------------------------------------------------------------------------ checks

@section
def checks():
    torch.manual_seed(0)
    lens = [1, 5, 17, 16, 3, 9, 12, 2]
    perm = torch.randperm(40, device=DEV)[:8]
    out = RESULTS["checks"]
    # verification / decode, three write modes, both kernels
    seed = 100  # a fresh draw for every check, so a stale buffer never holds the right answer
    for impl in ("block", "seq"):
        for wname, ws in (("nowrite", False), ("write", True),
                          ("mask", torch.tensor([1, 0, 1, 1, 0, 0, 1, 0], dtype=torch.bool, device=DEV))):
            seed += 2
            q, k, v, g, beta, cu = make_block(lens, seed)
            pool = make_pool(40, seed + 1)
            s_ref, s_tri = pool.clone(), pool.clone()
            o_ref = gdn_recurrent_ref(q, k, v, g, beta, cu, s_ref, perm, 17, write_state=ws)
            o_tri = gt.gdn_triton(q, k, v, g, beta, cu, s_tri, perm, 17, write_state=ws, impl=impl)
            out[f"verify_{impl}_{wname}"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, perm)}
    # commit: none / partial / all
    q, k, v, g, beta, cu = make_block(lens, 3)
    keep = torch.tensor([0, 2, 17, 16, 1, 0, 12, 2], device=DEV)
    pool = make_pool(40, 4)
    s_ref, s_tri = pool.clone(), pool.clone()
    gdn_commit_ref(k, v, g, beta, cu, keep, s_ref, perm, 17)
    for impl in ("seq", "block"):
        s_tri = pool.clone()
        gt.gdn_commit_triton(k, v, g, beta, cu, keep, s_tri, perm, 17, impl=impl)
        out[f"commit_{impl}"] = {"state": srel(s_tri, s_ref, perm)}
    # fused commit + verify
    pq, pk, pv, pg, pb, pcu = make_block(lens, 5)
    q, k, v, g, beta, cu = make_block([4, 1, 17, 16, 8, 2, 3, 1], 6)
    pool = make_pool(40, 7)
    s_ref, s_tri = pool.clone(), pool.clone()
    args = (pk, pv, pg, pb, pcu[:-1].long(), keep, 17)
    o_ref = gt.gdn_commit_verify_ref(q, k, v, g, beta, cu, s_ref, perm, 17, *args)
    o_tri = gt.gdn_commit_verify_triton(q, k, v, g, beta, cu, s_tri, perm, 17, *args)
    out["commit_verify_fused"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, perm)}
    prefill_checks()  # chunked prefill (its own section: `prefill` runs it alone)
    # stress: correlated keys, per dot precision (and the sequential kernel)
    q, k, v, g, beta, cu = make_block(lens, 10, correlated=True)
    pool = make_pool(40, 11)
    s_ref = pool.clone()
    o_ref = gdn_recurrent_ref(q, k, v, g, beta, cu, s_ref, perm, 17, write_state=True)
    for prec in ("tf32", "tf32x3"):
        s_tri = pool.clone()
        o_tri = gt.gdn_triton(q, k, v, g, beta, cu, s_tri, perm, 17, write_state=True, precision=prec,
                              impl="block")
        out[f"stress_correlated_{prec}"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, perm)}
    s_tri = pool.clone()
    o_tri = gt.gdn_triton(q, k, v, g, beta, cu, s_tri, perm, 17, write_state=True, impl="seq")
    out["stress_correlated_seq"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, perm)}
    # conv + commit
    x = torch.randn(sum(lens), CONV_DIM, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(CONV_DIM, 1, CONV_K, device=DEV, dtype=torch.bfloat16)[:, 0, :]
    cs = torch.randn(40, CONV_DIM, CONV_K - 1, device=DEV, dtype=torch.bfloat16)
    cu = cu_of(lens)
    for wname, ws in (("nowrite", False), ("write", True)):
        c_ref, c_tri = cs.clone(), cs.clone()
        o_ref = causal_conv1d_ref(x, w, cu, c_ref, perm, 17, ws)
        o_tri = causal_conv1d_triton(x, w, cu, c_tri, perm, 17, ws)
        out[f"conv_{wname}"] = {"o": rel(o_tri, o_ref), "state": srel(c_tri, c_ref, perm)}
    o32 = causal_conv1d_ref(x.float(), w.float(), cu, cs.float().clone(), perm, 17, False)  # fp32 reference
    out["conv_vs_fp32_ref"] = {"o_ours": rel(causal_conv1d_triton(x, w, cu, cs.clone(), perm, 17, False), o32),
                               "o_bf16_ref": rel(causal_conv1d_ref(x, w, cu, cs.clone(), perm, 17, False), o32)}
    c_ref, c_tri = cs.clone(), cs.clone()
    conv_commit_ref(x, cu, keep, c_ref, perm, 17)
    conv_commit_triton(x, cu, keep, c_tri, perm, 17)
    out["conv_commit"] = {"state": srel(c_tri, c_ref, perm)}
    # the baseline computes the same function
    if HAVE_FLA:
        q, k, v, g, beta, cu = make_block(lens, 12)
        pool = make_pool(40, 13)
        s_ref = pool.clone()
        o_ref = gdn_recurrent_ref(q, k, v, g, beta, cu, s_ref, perm, 17, write_state=True)
        o_fla, s_fla = fla_recurrent(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g=g[None],
                                     beta=beta[None], initial_state=pool[perm].contiguous(), output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
        out["fla_recurrent"] = {"o": rel(o_fla[0], o_ref), "state": rel(s_fla, s_ref[perm])}
    for name, r in out.items():
        log(f"check {name:28s} " + " ".join(f"{k}={e:.2e}" for k, e in r.items()))


# ------------------------------------------------------------------------------------------------ timings

def _commit_cfg(cfg):
    return dict({kk: vv for kk, vv in cfg.items() if kk in ("bv", "num_warps", "precision", "trans")}, impl="block")


def prepare(blk, pool, sl, t):
    """Everything a timed call needs besides the kernel itself, made outside the graph."""
    q, k, v, g, beta, cu = blk
    keep = torch.full((sl.shape[0],), t, dtype=torch.int64, device=DEV)
    ctx = dict(blk=blk, pool=pool, sl=sl, t=t, keep=keep, mask=keep > 0, starts=cu[:-1].long())
    if HAVE_FLA:
        ctx["fla"] = (q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g[None].contiguous(),
                      beta[None].contiguous(), pool[sl].contiguous(), cu.long())
    return ctx


def run_mode(mode, cfg, ctx):
    """One launch (two for verify+commit) of a GDN variant; every request has T = ctx['t'] tokens."""
    q, k, v, g, beta, cu = ctx["blk"]
    pool, sl, t, keep = ctx["pool"], ctx["sl"], ctx["t"], ctx["keep"]
    if mode.startswith("verify") and "impl" not in cfg:
        cfg = dict(cfg, impl="block")
    if mode == "verify":
        return gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=False, **cfg)
    if mode == "verify_w":
        return gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=True, **cfg)
    if mode == "verify_x3":  # output-only dots in tf32x3 too
        return gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=False, **cfg, precision_out="tf32x3")
    if mode == "verify_w_tf32":
        return gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=True, **cfg, precision="tf32")
    if mode == "commit_tf32":
        return gt.gdn_commit_triton(k, v, g, beta, cu, keep, pool, sl, t, **_commit_cfg(cfg), precision="tf32")
    if mode == "verify_mask":
        return gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=ctx["mask"], **cfg)
    if mode == "commit":
        return gt.gdn_commit_triton(k, v, g, beta, cu, keep, pool, sl, t, **_commit_cfg(cfg))
    if mode == "verify+commit":
        gt.gdn_triton(q, k, v, g, beta, cu, pool, sl, t, write_state=False, **cfg)
        return gt.gdn_commit_triton(k, v, g, beta, cu, keep, pool, sl, t, **_commit_cfg(cfg))
    if mode == "fused":  # the previous block = this one, every token accepted
        fused_cfg = {kk: vv for kk, vv in _commit_cfg(cfg).items() if kk != "impl"}  # one kernel: no impl choice
        return gt.gdn_commit_verify_triton(q, k, v, g, beta, cu, pool, sl, t, k, v, g, beta, ctx["starts"], keep, t,
                                           write_state=False, **fused_cfg)
    if mode == "chunk":  # cfg["impl"]: "block" (the default) or "two_phase" (kernels/gdn_chunk_triton.py)
        return run_chunk(cfg, q, k, v, g, beta, cu, pool, sl, t)
    if mode in ("chunk_nowrite", "chunk_mask"):
        return run_chunk(cfg, q, k, v, g, beta, cu, pool, sl, t, write_state=False if mode == "chunk_nowrite"
                         else ctx["mask"])
    if mode == "fla_recurrent":
        fq, fk, fv, fg, fb, init, cul = ctx["fla"]
        return fla_recurrent(fq, fk, fv, g=fg, beta=fb, initial_state=init, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=cul)
    if mode == "fla_chunk":
        fq, fk, fv, fg, fb, init, _ = ctx["fla"]
        return fla_chunk(fq, fk, fv, g=fg, beta=fb, initial_state=init, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
    raise ValueError(mode)


def verify_calls(bsz, t, cfg, mode, pool, slot_sets, blk):
    ctxs = [prepare(blk, pool, sl, t) for sl in slot_sets]
    return lambda r: (lambda: run_mode(mode, cfg, ctxs[r]))


def setup(bsz, t, seed=0):
    R = rotations(bsz)
    pool = make_pool(R * bsz + 1, seed)
    perm = torch.randperm(R * bsz + 1, device=DEV)
    slot_sets = [perm[r * bsz:(r + 1) * bsz].clone() for r in range(R)]
    return R, pool, slot_sets, make_block([t] * bsz, seed + 1)


# num_warps=8 is left out of the one-block (verification) kernels: on triton 3.6 the (bv=64, 8 warps) commit /
# verify-with-write variants raised an illegal memory access in run 2 (bench/NOTES_gdn.md); the chunk loop with
# 8 warps passed its checks.
BLOCK_CFGS = [dict(bv=32, num_warps=4), dict(bv=64, num_warps=4)]
TABLE_CFG = dict(bv=64, num_warps=4)
SEQ_CFGS = [dict(impl="seq", bv=8, num_warps=1), dict(impl="seq", bv=16, num_warps=1)]
SWEEP_POINTS = [(1, 16), (32, 16), (8, 4), (1, 1)]
TABLE_B, TABLE_T = (1, 8, 32), (1, 4, 8, 16, 17)
TABLE_MODES = ("verify", "verify_x3", "verify_w", "verify_w_tf32", "commit", "commit_tf32", "verify+commit", "fused")
PREFILL_CFGS = [dict(bt=16, bv=64, num_warps=4), dict(bt=32, bv=64, num_warps=4), dict(bt=64, bv=64, num_warps=8)]
# two-phase (kernels/gdn_chunk_triton.py): phase 2's value tile x warps at BT=64, then single variations of its
# default point (bv=32, 4 warps): 2 pipeline stages, 8 warps in phase 1, tf32 state dots (less accurate: timed, not
# picked), bf16 scratch (idem), chunks of 32; phase 1's block inverse (inverse="blocks") at BT=64 and 32
# (bv=128 left out since 2026-12-01: 2478 us at 4096 and 3.5 KB spill; its compile was the slowest)
PREFILL2_CFGS = [dict(impl="two_phase", bt=64, bv=bv, num_warps=w) for bv in (32, 64) for w in (4, 8)] + [
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, num_stages=2),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, prep_warps=8),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, precision="tf32"),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, scratch_dtype="bfloat16"),
    dict(impl="two_phase", bt=32, bv=32, num_warps=4),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, inverse="blocks"),
    dict(impl="two_phase", bt=64, bv=64, num_warps=4, inverse="blocks"),
    dict(impl="two_phase", bt=32, bv=32, num_warps=4, inverse="blocks"),
    # phase 2 in value tiles of 16: 256 programs for one request (2 per SM; sm_90 compile: 4 warps 255 registers,
    # 60 B spill, 97 KB shared; 2 warps 700 B spill)
    dict(impl="two_phase", bt=64, bv=16, num_warps=4),
    dict(impl="two_phase", bt=64, bv=16, num_warps=2),
    # state_pass="split": the sequential state walk (no o; chunk-start states + v_new stored), then a parallel output
    # pass per (chunk, head, bvo value columns). Walk sm_90 compile: bv=16 4 warps 255 registers no spill 60 KB
    # shared (1 stage: 243, 16 KB); bv=32 2 stages 172 B spill, 1 stage no spill. h_dtype=bfloat16: o only (not
    # picked)
    dict(impl="two_phase", bt=64, bv=16, num_warps=4, state_pass="split"),
    dict(impl="two_phase", bt=64, bv=16, num_warps=4, num_stages=1, state_pass="split"),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, state_pass="split"),
    dict(impl="two_phase", bt=64, bv=32, num_warps=4, num_stages=1, state_pass="split"),
    dict(impl="two_phase", bt=64, bv=16, num_warps=4, state_pass="split", bvo=128, out_warps=8),
    dict(impl="two_phase", bt=64, bv=16, num_warps=4, state_pass="split", h_dtype="bfloat16"),
]
PREFILL2_INVERSES = ("rows", "blocks")  # every length: the best two-phase config with each phase-1 inverse
PREFILL2_PASSES = ("fused", "split")  # every length: the best two-phase config with each phase-2 form
PREFILL_MULTI = (4, 1024)  # B x T: the best fused and split configs and the default at B > 1
# checked with write_state False and a mask too (precompiled: WRITE is a constexpr)
PREFILL2_WRITE_CHECKS = {"default": dict(impl="two_phase"), "split": dict(impl="two_phase", bv=16, state_pass="split")}
PREFILL_CHECK_LENS = [1000, 37, 2048, 64]
PREFILL_STATE_TOL = 1e-5  # a config whose state error is above this is timed but never picked as the best
PREFILL_LENS = (4096, 1024, 2048, 8192)


# ------------------------------------------------------------------------------- parallel precompile

def warm_jobs():
    """Every (mode, cfg, T) the run will launch, so that worker processes compile them all in parallel into
    Triton's on-disk cache (same shapes and layouts, hence the same specialisations) before anything is timed."""
    default = dict(bv=gt.VERIFY_BV, num_warps=gt.VERIFY_WARPS)
    jobs = [(m, TABLE_CFG, t) for t in (16, 17) for m in TABLE_MODES if m != "verify+commit"]
    jobs += [("verify", c, 16) for c in BLOCK_CFGS + SEQ_CFGS] + [("verify_w", c, 16) for c in SEQ_CFGS]
    jobs += [(m, dict(impl="seq"), 17) for m in ("verify", "verify_w", "verify_mask")]
    jobs += [(m, default, 17) for m in ("verify_mask", "verify", "verify_w", "commit", "fused")]
    jobs += [("verify_w", dict(default, precision=p), 17) for p in ("tf32",)]
    jobs += prefill_jobs()
    jobs += [("conv", {}, 16)]
    if HAVE_FLA:
        jobs += [("fla_recurrent", {}, 16), ("fla_chunk", {}, 1024)]
    seen = set()
    return [j for j in jobs if not (json.dumps(j, sort_keys=True) in seen or seen.add(json.dumps(j, sort_keys=True)))]


def prefill_jobs():
    wm = [(m, c, 100) for m in ("chunk_nowrite", "chunk_mask") for c in PREFILL2_WRITE_CHECKS.values()]
    return [("chunk", c, 100) for c in PREFILL_CFGS + PREFILL2_CFGS] + wm + (
        [("fla_chunk", {}, 1024)] if HAVE_FLA else [])


def _warm_one(job):
    mode, cfg, t = job
    try:
        if mode == "conv":
            x = torch.randn(2 * t, CONV_DIM, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(CONV_DIM, 1, CONV_K, device=DEV, dtype=torch.bfloat16)[:, 0, :]
            cs = torch.randn(4, CONV_DIM, CONV_K - 1, device=DEV, dtype=torch.bfloat16)
            cu, sl = cu_of([t, t]), torch.tensor([2, 0], device=DEV)
            causal_conv1d_triton(x, w, cu, cs, sl, t, True)
            causal_conv1d_triton(x, w, cu, cs, sl, t, False)
            conv_commit_triton(x, cu, torch.tensor([1, 3], device=DEV), cs, sl, t)
        else:
            pool = make_pool(4, 0)
            run_mode(mode, cfg, prepare(make_block([t, t], 1), pool, torch.tensor([2, 0], device=DEV), t))
        torch.cuda.synchronize()
        return None
    except Exception:  # noqa: BLE001
        return f"{job}: {traceback.format_exc()}"


def _warm_worker(jobs):
    return [e for e in (_warm_one(j) for j in jobs) if e]


@section
def precompile(jobs=None):
    import multiprocessing as mp
    RESULTS["precompiled"] = "all" if jobs is None else RESULTS.get("precompiled", "some")
    jobs = warm_jobs() if jobs is None else jobs
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 15))
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        errs = [e for part in pool.map(_warm_worker, chunks) for e in part]
    log(f"precompiled {len(jobs)} variants in {workers} processes; {len(errs)} failed")
    for e in errs:
        log("WARM FAILED", e)
        RESULTS["errors"].append({"section": "precompile", "traceback": e})


# ---------------------------------------------------------------------------------------- timed sections

@section
def sweep():
    """Verification without state write for every layout config and the sequential kernel; commit (all T tokens)
    for the block configs."""
    res = RESULTS["sweep"]
    for bsz, t in SWEEP_POINTS:
        R, pool, slot_sets, blk = setup(bsz, t)
        for cfg in BLOCK_CFGS + SEQ_CFGS:
            key = json.dumps(cfg, sort_keys=True)
            res.setdefault(key, {})[f"B{bsz}_T{t}"] = graph_us(verify_calls(bsz, t, cfg, "verify", pool, slot_sets,
                                                                             blk), R)
        del pool
    lines = [f"  {key:62s} " + " ".join(f"{p}={u:7.2f}" for p, u in row.items()) for key, row in res.items()]
    log("sweep (verify without state write / commit, us):\n" + "\n".join(lines))


def best_cfg(bsz=None):
    """The block config with the lowest sum of time / best time over the sweep points with this batch size (all
    points when bsz is None or not swept)."""
    block = {k: r for k, r in RESULTS["sweep"].items() if k.startswith("{") and '"impl"' not in k and '"trans"' not in k}
    if not block:
        return dict(bv=gt.VERIFY_BV, num_warps=gt.VERIFY_WARPS)
    points = list(next(iter(block.values())).keys())
    points = [p for p in points if p.startswith(f"B{bsz}_")] or points
    best = {p: min(r[p] for r in block.values()) for p in points}
    return json.loads(min(block, key=lambda k: sum(block[k][p] / best[p] for p in points)))


def best_seq_cfg():
    res = {k: r for k, r in RESULTS["sweep"].items() if '"impl"' in k}
    return json.loads(min(res, key=lambda k: sum(res[k].values()))) if res else SEQ_CFGS[1]


def fmt(row):
    return " ".join(f"{kk}={vv:.2f}" if isinstance(vv, float) else f"{kk}={vv}" for kk, vv in row.items())


@section
def table():
    seq_cfg = best_seq_cfg()
    RESULTS["table_cfg"] = TABLE_CFG
    RESULTS["best_cfg_by_B"] = {f"B{b}": best_cfg(b) for b in TABLE_B}
    RESULTS["table_seq_cfg"] = seq_cfg
    log(f"table config: block {TABLE_CFG} (sweep's best by B: {RESULTS['best_cfg_by_B']}), seq {seq_cfg}")
    for bsz in TABLE_B:
        cfg = TABLE_CFG
        for t in TABLE_T:
            R, pool, slot_sets, blk = setup(bsz, t)
            row = {"B": bsz, "T": t, **floors_us(bsz * t, bsz)}
            for mode in TABLE_MODES:
                row[mode] = graph_us(verify_calls(bsz, t, cfg, mode, pool, slot_sets, blk), R)
            row["seq_verify"] = graph_us(verify_calls(bsz, t, seq_cfg, "verify", pool, slot_sets, blk), R)
            # the factored kernel (kernels/gdn_verify_triton.py), what auto picks for verification since 2026-12-02
            row["factored_verify"] = graph_us(verify_calls(bsz, t, {"impl": "factored"}, "verify", pool, slot_sets,
                                                           blk), R)
            row["seq_verify_w"] = graph_us(verify_calls(bsz, t, seq_cfg, "verify_w", pool, slot_sets, blk), R)
            if HAVE_FLA:
                try:
                    row["fla"] = graph_us(verify_calls(bsz, t, {}, "fla_recurrent", pool, slot_sets, blk), R)
                except Exception as exc:  # noqa: BLE001
                    row["fla_error"] = repr(exc)
            RESULTS["table"].append(row)
            log(fmt(row))
            del pool


def run_chunk(cfg, q, k, v, g, beta, cu, pool, sl, max_len, write_state=True):
    cfg = dict(cfg)
    if cfg.pop("impl", "block") == "two_phase":
        return gdn_chunk2_triton(q, k, v, g, beta, cu, pool, sl, max_len, write_state=write_state, **cfg)
    return gt.gdn_chunk_triton(q, k, v, g, beta, cu, pool, sl, max_len, write_state=write_state, impl="block", **cfg)


def cfg_name(cfg):
    return ("2p " if cfg.get("impl") == "two_phase" else "blk ") + " ".join(
        f"{kk}={vv}" for kk, vv in cfg.items() if kk != "impl")


@section
def prefill_checks():
    """Chunked prefill against gdn_chunk_ref at the real shapes, bf16 in, ragged, from non-zero states: every block
    and two-phase config (a config that fails to compile or run is recorded and left out of the timings), the
    two-phase default with write_state False / a mask, correlated keys, and fla's chunk kernel (the baseline)."""
    if RESULTS.get("prefill_checked"):
        return
    RESULTS["prefill_checked"] = True
    out = RESULTS["checks"]
    failed = RESULTS.setdefault("prefill_failed", [])
    plens = PREFILL_CHECK_LENS
    q, k, v, g, beta, cu = make_block(plens, 8)
    pool = make_pool(10, 9)
    sl = torch.tensor([3, 7, 0, 5][:len(plens)], device=DEV)
    s_ref = pool.clone()
    o_ref = gdn_chunk_ref(q, k, v, g, beta, cu, s_ref, sl, max(plens))
    for cfg in PREFILL_CFGS + PREFILL2_CFGS:
        name = cfg_name(cfg)
        try:
            s_tri = pool.clone()
            o_tri = run_chunk(cfg, q, k, v, g, beta, cu, s_tri, sl, max(plens))
            torch.cuda.synchronize()
            out[f"chunk {name}"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, sl)}
            if not out[f"chunk {name}"]["state"] <= PREFILL_STATE_TOL or cfg.get("h_dtype") == "bfloat16":
                RESULTS.setdefault("prefill_inexact", []).append(name)
        except Exception:  # noqa: BLE001 - a config that does not compile is reported, the others still run
            tb = traceback.format_exc()
            failed.append(name)
            RESULTS["errors"].append({"section": f"prefill_checks {name}", "traceback": tb})
            log(f"FAILED chunk {name}:\n{tb}")
    default = dict(impl="two_phase")
    for wname, ws in (("nowrite", False), ("mask", torch.tensor([1, 0, 1, 0], dtype=torch.bool, device=DEV))):
        s_ref = pool.clone()
        o_ref = gdn_chunk_ref(q, k, v, g, beta, cu, s_ref, sl, max(plens), write_state=ws)
        for cname, cfg in PREFILL2_WRITE_CHECKS.items():
            s_tri = pool.clone()
            o_tri = run_chunk(cfg, q, k, v, g, beta, cu, s_tri, sl, max(plens), write_state=ws)
            out[f"chunk 2p {cname} {wname}"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, sl)}
    q, k, v, g, beta, cu = make_block(plens, 14, correlated=True)
    s_ref = pool.clone()
    o_ref = gdn_chunk_ref(q, k, v, g, beta, cu, s_ref, sl, max(plens))
    for name, cfg in (("block", PREFILL_CFGS[0]), ("2p", default), ("2p blocks", dict(default, inverse="blocks"))):
        s_tri = pool.clone()
        o_tri = run_chunk(cfg, q, k, v, g, beta, cu, s_tri, sl, max(plens))
        out[f"chunk stress_correlated {name}"] = {"o": rel(o_tri, o_ref), "state": srel(s_tri, s_ref, sl)}
    if HAVE_FLA:
        try:
            q, k, v, g, beta, cu = make_block([2048], 15)
            s_ref = pool.clone()
            o_ref = gdn_chunk_ref(q, k, v, g, beta, cu, s_ref, sl[:1], 2048)
            o_fla, s_fla = fla_chunk(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g=g[None],
                                     beta=beta[None], initial_state=pool[sl[:1]].contiguous(),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
            out["chunk fla_chunk"] = {"o": rel(o_fla[0], o_ref), "state": rel(s_fla, s_ref[sl[:1]])}
        except Exception:  # noqa: BLE001
            RESULTS["errors"].append({"section": "prefill_checks fla", "traceback": traceback.format_exc()})
    for name, r in out.items():
        if name.startswith("chunk"):
            log(f"check {name:58s} " + " ".join(f"{kk}={e:.2e}" for kk, e in r.items()))


@section
def prefill():
    """Chunked prefill, one request of 1k..8k tokens from a non-zero state; eager do_bench (no graph). The first
    length sweeps every block and two-phase config; the others time the best of each, fla and the torch ref."""
    if not RESULTS.get("precompiled"):
        precompile(prefill_jobs())
    prefill_checks()
    failed = set(RESULTS.get("prefill_failed", []))
    sweep_res = RESULTS["prefill_sweep"]
    for n in PREFILL_LENS:  # the first one picks the configs for the others
        pool = make_pool(2, 21)
        ctx = prepare(make_block([n], 20), pool, torch.tensor([1], device=DEV), n)
        row = {"B": 1, "T": n,
               "floor_us": (2 * STATE_BYTES + n * (2 * HK * DK * 2 + 2 * HV * DV * 2 + HV * 6)) / BW * 1e6}
        for kind, cfgs in (("block", PREFILL_CFGS), ("two_phase", PREFILL2_CFGS)):
            if n != PREFILL_LENS[0]:
                cfgs = [RESULTS[f"prefill_cfg_{kind}"]] if RESULTS.get(f"prefill_cfg_{kind}") else []
            times = {}
            for cfg in cfgs:
                name = cfg_name(cfg)
                if name in failed:
                    continue
                try:
                    times[name] = eager_us(lambda: run_mode("chunk", cfg, ctx))
                except Exception:  # noqa: BLE001
                    failed.add(name)
                    RESULTS["errors"].append({"section": f"prefill {name}", "traceback": traceback.format_exc()})
                    log(f"FAILED timing {name}")
                    continue
                sweep_res.setdefault(name, {})[f"T{n}"] = times[name]
            exact = {kk: vv for kk, vv in times.items() if kk not in RESULTS.get("prefill_inexact", [])}
            if exact:
                best = min(exact, key=exact.get)
                if n == PREFILL_LENS[0]:
                    RESULTS[f"prefill_cfg_{kind}"] = next(c for c in cfgs if cfg_name(c) == best)
                    for sp in PREFILL2_PASSES if kind == "two_phase" else ():  # the best of each phase-2 form
                        of_sp = [c for c in cfgs if cfg_name(c) in exact and c.get("state_pass", "fused") == sp]
                        if of_sp:
                            RESULTS[f"prefill_cfg_2p_{sp}"] = min(of_sp, key=lambda c: exact[cfg_name(c)])
                    log(f"{kind} sweep at T={n} (us; * = state error over {PREFILL_STATE_TOL}, not picked): "
                        + "; ".join(f"{kk}{'' if kk in exact else '*'}: {vv:.0f}"
                                    for kk, vv in sorted(times.items(), key=lambda x: x[1])))
                row[kind] = times[best]
                if kind == "two_phase":  # phase 1 alone (the parallel UT transform), for the split of the time
                    prep = dict(RESULTS["prefill_cfg_two_phase"], only_prep=True)
                    try:
                        row["two_phase_prep"] = eager_us(lambda: run_mode("chunk", prep, ctx))
                    except Exception:  # noqa: BLE001
                        RESULTS["errors"].append({"section": "prefill prep", "traceback": traceback.format_exc()})
        if RESULTS.get("prefill_cfg_two_phase"):  # the best two-phase config with each inverse: whole, phase 1 alone
            for inv in PREFILL2_INVERSES:
                cfg = dict(RESULTS["prefill_cfg_two_phase"], inverse=inv)
                if cfg_name(cfg) in failed:
                    continue
                try:
                    row[f"2p_{inv}"] = eager_us(lambda: run_mode("chunk", cfg, ctx))
                    row[f"ph1_{inv}"] = eager_us(lambda: run_mode("chunk", dict(cfg, only_prep=True), ctx))
                except Exception:  # noqa: BLE001
                    failed.add(cfg_name(cfg))
                    RESULTS["errors"].append({"section": f"prefill inverse={inv}",
                                              "traceback": traceback.format_exc()})
        for sp in PREFILL2_PASSES:  # the best config of each phase-2 form; the split one without its output pass
            cfg = RESULTS.get(f"prefill_cfg_2p_{sp}")
            if cfg is None or cfg_name(cfg) in failed:
                continue
            try:
                row[f"2p_{sp}"] = eager_us(lambda: run_mode("chunk", cfg, ctx))
                if sp == "split":
                    row["walk_split"] = eager_us(lambda: run_mode("chunk", dict(cfg, only_walk=True), ctx))
            except Exception:  # noqa: BLE001
                failed.add(cfg_name(cfg))
                RESULTS["errors"].append({"section": f"prefill state_pass={sp}", "traceback": traceback.format_exc()})
        row["ours"] = row.get("block", float("nan"))  # (the key earlier runs wrote)
        q, k, v, g, beta, cu = ctx["blk"]
        row["torch_ref"] = eager_us(lambda: gdn_chunk_ref(q, k, v, g, beta, cu, pool, ctx["sl"], n))
        if HAVE_FLA:
            try:
                row["fla_chunk"] = eager_us(lambda: run_mode("fla_chunk", {}, ctx))
            except Exception as exc:  # noqa: BLE001
                row["fla_error"] = repr(exc)
        RESULTS["prefill"].append(row)
        log(fmt(row))
    RESULTS["prefill_cfg"] = RESULTS.get("prefill_cfg_block")
    nan = float("nan")
    lines = [f"prefill on {torch.cuda.get_device_name()}, B=1, eager, us per layer (HV={HV} DK=DV={DK}); "
             f"block {RESULTS.get('prefill_cfg_block')}, two-phase {RESULTS.get('prefill_cfg_two_phase')}",
             f"{'T':>5} {'floor':>6} {'block':>8} {'2phase':>8} {'(ph1)':>7} {'fla':>8} {'ref':>8} {'blk/2p':>7} "
             f"{'2p/fla':>7}  " + " ".join(f"{'2p_' + i:>9} {'ph1_' + i:>10}" for i in PREFILL2_INVERSES)
             + f" {'2p_fused':>9} {'2p_split':>9} {'(walk)':>7}"]
    for r in RESULTS["prefill"]:
        b, tp, fl = r.get("block", nan), r.get("two_phase", nan), r.get("fla_chunk", nan)
        lines.append(f"{r['T']:>5} {r['floor_us']:6.1f} {b:8.0f} {tp:8.0f} {r.get('two_phase_prep', nan):7.0f} "
                     f"{fl:8.0f} {r['torch_ref']:8.0f} "
                     f"{b / tp:7.2f} {tp / fl:7.2f}  "
                     + " ".join(f"{r.get('2p_' + i, nan):9.0f} {r.get('ph1_' + i, nan):10.0f}"
                                for i in PREFILL2_INVERSES)
                     + f" {r.get('2p_fused', nan):9.0f} {r.get('2p_split', nan):9.0f} {r.get('walk_split', nan):7.0f}")
    lines.append(f"  best fused {RESULTS.get('prefill_cfg_2p_fused')}, best split {RESULTS.get('prefill_cfg_2p_split')}"
                 "; (walk) = phase 1 + the split's state walk, without its output pass")
    print("\n".join(lines), flush=True)
    prefill_multi()


def prefill_multi():
    """B > 1 (PREFILL_MULTI: B requests of T tokens): the two-phase default, the best fused and split configs."""
    bsz, n = PREFILL_MULTI
    failed = set(RESULTS.get("prefill_failed", []))
    pool = make_pool(bsz + 1, 22)
    ctx = prepare(make_block([n] * bsz, 23), pool, torch.arange(1, bsz + 1, device=DEV), n)
    row = {"B": bsz, "T": n}
    cfgs = {"default": dict(impl="two_phase")}
    cfgs.update({sp: RESULTS[f"prefill_cfg_2p_{sp}"] for sp in PREFILL2_PASSES if RESULTS.get(f"prefill_cfg_2p_{sp}")})
    for label, cfg in cfgs.items():
        if cfg_name(cfg) in failed:
            continue
        try:
            row[f"2p_{label}"] = eager_us(lambda: run_mode("chunk", cfg, ctx))
        except Exception:  # noqa: BLE001
            RESULTS["errors"].append({"section": f"prefill_multi {label}", "traceback": traceback.format_exc()})
    RESULTS["prefill_multi"] = row
    log(f"prefill B={bsz} x T={n} (us, eager): " + fmt(row))


@section
def conv():
    for bsz, t in ((1, 16), (32, 16), (32, 1)):
        n, R = bsz * t, 8
        x = torch.randn(n, CONV_DIM, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(CONV_DIM, 1, CONV_K, device=DEV, dtype=torch.bfloat16)[:, 0, :]
        cs = torch.randn(R * bsz, CONV_DIM, CONV_K - 1, device=DEV, dtype=torch.bfloat16)
        cu = cu_of([t] * bsz)
        keep = torch.full((bsz,), max(1, t // 2), device=DEV)
        sets = [torch.arange(r * bsz, (r + 1) * bsz, device=DEV) for r in range(R)]
        row = {"B": bsz, "T": t,
               "floor_us": (2 * n * CONV_DIM * 2 + 2 * bsz * CONV_DIM * (CONV_K - 1) * 2) / BW * 1e6}
        row["conv_w"] = graph_us(lambda r: (lambda: causal_conv1d_triton(x, w, cu, cs, sets[r], t, True)), R)
        row["conv_nowrite"] = graph_us(lambda r: (lambda: causal_conv1d_triton(x, w, cu, cs, sets[r], t, False)), R)
        row["conv_commit"] = graph_us(lambda r: (lambda: conv_commit_triton(x, cu, keep, cs, sets[r], t)), R)
        row["ref_conv_eager"] = eager_us(lambda: causal_conv1d_ref(x, w, cu, cs, sets[0], t, True))
        RESULTS["conv"].append(row)
        log(fmt(row))


def summary():
    cols = ("verify", "verify_x3", "verify_w", "verify_w_tf32", "commit", "commit_tf32", "verify+commit", "fused", "seq_verify",
            "seq_verify_w", "fla")
    short = ("verify", "ver_x3", "ver_w", "ver_w32", "commit", "cmt32", "v+c", "fused", "seq", "seq_w", "fla")
    lines = ["", f"GDN on {torch.cuda.get_device_name()} (commit {RESULTS.get('commit')}), bf16 in, fp32 state, "
             f"HK={HK} HV={HV} DK=DV={DK}; us per call, CUDA graph; block cfg {RESULTS.get('table_cfg')}",
             f"{'B':>3} {'T':>3} {'fl_r':>6} {'fl_rw':>6} " + " ".join(f"{c:>7}" for c in short)]
    for r in RESULTS["table"]:
        lines.append(f"{r['B']:>3} {r['T']:>3} {r['floor_r_us']:6.2f} {r['floor_rw_us']:6.2f} "
                     + " ".join(f"{r.get(c, float('nan')):7.2f}" for c in cols))
    if RESULTS["prefill"]:
        lines.append("prefill (B=1, eager, us): " + "; ".join(
            f"T={r['T']}: block {r.get('block', float('nan')):.0f} two-phase {r.get('two_phase', float('nan')):.0f} "
            f"ref {r['torch_ref']:.0f} fla {r.get('fla_chunk', float('nan')):.0f} floor {r['floor_us']:.1f}"
            for r in RESULTS["prefill"]))
    worst = {k: max(v.values()) for k, v in RESULTS["checks"].items()}
    lines.append(f"checks: {len(worst)} run, over 1e-4: " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()
                                                                       if e > 1e-4)
                 + f"; errors: {len(RESULTS['errors'])}")
    print("\n".join(lines), flush=True)


def main():
    try:  # the device machine's copy of the tree may have no .git: pass HYBRIDSPEC_COMMIT=$(git rev-parse ...)
        RESULTS["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        RESULTS["commit"] = ""
    RESULTS["commit"] = RESULTS["commit"] or os.environ.get("HYBRIDSPEC_COMMIT", "unknown")
    RESULTS["gpu"] = torch.cuda.get_device_name()
    RESULTS["versions"] = {"torch": torch.__version__, "triton": triton.__version__, "fla": HAVE_FLA}
    log(RESULTS["gpu"], RESULTS["versions"])
    parts = sys.argv[1:] or ["precompile", "checks", "sweep", "table", "prefill", "conv"]
    for p in parts:
        globals()[p]()
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "kernels_gdn.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    summary()


if __name__ == "__main__":
    main()
