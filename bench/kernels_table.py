"""Issue 6's kernel benchmark in one command on the H200, with its targets:
    PYTHONPATH=. python bench/kernels_table.py [--out $OUT] [--parts gdn,moe_attn,step] [--budget-s 540]
(The issue names it bench/kernels.py: a file of that name stands for the `kernels` package wherever bench/ is on
sys.path first: in every bench script run directly, and in processes that tests spawn after putting bench/ there.)
Runs three benchmarks, each in its own process with its output under $OUT/<part>/:
  gdn       bench/kernels_gdn.py precompile checks table: GDN verification (+ commit) at B x T against fla-core's
            fused_recurrent_gated_delta_rule (when importable: ../shared/device/prepare-wheels.sh), bf16 checks first;
  moe_attn  bench/kernels_moe_attn.py --no-sweep: the MoE against its bandwidth floor and torch._grouped_mm (Zipf
            and uniform routing), paged attention against torch SDPA on the same data;
  step      bench/step_profile.py --layers 40 --modes graphs: one AR decode step of the 40-layer bench model at
            B=1 (and 16), replayed from a CUDA graph, against its floor.
Then it prints one table against the issue's targets and writes `kernels_summary.json` and `kernels_summary.md`
to --out (rewritten after each part: a command killed at a device's time limit leaves the parts done so far). A
part that fails or runs past its time (--part-timeout-s, and what is left of --budget-s) is reported as not measured
with its exit status (its log under $OUT/<part>/; a JSON left by an earlier run is removed first); the others still
run. Each part's own error list and the worst error of its bf16 checks get a row.
`--summary-only GDN_JSON MOE_ATTN_JSON STEP_JSON`: only the table, from the three parts' JSON files (a missing
file: pass `-`). `--dry-run` prints the commands. Every part's own script has more options (sweeps, prefill,
tiles); bench/NOTES.md records what each measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (part, its script's command line, the JSON file it writes under its OUT)
PARTS = {
    "gdn": (["bench/kernels_gdn.py", "precompile", "checks", "table"], "kernels_gdn.json"),
    "moe_attn": (["bench/kernels_moe_attn.py", "--no-sweep"], "kernels_moe_attn.json"),
    "step": (["bench/step_profile.py", "--layers", "40", "--modes", "graphs"], "step_profile.json"),
}
# the targets
GDN_TARGETS_US = {(1, 16): 10.0, (32, 16): 60.0}  # GDN verification, B x T -> us
MOE_TARGET_X_FLOOR, MOE_TARGET_MAX_N = 1.5, 64  # the MoE at most 1.5x its floor for N <= 64
STEP_TARGET_X_FLOOR = 1.6  # the AR step at B=1 at most 1.6x its floor
GDN_B, GDN_T = (1, 8, 32), (1, 4, 8, 16, 17)
MOE_N = (1, 4, 16, 64, 272)


@dataclass
class Row:
    part: str
    case: str
    ours: str
    baseline: str
    floor: str
    target: str
    verdict: str  # "met", "missed", "" (no target), "not measured"


def _us(x) -> str:
    return f"{x:.1f} us" if isinstance(x, (int, float)) else "-"


def gdn_rows(report: dict | None) -> list[Row]:
    """GDN verification at B x T: the factored kernel that graphs call (older files: `verify`, the block kernel),
    the block kernel's verification + commit (the bench's; serving commits with the sequential kernel,
    bench/gdn_commit.py), fla's fused_recurrent."""
    if report is None:
        return [Row("GDN verify", "B x T", "-", "-", "-", "B=1 T=16 <= 10 us, B=32 T=16 <= 60 us", "not measured")]
    table = {(r["B"], r["T"]): r for r in report.get("table", [])}
    rows = []
    for b in GDN_B:
        for t in GDN_T:
            r = table.get((b, t))
            target = GDN_TARGETS_US.get((b, t))
            if r is None:
                rows.append(Row("GDN verify", f"B={b} T={t}", "-", "-", "-", "", "not measured"))
                continue
            key = "factored_verify" if "factored_verify" in r else "verify"
            ours = r.get(key)
            fla = f"fla {_us(r['fla'])}" if "fla" in r else "fla not run"
            commit = f" (block verify + commit {_us(r['verify+commit'])})" if "verify+commit" in r else ""
            verdict = ""
            if target is not None:
                verdict = "met" if isinstance(ours, (int, float)) and ours <= target else "missed"
            rows.append(Row("GDN verify" + (" (block)" if key == "verify" else ""), f"B={b} T={t}",
                            _us(ours) + commit, fla, _us(r.get("floor_r_us")),
                            f"<= {target:g} us" if target is not None else "", verdict))
    return rows


