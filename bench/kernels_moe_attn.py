"""MoE and paged-attention kernels on the GPU: correctness in bf16 at Qwen3.6-35B-A3B shapes, then CUDA-graph
timings against the bandwidth floor, torch._grouped_mm and torch SDPA.

    PYTHONPATH=. python bench/kernels_moe_attn.py [--quick] [--no-sweep] [--only shared,...]

`--only shared`: just the MoE layer's tail with the shared expert apart (today) vs fused into the MoE kernels as
expert id E (SparseMoe.SHARED_FUSE_MAX_N), at N in SHARED_SIZES tokens, Zipf routing (`shared_tail`).

Writes $OUT/kernels_moe_attn.json (or bench/out/ without $OUT) and prints a short table last.

Conventions (docs/benchmarking.md): bf16, random (never zero) inputs; each timing is the median over replays of
one CUDA graph holding several calls (per-call time = replay / calls); consecutive calls in a graph use different
weights / KV caches so that nothing is served from the 60 MB L2 that a real 40-layer step would not find there.
MoE: 256 experts, top-8 renormalized, hidden 2048, expert dim 512 (6 MiB of bf16 weights per expert). Routing:
"zipf" = unit-variance logits + per-expert bias -log(rank) (as workers/bench_model.py), "uniform" = no bias.
Floor = distinct experts touched x 6 MiB / 4.3 TB/s. Attention: 16 q / 2 kv heads, head dim 256, page 16,
shuffled pages; floor = KV bytes read once / 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_timing import graph_time  # noqa: E402
from kernels.attention import paged_attention_ref, write_kv_ref  # noqa: E402
import kernels.attention_triton as AT  # noqa: E402
from kernels.attention_triton import attention_plan, paged_attention_triton, write_kv_triton  # noqa: E402
from kernels.moe import fused_moe_ref, route_ref  # noqa: E402
import kernels.moe_triton as MT  # noqa: E402
from kernels.moe_triton import MOE_CONFIGS, fused_moe_triton, moe_block_m, route_triton  # noqa: E402

BW = 4.3e12  # bytes/s, measured device-to-device copy on this H200 (docs)
E, TOPK, HID, INTER = 256, 8, 2048, 512
EXPERT_BYTES = 3 * INTER * HID * 2  # 6 MiB
HQ, HKV, HD, PAGE = 16, 2, 256, 16
DEV = "cuda"
DT = torch.bfloat16


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def eager_time(calls, reps: int = 10) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(calls))
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------
def zipf_bias(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(E, generator=gen).float() + 1.0
    return (-torch.log(rank)).to(DEV)


def make_routing(n: int, routing: str, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(1000 + seed)
    logits = torch.randn(n, E, device=DEV, generator=gen)
    if routing == "zipf":
        logits = logits + zipf_bias(seed)
    w, ids = route_ref(logits, TOPK, True)
    return logits, w.to(DT), ids


class MoeWeights:
    """`layers` independent expert weight sets (a graph cycles through them so L2 holds none)."""

    def __init__(self, layers: int):
        g = torch.Generator(device=DEV).manual_seed(7)
        self.gu = [torch.randn(E, 2 * INTER, HID, device=DEV, dtype=DT, generator=g) * HID ** -0.5
                   for _ in range(layers)]
        self.dn = [torch.randn(E, HID, INTER, device=DEV, dtype=DT, generator=g) * INTER ** -0.5
                   for _ in range(layers)]


def grouped_mm_moe(x, w_gu, w_dn, topk_w, topk_ids):
    """Baseline: sort by expert, torch._grouped_mm for gate/up and down, weight, index_add (no host sync)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // TOPK
    xs = x[tok]
    gu = torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs)  # [NK, 2I]
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_dn.transpose(1, 2), offs=offs)  # [NK, H]
    y = y * topk_w.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tok, y)


def moe_checks(wts: MoeWeights, log) -> dict:
    res = {}
    gu32, dn32 = wts.gu[0].float(), wts.dn[0].float()
    for n, routing, masked in [(1, "zipf", False), (16, "uniform", True), (64, "zipf", False),
                               (272, "zipf", True), (1024, "uniform", False)]:
        _, w, ids = make_routing(n, routing, 0)
        x = torch.randn(n, HID, device=DEV, dtype=DT)
        mask = (torch.rand(n, device=DEV) > 0.25) if masked else None
        out = fused_moe_triton(x, wts.gu[0], wts.dn[0], w, ids, mask)
        ref = fused_moe_ref(x.float(), gu32, dn32, w.float(), ids, mask)
        key = f"moe_N{n}_{routing}{'_mask' if masked else ''}"
        res[key] = rel(out, ref)
        if masked and out[~mask].abs().max().item() != 0:
            res[key] = float("inf")
        log(f"check {key}: rel err {res[key]:.2e}")
    for variant, cfg in MOE_VARIANTS.items():  # the fused align / fused reduce paths at small N, twice each
        for n, masked in ((1, False), (4, True), (16, True)):
            _, w, ids = make_routing(n, "zipf", 1)
            x = torch.randn(n, HID, device=DEV, dtype=DT)
            mask = (torch.rand(n, device=DEV) > 0.3) if masked else None
            ref = fused_moe_ref(x.float(), gu32, dn32, w.float(), ids, mask)
            errs = [rel(fused_moe_triton(x, wts.gu[0], wts.dn[0], w, ids, mask, cfg), ref) for _ in range(3)]
            res[f"moe_{variant}_N{n}{'_mask' if masked else ''}"] = max(errs)
        log(f"check variant {variant}: max rel err {max(v for k, v in res.items() if variant in k):.2e}")
    logits = torch.randn(272, E, device=DEV) + zipf_bias(0)
    w, ids = route_triton(logits, TOPK, True)
    w_ref, ids_ref = route_ref(logits, TOPK, True)
    res["route_ids_equal"] = bool(torch.equal(ids, ids_ref))
    res["route_w"] = rel(w, w_ref)
    log(f"check route: ids equal {res['route_ids_equal']}, weights rel err {res['route_w']:.2e}")
    return res


