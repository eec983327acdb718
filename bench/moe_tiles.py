"""Tile configurations of the fused MoE at few tokens (issue 6: <= 1.5x floor for N <= 64; N=1 was 2.1x, zipf N=4
1.6x), one command on the H200:
    PYTHONPATH=. python bench/moe_tiles.py --out $OUT
For N in 1, 4, 16 (Zipf routing, Qwen3.6-35B-A3B shapes, CUDA-graph medians cycling four weight sets as
bench/kernels_moe_attn.py does) it times fused_moe_triton with the default tiles and with each candidate gate/up
and down tile (BLOCK_N, BLOCK_K, warps, stages), checks each against fused_moe_ref, and writes
`$OUT/moe_tiles.json`: per N and config the time, its ratio to the floor and the max error. The default tiles were
chosen by a sweep dominated by N >= 16; at one token a layer's gate/up ran 128-144 programs of 128-256 KB each (59% of
bandwidth) and its down 45% (bench/NOTES_moe_attn.md).
`--tiny` checks every candidate on CPU under TRITON_INTERPRET=1 at tiny shapes (a config that cannot compile or
computes wrong fails there, not on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates for block_m 16 (N*k/E <= 8: every N here)
GATE_UP = [(16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3), (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
           (16, 128, 2, 4), (32, 128, 2, 4)]
DOWN = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4), (32, 256, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4)]
SIZES = (1, 4, 16)


def candidates() -> list[tuple[str, dict | None]]:
    """(label, fused_moe_triton config or None for the defaults)."""
    out: list[tuple[str, dict | None]] = [("default", None)]
    out += [(f"gate_up={c}", {"gate_up": c}) for c in GATE_UP]
    out += [(f"down={c}", {"down": c}) for c in DOWN]
    return out


def tiny() -> dict:
    """Every candidate against the reference on CPU (TRITON_INTERPRET=1, fp32, E=8, H=64, I=32)."""
    import torch

    from kernels.moe import fused_moe_ref
    from kernels.moe_triton import fused_moe_triton

    gen = torch.Generator().manual_seed(0)
    e, h, i, k = 8, 64, 32, 2
    w_gu = torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5
    w_dn = torch.randn(e, h, i, generator=gen) * i ** -0.5
    errors = {}
    for n in (1, 4):
        x = torch.randn(n, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        w = torch.softmax(torch.randn(n, k, generator=gen), dim=-1)
        ref = fused_moe_ref(x, w_gu, w_dn, w, ids)
        for label, cfg in candidates():
            got = fused_moe_triton(x, w_gu, w_dn, w, ids, None, cfg)
            errors[f"N={n} {label}"] = float((got - ref).abs().max())
    return errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU check of every candidate (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        errors = tiny()
        worst = max(errors.values())
        print(f"{len(errors)} checks, max error {worst:.2e}")
        (out / "moe_tiles.json").write_text(json.dumps({"tiny_errors": errors}, indent=1))
        if worst > 1e-3:
            raise SystemExit(f"a candidate disagrees with fused_moe_ref: {worst:.2e}")
        return

    import torch

    from bench.kernels_moe_attn import DEV, DT, E, HID, TOPK, MoeWeights, make_routing, moe_time
    from kernels.moe import fused_moe_ref
    from kernels.moe_triton import fused_moe_triton

    torch.manual_seed(0)
    wts = MoeWeights(layers=4)
    rows = []
    for n in SIZES:
        _, w, ids = make_routing(n, "zipf", 1)
        x = torch.randn(n, HID, device=DEV, dtype=DT)
        ref = fused_moe_ref(x.float(), wts.gu[0].float(), wts.dn[0].float(), w.float(), ids)
        for label, cfg in candidates():
            err = float((fused_moe_triton(x, wts.gu[0], wts.dn[0], w, ids, None, cfg).float() - ref).abs().max())
            r = moe_time(wts, n, "zipf", cfg)
            rows.append({"N": n, "config": label, "us": r["triton_us"], "x_floor": r["x_floor"],
                         "floor_us": r["floor_us"], "max_err": err})
            print(f"N={n:3d} {label:32s} {r['triton_us']:7.1f} us ({r['x_floor']:.2f}x floor) err {err:.1e}",
                  flush=True)
    best = {}
    for n in SIZES:
        mine = [r for r in rows if r["N"] == n]
        default = next(r for r in mine if r["config"] == "default")
        top = min(mine, key=lambda r: r["us"])
        best[n] = {"default_us": default["us"], "best": top["config"], "best_us": top["us"]}
        print(f"N={n}: default {default['us']:.1f} us, best {top['config']} {top['us']:.1f} us")
    commit = os.environ.get("HYBRIDSPEC_COMMIT", "unknown")
    (out / "moe_tiles.json").write_text(json.dumps(
        {"commit": commit, "device": torch.cuda.get_device_name(0), "shape": {"E": E, "top_k": TOPK, "H": HID},
         "rows": rows, "best": best}, indent=1))


if __name__ == "__main__":
    main()
