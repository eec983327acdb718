"""A GDN layer's plain decode: the four-kernel chain vs the fused kernel (kernels/gdn_decode_triton.py).

    PYTHONPATH=. python bench/kernels_gdn_decode.py [--out bench/out/kernels_gdn_decode.json] [--batches 1,4,16,64]
    PYTHONPATH=. python bench/kernels_gdn_decode.py --tiny     (CPU, TRITON_INTERPRET=1, tiny shapes: the script runs)

Qwen3.6-35B-A3B GDN shapes: HK=16, HV=32, DK=DV=128, conv_dim 8192, conv kernel 4; bf16 activations, fp32 state
pool. Per batch size B, every variant runs inside one CUDA graph of LAYERS launches (sequences), each on its own
layer: its own state pool, conv windows, conv/norm weights and in_proj row (30 x B x 2 MiB of state, several times
the 50 MB L2), timed by triton.testing.do_bench on the graph (median, L2 flushed before each replay), divided by
LAYERS: us per layer.
    chain      what GatedDeltaNet.forward ran before: causal_conv1d + gdn_gates + gdn (seq kernel) + gated_rmsnorm
    fused_*    gdn_decode_triton: auto (the default), every value tile BV (128 = the norm in the program; < 128 =
               the last program of a key head normalises), `_sep` = the norm as its own launch, `_w` warps
    graph      the call a captured decode step makes: auto with a [B] write mask and the commit's block inputs kept
Errors: each variant vs the chain, bf16, from the same pools: o (max abs, and relative to max |o|), the states
after the step (max abs), the conv windows (elements that differ). Floor: the state read + write, the conv
windows, the in_proj row, o and the layer's small weights at BW.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# the repository root first (run as a script, bench/ is sys.path[0]): the packages are the repository's, with or
# without PYTHONPATH (tests/test_bench_scripts.py checks every script)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = "--tiny" in sys.argv
if TINY:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu_timing import graph_time  # noqa: E402
from kernels import gdn_decode_triton as gdt  # noqa: E402
from kernels.conv_triton import causal_conv1d_triton  # noqa: E402
from kernels.elementwise_triton import gdn_gates_triton  # noqa: E402
from kernels.gdn_triton import gdn_triton  # noqa: E402
from kernels.norm_triton import gated_rmsnorm_triton  # noqa: E402

BW = 4.3e12  # bytes/s, the H200's measured copy bandwidth (as bench/kernels_gdn.py)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


class Shapes:
    def __init__(self, tiny: bool):
        self.hk, self.hv, self.dk, self.dv, self.k = (2, 4, 16, 16, 4) if tiny else (16, 32, 128, 128, 4)
        self.c = 2 * self.hk * self.dk + self.hv * self.dv
        self.dev = "cpu" if tiny else "cuda"
        self.dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter computes bf16 wrongly


def make_layer(sh: Shapes, bsz: int, seed: int) -> dict:
    """One layer's tensors: a fused in_proj row per request (conv input | z | b | a | 4 padding columns, as
    FusedLinears gives them), weights, pools of B + 1 slots (the last one spare), slots in reverse order."""
    gen = torch.Generator(device=sh.dev).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, device=sh.dev)

    width = sh.c + sh.hv * sh.dv + 2 * sh.hv
    proj = randn(bsz, width + 4).to(sh.dtype)
    x, z, b, a = torch.split(proj[:, :width], [sh.c, sh.hv * sh.dv, sh.hv, sh.hv], dim=-1)
    return dict(
        x=x, z=z, a=a, b=b, weight=randn(sh.c, 1, sh.k, scale=0.5).to(sh.dtype)[:, 0, :],
        neg_a=-randn(sh.hv, scale=0.5).exp(), dt_bias=randn(sh.hv).to(sh.dtype),
        norm_w=(1 + 0.2 * randn(sh.dv)).to(sh.dtype), conv_state=randn(bsz + 1, sh.c, sh.k - 1).to(sh.dtype),
        state=randn(bsz + 1, sh.hv, sh.dk, sh.dv, scale=0.1),
        slots=torch.arange(bsz - 1, -1, -1, device=sh.dev),
        cu=torch.arange(bsz + 1, dtype=torch.int32, device=sh.dev),
        mask=torch.ones(bsz, dtype=torch.bool, device=sh.dev))


def chain(sh: Shapes, L: dict, eps: float = 1e-6):
    n = L["x"].shape[0]
    mixed = causal_conv1d_triton(L["x"], L["weight"], L["cu"], L["conv_state"], L["slots"], 1, True)
    q, k, v = torch.split(mixed, [sh.hk * sh.dk, sh.hk * sh.dk, sh.hv * sh.dv], dim=-1)
    g, beta = gdn_gates_triton(L["a"], L["b"], L["neg_a"], L["dt_bias"])
    o = gdn_triton(q.reshape(n, sh.hk, sh.dk), k.reshape(n, sh.hk, sh.dk), v.reshape(n, sh.hv, sh.dv), g, beta,
                   L["cu"], L["state"], L["slots"], 1, write_state=True)
    return gated_rmsnorm_triton(o, L["z"].view(n, sh.hv, sh.dv), L["norm_w"], eps).reshape(n, -1)


def chain_parts(sh: Shapes, L: dict, eps: float = 1e-6) -> dict:
    """The chain's four kernels one at a time (inputs made once, outside the timed graph)."""
    n = L["x"].shape[0]
    mixed = causal_conv1d_triton(L["x"], L["weight"], L["cu"], L["conv_state"].clone(), L["slots"], 1, True)
    q, k, v = torch.split(mixed, [sh.hk * sh.dk, sh.hk * sh.dk, sh.hv * sh.dv], dim=-1)
    q, k, v = q.reshape(n, sh.hk, sh.dk), k.reshape(n, sh.hk, sh.dk), v.reshape(n, sh.hv, sh.dv)
    g, beta = gdn_gates_triton(L["a"], L["b"], L["neg_a"], L["dt_bias"])
    o = torch.zeros(n, sh.hv, sh.dv, dtype=sh.dtype, device=sh.dev)
    return {
        "conv": lambda: causal_conv1d_triton(L["x"], L["weight"], L["cu"], L["conv_state"], L["slots"], 1, True),
        "gates": lambda: gdn_gates_triton(L["a"], L["b"], L["neg_a"], L["dt_bias"]),
        "gdn": lambda: gdn_triton(q, k, v, g, beta, L["cu"], L["state"], L["slots"], 1, write_state=True),
        "norm": lambda: gated_rmsnorm_triton(o, L["z"].view(n, sh.hv, sh.dv), L["norm_w"], eps),
    }


