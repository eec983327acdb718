"""How much any choice of verification lengths can gain at concurrency 1, given the measured step times.
CPU only, seconds:
    PYTHONPATH=. python bench/length_bound.py --from-e2e bench/results/e2e_c1_beta_ablation_h100_5d8ded4.json
    PYTHONPATH=. python bench/length_bound.py --curve 1:2.8,5:6.11,9:6.9,17:7.3 [--acceptance 0.7,0.85]

At c=1 a step that verifies n = L + 1 tokens takes T(n) ms (n = 1: a plain decode step) and yields the accepted
drafts + 1 tokens. The curve T comes from an e2e JSON (its c=1 rows' `step_ms_by_tokens`, the steps' median at
each token count, weighted over rows with >= 20 steps there: T(1) from ar's rows, T(n >= 2) from the fixed-length
policies' rows, whose steps carry no planning; with --rows all, the token counts those lack from the other
policies' rows, whose steps include their planning) or from --curve, and is interpolated linearly in n.

The replay drafter's model (workers/drafters.py): draft j is right with probability p_j, independently, and the
step keeps drafts up to the first wrong one. noise: p_j = acceptance; beta: p_j ~ Beta(acceptance * c,
(1 - acceptance) * c). Each step starts at fresh positions (a wrong draft's position gets the target's token), so
steps are independent draws and the long-run rate of a length rule is E[tokens] / E[ms] (renewal reward). Rules:
- fixedK: L = K every step (K = 0: ar; best fixed: the best K of 0..16);
The adaptive rules below see a step's drafts only once it has drafted, so they choose L >= 1 (a drafted step
verifying none would still pay the drafting, which the curve does not separate) and the better of that and ar is
reported (no mix of plain and drafted steps beats both):
- oracle: knows every p_j of the step and picks L maximizing E[tokens | p] - rate * T(L + 1), at the rate that
  this rule itself reaches (Dinkelbach's iteration): the best any rule can do that sees no outcome ahead;
- rate: the same rule on the drafter's confidences (p_j + N(0, noise), clipped) as an ideally calibrated planner
  sees them (E[p | confidence], binned on the same draws): hybridspec-rate's objective (planner.check_rate);
- ratio: each step's own ratio E[tokens] / T(L + 1) maximized on the same calibrated confidences: budget's
  and hybridspec's objective.
The table gives each rule's tokens/ms relative to ar (1 / T(1)), the mean L of the adaptive rules (0: ar was
better), and oracle / best fixed, oracle / fixed16, rate / fixed16, rate / ratio.
What bounds what: the oracle bounds every rule that decides a step's lengths from that step's drafts, under the
replay drafter's draws="stream" (each draft's p drawn afresh). With draws="common" (e2e's default) a position keeps
its p across steps: a rule that stops before a weak position has the target fill it (the bonus token), and its next
step's positions are those a long-sighted choice saw ahead, so steps are not independent there; the numbers are
then the one-step model's, not a strict bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.planner import survival_from_acceptance  # noqa: E402

MAX_DRAFTS = 16


def curve_from_e2e(rows: list[dict], fill_from_all: bool = False) -> dict[int, float]:
    """{tokens per step: median step ms} of the c=1 rows (each token count's medians weighted by their steps):
    n = 1 from ar's rows, n >= 2 from fixedK rows (steps without planning); fill_from_all: the counts >= 2 those
    lack from the other policies' rows too. Raises ValueError naming what is missing or malformed."""
    acc: dict[int, list[tuple[int, float]]] = {}
    extra: dict[int, list[tuple[int, float]]] = {}
    if not isinstance(rows, list):
        raise ValueError(f"--from-e2e: 'rows' must be a list of result rows, got {type(rows).__name__}")
    for r in rows:
        if not isinstance(r, dict) or r.get("concurrency") != 1:
            continue
        policy = str(r.get("policy", ""))
        planned = policy != "ar" and not policy.startswith("fixed")
        if planned and not fill_from_all:
            continue
        by_tokens = r.get("step_ms_by_tokens") or {}
        try:
            points = [(int(n), int(v[0]), float(v[1])) for n, v in by_tokens.items()]
        except (TypeError, ValueError, IndexError, AttributeError):
            raise ValueError(f"--from-e2e: row {policy!r}: step_ms_by_tokens must map tokens to [steps, ms], got "
                             f"{by_tokens!r:.200}") from None
        for n, steps, ms in points:
            if (n == 1) == (policy == "ar") and steps > 0 and 0.0 < ms < float("inf"):
                (extra if planned else acc).setdefault(n, []).append((steps, ms))

    def medians(points: dict[int, list[tuple[int, float]]]) -> dict[int, float]:
        return {n: sum(s * m for s, m in v) / sum(s for s, _ in v) for n, v in points.items()
                if sum(s for s, _ in v) >= 20}

    curve = {**medians(extra), **medians(acc)}  # (fixed rows' counts win)
    if 1 not in curve:
        raise ValueError("--from-e2e: no c=1 ar row with >= 20 steps: T(1) is unknown")
    if len(curve) < 2:
        raise ValueError("--from-e2e: the c=1 fixed-length rows give no token count >= 2 with >= 20 steps")
    return curve


def parse_curve(text: str) -> dict[int, float]:
    curve = {}
    for part in text.split(","):
        try:
            n, ms = part.split(":")
            curve[int(n)] = float(ms)
        except ValueError:
            raise ValueError(f"--curve: expected tokens:ms pairs like 1:2.8,17:7.3, got {part!r}") from None
    if 1 not in curve or len(curve) < 2 or min(curve) < 1 or \
            not all(0.0 < ms < float("inf") for ms in curve.values()):
        raise ValueError(f"--curve needs tokens >= 1 including 1 and at least two points, ms finite and > 0; got "
                         f"{text!r}")
    return curve


def step_ms(curve: dict[int, float], max_drafts: int = MAX_DRAFTS) -> np.ndarray:
    """[max_drafts + 1] T(L + 1) for L = 0..max_drafts, interpolated (flat past the last measured count)."""
    xs = sorted(curve)
    return np.interp(np.arange(1, max_drafts + 2, dtype=np.float64), xs, [curve[x] for x in xs])


def draws(kind: str, acceptance: float, concentration: float, noise: float, steps: int,
          rng: np.random.Generator, max_drafts: int = MAX_DRAFTS) -> tuple[np.ndarray, np.ndarray]:
    """([steps, max_drafts] true p, [steps, max_drafts] confidence)."""
    if kind not in ("noise", "beta"):
        raise ValueError(f"kind must be noise or beta, got {kind!r}")
    if kind == "noise" or acceptance in (0.0, 1.0):
        p = np.full((steps, max_drafts), acceptance)
    else:
        p = rng.beta(acceptance * concentration, (1.0 - acceptance) * concentration, (steps, max_drafts))
    return p, np.clip(p + rng.normal(0.0, noise, p.shape), 0.0, 1.0)


def expected_tokens(p: np.ndarray) -> np.ndarray:
    """[steps, max_drafts + 1] E[accepted + 1] of L = 0..max_drafts drafts: 1 + the survivals' running sum (the
    planner's survival: the products of the acceptances)."""
    surv = survival_from_acceptance(p)
    return 1.0 + np.concatenate([np.zeros((p.shape[0], 1)), np.cumsum(surv, axis=1)], axis=1)


def calibrated(p: np.ndarray, conf: np.ndarray, bins: int = 50) -> np.ndarray:
    """E[p | confidence] of each draft, binned over all the draws: an ideally calibrated planner's acceptance."""
    idx = np.minimum((conf * bins).astype(np.intp), bins - 1)  # [steps, K]
    sums = np.bincount(idx.ravel(), weights=p.ravel(), minlength=bins)
    counts = np.bincount(idx.ravel(), minlength=bins)
    return (sums / np.maximum(counts, 1))[idx]


def best_rule_rate(true_tokens: np.ndarray, seen_tokens: np.ndarray, ms: np.ndarray, first: int = 1,
                   iters: int = 200) -> tuple[float, float]:
    """(tokens per ms, mean L) of the rule L = argmax seen_tokens - rate * T over L >= first at its own rate
    (Dinkelbach; the rate it reaches is measured on true_tokens). Where the rule sees other values than the truth
    the iteration can cycle between near rates: the best rate met is kept."""
    rows = np.arange(true_tokens.shape[0])
    true_tokens, seen_tokens, ms = true_tokens[:, first:], seen_tokens[:, first:], ms[first:]
    rate = true_tokens[:, 0].mean() / ms[0]
    best = (rate, float(first))
    for _ in range(iters):
        L = np.argmax(seen_tokens - rate * ms[None, :], axis=1)
        new = float(true_tokens[rows, L].sum() / ms[L].sum())
        if new > best[0]:
            best = (new, float(L.mean()) + first)
        if abs(new - rate) <= 1e-12 * max(1.0, abs(rate)):
            break
        rate = new
    return best


def bound(curve: dict[int, float], kind: str, acceptance: float, concentration: float = 2.0, noise: float = 0.1,
          steps: int = 20000, seed: int = 0) -> dict:
    """Every rule's tokens/ms relative to ar at one acceptance."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    ms = step_ms(curve)
    p, conf = draws(kind, acceptance, concentration, noise, steps, np.random.default_rng(seed))
    true_tokens, seen_tokens = expected_tokens(p), expected_tokens(calibrated(p, conf))
    ar = 1.0 / ms[0]
    out = {"ar": 1.0, **{f"fixed{k}": float(true_tokens[:, k].mean() / ms[k]) / ar for k in range(1, MAX_DRAFTS + 1)}}
    best_fixed = max((k for k in out), key=out.get)

    def or_ar(rate: float, mean_len: float) -> tuple[float, float]:  # a drafting rule (L >= 1) or ar, the better
        return (rate / ar, mean_len) if rate > ar else (1.0, 0.0)

    oracle, oracle_len = or_ar(*best_rule_rate(true_tokens, true_tokens, ms))
    rate, rate_len = or_ar(*best_rule_rate(true_tokens, seen_tokens, ms))
    L = 1 + np.argmax(seen_tokens[:, 1:] / ms[None, 1:], axis=1)  # [steps] each step's own best ratio, L >= 1
    ratio, ratio_len = or_ar(float(true_tokens[np.arange(steps), L].sum() / ms[L].sum()), float(L.mean()))
    out.update(oracle=oracle, oracle_mean_len=oracle_len, rate=rate, rate_mean_len=rate_len,
               ratio=ratio, ratio_mean_len=ratio_len, best_fixed=best_fixed)
    out["oracle_over_best_fixed"] = out["oracle"] / out[best_fixed]
    out["oracle_over_fixed16"] = out["oracle"] / out["fixed16"]
    out["rate_over_fixed16"] = out["rate"] / out["fixed16"]
    out["rate_over_ratio"] = out["rate"] / out["ratio"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-e2e", help="an e2e JSON whose c=1 rows give T(n)")
    src.add_argument("--curve", help="tokens:ms pairs, e.g. 1:2.8,5:6.11,9:6.9,17:7.3")
    ap.add_argument("--rows", default="fixed", choices=("fixed", "all"),
                    help="--from-e2e: T(n >= 2) from the fixed-length rows only, or also from the learned policies' "
                         "rows where those lack a token count")
    ap.add_argument("--acceptance", default="0.5,0.7,0.85,0.95")
    ap.add_argument("--kinds", default="noise,beta")
    ap.add_argument("--concentration", type=float, default=2.0)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    try:
        if args.from_e2e:
            try:
                rows = json.loads(Path(args.from_e2e).read_text())["rows"]
            except (OSError, KeyError, json.JSONDecodeError) as e:
                raise ValueError(f"--from-e2e: cannot read an e2e JSON's rows from {args.from_e2e}: {e!r}") from None
            curve = curve_from_e2e(rows, fill_from_all=args.rows == "all")
        else:
            curve = parse_curve(args.curve)
        try:
            accs = [float(a) for a in args.acceptance.split(",")]
        except ValueError:
            raise ValueError(f"--acceptance: comma-separated numbers in [0, 1], got {args.acceptance!r}") from None
        if not all(0.0 <= a <= 1.0 for a in accs):
            raise ValueError(f"--acceptance: each must be in [0, 1], got {args.acceptance!r}")
        kinds = args.kinds.split(",")
        if not set(kinds) <= {"noise", "beta"}:
            raise ValueError(f"--kinds: each must be noise or beta, got {args.kinds!r}")
        if args.steps < 100:
            raise ValueError(f"--steps must be >= 100, got {args.steps}")
        if not 0.0 < args.concentration < float("inf"):
            raise ValueError(f"--concentration must be finite and > 0, got {args.concentration}")
        if not 0.0 <= args.noise < float("inf"):
            raise ValueError(f"--noise must be finite and >= 0, got {args.noise}")
        rows = [dict(kind=k, acceptance=a, **bound(curve, k, a, args.concentration, args.noise, args.steps))
                for k in kinds for a in accs]
    except ValueError as e:
        ap.error(str(e))
    print("T(n) ms:", ", ".join(f"{n}: {curve[n]:.2f}" for n in sorted(curve)))
    if 2 not in curve:
        print("warning: no T(2): interpolated from T(1), which misses a drafted step's jump (the drafter's forward): "
              "short lengths look cheaper than they are (give it with --curve, or --rows all)")
    print("| confidence | acc | fixed4 | fixed8 | fixed16 | best fixed | oracle (mean L) | rate (mean L) "
          "| ratio (mean L) | oracle / best fixed | oracle / fixed16 | rate / fixed16 | rate / ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['acceptance']} | {r['fixed4']:.2f} | {r['fixed8']:.2f} | {r['fixed16']:.2f} | "
              f"{r['best_fixed']} {r[r['best_fixed']]:.2f} | {r['oracle']:.2f} ({r['oracle_mean_len']:.1f}) | "
              f"{r['rate']:.2f} ({r['rate_mean_len']:.1f}) | {r['ratio']:.2f} ({r['ratio_mean_len']:.1f}) | "
              f"{r['oracle_over_best_fixed']:.3f} | {r['oracle_over_fixed16']:.3f} | {r['rate_over_fixed16']:.3f} | "
              f"{r['rate_over_ratio']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"curve": curve, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
