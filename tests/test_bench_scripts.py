"""The GPU-session bench scripts run end to end in their --tiny CPU mode (a broken script would waste device
time): bench/host_profile.py (host time of a step's parts per policy) and bench/verify_overhead.py (hybridspec's
verification graphs vs budget's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "bench" / name), "--tiny", *args], check=True, cwd=ROOT,
                   capture_output=True, timeout=600)


def test_host_profile_tiny_reports_each_policys_parts(tmp_path):
    run_script("host_profile.py", "--concurrency", "2", "--prompt-len", "16", "--max-new", "8", "--top", "5",
               "--out", str(tmp_path))
    report = json.loads((tmp_path / "host_profile.json").read_text())
    assert set(report["policies"]) == {"budget", "hybridspec"}
    for name, r in report["policies"].items():
        parts = r["parts_ms_per_step"]
        assert r["tokens_match_ar"], name  # greedy speculation stays lossless under the profiler
        assert parts["execute (whole step)"] > parts["forward: graphs.run"] > 0 and parts["plan: lengths"] > 0
    assert "== hybridspec" in (tmp_path / "host_profile.txt").read_text()


def test_verify_overhead_tiny_times_both_graph_sets(tmp_path):
    run_script("verify_overhead.py", "--reps", "1", "--shapes", "1x4,2x3", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "verify_overhead.json").read_text())["rows"]
    assert [(r["B"], r["T"]) for r in rows] == [(1, 4), (2, 3)]
    for r in rows:
        assert min(r["budget"], r["hybridspec"], r["hybridspec+extra"]) > 0
        assert r["hybridspec_over_budget_ms"] == r["hybridspec"] - r["budget"]
