"""GDN verification (T <= 17 tokens a request, no state write) on the H200: the one-launch block kernel and the
sequential kernel (kernels/gdn_triton.py) against the factored kernel (kernels/gdn_verify_triton.py: o = q' S_0 + y,
one state product, two launches):
    PYTHONPATH=. python bench/gdn_verify2.py [--out DIR] [--tiny]   (writes DIR/gdn_verify2.json, DIR defaults to
                                                                     $OUT; prints a table last)

1. bf16 checks of every variant on a ragged batch (T_i in 0..17, permuted slots) against gdn_recurrent_ref; the
   state pool must stay untouched.
2. The factored kernel's variants (phase 2's value tile, its layout, warps of each phase, phase 1's precision) at
   SWEEP_POINTS; the one with the least summed time is the `factored` column below.
3. block / seq / factored at every (B, T) of POINTS (all B requests verify T tokens), against floor_r (the fp32
   states read once plus q/k/v/g/beta/o at 4.3 TB/s); the factored default also as a captured graph calls it
   (max_len 17, the bucket's largest block). The engine's verification steps pass a write mask (requests without
   drafts advance their states), which took the sequential kernel every time before: `seq` is what served
   verification ran. `auto in a graph` is _auto_impl's pick for such a call.

Issue 6's target: B=32, T=16 <= 60 us (block kernel 83 us, bench/NOTES_gdn.md). Same shapes, data, rotation of
state slots and CUDA-graph timing as bench/kernels_gdn.py. --tiny: a CPU-sized smoke run (tiny shapes, the
Triton interpreter where no GPU is present; checks only, no timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POINTS = [(b, t) for b in (1, 4, 8, 16, 32, 64) for t in (4, 8, 16, 17)]  # (fla where carried: .device/fla)
SWEEP_POINTS = [(1, 16), (8, 17), (32, 16), (64, 8), (16, 17)]
FACTORED = {  # the first is the kernel's default (kernels/gdn_verify_triton.py FACTORED_*)
    "f default": dict(),
    "f bv64 T": dict(bv=64, trans=True),
    "f bv64 N": dict(bv=64, trans=False),
    "f p4": dict(prep_warps=4),
    "f kc64": dict(kc=64),
    "f prep x3": dict(precision="tf32x3"),
    "f out x3": dict(precision_out="tf32x3"),
}
GRAPH_MAX_LEN = 17  # a captured verification graph's max_len (its bucket's largest block at max_verify_len 16)


def _variants(gt, fv):
    block = {"block": lambda a, t: gt.gdn_triton(*a, t, write_state=False, impl="block"),
             "seq": lambda a, t: gt.gdn_triton(*a, t, write_state=False, impl="seq")}
    fact = {name: (lambda kw: (lambda a, t: fv.gdn_verify_factored_triton(*a, t, **kw)))(kw)
            for name, kw in FACTORED.items()}
    # the default as a captured graph calls it: max_len the bucket's largest block, the blocks shorter
    block["f default @17"] = lambda a, t: fv.gdn_verify_factored_triton(*a, GRAPH_MAX_LEN)
    return block, fact


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, checks only")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    if args.tiny and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import bench.kernels_gdn as kg  # noqa: E402  (after TRITON_INTERPRET)
    from kernels import gdn_triton as gt  # noqa: E402
    from kernels import gdn_verify_triton as fv  # noqa: E402
    from kernels.gdn import gdn_recurrent_ref  # noqa: E402

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"commit": os.environ.get("HYBRIDSPEC_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "checks": {}, "sweep": {}, "rows": [], "errors": []}
    block, fact = _variants(gt, fv)
    everything = {**block, **fact}
    t0 = time.time()

    # 1. checks: a ragged batch with an idle request, permuted slots
    lens = [1, 5, 17, 16, 3, 0, 9, 12, 2] if not args.tiny else [1, 5, 0, 17]
    if args.tiny:  # tiny shapes (make_block / make_pool read these module globals at each call)
        kg.HK, kg.HV, kg.DK, kg.DV = 2, 4, 16, 32
        kg.CONV_DIM = 2 * kg.HK * kg.DK + kg.HV * kg.DV
        kg.DEV = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta, cu = kg.make_block(lens, 7)
    pool = kg.make_pool(40, 8)
    perm = torch.randperm(40, device=pool.device)[:len(lens)]
    o_ref = gdn_recurrent_ref(q, k, v, g, beta, cu, pool.clone(), perm, 17, write_state=False)
    for name, fn in everything.items():
        try:
            p = pool.clone()
            o = fn((q, k, v, g, beta, cu, p, perm), 17)
            res["checks"][name] = {"o_err": kg.rel(o, o_ref), "state_untouched": bool(torch.equal(p, pool))}
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            res["errors"].append(f"check {name}: {exc!r}"[:400])
    # the engine's verification steps pass a write mask (requests decoding without drafts advance their states)
    wm = torch.tensor([i % 3 == 0 for i in range(len(lens))], device=pool.device)
    s_ref = pool.clone()
    o_ref_m = gdn_recurrent_ref(q, k, v, g, beta, cu, s_ref, perm, 17, write_state=wm)
    for name, impl in (("seq", "seq"), (next(iter(fact)), "factored")):  # each at its defaults
        try:
            p = pool.clone()
            o = gt.gdn_triton(q, k, v, g, beta, cu, p, perm, 17, write_state=wm, impl=impl)
            others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
            others[perm[wm]] = False  # every slot but the masked requests' must stay as it was
            res["checks"][f"{name} mask"] = {"o_err": kg.rel(o, o_ref_m), "state_err": kg.srel(p, s_ref, perm),
                                             "state_untouched": bool(torch.equal(p[others], pool[others]))}
        except Exception as exc:  # noqa: BLE001
            res["errors"].append(f"check {name} mask: {exc!r}"[:400])
    print(f"[{time.time() - t0:6.1f}s] checks: " + ", ".join(
        f"{n} {c['o_err']:.1e}{'' if c['state_untouched'] else ' STATE WRITTEN'}" for n, c in res["checks"].items()),
        flush=True)
    if args.tiny:
        (out / "gdn_verify2.json").write_text(json.dumps(res, indent=1))
        return

    def timed(bsz, t, names):
        R, pool, slot_sets, blk = kg.setup(bsz, t)
        row = {}
        for name in names:
            try:
                if name == "fla":  # fla-core's fused_recurrent (writes the final state), where carried
                    row[name] = kg.graph_us(kg.verify_calls(bsz, t, {}, "fla_recurrent", pool, slot_sets, blk), R)
                    continue
                fn = everything[name]
                row[name] = kg.graph_us(lambda r: (lambda: fn((*blk, pool, slot_sets[r]), t)), R)
            except Exception as exc:  # noqa: BLE001
                res["errors"].append(f"B={bsz} T={t} {name}: {exc!r}"[:400])
        del pool
        return row

    # 2. the factored kernel's variants
    for bsz, t in SWEEP_POINTS:
        res["sweep"][f"{bsz}x{t}"] = row = timed(bsz, t, list(fact))
        print(f"[{time.time() - t0:6.1f}s] sweep B={bsz} T={t}: " + ", ".join(f"{n} {u:.1f}" for n, u in row.items()),
              flush=True)
    ok = [n for n in fact if n in res["checks"] and res["checks"][n]["o_err"] < 1e-2
          and res["checks"][n]["state_untouched"] and all(n in r for r in res["sweep"].values())]
    best = min(ok, key=lambda n: sum(r[n] for r in res["sweep"].values())) if ok else None
    res["best_factored"] = best

    # 3. the table
    names = ["block", "seq", "f default @17"] + ([best] if best else []) + (["fla"] if kg.HAVE_FLA else [])
    for bsz, t in POINTS:
        row = {"B": bsz, "T": t, **kg.floors_us(bsz * t, bsz), **timed(bsz, t, names)}
        res["rows"].append(row)
    (out / "gdn_verify2.json").write_text(json.dumps(res, indent=1))
    for e in res["errors"]:
        print("error:", e)
    print(f"best factored variant: {best} ({FACTORED.get(best)})")
    print("| B | T | floor_r | block | seq (served before) | factored, best | factored default, max_len 17 "
          "(as in graphs) | that / seq | auto in a graph | fla fused_recurrent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        f = r.get(best, float("nan")) if best else float("nan")
        sq, g17 = r.get("seq", float("nan")), r.get("f default @17", float("nan"))
        auto = gt._auto_impl(r["B"], GRAPH_MAX_LEN, torch.zeros(r["B"], dtype=torch.bool), r["B"] * r["T"])
        print(f"| {r['B']} | {r['T']} | {r['floor_r_us']:.1f} | {r.get('block', float('nan')):.1f} | {sq:.1f} | "
              f"{f:.1f} | {g17:.1f} | {g17 / sq:.2f} | {auto} | {r.get('fla', float('nan')):.1f} |")


if __name__ == "__main__":
    main()
