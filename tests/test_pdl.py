"""Programmatic dependent launch (kernels/pdl.py): off on CPU and under the interpreter, a bad setting named at
import, and every Triton kernel of the package launched with PDL waits in its prologue (a kernel launched with
launch_pdl=True that read its inputs without griddepcontrol.wait would race the kernel before it: the GPU
checks, bench/graph_check.py, cannot prove the absence of a race, so the structure is checked here)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

import kernels.pdl as pdl

ROOT = Path(__file__).resolve().parents[1]


def test_off_on_cpu_and_under_the_interpreter():
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    was = pdl._enabled
    try:
        pdl.set_enabled(True)
        assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
        if os.environ.get("TRITON_INTERPRET") == "1":
            assert not pdl._enabled
    finally:
        pdl._enabled = was


def test_bad_setting_is_named():
    env = dict(os.environ, HYBRIDSPEC_PDL="yes", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", "import kernels.pdl"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "HYBRIDSPEC_PDL='yes'" in r.stderr and "0 or 1" in r.stderr


def _kernels_and_launches(path: Path) -> tuple[dict[str, ast.FunctionDef], list[ast.Call]]:
    tree = ast.parse(path.read_text())
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                and isinstance(n.func.value, ast.Name) and n.func.value.id in defs]
    return defs, launches


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == name]


def test_every_kernel_launch_waits_in_its_prologue():
    files = sorted((ROOT / "kernels").glob("*_triton.py"))
    launched = 0
    for path in files:
        defs, launches = _kernels_and_launches(path)
        for call in launches:
            name = call.func.value.id
            where = f"{path.name}: {name}"
            # the launch takes PDL and launch_pdl together from pdl_args
            starred = [k.value for k in call.keywords if k.arg is None]
            assert any(isinstance(v, ast.Call) and getattr(v.func, "id", "") == "pdl_args" for v in starred), where
            assert not any(k.arg in ("PDL", "launch_pdl") for k in call.keywords), where
            kernel = defs[name]
            args = [a.arg for a in kernel.args.args]
            assert args[-1] == "PDL", where
            # a kernel's body calls the prologue (where it is placed on each path is reviewed, not checked here: the
            # GEMV's, the router's and the decode's early reads come before it by design, kernels/pdl.py)
            prologues = _calls(kernel, "pdl_prologue")
            assert prologues and all(isinstance(p.args[0], ast.Name) and p.args[0].id == "PDL" for p in prologues), where
            launched += 1
    assert launched >= 27  # every kernel of the package (28 launch sites when this test was written)
