"""Programmatic dependent launch (PDL, Hopper and later) for every Triton kernel of this package.

A step is hundreds of small kernels back to back on one stream (535 at one request in the 40-layer bench model):
between two of them the GPU drains the first, launches the second and ramps it up (~1.2 us a kernel boundary at
one request on the H200, CUDA-graph replay: 3.63 ms of wall against 2.98 ms of kernel time, bench/NOTES.md). With
PDL a kernel is launched with `launch_pdl=True` and may be scheduled while the kernel before it still runs:

- every kernel starts with `pdl_prologue(PDL)`: `griddepcontrol.wait` (returns once the kernel launched before it
  has completed and its writes are visible: the stream order, as without PDL) and then
  `griddepcontrol.launch_dependents` (the next kernel may be scheduled once every program of this one has passed
  this point: its programs take free SM slots and wait in their own prologue);
- inside a CUDA-graph capture (`early_reads`) a few kernels read operands before their prologue, so those loads are
  in flight while the kernel before them finishes: the GEMV and the router logits their first weight tile
  (kernels/gemv_triton.py, moe_triton.py), the GDN decode cu_seqlens, slots and its state tile
  (gdn_decode_triton.py), the per-assignment MoE gate/up GEMV's shared-expert programs the shared weights and
  their token's x, which the router logits read before the route (moe_triton.py MOE_SHARED_EARLY). Because the
  kernel before a kernel waited for its own predecessor before letting it launch, only the immediately preceding
  kernel can still be running there: such a read is safe for data that kernel does not write. In a captured step
  the weights (and the caches derived from them) were written before the capture began and the decode follows its
  layer's input projection; a launcher that copies a weight first (a non-contiguous one) reads it after the wait.
  Eager launches read everything after the wait (a weight cache may have been built by the kernel just before);
- the second launch of the factored GDN verification (gdn_verify_triton.py) reads its state tile before its
  prologue in every launch, eager ones too: the kernel before it is always its own first launch, which writes no
  state, so by the argument above every earlier write of the state is complete.

Without PDL at launch the two instructions do nothing. Off: HYBRIDSPEC_PDL=0 (read at import; `set_enabled` for
benchmarks: graphs captured before keep what they captured), any device below compute capability 9, and under
TRITON_INTERPRET=1 (the interpreter has no inline assembly: PDL=False compiles the prologue away). A CUDA graph
captures the launch attribute as a programmatic edge.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_SETTING = os.environ.get("HYBRIDSPEC_PDL", "1")
if _SETTING not in ("0", "1"):
    raise ValueError(f"HYBRIDSPEC_PDL={_SETTING!r}: must be 0 or 1")
try:  # the GPU host has triton 3.6, CPU machines 3.7: both have them
    import triton.language.extra.cuda as _cuda
    _AVAILABLE = hasattr(_cuda, "gdc_wait") and hasattr(_cuda, "gdc_launch_dependents")
except ImportError:
    _AVAILABLE = False
_enabled = _SETTING == "1" and _AVAILABLE and os.environ.get("TRITON_INTERPRET") != "1"
_capable: dict[int, bool] = {}


def set_enabled(on: bool) -> None:
    """Switches PDL for launches from now on (benchmarks' A/B in one process); never on under the interpreter."""
    global _enabled
    _enabled = bool(on) and _AVAILABLE and os.environ.get("TRITON_INTERPRET") != "1"


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL."""
    if not _enabled or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capable.get(idx)
    if cap is None:
        cap = _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return cap


def early_reads(device: torch.device) -> bool:
    """Whether a launch now may read its weights (and the GDN decode its state) before its prologue: PDL on and
    the stream capturing a CUDA graph (see the module docstring). A runtime argument of the kernels, not a
    constexpr: the eager warm-ups before a capture compile what the capture replays."""
    return enabled(device) and torch.cuda.is_current_stream_capturing()


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel with a `PDL: tl.constexpr` parameter: PDL and launch_pdl together."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of every kernel (after its early reads, where it has them): wait for the kernel launched
    before, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