def moe_time(wts: MoeWeights, n: int, routing: str, config=None, grouped=False, seed=0, masked_half=False) -> dict:
    _, w, ids = make_routing(n, routing, seed)
    xs = [torch.randn(n, HID, device=DEV, dtype=DT) for _ in wts.gu]
    layers = len(wts.gu)
    reps = max(2, 8 // layers) * layers
    mask = (torch.arange(n, device=DEV) % 2 == 0) if masked_half else None  # every other token masked out

    def ours(i):
        return lambda: fused_moe_triton(xs[i % layers], wts.gu[i % layers], wts.dn[i % layers], w, ids, mask, config)

    kept = ids if mask is None else ids[mask]
    row = {"N": n, "routing": routing + ("+mask50%" if masked_half else ""), "experts": int(kept.unique().numel())}
    row["floor_us"] = row["experts"] * EXPERT_BYTES / BW * 1e6
    row["triton_us"] = graph_time([ours(i) for i in range(reps)])
    row["x_floor"] = row["triton_us"] / row["floor_us"]
    if grouped and hasattr(torch, "_grouped_mm"):
        def base(i):
            return lambda: grouped_mm_moe(xs[i % layers], wts.gu[i % layers], wts.dn[i % layers], w, ids)
        try:
            row["grouped_mm_eager_us"] = eager_time([base(i) for i in range(reps)])
        except Exception as exc:  # noqa: BLE001
            row["grouped_mm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            try:
                row["grouped_mm_graph_us"] = graph_time([base(i) for i in range(reps)])
            except Exception as exc:  # noqa: BLE001
                row["grouped_mm_graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _noop_kernel(p):
    tl.store(p, 1)


def launch_overhead() -> dict:
    """A one-store Triton kernel and a one-element torch op, in a graph: the fixed cost of one kernel node."""
    buf = torch.zeros(1, device=DEV, dtype=torch.int32)
    return {"triton_noop_us": graph_time([lambda: _noop_kernel[(1,)](buf)] * 16),
            "torch_add_us": graph_time([lambda: buf.add_(1)] * 16)}


def moe_breakdown(wts: MoeWeights, n: int, routing: str) -> dict:
    """Each launch of fused_moe_triton timed alone (graph, 8 calls over the 4 weight sets)."""
    _, w, ids = make_routing(n, routing, 0)
    layers = len(wts.gu)
    xs = [torch.randn(n, HID, device=DEV, dtype=DT) for _ in range(layers)]
    flat, rw = ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
    nk, bm = flat.numel(), moe_block_m(n, TOPK, E)
    max_blocks = triton.cdiv(nk, bm) + min(E, nk)
    sids, bexp, nblk, mask = MT.moe_align_triton(flat, None, E, TOPK, bm)
    sids2, bexp2, nblk2 = sids.clone(), bexp.clone(), nblk.clone()
    h = torch.empty(max_blocks * bm, INTER, device=DEV, dtype=DT)
    y = torch.empty(nk, HID, device=DEV, dtype=DT)
    out = torch.empty(n, HID, device=DEV, dtype=DT)
    gbn, gbk, gw, gs = MOE_CONFIGS[bm]["gate_up"]
    dbn, dbk, dw, ds = MOE_CONFIGS[bm]["down"]
    e_p2 = triton.next_power_of_2(E + 1)
    # routing statistics (issue 7): written by the grouping (align kernel, or the gate/up kernel's program (0, 0))
    st_d, st_c = torch.empty((), device=DEV, dtype=torch.int64), torch.empty(E, device=DEV, dtype=torch.int64)

    def gate_up(i, fused, stats=False):
        dst = (sids2, bexp2, nblk2) if fused else (sids, bexp, nblk)
        st = (st_d, st_c, 2) if stats else (st_d, st_d, 0)
        return lambda: MT._moe_gate_up_kernel[(max_blocks, triton.cdiv(INTER, gbn))](
            xs[i % layers], wts.gu[i % layers], wts.gu[i % layers], h, *dst, flat, sids, *st, nk, E, HID, INTER, INTER,
            xs[0].stride(0), wts.gu[0].stride(0), wts.gu[0].stride(1), wts.gu[0].stride(1), h.stride(0),
            TOP_K=TOPK, BLOCK_M=bm, BLOCK_N=gbn, BLOCK_K=gbk, FUSED_ALIGN=fused, HAS_MASK=False, E_P2=e_p2,
            NK_P2=triton.next_power_of_2(nk), SHARED=False, num_warps=gw, num_stages=gs)

    def down(i):
        return lambda: MT._moe_down_kernel[(max_blocks, triton.cdiv(HID, dbn))](
            h, wts.dn[i % layers], wts.dn[i % layers], y, rw, sids, bexp, nblk, out, sids, nblk, nk, E, HID, INTER,
            INTER, h.stride(0), wts.dn[0].stride(0), wts.dn[0].stride(1), wts.dn[0].stride(1), y.stride(0),
            BLOCK_M=bm, BLOCK_N=dbn, BLOCK_K=dbk, TOP_K=TOPK, FUSED_REDUCE=False, HAS_MASK=False, FENCE=False,
            RED_T=16, SHARED=False, num_warps=dw, num_stages=ds)

    experts = int(ids.unique().numel())
    row = {"N": n, "routing": routing, "experts": experts, "block_m": bm,
           "floor_gate_up_us": experts * 2 * INTER * HID * 2 / BW * 1e6,
           "floor_down_us": experts * INTER * HID * 2 / BW * 1e6}
    row["align_us"] = graph_time([lambda: MT.moe_align_triton(flat, None, E, TOPK, bm)] * 8)
    row["align_stats_us"] = graph_time([lambda: MT.moe_align_triton(flat, None, E, TOPK, bm, stats=(st_d, st_c))] * 8)
    row["stats_kernel_us"] = graph_time([lambda: MT.expert_counts_triton(ids, None, E)] * 8)  # the separate one
    row["gate_up_us"] = graph_time([gate_up(i, False) for i in range(8)])
    row["gate_up_fused_align_us"] = graph_time([gate_up(i, True) for i in range(8)])
    row["gate_up_fused_align_stats_us"] = graph_time([gate_up(i, True, stats=True) for i in range(8)])
    row["down_us"] = graph_time([down(i) for i in range(8)])
    row["reduce_us"] = graph_time([lambda: MT._moe_reduce_kernel[(n, triton.cdiv(HID, 1024))](
        y, sids, out, flat, E, HID, TOP_K=TOPK, HAS_MASK=False, BLOCK_H=1024, SHARED=False, num_warps=4)] * 8)
    return row


SHARED_SIZES = (1, 2, 4, 8, 16, 64)


def shared_moe_layers(wts: MoeWeights, seed: int = 0) -> list:
    """One SparseMoe per weight set at the bench shapes (workers/bench_model.py's config): the routed experts are
    wts' tensors (no copy); router N(0, 1/H) (unit-variance logits) + the Zipf bias, shared expert and its gate
    random; an RMSNorm for the layer's tail."""
    from workers.bench_model import qwen36_35b_a3b_config
    from workers.model import RMSNorm, SparseMoe

    cfg = qwen36_35b_a3b_config(1)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size) == (E, TOPK, HID,
                                                                                                      INTER)
    g = torch.Generator(device=DEV).manual_seed(100 + seed)
    layers = []
    for i, (gu, dn) in enumerate(zip(wts.gu, wts.dn)):
        moe = SparseMoe(cfg, DT, DEV)
        moe.experts.gate_up_proj = torch.nn.Parameter(gu, requires_grad=False)
        moe.experts.down_proj = torch.nn.Parameter(dn, requires_grad=False)
        torch.cuda.empty_cache()
        with torch.no_grad():
            for name, prm in moe.named_parameters():
                if name.startswith("experts."):
                    continue
                prm.copy_(torch.randn(prm.shape, device=DEV, generator=g) * prm.shape[-1] ** -0.5)
        moe.router_bias = zipf_bias(seed + i).float()
        norm = RMSNorm(HID, cfg.rms_norm_eps, DT, DEV)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(HID, device=DEV, generator=g) * 0.1)
        layers.append((moe, norm))
    return layers


def shared_tail(wts: MoeWeights, log, sizes=SHARED_SIZES) -> dict:
    """A MoE layer's whole tail (router logits + route + routed experts + shared expert + residual add + next
    RMSNorm, i.e. SparseMoe.forward(h, residual=x, norm=...)) as today (shared expert apart: its GEMM, silu_mul,
    down GEMM, moe_residual_rmsnorm) vs fused (the shared expert as expert id E: router logits over E + 1 rows,
    route with the shared slot, fused_moe, add_rmsnorm), per N tokens, Zipf routing, CUDA graphs over the 4
    weight sets. Also the fused MoE kernels alone without / with the shared slot (same routing), and the error
    between the two tails (norm-wise relative, and max |diff| / max |today|, on both outputs)."""
    from workers.model import SparseMoe

    layers = shared_moe_layers(wts)
    nl = len(layers)
    reps = max(2, 8 // nl) * nl
    saved = SparseMoe.SHARED_FUSE_MAX_N
    rows = []
    try:
        with torch.inference_mode():
            for n in sizes:
                gen = torch.Generator(device=DEV).manual_seed(2000 + n)
                hs = [torch.randn(n, HID, device=DEV, dtype=DT, generator=gen) for _ in range(nl)]
                res = [torch.randn(n, HID, device=DEV, dtype=DT, generator=gen) * 4 for _ in range(nl)]

                def tail(i):
                    moe, norm = layers[i % nl]
                    return lambda: moe(hs[i % nl], None, res[i % nl], norm)

                out = {}
                for mode, limit in (("today", 0), ("fused", 1 << 30)):
                    SparseMoe.SHARED_FUSE_MAX_N = limit
                    out[mode] = [tail(i)() for i in range(nl)]
                    out[mode + "_us"] = graph_time([tail(i) for i in range(reps)])
                moe0 = layers[0][0]
                w, ids = moe0.route(hs[0])
                ws, ids_s = moe0.route_shared(hs[0])
                row = {"N": n, "routing": "zipf", "experts": int(ids.unique().numel()),
                       "today_us": out["today_us"], "fused_us": out["fused_us"],
                       "saved_us": out["today_us"] - out["fused_us"],
                       "routing_equal": bool(torch.equal(ids, ids_s[:, :TOPK]))}
                row["rel_err"] = max(rel(a, b) for ta, tb in zip(out["fused"], out["today"]) for a, b in zip(ta, tb))
                row["max_abs_rel_err"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                             for ta, tb in zip(out["fused"], out["today"]) for a, b in zip(ta, tb))
                # the expert kernels alone: the routed MoE, and the call with the shared slot (layer 0's routing)
                shared_w = [layer.shared_weights() for layer, _ in layers]

                def kernels(i, with_shared):
                    j = i % nl
                    moe = layers[j][0]
                    if with_shared:
                        return lambda: fused_moe_triton(hs[j], moe.experts.gate_up_proj, moe.experts.down_proj, ws,
                                                        ids_s, None, shared=shared_w[j])
                    return lambda: fused_moe_triton(hs[j], moe.experts.gate_up_proj, moe.experts.down_proj, w, ids)

                row["moe_kernels_us"] = graph_time([kernels(i, False) for i in range(reps)])
                row["moe_kernels_shared_us"] = graph_time([kernels(i, True) for i in range(reps)])
                rows.append(row)
                log(f"shared tail N={n}: today {row['today_us']:.1f} us, fused {row['fused_us']:.1f} us "
                    f"(saved {row['saved_us']:.1f}); MoE kernels {row['moe_kernels_us']:.1f} -> "
                    f"{row['moe_kernels_shared_us']:.1f} with the shared slot; rel err {row['rel_err']:.2e} "
                    f"(max {row['max_abs_rel_err']:.2e}), routing equal {row['routing_equal']}")
    finally:
        SparseMoe.SHARED_FUSE_MAX_N = saved
    torch.cuda.empty_cache()
    return {"rows": rows, "shared_fuse_max_n": saved}


MOE_VARIANTS = {
    "unfused": {"fuse_align": False, "fuse_reduce": False},  # align kernel + gate/up + down + reduce kernel
    "fuse_align": {"fuse_align": True, "fuse_reduce": False},  # grouping inside gate/up: 3 launches
    "fuse_both": {"fuse_align": True, "fuse_reduce": True},  # + last down program reduces: 2 launches
}


def moe_sweep(wts: MoeWeights, log) -> dict:
    """Launch structure (MOE_VARIANTS) by N, and a few down tiles; picks the fastest structure per N."""
    out = {"variants": [], "down": []}
    for routing in ("zipf", "uniform"):
        for n in (1, 4, 16, 64, 128):
            for name, cfg in MOE_VARIANTS.items():
                if name == "fuse_both" and n > 32:
                    continue
                t = moe_time(wts, n, routing, cfg)["triton_us"]
                out["variants"].append({"N": n, "routing": routing, "variant": name, "us": t})
                log(f"sweep moe {routing} N={n} {name}: {t:.1f} us")
    for dn in [(64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3)]:
        for n in (1, 64):
            t = moe_time(wts, n, "zipf", {"down": dn})["triton_us"]
            out["down"].append({"N": n, "cfg": dn, "us": t})
            log(f"sweep moe down {dn} N={n}: {t:.1f} us")
    # thresholds: fuse_align while it wins at every N measured up to there (zipf + uniform summed), same for reduce
    def total(n, name):
        return sum(r["us"] for r in out["variants"] if r["N"] == n and r["variant"] == name)

    align_max = reduce_max = 0
    for n in (1, 4, 16, 64, 128):
        if total(n, "fuse_align") <= total(n, "unfused") and align_max == n_prev(n):
            align_max = n
        if n <= 32 and total(n, "fuse_both") <= total(n, "fuse_align") and reduce_max == n_prev(n):
            reduce_max = n
    out["best"] = {"fuse_align_max_nk": align_max * TOPK, "fuse_reduce_max_nk": reduce_max * TOPK}
    return out


def n_prev(n: int) -> int:
    sizes = (1, 4, 16, 64, 128)
    i = sizes.index(n)
    return 0 if i == 0 else sizes[i - 1]


# ---------------------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------------------
class PagedCase:
    """B requests with the given query / context lengths over `copies` disjoint page sets of one shuffled pool."""

    def __init__(self, q_lens, ctx_lens, copies: int, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.q_lens, self.ctx_lens = list(q_lens), list(ctx_lens)
        self.b = len(q_lens)
        pages = [math.ceil((c + t) / PAGE) for c, t in zip(ctx_lens, q_lens)]
        per_copy = sum(pages)
        num_pages = per_copy * copies + 1
        self.k = torch.randn(num_pages, PAGE, HKV, HD, device=DEV, dtype=DT)
        self.v = torch.randn(num_pages, PAGE, HKV, HD, device=DEV, dtype=DT)
        perm = torch.randperm(num_pages, generator=g)
        self.tables, used = [], 0
        for _ in range(copies):
            t = torch.zeros(self.b, max(pages), dtype=torch.int32)
            for i, p in enumerate(pages):
                t[i, :p] = perm[used : used + p].int()
                used += p
            self.tables.append(t.to(DEV))
        self.n = sum(q_lens)
        self.cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
        self.ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
        self.qs = [torch.randn(self.n, HQ, HD, device=DEV, dtype=DT) for _ in range(copies)]
        self.kv_bytes = sum(c + t for c, t in zip(ctx_lens, q_lens)) * HKV * HD * 2 * 2

    def run(self, i: int, plan=None):
        return paged_attention_triton(self.qs[i], self.k, self.v, self.tables[i], self.cu, self.ctx, HD ** -0.5,
                                      self.q_lens, self.ctx_lens, plan=plan)

    def dense(self, i: int):
        """Per request, contiguous K/V [1, HKV, L, D] gathered from the pages (outside any timing)."""
        out = []
        for r in range(self.b):
            total = self.ctx_lens[r] + self.q_lens[r]
            pos = torch.arange(total, device=DEV)
            rows = self.tables[i][r, pos // PAGE].long() * PAGE + pos % PAGE
            kk = self.k.view(-1, HKV, HD)[rows].transpose(0, 1).unsqueeze(0).contiguous()
            vv = self.v.view(-1, HKV, HD)[rows].transpose(0, 1).unsqueeze(0).contiguous()
            out.append((kk, vv))
        return out


def sdpa_calls(case: PagedCase, copies: int):
    """torch SDPA on the same data, pre-gathered contiguous; uniform lengths -> one batched call (GQA)."""
    uniform = len(set(case.q_lens)) == 1 and len(set(case.ctx_lens)) == 1
    t, c = case.q_lens[0], case.ctx_lens[0]
    calls = []
    for i in range(copies):
        dense = case.dense(i)
        if uniform:
            k = torch.cat([d[0] for d in dense]).contiguous()  # [B, HKV, L, D]
            v = torch.cat([d[1] for d in dense]).contiguous()
            q = case.qs[i].view(case.b, t, HQ, HD).transpose(1, 2).contiguous()  # [B, H, T, D]
            mask, causal = None, False
            if t > 1 and c == 0:
                causal = True  # plain causal prefill: lets SDPA pick its flash kernel
            elif t > 1:
                L = c + t  # bottom-right causal: query j sees positions <= c + j
                mask = (torch.arange(L, device=DEV)[None, :] <= (c + torch.arange(t, device=DEV))[:, None])
            calls.append(lambda q=q, k=k, v=v, mask=mask, causal=causal: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=HD ** -0.5, enable_gqa=True))
        else:
            raise ValueError("sdpa baseline only for uniform lengths")
    return calls


def attn_checks(log) -> dict:
    res = {}
    gen = torch.Generator().manual_seed(3)
    for name, q_lens, ctx_lens, plan in [
        ("verify_ragged_B8", [1, 17, 4, 9, 17, 2, 1, 13], [512, 4096, 777, 2048, 0, 3000, 1, 1500], None),
        ("verify_ragged_B8_nosplit", [1, 17, 4, 9, 17, 2, 1, 13], [512, 4096, 777, 2048, 0, 3000, 1, 1500],
         {"splits": 1}),
        ("decode_B1_4096", [1], [4096], None),
        ("prefill_B2", [700, 300], [0, 1000], None),
    ]:
        case = PagedCase(q_lens, ctx_lens, 1)
        out = case.run(0, plan)
        ref = paged_attention_ref(case.qs[0].float(), case.k.float(), case.v.float(), case.tables[0], case.cu,
                                  case.ctx, HD ** -0.5, q_lens, ctx_lens)
        res[f"attn_{name}"] = rel(out, ref)
        log(f"check attn {name}: rel err {res[f'attn_{name}']:.2e} plan "
            f"{attention_plan(sum(q_lens), len(q_lens), HQ, HKV, max(q_lens), max(c + t for c, t in zip(ctx_lens, q_lens)), 132)}")
    # write_kv
    case = PagedCase([3, 17, 1], [100, 40, 0], 1)
    pos = torch.cat([torch.arange(c, c + t) for c, t in zip(case.ctx_lens, case.q_lens)]).to(DEV)
    owner = torch.cat([torch.full((t,), i) for i, t in enumerate(case.q_lens)]).to(DEV)
    k = torch.randn(case.n, HKV, HD, device=DEV, dtype=DT)
    v = torch.randn(case.n, HKV, HD, device=DEV, dtype=DT)
    kc, vc = case.k.clone(), case.v.clone()
    write_kv_triton(k, v, case.k, case.v, case.tables[0], pos, owner)
    write_kv_ref(k, v, kc, vc, case.tables[0], pos, owner)
    res["write_kv_equal"] = bool(torch.equal(kc, case.k) and torch.equal(vc, case.v))
    log(f"check write_kv: equal {res['write_kv_equal']}")
    del gen
    return res


def attn_prep(log) -> dict:
    """The attention layer's fused launches in bf16 at real shapes: q/k norm + rope + KV write in one kernel
    (qk_norm_rope_write) against its reference and the five launches it replaces, and the output gate in the
    attention kernel's epilogue against attention followed by o * sigmoid(gate). Timings: CUDA graphs of 8 calls
    over disjoint page sets (the q/gate projection's strided halves as the model passes them)."""
    from kernels import dispatch
    from kernels.attention import qk_norm_rope_write_ref
    from kernels.attention_triton import qk_norm_rope_write_triton
    res = {"checks": {}, "prep": [], "gated": []}
    R = HD // 4  # partial rotary: 25% of the head dims
    for name, q_lens, ctx_lens, plan in [
        ("verify_ragged_B8", [1, 17, 4, 9, 17, 2, 1, 13], [512, 4096, 777, 2048, 0, 3000, 1, 1500], None),
        ("verify_ragged_B8_nosplit", [1, 17, 4, 9, 17, 2, 1, 13], [512, 4096, 777, 2048, 0, 3000, 1, 1500],
         {"splits": 1}),
        ("decode_B1_4096", [1], [4096], None),
    ]:
        case = PagedCase(q_lens, ctx_lens, 1)
        gate = torch.randn(case.n, HQ, 2 * HD, device=DEV, dtype=DT)[..., HD:] * 2
        out = paged_attention_triton(case.qs[0], case.k, case.v, case.tables[0], case.cu, case.ctx, HD ** -0.5,
                                     q_lens, ctx_lens, gate, plan=plan)
        ref = paged_attention_ref(case.qs[0].float(), case.k.float(), case.v.float(), case.tables[0], case.cu,
                                  case.ctx, HD ** -0.5, q_lens, ctx_lens, gate.float())
        res["checks"][f"gated_{name}"] = rel(out, ref)
        log(f"check gated attn {name}: rel err {res['checks'][f'gated_{name}']:.2e}")

    def prep_inputs(case, copies):
        n = case.n
        pos = torch.cat([torch.arange(c, c + t) for c, t in zip(case.ctx_lens, case.q_lens)]).to(DEV)
        owner = torch.cat([torch.full((t,), i) for i, t in enumerate(case.q_lens)]).to(DEV)
        ang = pos.float()[:, None] * torch.rand(R // 2, device=DEV)[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos().to(DT), torch.cat((ang, ang), -1).sin().to(DT)
        ins = []
        for _ in range(copies):
            q = torch.randn(n, HQ, 2 * HD, device=DEV, dtype=DT)[..., :HD]
            ins.append((q, torch.randn(n, HKV, HD, device=DEV, dtype=DT), torch.randn(n, HKV, HD, device=DEV,
                                                                                       dtype=DT)))
        qw, kw = torch.randn(HD, device=DEV, dtype=DT) * 0.1, torch.randn(HD, device=DEV, dtype=DT) * 0.1
        return pos, owner, cos, sin, ins, qw, kw

    case = PagedCase([3, 17, 1], [100, 40, 0], 1)
    pos, owner, cos, sin, ins, qw, kw = prep_inputs(case, 1)
    q, k, v = ins[0]
    kc, vc = case.k.clone(), case.v.clone()
    out = qk_norm_rope_write_triton(q, k, v, qw, kw, 1e-6, cos, sin, R, case.k, case.v, case.tables[0], pos, owner)
    ref = qk_norm_rope_write_ref(q, k, v, qw, kw, 1e-6, cos, sin, R, kc, vc, case.tables[0], pos, owner)
    res["checks"]["qk_prep_equal"] = bool(torch.equal(out, ref) and torch.equal(kc, case.k)
                                          and torch.equal(vc, case.v))
    res["checks"]["qk_prep_rel"] = max(rel(out, ref), rel(case.k, kc))
    log(f"check qk_norm_rope_write: bit-equal {res['checks']['qk_prep_equal']} rel {res['checks']['qk_prep_rel']:.2e}")

    copies = 8
    for b, t in [(1, 1), (16, 1), (4, 17), (64, 1), (16, 17)]:
        case = PagedCase([t] * b, [1000] * b, copies)
        pos, owner, cos, sin, ins, qw, kw = prep_inputs(case, copies)

        def fused(i):
            q, k, v = ins[i]
            qk_norm_rope_write_triton(q, k, v, qw, kw, 1e-6, cos, sin, R, case.k, case.v, case.tables[i], pos,
                                      owner)

        def apart(i):
            q, k, v = ins[i]
            dispatch.rope(dispatch.rmsnorm(q, qw, 1e-6), cos, sin, R)
            kk = dispatch.rope(dispatch.rmsnorm(k, kw, 1e-6), cos, sin, R)
            write_kv_triton(kk, v, case.k, case.v, case.tables[i], pos, owner)

        row = {"B": b, "T": t, "fused_us": graph_time([(lambda i=i: fused(i)) for i in range(copies)]),
               "apart_us": graph_time([(lambda i=i: apart(i)) for i in range(copies)])}
        res["prep"].append(row)
        log(f"qk prep B={b} T={t}: fused {row['fused_us']:.2f} us, apart {row['apart_us']:.2f} us")
        gates = [torch.randn(case.n, HQ, 2 * HD, device=DEV, dtype=DT)[..., HD:] for _ in range(copies)]

        def attn(i, gated):
            o = paged_attention_triton(case.qs[i], case.k, case.v, case.tables[i], case.cu, case.ctx, HD ** -0.5,
                                       case.q_lens, case.ctx_lens, gates[i] if gated else None)
            if not gated:
                o.reshape(case.n, -1) * torch.sigmoid(gates[i].reshape(case.n, -1))

        row = {"B": b, "T": t, "ctx": 1000,
               "epilogue_us": graph_time([(lambda i=i: attn(i, True)) for i in range(copies)]),
               "apart_us": graph_time([(lambda i=i: attn(i, False)) for i in range(copies)])}
        res["gated"].append(row)
        log(f"gated attn B={b} T={t} ctx 1000: epilogue {row['epilogue_us']:.2f} us, apart {row['apart_us']:.2f} us")
    return res


def attn_sweep(log) -> dict:
    """Decode/verify tiles per BLOCK_M class, the split policy, and prefill tiles."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"tiles": [], "splits": [], "prefill": []}
    cases = {16: [(1, 1, 4096), (8, 1, 4096), (32, 1, 4096)], 64: [(1, 17, 4096), (8, 17, 4096), (32, 17, 4096)]}
    tiles = {16: [(32, 8, 3), (64, 8, 2), (32, 4, 3), (16, 4, 4)], 64: [(32, 8, 3), (32, 8, 2), (64, 8, 2)]}
    made = {}

    def case(b, t, ctx):
        if (b, t, ctx) not in made:
            per = b * (ctx + t) * HKV * HD * 4
            made[(b, t, ctx)] = (PagedCase([t] * b, [ctx] * b, max(2, min(8, math.ceil(200e6 / per)))), per)
        return made[(b, t, ctx)][0]

    def timeit(c, plan):
        copies = len(c.tables)
        reps = max(copies, 8 // copies * copies)
        return graph_time([(lambda i=i: c.run(i % copies, plan)) for i in range(reps)])

    best_tiles = {}
    for bm, cs in cases.items():
        score = {}
        for tile in tiles[bm]:
            AT.ATTN_TILES[bm] = tile
            for (b, t, ctx) in cs:
                us = timeit(case(b, t, ctx), None)
                score[tile] = score.get(tile, 0.0) + us
                out["tiles"].append({"B": b, "T": t, "ctx": ctx, "block_m": bm, "tile": tile, "us": us})
                log(f"sweep attn B={b} T={t} ctx={ctx} bm={bm} tile={tile}: {us:.1f} us")
        best_tiles[bm] = min(score, key=score.get)
        AT.ATTN_TILES[bm] = best_tiles[bm]
    # 128-row tiles (16 tokens) for verification: 2 tiles for T=17 instead of 3
    for (b, t, ctx) in cases[64]:
        c = case(b, t, ctx)
        p = attention_plan(c.n, b, HQ, HKV, t, ctx + t, sms)
        p.update(block_m=128, tpt=16, grid_m=2, block_n=32, num_warps=8, num_stages=2)
        p["splits"] = max(1, p["splits"] * 3 // 2)
        us = timeit(c, p)
        out["tiles"].append({"B": b, "T": t, "ctx": ctx, "block_m": 128, "tile": (32, 8, 2), "us": us})
        log(f"sweep attn B={b} T={t} ctx={ctx} bm=128: {us:.1f} us")
    # split policy
    score = {}
    for waves in (1, 3, 6):
        for min_keys in (64, 128, 256):
            AT.SPLIT_WAVES, AT.SPLIT_MIN_KEYS = waves, min_keys
            for (b, t, ctx) in cases[16] + cases[64] + [(1, 1, 512), (8, 4, 1024)]:
                us = timeit(case(b, t, ctx), None)
                score[(waves, min_keys)] = score.get((waves, min_keys), 0.0) + us
                out["splits"].append({"B": b, "T": t, "ctx": ctx, "waves": waves, "min_keys": min_keys, "us": us})
            log(f"sweep attn splits waves={waves} min_keys={min_keys}: total {score[(waves, min_keys)]:.1f} us")
    AT.SPLIT_WAVES, AT.SPLIT_MIN_KEYS = min(score, key=score.get)
    # prefill
    pscore = {}
    c = PagedCase([2048], [0], 2)
    for tile in [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3)]:
        AT.PREFILL_TILE = tile
        try:
            us = timeit(c, None)
        except Exception as exc:  # noqa: BLE001
            log(f"prefill tile {tile} failed: {exc}")
            continue
        pscore[tile] = us
        out["prefill"].append({"tile": tile, "us": us})
        log(f"sweep attn prefill B=1 T=2048 tile={tile}: {us:.1f} us")
    AT.PREFILL_TILE = min(pscore, key=pscore.get)
    out["best"] = {"tiles": {k: list(v) for k, v in AT.ATTN_TILES.items()}, "split_waves": AT.SPLIT_WAVES,
                   "split_min_keys": AT.SPLIT_MIN_KEYS, "prefill_tile": list(AT.PREFILL_TILE)}
    log(f"attention best: {out['best']}")
    del made
    return out


def attn_time(b: int, t: int, ctx: int, sdpa: bool = True, **kw) -> dict:
    per = b * (ctx + t) * HKV * HD * 4
    copies = max(2, min(8, math.ceil(200e6 / per)))
    case = PagedCase([t] * b, [ctx] * b, copies)
    row = {"B": b, "q_len": t, "ctx": ctx, "floor_us": case.kv_bytes / BW * 1e6,
           "plan": attention_plan(case.n, b, HQ, HKV, t, ctx + t, torch.cuda.get_device_properties(0).multi_processor_count)}
    reps = max(copies, 8 // copies * copies)
    if kw:
        row["triton_us"] = graph_time([(lambda i=i: paged_attention_triton(
            case.qs[i % copies], case.k, case.v, case.tables[i % copies], case.cu, case.ctx, HD ** -0.5,
            case.q_lens, case.ctx_lens, **kw)) for i in range(reps)])
    else:
        row["triton_us"] = graph_time([(lambda i=i: case.run(i % copies)) for i in range(reps)])
    row["x_floor"] = row["triton_us"] / row["floor_us"]
    if sdpa:
        try:
            calls = sdpa_calls(case, copies)
            row["sdpa_us"] = graph_time([calls[i % copies] for i in range(reps)])
        except Exception as exc:  # noqa: BLE001
            row["sdpa_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


# ---------------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated sections to run, e.g. 'shared' (the shared "
                    "expert fused into the MoE vs apart); others: checks_moe, checks_attn, moe_sweep, moe, "
                    "launch_overhead, moe_breakdown, attn_prep, attn_sweep, attention")
    ap.add_argument("--shared-sizes", default=",".join(map(str, SHARED_SIZES)),
                    help="token counts of the 'shared' section (e.g. 1,64,272,1024 to place SHARED_FUSE_MAX_N)")
    args = ap.parse_args()
    only = {"moe_shared_tail" if x.strip() == "shared" else x.strip() for x in args.only.split(",") if x.strip()}
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    lines = []

    def log(msg):
        msg = f"[{time.time() - t0:6.1f}s] {msg}"
        print(msg, flush=True)
        lines.append(msg)

    commit = os.environ.get("HYBRIDSPEC_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"
    props = torch.cuda.get_device_properties(0)
    result = {"commit": commit, "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "triton": __import__("triton").__version__, "dtype": "bfloat16", "bw_floor_Bps": BW,
              "moe_shape": {"E": E, "top_k": TOPK, "H": HID, "I": INTER}, "attn_shape":
              {"HQ": HQ, "HKV": HKV, "D": HD, "page": PAGE}, "errors": {}}
    out_json = out_dir / "kernels_moe_attn.json"

    def save():
        result["log"] = lines
        out_json.write_text(json.dumps(result, indent=1, default=str))

    def section(name, fn):
        if only and name not in only:
            return
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc()
            result["errors"][name] = tb[-3000:]
            log(f"SECTION {name} FAILED:\n{tb[-2000:]}")
        save()

    torch.manual_seed(0)
    wts = MoeWeights(layers=4)  # 4 x 1.5 GiB
    section("checks_moe", lambda: moe_checks(wts, log))
    section("moe_shared_tail", lambda: shared_tail(wts, log, [int(n) for n in args.shared_sizes.split(",")]))
    section("checks_attn", lambda: attn_checks(log))
    section("attn_prep", lambda: attn_prep(log))
    if not args.no_sweep and (not only or "moe_sweep" in only):
        section("moe_sweep", lambda: moe_sweep(wts, log))
        best = result.get("moe_sweep", {}).get("best")
        if best:
            MT.FUSE_ALIGN_MAX_NK = best["fuse_align_max_nk"]
            MT.FUSE_REDUCE_MAX_NK = best["fuse_reduce_max_nk"]
            log(f"using fuse_align up to N*k={MT.FUSE_ALIGN_MAX_NK}, fuse_reduce up to N*k={MT.FUSE_REDUCE_MAX_NK}")

    def moe_table():
        rows = []
        sizes = (1, 16, 64) if args.quick else (1, 4, 16, 64, 272)
        for routing in ("zipf", "uniform"):
            for n in sizes:
                r = moe_time(wts, n, routing, grouped=True)
                r["block_m"] = moe_block_m(n, TOPK, E)
                rows.append(r)
                log(f"moe {routing} N={n}: {r['triton_us']:.1f} us, "
                    f"floor {r['floor_us']:.1f} ({r['x_floor']:.2f}x), "
                    f"grouped_mm eager {r.get('grouped_mm_eager_us', float('nan')):.1f} graph "
                    f"{r.get('grouped_mm_graph_us', float('nan')):.1f}")
        for n in (16, 64):  # half the tokens masked out: cost should follow the kept tokens' experts
            r = moe_time(wts, n, "zipf", masked_half=True)
            rows.append(r)
            log(f"moe zipf N={n} half masked: {r['triton_us']:.1f} us, floor {r['floor_us']:.1f} ({r['x_floor']:.2f}x)")
        # routing kernel alone
        for n in (1, 64, 272):
            logits = torch.randn(n, E, device=DEV)
            rows.append({"route_N": n, "triton_us": graph_time([lambda: route_triton(logits, TOPK, True)] * 8),
                         "torch_us": graph_time([lambda: route_ref(logits, TOPK, True)] * 8)})
        return rows

    result["moe_defaults"] = {"configs": {str(k): v for k, v in MOE_CONFIGS.items()},
                              "fuse_align_max_nk": MT.FUSE_ALIGN_MAX_NK, "fuse_reduce_max_nk": MT.FUSE_REDUCE_MAX_NK}
    section("moe", moe_table)
    section("launch_overhead", launch_overhead)

    def breakdown():
        rows = []
        for n, routing in ((1, "zipf"), (4, "zipf"), (64, "zipf"), (64, "uniform")):
            r = moe_breakdown(wts, n, routing)
            rows.append(r)
            log(f"moe parts {routing} N={n}: align {r['align_us']:.1f}, gate_up {r['gate_up_us']:.1f} "
                f"(fused align {r['gate_up_fused_align_us']:.1f}; floor {r['floor_gate_up_us']:.1f}), down "
                f"{r['down_us']:.1f} (floor {r['floor_down_us']:.1f}), reduce {r['reduce_us']:.1f} us")
        return rows

    section("moe_breakdown", breakdown)
    del wts
    torch.cuda.empty_cache()

    def attn_table():
        rows = []
        bs = (1, 32) if args.quick else (1, 8, 32)
        for b in bs:
            for t in (1, 4, 17):
                for ctx in (512, 4096):
                    r = attn_time(b, t, ctx)
                    rows.append(r)
                    log(f"attn B={b} T={t} ctx={ctx}: {r['triton_us']:.1f} us, floor {r['floor_us']:.1f} "
                        f"({r['x_floor']:.2f}x), sdpa {r.get('sdpa_us', float('nan')):.1f} splits {r['plan']['splits']}")
        for b, t in ((1, 2048), (4, 512)):
            r = attn_time(b, t, 0)  # fresh prompts: paged_attention_triton takes its SDPA path
            r["path"] = "sdpa (auto)"
            rows.append(r)
            r2 = attn_time(b, t, 0, sdpa=False, prefill_sdpa=False)
            r2["path"] = "triton kernel"
            rows.append(r2)
            log(f"attn prefill B={b} T={t}: auto(sdpa path) {r['triton_us']:.1f} us, triton kernel "
                f"{r2['triton_us']:.1f} us, raw sdpa {r.get('sdpa_us', float('nan')):.1f}")
        r = attn_time(2, 1024, 1024)  # chunked prefill continuing a context: the Triton kernel
        r["path"] = "triton kernel (chunked)"
        rows.append(r)
        log(f"attn chunked prefill B=2 T=1024 ctx=1024: {r['triton_us']:.1f} us, sdpa (masked) "
            f"{r.get('sdpa_us', float('nan')):.1f}")
        return rows

    if not args.no_sweep and (not only or "attn_sweep" in only):
        section("attn_sweep", lambda: attn_sweep(log))
    result["attn_defaults"] = {"tiles": {str(k): v for k, v in AT.ATTN_TILES.items()}, "prefill": AT.PREFILL_TILE,
                               "split_waves": AT.SPLIT_WAVES, "split_min_keys": AT.SPLIT_MIN_KEYS}
    section("attention", attn_table)
    save()

    # ---- short table last
    checks = {**result.get("checks_moe", {}), **result.get("checks_attn", {})}
    if checks:
        print("\n== checks (rel err vs fp32 reference) ==")
    for k, v in checks.items():
        print(f"  {k}: {v if isinstance(v, bool) else f'{v:.2e}'}")
    if result.get("moe"):
        print(f"\n== MoE (commit {commit}, {props.name}, bf16, E=256 top-8 H=2048 I=512, graph median us/call) ==")
        print(f"{'routing':14} {'N':>4} {'exp':>4} {'floor':>7} {'triton':>7} {'x':>5} {'gmm_eag':>8} {'gmm_gr':>7}")
    for r in result.get("moe", []):
        if "N" in r:
            print(f"{r['routing']:14} {r['N']:>4} {r['experts']:>4} {r['floor_us']:7.1f} {r['triton_us']:7.1f} "
                  f"{r['x_floor']:5.2f} {r.get('grouped_mm_eager_us', float('nan')):8.1f} "
                  f"{r.get('grouped_mm_graph_us', float('nan')):7.1f}")
        else:
            print(f"route N={r['route_N']}: triton {r['triton_us']:.1f} us, torch {r['torch_us']:.1f} us")
    if result.get("attention"):
        print("\n== paged attention (HQ16/HKV2/D256, page 16, graph median us/call) ==")
        print(f"{'B':>3} {'T':>5} {'ctx':>5} {'floor':>7} {'ours':>7} {'x':>6} {'sdpa':>7} {'S':>3} {'BM':>4}")
    for r in result.get("attention", []):
        print(f"{r['B']:>3} {r['q_len']:>5} {r['ctx']:>5} {r['floor_us']:7.1f} {r['triton_us']:7.1f} "
              f"{r['x_floor']:6.2f} {r.get('sdpa_us', float('nan')):7.1f} {r['plan']['splits']:>3} "
              f"{r['plan']['block_m']:>4} {r.get('path', '')}")
    if result.get("moe_breakdown"):
        print("\n== MoE launches alone (us; floors = weight bytes / 4.3 TB/s) ==")
        for r in result["moe_breakdown"]:
            print(f"  {r['routing']} N={r['N']}: align {r['align_us']:.1f} | gate_up {r['gate_up_us']:.1f} "
                  f"(fused-align {r['gate_up_fused_align_us']:.1f}, floor {r['floor_gate_up_us']:.1f}) | down "
                  f"{r['down_us']:.1f} (floor {r['floor_down_us']:.1f}) | reduce {r['reduce_us']:.1f}")
    if result.get("launch_overhead"):
        print(f"  one-kernel graph node: {result['launch_overhead']}")
    if result.get("moe_shared_tail"):
        print(f"\n== MoE layer tail (router + route + experts + shared + residual/norm), zipf, graph median us; "
              f"fused up to SHARED_FUSE_MAX_N={result['moe_shared_tail']['shared_fuse_max_n']} in the model ==")
        print(f"{'N':>4} {'exp':>4} {'today':>7} {'fused':>7} {'saved':>6} {'moe':>7} {'moe+sh':>7} {'rel_err':>9} "
              f"{'max_err':>9} {'ids=':>5}")
        for r in result["moe_shared_tail"]["rows"]:
            print(f"{r['N']:>4} {r['experts']:>4} {r['today_us']:7.1f} {r['fused_us']:7.1f} {r['saved_us']:6.1f} "
                  f"{r['moe_kernels_us']:7.1f} {r['moe_kernels_shared_us']:7.1f} {r['rel_err']:9.2e} "
                  f"{r['max_abs_rel_err']:9.2e} {str(r['routing_equal']):>5}")
    if result["errors"]:
        print("ERRORS in sections:", list(result["errors"]))
    print(f"json: {out_json}  total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
