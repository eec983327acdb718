"""Compiles a Triton kernel for the H200 (sm_90) on a CPU machine, without a GPU: what the kernel tests under the
interpreter cannot see (a compile error, register spills) shows here. `compile_sm90` returns triton's compiled
kernel (its .asm holds "ptx" and "cubin"); `ptxas_usage` runs the ptxas that ships with triton on its PTX and
returns (registers, spill bytes) per thread."""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path


def compile_sm90(kernel, constexprs: dict, types: dict, num_warps: int = 4, **options):
    """kernel: a @triton.jit function; constexprs: its constexpr parameters' values; types: the others' triton
    types by name (default "i32")."""
    import triton
    from triton.backends.compiler import GPUTarget

    params = inspect.signature(kernel.fn).parameters
    # a constexpr parameter with a default that the caller left out takes its default (as a launch does)
    constexprs = {**{p: v.default for p, v in params.items() if v.default is not inspect.Parameter.empty
                     and "constexpr" in str(v.annotation)}, **constexprs}
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers a thread, spill store bytes) from `ptxas -v` on the compiled kernel's PTX."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", out).group(1))
    return regs, spill
