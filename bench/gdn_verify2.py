"""GDN verification (T <= 17 tokens a request, no state write) in one launch against the two-phase kernel, on the H200:
    PYTHONPATH=. python bench/gdn_verify2.py          (writes $OUT/gdn_verify2.json, prints a table)

The one-launch block kernel (kernels/gdn_triton.py, `_gdn_fwd_kernel`) recomputes each request's S-independent
[T, T] work (k k^T, the UT system's inverse, the masked q k^T) in every value tile's program; the two-phase kernel
(kernels/gdn_chunk_triton.py) computes it once per (request, head) and then runs the state products per value tile,
at the price of a second launch and a round trip through fp32 scratch. Issue 6's target: B=32, T=16 <= 60 us
(the block kernel: 83 us, bench/NOTES_gdn.md). Same shapes, data, rotation of state slots and CUDA-graph timing as
bench/kernels_gdn.py; every variant is checked in bf16 against gdn_recurrent_ref first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.kernels_gdn as kg  # noqa: E402
from kernels import gdn_triton as gt  # noqa: E402
from kernels.gdn import gdn_recurrent_ref  # noqa: E402
from kernels.gdn_chunk_triton import gdn_chunk2_triton  # noqa: E402

POINTS = [(8, 16), (32, 8), (32, 16), (32, 17), (64, 16)]
VARIANTS = {
    "block bv64": lambda a, t: gt.gdn_triton(*a, t, write_state=False, impl="block", bv=64, num_warps=4),
    "auto": lambda a, t: gt.gdn_triton(*a, t, write_state=False),
    "2p bt16 bv32": lambda a, t: gdn_chunk2_triton(*a, t, write_state=False, bt=16, bv=32),
    "2p bt16 bv64": lambda a, t: gdn_chunk2_triton(*a, t, write_state=False, bt=16, bv=64),
    "2p bt32 bv32": lambda a, t: gdn_chunk2_triton(*a, t, write_state=False, bt=32, bv=32),
    "2p bt32 bv64": lambda a, t: gdn_chunk2_triton(*a, t, write_state=False, bt=32, bv=64),
}


def main() -> None:
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    res = {"commit": os.environ.get("HYBRIDSPEC_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "rows": [], "errors": []}
    t0 = time.time()
    for bsz, t in POINTS:
        R, pool, slot_sets, blk = kg.setup(bsz, t)
        q, k, v, g, beta, cu = blk
        sl = slot_sets[0]
        o_ref = gdn_recurrent_ref(q, k, v, g, beta, cu, pool.clone(), sl, t, write_state=False)
        row = {"B": bsz, "T": t, **kg.floors_us(bsz * t, bsz)}
        for name, fn in VARIANTS.items():
            try:
                p = pool.clone()
                o = fn((q, k, v, g, beta, cu, p, sl), t)
                err = kg.rel(o, o_ref)
                untouched = torch.equal(p, pool)
                us = kg.graph_us(lambda r: (lambda: fn((q, k, v, g, beta, cu, pool, slot_sets[r]), t)), R)
                row[name] = {"us": us, "o_err": err, "state_untouched": untouched}
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
                res["errors"].append(f"B={bsz} T={t} {name}: {exc!r}"[:400])
        res["rows"].append(row)
        print(f"[{time.time() - t0:6.1f}s] B={bsz} T={t} floor_r {row['floor_r_us']:.1f} us: " + ", ".join(
            f"{n} {v['us']:.1f} (err {v['o_err']:.1e}{'' if v['state_untouched'] else ', STATE WRITTEN'})"
            for n, v in row.items() if isinstance(v, dict)), flush=True)
    (out / "gdn_verify2.json").write_text(json.dumps(res, indent=1))
    for e in res["errors"]:
        print("error:", e)


if __name__ == "__main__":
    main()