def moe_attn_rows(report: dict | None) -> list[Row]:
    """MoE at N tokens (Zipf, uniform) against its floor and torch._grouped_mm in a graph; attention against SDPA."""
    if report is None:
        return [Row("MoE", "N tokens", "-", "-", "-", f"<= {MOE_TARGET_X_FLOOR}x floor for N <= {MOE_TARGET_MAX_N}",
                    "not measured"), Row("attention", "-", "-", "-", "-", "", "not measured")]
    rows = []
    for routing in ("zipf", "uniform"):
        by_n = {r["N"]: r for r in report.get("moe", []) if r.get("routing") == routing}
        for n in MOE_N:
            r = by_n.get(n)
            if r is None:
                rows.append(Row("MoE", f"{routing} N={n}", "-", "-", "-", "", "not measured"))
                continue
            x = r["triton_us"] / r["floor_us"]
            gated = n <= MOE_TARGET_MAX_N
            rows.append(Row("MoE", f"{routing} N={n} ({r.get('experts', '?')} experts)",
                            f"{_us(r['triton_us'])} ({x:.2f}x floor)",
                            f"grouped_mm {_us(r.get('grouped_mm_graph_us'))}", _us(r["floor_us"]),
                            f"<= {MOE_TARGET_X_FLOOR}x floor" if gated else "",
                            ("met" if x <= MOE_TARGET_X_FLOOR else "missed") if gated else ""))
    for r in report.get("attention", []):
        if "sdpa_us" not in r:
            continue
        case = f"B={r['B']} q_len={r['q_len']} ctx={r['ctx']}" + (f" ({r['path']})" if "path" in r else "")
        rows.append(Row("attention", case, f"{_us(r['triton_us'])} (SDPA / ours {r['sdpa_us'] / r['triton_us']:.2f})",
                        f"SDPA {_us(r['sdpa_us'])}", _us(r.get("floor_us")), "", ""))
    return rows


def step_rows(report: dict | None) -> list[Row]:
    """The AR decode step at B=1 (and 16), replayed from a CUDA graph, against its floor."""
    rows = []
    for key, b in (("graphs_b1", 1), ("graphs_b16", 16)):
        r = (report or {}).get(key)
        target = f"<= {STEP_TARGET_X_FLOOR}x floor" if b == 1 else ""
        if r is None:
            rows.append(Row("AR step", f"B={b}", "-", "-", "-", target, "not measured"))
            continue
        x = r["step_ms_median"] / r["floor_ms"]
        note = "" if b == 1 else " (floor: every expert the step touches, read once; L2 holds part of them)"
        rows.append(Row("AR step", f"B={b}, 40 layers, {int(r.get('kernels_per_step', 0))} kernels{note}",
                        f"{r['step_ms_median']:.3f} ms ({x:.2f}x floor)", "", f"{r['floor_ms']:.3f} ms", target,
                        ("met" if x <= STEP_TARGET_X_FLOOR else "missed") if b == 1 else ""))
    return rows


def _floats(x) -> list[float]:
    """Every number in a (nested) checks record."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    if isinstance(x, dict):
        return [f for v in x.values() for f in _floats(v)]
    if isinstance(x, (list, tuple)):
        return [f for v in x for f in _floats(v)]
    return []


def health_rows(reports: dict[str, dict | None]) -> list[Row]:
    """Per part that ran: its own error list (sections that failed) and the worst relative error of its bf16 checks
    against the PyTorch references."""
    rows = []
    for name, report in reports.items():
        if report is None:
            continue
        errors = report.get("errors") or []
        checks = [f for key in ("checks", "checks_moe", "checks_attn") for f in _floats(report.get(key, {}))]
        worst = f"worst check error {max(checks):.2e}" if checks else "no checks"
        rows.append(Row(name, "errors / checks", f"{len(errors)} errors, {worst}", "", "", "no errors",
                        "errors" if errors else "ok"))
    return rows


def summarize(gdn: dict | None, moe_attn: dict | None, step: dict | None) -> list[Row]:
    return gdn_rows(gdn) + moe_attn_rows(moe_attn) + step_rows(step) + \
        health_rows({"gdn": gdn, "moe_attn": moe_attn, "step": step})


def markdown(rows: list[Row], sources: dict[str, str]) -> str:
    head = "| part | case | ours | baseline | floor | target | verdict |\n|---|---|---|---|---|---|---|\n"
    body = "".join(f"| {r.part} | {r.case} | {r.ours} | {r.baseline} | {r.floor} | {r.target} | {r.verdict} |\n"
                   for r in rows)
    src = "".join(f"- {part}: {what}\n" for part, what in sources.items())
    return head + body + "\n" + src


def _load(path: str | Path | None) -> dict | None:
    """A part's JSON; None where it left none (or a part killed mid-write left one that does not parse)."""
    if path is None or str(path) == "-" or not Path(path).is_file():
        return None
    try:
        report = json.loads(Path(path).read_text())
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _provenance(report: dict | None, path, status: str = "") -> str:
    status = f"; {status}" if status else ""
    if report is None:
        return f"not measured ({path}{status})"
    return f"{path} (commit {report.get('commit') or '?'}, {report.get('gpu') or report.get('device') or '?'}{status})"


