"""Where the host time of a speculative step goes, per policy (issue 7), one command on the H200:
    PYTHONPATH=. python bench/host_profile.py --layers 40 --concurrency 64 --acceptance 0.85 --out $OUT
Serves one e2e cell (bench/e2e.py's loop: scheduler + ModelRunner, replay drafter with the DFlash-shaped cost,
CUDA graphs, the start-up profile and a warm-up run first) once per policy under cProfile, and writes per policy
the median step ms, the mean ms per step of the runner's parts (drafting, planning, the forward, acceptance,
commit, the policy's learning) and the top functions by cumulative time to `$OUT/host_profile.json` / `.txt`.
Made to find why hybridspec's whole step was ~4 ms longer than budget's beyond equal forwards at c=64
(bench/NOTES.md, 2026-11-30). `--tiny` runs the plumbing on CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cell import build_cell  # noqa: E402
from bench.e2e import git_commit  # noqa: E402

# the runner's parts: (label, the function's file suffix and name as pstats keys them)
PARTS = (("execute (whole step)", "workers/runner.py", "execute"),
         ("draft: propose", "workers/drafters.py", "propose"),
         ("draft: cost forward", "workers/drafters.py", "spend_forward"),
         ("draft: commit", "workers/drafters.py", "commit"),
         ("gate: should_draft", "workers/policy.py", "should_draft"),
         ("plan: lengths", "workers/policy.py", "lengths"),
         ("plan: extra_tokens", "workers/policy.py", "extra_tokens"),
         ("forward: graphs.run (target + drafter cost)", "workers/graphs.py", "run"),
         ("accept", "workers/acceptance.py", "accept"),
         ("commit: graphs.commit", "workers/graphs.py", "commit"),
         ("learn: policy.observe", "workers/policy.py", "observe"),
         ("learn: observe_outcome", "workers/policy.py", "observe_outcome"),
         ("learn: observe_cycle (the gate)", "workers/policy.py", "observe_cycle"),
         ("sync: tolist (waits for the GPU)", "~", "<method 'tolist' of 'torch._C.TensorBase' objects>"),
         ("sync: event synchronize", "~", "<method 'synchronize' of 'torch._C._CudaEventBase' objects>"))


def part_ms(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Cumulative ms per step of each PARTS entry (summed over same-named functions of that file)."""
    out = {}
    for label, path, name in PARTS:
        total = sum(v[3] for (f, _, fn), v in stats.stats.items() if f.endswith(path) and fn == name)
        out[label] = total * 1e3 / max(1, steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--acceptance", type=float, default=0.85)
    ap.add_argument("--policies", default="budget,hybridspec")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cell = build_cell(args.layers, args.tiny, args.concurrency, args.prompt_len, args.max_new)
    device, conc, ar = cell.device, args.concurrency, cell.ar
    report, text = {"commit": git_commit(), "device": device, "concurrency": conc, "acceptance": args.acceptance,
                    "policies": {}}, []
    for policy in args.policies.split(","):
        k = cell.use_policy(policy, args.acceptance)
        cell.serve(policy, 32, k)  # warm-up
        plain = cell.serve(policy, args.max_new, k)
        prof = cProfile.Profile()
        prof.enable()
        res = cell.serve(policy, args.max_new, k)
        prof.disable()
        stats = pstats.Stats(prof)
        parts = part_ms(stats, res.steps)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
        report["policies"][policy] = {"steps": res.steps, "step_ms_median": statistics.median(res.step_ms),
                                      "step_ms_median_unprofiled": statistics.median(plain.step_ms),
                                      "step_ms_mean_unprofiled": statistics.fmean(plain.step_ms),
                                      "parts_ms_per_step": parts, "tokens_match_ar": res.tokens == ar.tokens}
        text.append(f"== {policy}: {res.steps} steps, median step {statistics.median(res.step_ms):.2f} ms "
                    f"under cProfile, {statistics.median(plain.step_ms):.2f} ms without "
                    f"(mean {statistics.fmean(plain.step_ms):.2f}); bench/step_timeline.py: GPU vs host")
        text.extend(f"   {ms:8.2f} ms/step  {label}" for label, ms in parts.items())
        text.append(buf.getvalue())
        print("\n".join(text[-len(parts) - 2:-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_profile.json").write_text(json.dumps(report, indent=1))
    (out / "host_profile.txt").write_text("\n".join(text))


if __name__ == "__main__":
    main()