def fused(L: dict, eps: float = 1e-6, graph: bool = False, **kw):
    return gdt.gdn_decode_triton(L["x"], L["z"], L["a"], L["b"], L["weight"], L["neg_a"], L["dt_bias"], L["norm_w"],
                                 eps, L["cu"], L["conv_state"], L["state"], L["slots"],
                                 write_state=L["mask"] if graph else True, keep_inputs=graph, **kw)


def variants(sh: Shapes) -> dict:
    dv = sh.dv
    out = {"fused_auto": {}, "graph": dict(graph=True)}
    for bv in (dv, dv // 2, dv // 4, dv // 8):
        out[f"fused_bv{bv}"] = dict(bv=bv)
    out[f"fused_bv{dv}_w8"] = dict(bv=dv, num_warps=8)
    out[f"fused_bv{dv // 4}_w2"] = dict(bv=dv // 4, num_warps=2)
    out[f"fused_bv{dv}_sep"] = dict(bv=dv, norm="separate")
    out[f"fused_bv{dv // 4}_sep"] = dict(bv=dv // 4, norm="separate")
    return out


def graph_us(calls: list, tiny: bool) -> float:
    """us per call: one CUDA graph of all the calls (each on its own layer; bench.gpu_timing.graph_time)."""
    if tiny:  # the interpreter: one pass, to run the script (times mean nothing)
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    return graph_time(calls)


def errors(sh: Shapes, L: dict, kw: dict) -> dict:
    """A variant vs the chain from the same pools (copies): o, state, conv windows."""
    ref = dict(L, state=L["state"].clone(), conv_state=L["conv_state"].clone())
    mine = dict(L, state=L["state"].clone(), conv_state=L["conv_state"].clone())
    o_ref = chain(sh, ref)
    o = fused(mine, **kw)
    o = o[0] if isinstance(o, tuple) else o
    d = (o.float() - o_ref.float()).abs()
    return {"o_max_abs": float(d.max()), "o_max_rel": float(d.max() / o_ref.float().abs().max()),
            "state_max_abs": float((mine["state"] - ref["state"]).abs().max()),
            "conv_state_diff": int((mine["conv_state"] != ref["conv_state"]).sum())}


def floor_us(sh: Shapes, bsz: int) -> float:
    e = 2 if sh.dtype == torch.bfloat16 else 4
    state = 2 * bsz * sh.hv * sh.dk * sh.dv * 4
    rows = bsz * (sh.c + 2 * sh.hv * sh.dv + 2 * sh.hv) * e + 2 * bsz * sh.c * (sh.k - 1) * e
    weights = (sh.c * sh.k + 2 * sh.hv + sh.dv) * e + sh.hv * 4
    return (state + rows + weights) / BW * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out/kernels_gdn_decode.json")
    ap.add_argument("--batches", default="1,3" if TINY else "1,4,16,64")
    ap.add_argument("--layers", type=int, default=2 if TINY else 30)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    sh = Shapes(TINY)
    res = {"gpu": "cpu (interpreter)" if TINY else torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "commit": os.environ.get("HYBRIDSPEC_COMMIT", "unknown"),
           "shapes": dict(HK=sh.hk, HV=sh.hv, DK=sh.dk, DV=sh.dv, conv_dim=sh.c, layers=args.layers),
           "rows": []}
    names = list(variants(sh))
    for bsz in (int(b) for b in args.batches.split(",")):
        layers = [make_layer(sh, bsz, seed=1000 * bsz + i) for i in range(args.layers)]
        row = {"B": bsz, "floor_us": floor_us(sh, bsz), "auto_bv": gdt._auto_bv(bsz, sh.hv, sh.dv)}
        row["chain"] = graph_us([lambda L=L: chain(sh, L) for L in layers], TINY)
        parts = [chain_parts(sh, L) for L in layers]
        for part in ("conv", "gates", "gdn", "norm"):
            row[f"chain_{part}"] = graph_us([p[part] for p in parts], TINY)
        row["errors"] = {}
        for name, kw in variants(sh).items():
            try:
                row["errors"][name] = errors(sh, layers[0], kw)
                row[name] = graph_us([lambda L=L, kw=kw: fused(L, **kw) for L in layers], TINY)
            except Exception as exc:  # noqa: BLE001 - one failed variant must not lose the rest
                row[name] = float("nan")
                row["errors"][name] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
        row["counters_zero"] = all(not bool(c.any()) for c in gdt._COUNTERS.values())
        best = min((n for n in names if row[n] == row[n]), key=lambda n: row[n])
        row["best"], row["best_us"] = best, row[best]
        res["rows"].append(row)
        split = " + ".join("%.2f" % row["chain_" + p] for p in ("conv", "gates", "gdn", "norm"))
        log(f"B={bsz}: chain {row['chain']:.2f} us ({split}), auto {row['fused_auto']:.2f}, best {best} "
            f"{row['best_us']:.2f}, floor {row['floor_us']:.2f}")
        del layers, parts
        if not TINY:
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    short = [n.replace("fused_", "") for n in names]
    lines = [f"GDN decode layer on {res['gpu']}: us per layer ({args.layers} layers per CUDA graph); "
             f"errors vs the chain (bf16): o max rel / state max abs / conv windows differing",
             f"{'B':>3} {'floor':>6} {'chain':>6} " + " ".join(f"{s:>9}" for s in short) + "   best"]
    for r in res["rows"]:
        lines.append(f"{r['B']:>3} {r['floor_us']:6.2f} {r['chain']:6.2f} "
                     + " ".join(f"{r[n]:9.2f}" for n in names) + f"   {r['best']} ({r['chain'] / r['best_us']:.2f}x)")
    for r in res["rows"]:
        worst = max((e.get("o_max_rel", float("inf")) for e in r["errors"].values()), default=float("nan"))
        st = max((e.get("state_max_abs", float("inf")) for e in r["errors"].values()), default=float("nan"))
        cw = max((e.get("conv_state_diff", 1 << 30) for e in r["errors"].values()), default=0)
        failed = [n for n, e in r["errors"].items() if "failed" in e]
        lines.append(f"B={r['B']}: worst o rel {worst:.2e}, state abs {st:.2e}, conv windows differing {cw}, "
                     f"counters left zero {r['counters_zero']}" + (f", FAILED {failed}" if failed else ""))
    print("\n".join(lines), flush=True)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