def run_part(name: str, out: Path, timeout_s: float, dry_run: bool) -> tuple[Path, str]:
    """Runs one part in its own process group (OUT=out/name); -> (the JSON path it writes, its exit status). The
    JSON of an earlier run is removed first, so a part that fails is not summarised from stale numbers; on a
    timeout the whole group goes (kernels_gdn.py's precompile pool included)."""
    argv, json_name = PARTS[name]
    part_out = out / name
    cmd = [sys.executable] + argv + (["--out", str(part_out)] if name == "step" else [])
    if dry_run:
        print(f"OUT={part_out} {' '.join(cmd)}")
        return part_out / json_name, "dry run"
    part_out.mkdir(parents=True, exist_ok=True)
    (part_out / json_name).unlink(missing_ok=True)
    # the repository first, the caller's PYTHONPATH after it (on the device machine fla-core comes from there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OUT=str(part_out), PYTHONPATH=path)
    t0 = time.perf_counter()
    with open(part_out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = f"exit {proc.wait(timeout=max(1.0, timeout_s))}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"killed after {timeout_s:.0f} s"
    print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {status}, log {part_out / 'log.txt'}", flush=True)
    return part_out / json_name, status


def write_summary(out: Path, paths: dict, statuses: dict[str, str]) -> str:
    """The table from whatever JSON the parts left (kernels_summary.md / .json under out); -> its text."""
    reports = {name: _load(paths.get(name, "-")) for name in PARTS}
    rows = summarize(reports["gdn"], reports["moe_attn"], reports["step"])
    sources = {name: _provenance(reports[name], paths.get(name, "-"), statuses.get(name, "")) for name in PARTS}
    text = markdown(rows, sources)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_summary.md").write_text(text)
    (out / "kernels_summary.json").write_text(json.dumps({"rows": [asdict(r) for r in rows], "sources": sources},
                                                         indent=1))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out")))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument("--part-timeout-s", type=float, default=900.0, help="one part's time limit")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="all parts' time together (0: no limit); a part gets what is left, none once it is spent "
                    "(a device command may run 600 s: e.g. 540)")
    ap.add_argument("--dry-run", action="store_true", help="print the parts' commands, run nothing")
    ap.add_argument("--summary-only", nargs=3, metavar=("GDN_JSON", "MOE_ATTN_JSON", "STEP_JSON"),
                    help="the table from existing JSON files ('-': not measured), running nothing")
    args = ap.parse_args()
    out = Path(args.out)
    if args.part_timeout_s <= 0 or args.budget_s < 0:
        raise SystemExit(f"--part-timeout-s must be > 0 (got {args.part_timeout_s}) and --budget-s >= 0 (got "
                         f"{args.budget_s}; 0: no limit)")
    if args.summary_only:
        missing = [p for p in args.summary_only if p != "-" and not Path(p).is_file()]
        if missing:
            raise SystemExit(f"--summary-only: no such file {missing} (a part not measured: '-')")
        print(write_summary(out, dict(zip(PARTS, args.summary_only)), {}), end="")
        return
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise SystemExit(f"--parts: unknown {unknown or 'none given'}; allowed: {', '.join(PARTS)}")
    t0 = time.perf_counter()
    paths: dict[str, object] = {}
    statuses: dict[str, str] = {name: "not asked for (--parts)" for name in PARTS if name not in parts}
    for name in PARTS:
        if name not in parts:
            continue
        left = args.budget_s - (time.perf_counter() - t0) if args.budget_s else args.part_timeout_s
        if left < 1.0:
            statuses[name] = f"not run: --budget-s {args.budget_s:g} spent"
            continue
        paths[name], statuses[name] = run_part(name, out, min(args.part_timeout_s, left), args.dry_run)
        if not args.dry_run:
            write_summary(out, paths, statuses)
    if not args.dry_run:
        print(write_summary(out, paths, statuses), end="")


if __name__ == "__main__":
    main()
