"""Runs a test module as a script under the Triton interpreter (TRITON_INTERPRET must be set before triton is
imported, so in a fresh process) and returns the JSON object its last `{...}` line prints; run_cases is the script
side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str | Path, timeout: int = 300, kernels: str | None = "triton") -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if kernels is not None:
        env["HYBRIDSPEC_KERNELS"] = kernels
    proc = subprocess.run([sys.executable, str(Path(script).resolve())], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def run_cases(cases: dict) -> None:
    """The script side: runs every case (name -> a function returning {check: relative error}) and prints the
    results as one JSON line; a case that raises reports its traceback instead."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (the pytest fixture does)"
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


def assert_case(results: dict, name: str, tol: float) -> None:
    """The pytest side: case `name` ran, and every check it reported (a relative error, or a flag that is 0 when
    it holds) is within tol."""
    result = results[name]
    assert "error" not in result, result.get("error")
    bad = {k: e for k, e in result.items() if not e <= tol}
    assert not bad, f"{name}: relative errors above {tol} (or flags set): {bad}"
