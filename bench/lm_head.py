"""The LM head's fp32 logits (issue 6), one command on the H200:
    PYTHONPATH=. python bench/lm_head.py [--out $OUT]
HybridModel.logits in bf16 returns fp32 logits in which greedy decoding cannot depend on a kernel's tie-break. It
used to take the bf16 GEMM, a copy to fp32, a top-4 over the vocabulary (radix select: ~6 kernels), a gather of
those 4 weight rows and an fp32 recompute scattered back; with LM_HEAD_FP32_OUT the GEMM itself writes fp32
(torch.mm(..., out_dtype=torch.float32): fp32 sums of the exact bf16 products). At the bench model's LM head
(vocab 248,320 x hidden 2048, bf16) and M = 1, 4, 16, 64 rows of random final-norm outputs this checks, per row,
that both give the exact argmax (of the float64 sums) and how far the new logits are from those sums (relative to
the row's largest logit; the old path's are exact only at its recomputed candidates: the rest keep bf16 rounding),
then times both in CUDA graphs of 8 calls (the weight is 1 GB: no L2 reuse between calls). Writes
`lm_head.json` and prints the table. `--tiny` runs the old path's check on CPU (bf16, a small vocabulary; the fp32
GEMM output exists on CUDA only) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    args = ap.parse_args()
    import torch

    from workers.model import HybridModel

    dev = "cpu" if args.tiny else "cuda"
    vocab, hidden = (1000, 64) if args.tiny else (248320, 2048)

    class Head:  # HybridModel.logits on a bare LM head (the rest of the model plays no part)
        LM_HEAD_FP32_OUT = True
        logits = HybridModel.logits

        def __init__(self):
            g = torch.Generator(device=dev).manual_seed(0)
            self.weight = (torch.randn(vocab, hidden, device=dev, generator=g) * hidden ** -0.5).bfloat16()

        def lm_head_weight(self):
            return self.weight

    head = Head()
    rows = []
    for m in ((1, 3) if args.tiny else (1, 4, 16, 64)):
        hs = [torch.randn(m, hidden, device=dev).bfloat16() for _ in range(8)]
        outs = {}
        for fp32_out in ((False,) if args.tiny else (False, True)):
            head.LM_HEAD_FP32_OUT = fp32_out
            outs[fp32_out] = head.logits(hs[0])
        old = outs[False]
        ref = hs[0].double() @ head.weight.double().t()  # [M, V] exact sums of the bf16 products
        top1 = old.argmax(-1, keepdim=True)  # [M, 1]
        row = {"M": m, "old_argmax_is_exact": bool(torch.equal(top1[:, 0], ref.argmax(-1)))}
        if not args.tiny:
            new = outs[True]
            scale = ref.abs().amax(-1, keepdim=True)
            row.update(
                same_argmax=bool(torch.equal(new.argmax(-1), old.argmax(-1))),
                new_argmax_is_exact=bool(torch.equal(new.argmax(-1), ref.argmax(-1))),
                rel_diff_at_argmax=float(((new.gather(1, top1) - old.gather(1, top1)).double().abs() / scale).max()),
                new_max_rel_err=float(((new.double() - ref).abs() / scale).max()),
                dtype=str(new.dtype))
            from bench.gpu_timing import graph_time
            for fp32_out in (False, True):
                head.LM_HEAD_FP32_OUT = fp32_out
                row["fp32_out_us" if fp32_out else "old_us"] = graph_time([lambda h=h: head.logits(h) for h in hs])
        rows.append(row)
        print(json.dumps(row), flush=True)
    bad = [r for r in rows if not r["old_argmax_is_exact"] or (not args.tiny and not (
        r["same_argmax"] and r["new_argmax_is_exact"] and r["new_max_rel_err"] < 1e-5))]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lm_head.json").write_text(json.dumps({"rows": rows, "bad": bad}, indent=1))
    if not args.tiny:
        print(f"\n{'M':>3} {'old us':>8} {'fp32 out us':>11}  same argmax  new rel err")
        for r in rows:
            print(f"{r['M']:>3} {r['old_us']:8.1f} {r['fp32_out_us']:11.1f}  {str(r['same_argmax']):>11}  "
                  f"{r['new_max_rel_err']:.1e}")
    if bad:
        raise SystemExit(f"the two paths disagree: {bad}")


if __name__ == "__main__":
    main()
