"""How well the acceptance calibrator (scheduler/calibration.py) knows a plan's expected tokens, by its prior:
"pooled" (each position's map shrunk towards the map of all positions together) against "identity" (towards the
raw confidence). CPU only, seconds:
    PYTHONPATH=. python bench/calibration_prior.py [--steps 190] [--seeds 12] [--out DIR]

A c=1 replay-like stream: each step verifies L=14 drafts (the calibrator observes the drafts up to the first
rejection), for `steps` steps; then the expected output tokens of a 16-draft plan (1 + sum of survivals) from
the calibrated acceptances is compared with the truth on fresh drafts: the bias (mean log ratio, %) and its rms.
Drafters: "noise" (every draft right with p, confidence p + N(0, 0.1): e2e's replay drafter), "beta" (p ~ Beta,
confidence p + noise: informative), "decay" (p falls 1.5 points a position), "overconf" (informative but
over-confident: confidence 0.5 + p / 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.calibration import CALIBRATION_PRIORS, AcceptanceCalibrator  # noqa: E402

KINDS = ("noise", "beta", "decay", "overconf")


def draws(kind: str, rng: np.random.Generator, p: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(true acceptance [n], confidence [n]) of n drafts at positions 0..n-1."""
    if kind == "noise":
        acc = np.full(n, p)
        conf = p + rng.normal(0.0, 0.1, n)
    elif kind == "beta":
        acc = rng.beta(p * 2.0, (1.0 - p) * 2.0, n)
        conf = acc + rng.normal(0.0, 0.1, n)
    elif kind == "decay":
        acc = np.clip(p - 0.015 * np.arange(n), 0.0, 1.0)
        conf = p + rng.normal(0.0, 0.1, n)
    elif kind == "overconf":
        acc = rng.beta(p * 2.0, (1.0 - p) * 2.0, n)
        conf = 0.5 + 0.5 * acc + rng.normal(0.0, 0.05, n)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return acc, np.clip(conf, 0.0, 1.0)


def run(kind: str, p: float, prior: str, seed: int, steps: int, verify: int = 14, plan: int = 16,
        evals: int = 300) -> tuple[float, float]:
    """(bias, rms) of log(estimated / true expected tokens) of `plan`-draft plans after `steps` observed steps."""
    rng = np.random.default_rng(seed)
    cal = AcceptanceCalibrator(max_positions=17, prior=prior)
    for _ in range(steps):
        acc, conf = draws(kind, rng, p, verify)
        right = rng.random(verify) < acc
        accepted = verify if right.all() else int(np.argmin(right))
        cal.observe_step("d", [(conf.tolist(), verify, accepted)])
    errs = []
    for _ in range(evals):
        acc, conf = draws(kind, rng, p, plan)
        est = cal.calibrate_array("d", conf[None, :])[0]
        errs.append(np.log((1.0 + np.cumprod(est).sum()) / (1.0 + np.cumprod(acc).sum())))
    e = np.array(errs)
    return float(e.mean()), float(np.sqrt((e ** 2).mean()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=190)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--acceptance", default="0.7,0.85,0.95")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for kind in args.kinds.split(","):
        for p in (float(x) for x in args.acceptance.split(",")):
            row = {"kind": kind, "acceptance": p}
            for prior in CALIBRATION_PRIORS:
                r = np.array([run(kind, p, prior, seed, args.steps) for seed in range(args.seeds)])
                row[prior] = {"bias_pct": 100 * r[:, 0].mean(), "rms_pct": 100 * np.sqrt((r[:, 1] ** 2).mean())}
            rows.append(row)
            print(f"{kind:8s} {p:.2f}: " + " | ".join(
                f"{prior} bias {row[prior]['bias_pct']:+5.1f}% rms {row[prior]['rms_pct']:4.1f}%"
                for prior in CALIBRATION_PRIORS), flush=True)
    result = {"steps": args.steps, "seeds": args.seeds, "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration_prior.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
