"""Triton MoE and paged-attention kernels equal their PyTorch references (TRITON_INTERPRET=1, CPU, fp32).

The interpreter must be switched on before any @triton.jit runs and must not leak into other test modules, so the
checks run in one subprocess: this file run as a script (`python tests/test_kernels_moe_attn.py`) with
TRITON_INTERPRET=1 set by the fixture; it prints one JSON line {case: relative error or an error message}.
Shapes are tiny and ragged: MoE E=8, top-2, H=32, I=16, some token_mask rows False (the shared expert as expert
id E: I_s = 16, 48 or 8); attention B=3 with query
lengths {1, 5, 17}, context lengths {0, 7, 30}, page size 4, shuffled (non-contiguous) pages, GQA 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 under the interpreter: relative error ||out - ref|| / ||ref||

CASES = [
    "router_logits_1", "router_logits_5", "router_logits_16", "router_logits_17", "router_logits_64",
    "router_logits_65_fallback", "router_logits_strided", "router_logits_row_stride", "router_logits_4",
    "router_logits_routing",
    "route_renorm", "route_plain", "route_bias_half_out", "distinct_experts", "distinct_experts_masked",
    "expert_counts_masked", "distinct_experts_int_or_strided_mask",
    "align_mask", "align_all_masked", "align_one_expert_many_blocks", "align_shared_mask", "align_shared_hot",
    "moe_plain", "moe_mask", "moe_one_token", "moe_block32", "moe_all_masked", "moe_hot_expert",
    "moe_unfused", "moe_mask_unfused", "moe_hot_unfused", "moe_align_fused_reduce_separate", "moe_counters_reset",
    "route_shared", "route_shared_half_out", "expert_counts_strided_ids",
    "moe_shared_plain", "moe_shared_mask", "moe_shared_one_token", "moe_shared_wider", "moe_shared_narrower",
    "moe_shared_hot", "moe_shared_unfused", "moe_shared_block32_wider", "moe_shared_fused_reduce",
    "moe_shared_all_masked",
    "moe_stats_fused_align", "moe_stats_fused_align_mask", "moe_stats_align", "moe_stats_align_mask",
    "moe_stats_shared_fused_align_mask", "moe_stats_shared_align_mask", "moe_stats_shared_fused_align",
    "moe_stats_hot_fused_align", "moe_stats_hot_align", "moe_stats_shared_hot_align_mask",
    "moe_stats_all_masked", "moe_stats_shared_all_masked", "moe_stats_shared_all_masked_align",
    "moe_stats_distinct_only", "moe_stats_distinct_only_align", "moe_stats_default_routing",
    "moe_stats_no_tokens", "moe_stats_block32", "moe_stats_bad_buffers",
    "moe_gemv_one_token", "moe_gemv_two_tokens_mask", "moe_gemv_forced_mask", "moe_gemv_tiles_past_the_widths",
    "moe_gemv_all_masked", "moe_gemv_shared_one_token", "moe_gemv_shared_masked_token", "moe_gemv_shared_wider",
    "moe_gemv_shared_narrower", "moe_gemv_stats", "moe_gemv_stats_distinct_only", "moe_gemv_routing",
    "moe_gemv_fuse_reduce_refused", "moe_gemv_early_reads",
    "write_kv",
    "attn_default", "attn_splits", "attn_small_tiles", "attn_prefill", "attn_no_hints", "attn_bm128",
    "attn_fresh_prefill_sdpa", "attn_fresh_prefill_triton",
    "attn_gated", "attn_gated_splits", "attn_gated_fresh_prefill_sdpa", "qk_norm_rope_write",
    "qk_norm_rope_write_full_rotary_fused_kv", "qk_norm_rope_write_d80_no_rows", "attn_gate_shape_refused",
]


@pytest.fixture(scope="module")
def interp_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(interp_results, case):
    got = interp_results[case]
    assert not isinstance(got, str), got
    assert got <= TOL, f"{case}: relative error {got}"


def test_moe_gemv_threshold_from_the_environment_is_validated():
    """HYBRIDSPEC_MOE_GEMV_MAX_N (read at import): an integer in [0, 64], else a named error."""
    code = "import kernels.moe_triton as MT; print(MT.MOE_GEMV_MAX_N)"
    for value, ok in (("0", True), ("4", True), ("-1", False), ("65", False), ("two", False)):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), HYBRIDSPEC_MOE_GEMV_MAX_N=value))
        if ok:
            assert proc.returncode == 0 and proc.stdout.split()[-1] == value, proc.stderr[-2000:]
        else:
            assert proc.returncode != 0 and "HYBRIDSPEC_MOE_GEMV_MAX_N" in proc.stderr and "[0, 64]" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# the checks (run in the subprocess only)
# ---------------------------------------------------------------------------------------------------------------
def _rel(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def _checks() -> dict:
    import torch

    from kernels.attention import paged_attention_ref, write_kv_ref
    from kernels.attention_triton import paged_attention_triton, write_kv_triton
    from kernels.moe import fused_moe_ref, route_ref
    from kernels.moe_triton import fused_moe_triton, moe_align_ref, moe_align_triton, route_triton

    torch.manual_seed(0)
    E, K, H, I = 8, 2, 32, 16
    checks = {}

    # ---- router logits (fp32 sums; one kernel up to ROUTER_LOGITS_MAX_N tokens: CUDA cores up to 4, tl.dot beyond)
    def logits_case(n, strided=False, row_stride=False):
        from kernels.moe import router_logits_ref
        from kernels.moe_triton import router_logits_triton

        w = torch.randn(40, 200)  # E not a multiple of 16, H not of BLOCK_K
        x = torch.randn(n, 400)[:, ::2] if strided else torch.randn(n, 200)
        if row_stride:  # unit inner stride, rows 400 apart: read in place (no copy)
            x = torch.randn(n, 400)[:, :200]
        out = router_logits_triton(x, w)
        if out.dtype != torch.float32 or out.shape != (n, 40):
            return f"dtype {out.dtype} / shape {tuple(out.shape)}"
        return _rel(out, router_logits_ref(x, w))

    checks["router_logits_1"] = lambda: logits_case(1)
    checks["router_logits_5"] = lambda: logits_case(5)
    checks["router_logits_4"] = lambda: logits_case(4)  # the CUDA-core kernel's last size (ROUTER_GEMV_MAX_N)
    checks["router_logits_16"] = lambda: logits_case(16)  # tl.dot from 5 tokens on (router_logits_5 the first)
    checks["router_logits_17"] = lambda: logits_case(17)
    checks["router_logits_64"] = lambda: logits_case(64)
    checks["router_logits_65_fallback"] = lambda: logits_case(65)
    checks["router_logits_strided"] = lambda: logits_case(3, strided=True)
    checks["router_logits_row_stride"] = lambda: logits_case(7, row_stride=True)

    def logits_routing_case():  # which kernel each token count takes: CUDA cores up to ROUTER_GEMV_MAX_N
        import kernels.moe_triton as MT

        launched = []

        class Spy:  # records the DOT flag of each launch
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                def launch(*args, **kw):
                    launched.append("dot" if kw["DOT"] else "gemv")
                    return self.kernel[grid](*args, **kw)

                return launch

        real = MT._router_logits_kernel
        MT._router_logits_kernel = Spy(real)
        try:
            w = torch.randn(40, 200)
            for n in (1, MT.ROUTER_GEMV_MAX_N, MT.ROUTER_GEMV_MAX_N + 1, 64, 65):
                MT.router_logits_triton(torch.randn(n, 200), w)
        finally:
            MT._router_logits_kernel = real
        want = ["gemv", "gemv", "dot", "dot"]  # 65 tokens: cuBLAS, no Triton launch
        return 0.0 if launched == want else f"kernels launched {launched}, want {want}"

    checks["router_logits_routing"] = logits_routing_case

    # ---- routing
    def route_case(renorm):
        logits = torch.randn(13, E)
        w, ids = route_triton(logits, K, renorm)
        w_ref, ids_ref = route_ref(logits, K, renorm)
        if not torch.equal(ids, ids_ref) or ids.dtype != torch.int64:
            return "expert ids differ"
        return _rel(w, w_ref)

    checks["route_renorm"] = lambda: route_case(True)
    checks["route_plain"] = lambda: route_case(False)

    def route_bias_case():  # the benchmarks' router bias and the weights' cast in the same launch
        logits, bias = torch.randn(9, E), torch.randn(E)
        w, ids = route_triton(logits, K, True, torch.float16, bias)
        w_ref, ids_ref = route_ref(logits, K, True, torch.float16, bias)
        if not torch.equal(ids, ids_ref) or w.dtype != torch.float16:  # (the interpreter rounds bf16 wrongly)
            return "expert ids or dtype differ"
        return _rel(w.float(), w_ref.float())

    checks["route_bias_half_out"] = route_bias_case

    def distinct_case(masked):
        from kernels.moe import distinct_experts_ref
        from kernels.moe_triton import distinct_experts_triton
        ids = torch.randint(0, 40, (37, 3))  # 111 assignments: several loop iterations of the kernel
        mask = (torch.rand(37) < 0.5) if masked else None
        got, ref = distinct_experts_triton(ids, mask, 40), distinct_experts_ref(ids, mask, 40)
        if got.dtype != torch.int64 or got.shape != ():
            return f"dtype/shape {got.dtype} {tuple(got.shape)}"
        return abs(int(got) - int(ref))

    def counts_case():
        from kernels.moe import expert_counts_ref
        from kernels.moe_triton import expert_counts_triton
        ids, mask = torch.randint(0, 40, (37, 3)), torch.rand(37) < 0.6
        (d, c), (d_ref, c_ref) = expert_counts_triton(ids, mask, 40), expert_counts_ref(ids, mask, 40)
        if c.dtype != torch.int64 or not torch.equal(c, c_ref) or int(d) != int(d_ref):
            return "counts or distinct differ"
        return 0.0

    checks["expert_counts_masked"] = counts_case

    def int_mask_case():  # a non-bool or strided mask is converted, not reinterpreted
        from kernels.moe import distinct_experts_ref
        from kernels.moe_triton import distinct_experts_triton
        ids, mask = torch.randint(0, 40, (37, 3)), torch.rand(37, 2) < 0.5
        want = int(distinct_experts_ref(ids, mask[:, 0], 40))
        got = [int(distinct_experts_triton(ids, m, 40)) for m in (mask[:, 0], mask[:, 0].long())]
        return 0.0 if got == [want, want] else f"{got} != {want}"

    checks["distinct_experts_int_or_strided_mask"] = int_mask_case
    checks["distinct_experts"] = lambda: distinct_case(False)
    checks["distinct_experts_masked"] = lambda: distinct_case(True)

    # ---- align (the device-side grouping): same blocks as the reference, masked assignments in none
    def align_case(n, mask, block_m, hot=None, shared=False):
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(n)])  # [n, K] distinct experts per token
        if hot is not None:
            ids[:, 0] = hot
        if shared:  # slot K: the shared expert, id E of E + 1 (kept for masked tokens)
            ids = torch.cat([ids, torch.full((n, 1), E)], dim=1)
        flat, e_tot, k_tot = ids.reshape(-1), E + shared, K + shared
        s, be, nb, _ = moe_align_triton(flat, mask, e_tot, k_tot, block_m, shared)
        s_ref, be_ref, nb_ref, _ = moe_align_ref(flat, mask, e_tot, k_tot, block_m, shared)
        if int(nb) != int(nb_ref):
            return f"num_blocks {int(nb)} != {int(nb_ref)}"
        rows = int(nb) * block_m
        keep = torch.ones(n, dtype=torch.bool) if mask is None else mask
        want = sorted(a for a in range(n * k_tot) if keep[a // k_tot] or (shared and a % k_tot == K))
        if sorted(int(a) for a in s[:rows] if a < n * k_tot) != want:  # each kept assignment once (+ shared slots)
            return "kept assignments differ"
        if not torch.equal(be[: int(nb)], be_ref[: int(nb)]):
            return "block experts differ"
        for b in range(int(nb)):  # rows inside one expert may come in any order
            seg, seg_ref = s[b * block_m : (b + 1) * block_m], s_ref[b * block_m : (b + 1) * block_m]
            if not torch.equal(seg.sort().values, seg_ref.sort().values):
                return f"block {b} rows differ"
        if not torch.equal(s[:rows].sort().values, s_ref[:rows].sort().values):
            return "rows differ"
        return 0.0

    mask13 = torch.tensor([True, False, True, True, False, True, True, True, False, True, True, True, True])
    checks["align_mask"] = lambda: align_case(13, mask13, 16)
    checks["align_all_masked"] = lambda: align_case(5, torch.zeros(5, dtype=torch.bool), 16)
    checks["align_one_expert_many_blocks"] = lambda: align_case(40, None, 16, hot=3)
    checks["align_shared_mask"] = lambda: align_case(13, mask13, 16, shared=True)
    checks["align_shared_hot"] = lambda: align_case(40, None, 16, hot=3, shared=True)

    # ---- fused MoE
    w_gu = torch.randn(E, 2 * I, H) / H ** 0.5
    w_dn = torch.randn(E, H, I) / I ** 0.5

    def moe_case(n, mask=None, config=None, hot=None):
        x = torch.randn(n, H)
        logits = torch.randn(n, E)
        if hot is not None:
            logits[:, hot] += 10.0
        w, ids = route_ref(logits, K, True)
        out = fused_moe_triton(x, w_gu, w_dn, w, ids, mask, config=config)
        ref = fused_moe_ref(x, w_gu, w_dn, w, ids, mask)
        if mask is not None and out[~mask].abs().max() > 0:
            return "masked rows not zero"
        return _rel(out, ref)

    checks["moe_plain"] = lambda: moe_case(13)
    checks["moe_mask"] = lambda: moe_case(13, mask13)
    checks["moe_one_token"] = lambda: moe_case(1, config={"gemv": False})  # the grouped kernels at one token
    checks["moe_block32"] = lambda: moe_case(13, mask13, config={"block_m": 32, "gate_up": (16, 16, 4, 2),
                                                                  "down": (16, 16, 4, 2)})
    checks["moe_all_masked"] = lambda: (lambda o: float(o.abs().max()))(
        fused_moe_triton(torch.randn(4, H), w_gu, w_dn, *route_ref(torch.randn(4, E), K, True),
                         torch.zeros(4, dtype=torch.bool)))
    checks["moe_hot_expert"] = lambda: moe_case(40, None, hot=5)  # 40 rows of one expert: 3 blocks of 16
    # the separate align kernel and reduce kernel (used for large N*k), and one fused without the other
    unfused = {"fuse_align": False, "fuse_reduce": False}
    checks["moe_unfused"] = lambda: moe_case(13, None, config=unfused)
    checks["moe_mask_unfused"] = lambda: moe_case(13, mask13, config=unfused)
    checks["moe_hot_unfused"] = lambda: moe_case(40, None, config=unfused, hot=5)
    checks["moe_align_fused_reduce_separate"] = lambda: moe_case(13, mask13, config={"fuse_align": True,
                                                                                       "fuse_reduce": False})

    def counters_case():  # the fused reduce leaves its counters at zero, so the next call (graph replay) works
        from kernels.moe_triton import _counters
        errs = [moe_case(13, mask13, config={"fuse_reduce": True}) for _ in range(2)]
        if any(int(c.abs().sum()) != 0 for c in _counters.values()):
            return "counters not reset"
        return max(errs)

    checks["moe_counters_reset"] = counters_case

    # ---- the shared expert as expert id E (route(..., shared=True) slot k, fused_moe(..., shared=...))
    def route_shared_case(out_dtype=None):
        logits, bias = torch.randn(13, E + 1) * 2, torch.randn(E)
        w, ids = route_triton(logits, K, True, out_dtype, bias, shared=True)
        w_ref, ids_ref = route_ref(logits, K, True, out_dtype, bias, shared=True)
        w_routed, ids_routed = route_ref(logits[:, :E], K, True, out_dtype, bias)  # the routed slots as today
        if ids.shape != (13, K + 1) or not torch.equal(ids, ids_ref) or not torch.equal(ids[:, :K], ids_routed):
            return "expert ids differ"
        if not (ids[:, K] == E).all() or w.dtype != (out_dtype or torch.float32):
            return "shared slot id or dtype wrong"
        gate = torch.sigmoid(logits[:, E]).to(w.dtype)
        return max(_rel(w.float(), w_ref.float()), _rel(w[:, :K].float(), w_routed.float()),
                   _rel(w[:, K].float(), gate.float()))

    checks["route_shared"] = route_shared_case
    checks["route_shared_half_out"] = lambda: route_shared_case(torch.float16)

    def counts_strided_case():  # the routed columns of [N, k + 1] read in place (a strided view, no copy)
        from kernels.moe import expert_counts_ref
        from kernels.moe_triton import expert_counts_triton
        full = torch.cat([torch.randint(0, 40, (37, 3)), torch.full((37, 1), 40)], dim=1)
        ids, mask = full[:, :3], torch.rand(37) < 0.6
        (d, c), (d_ref, c_ref) = expert_counts_triton(ids, mask, 40), expert_counts_ref(ids.contiguous(), mask, 40)
        if not torch.equal(c, c_ref) or int(d) != int(d_ref) or int(c.sum()) != int(mask.sum()) * 3:
            return "counts or distinct differ"
        return 0.0

    checks["expert_counts_strided_ids"] = counts_strided_case

    def moe_shared_case(n, mask=None, config=None, hot=None, inter_s=I, x_stride=1):
        import torch.nn.functional as F
        x = torch.randn(n, H * x_stride)[:, ::x_stride]  # (x_stride > 1: a strided view)
        logits = torch.randn(n, E + 1)
        if hot is not None:
            logits[:, hot] += 10.0
        w, ids = route_ref(logits, K, True, shared=True)  # [n, K + 1], slot K = (E, sigmoid)
        ws = (torch.randn(2 * inter_s, H) / H ** 0.5, torch.randn(H, inter_s) / inter_s ** 0.5)
        out = fused_moe_triton(x, w_gu, w_dn, w, ids, mask, config=config, shared=ws)
        ref = fused_moe_ref(x, w_gu, w_dn, w, ids, mask, shared=ws)
        # the reference is the routed experts plus the gated shared MLP on every row (the model's separate
        # computation): masked tokens get no routed work and keep the shared slot
        gate, up = F.linear(x, ws[0]).chunk(2, dim=-1)
        shared = w[:, K:] * F.linear(F.silu(gate) * up, ws[1])
        sep = fused_moe_ref(x, w_gu, w_dn, w[:, :K], ids[:, :K], mask) + shared
        if mask is not None and _rel(out[~mask], shared[~mask]) > TOL:
            return "masked rows are not their shared slot alone"
        return max(_rel(out, ref), _rel(ref, sep))

    checks["moe_shared_plain"] = lambda: moe_shared_case(13)
    checks["moe_shared_mask"] = lambda: moe_shared_case(13, mask13)
    checks["moe_shared_one_token"] = lambda: moe_shared_case(1, config={"gemv": False})
    checks["moe_shared_wider"] = lambda: moe_shared_case(13, mask13, inter_s=48)  # I_s = 3 I: 2 column tiles
    checks["moe_shared_narrower"] = lambda: moe_shared_case(13, mask13, inter_s=8)  # I_s < BLOCK_K
    # 40 tokens: the hot expert and the shared one 3 blocks of 16 each
    checks["moe_shared_hot"] = lambda: moe_shared_case(40, None, hot=5)
    checks["moe_shared_unfused"] = lambda: moe_shared_case(13, mask13, config=unfused, inter_s=48)
    checks["moe_shared_block32_wider"] = lambda: moe_shared_case(
        13, mask13, config={"block_m": 32, "gate_up": (16, 16, 4, 2), "down": (16, 16, 4, 2)}, inter_s=40)
    checks["moe_shared_fused_reduce"] = lambda: moe_shared_case(13, mask13, config={"fuse_reduce": True})
    checks["moe_shared_all_masked"] = lambda: moe_shared_case(5, torch.zeros(5, dtype=torch.bool))  # shared only

    # ---- routing statistics written by the grouping (fused_moe(..., stats=...)): expert_counts_ref of the routed
    # slots ids[:, :k] of the unmasked tokens, from the gate/up kernel's own grouping (program (0, 0)) or the align
    # kernel's; the output unchanged; every entry written (the buffers start as garbage)
    def moe_stats_case(n, mask=None, config=None, hot=None, shared=False, counts=True, want_path=None):
        import kernels.moe_triton as MT
        from kernels.moe import expert_counts_ref

        x = torch.randn(n, H)
        logits = torch.randn(n, E + 1 if shared else E)
        if hot is not None:
            logits[:, hot] += 10.0
        w, ids = route_ref(logits, K, True, shared=shared)
        ws = (torch.randn(2 * I, H) / H ** 0.5, torch.randn(H, I) / I ** 0.5) if shared else None
        launched = []

        class Spy:  # which kernel wrote the statistics (the STATS flag of each grouping launch)
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                def launch(*args, **kw):
                    fused = kw.get("FUSED_ALIGN", True)
                    if fused:  # (the gate/up kernel's flag matters only with the grouping inside it)
                        launched.append((self.name, int(args[11 if self.name == "gate_up" else 10])))
                    return self.kernel[grid](*args, **kw)

                return launch

        real = MT._moe_gate_up_kernel, MT._moe_align_kernel
        MT._moe_gate_up_kernel, MT._moe_align_kernel = Spy("gate_up", real[0]), Spy("align", real[1])
        try:
            d_out = torch.full((), -7, dtype=torch.int64)
            c_out = torch.full((E,), -7, dtype=torch.int64) if counts else None
            out = fused_moe_triton(x, w_gu, w_dn, w, ids, mask, config=config, shared=ws, stats=(d_out, c_out))
        finally:
            MT._moe_gate_up_kernel, MT._moe_align_kernel = real
        d_ref, c_ref = expert_counts_ref(ids[:, :K], mask, E)
        # the reference writes the same buffers
        d_out2 = torch.full((), -7, dtype=torch.int64)
        c_out2 = torch.full((E,), -7, dtype=torch.int64) if counts else None
        ref = fused_moe_ref(x, w_gu, w_dn, w, ids, mask, shared=ws, stats=(d_out2, c_out2))
        if int(d_out) != int(d_ref) or int(d_out2) != int(d_ref):
            return f"distinct {int(d_out)} / ref path {int(d_out2)} != {int(d_ref)}"
        if counts and (not torch.equal(c_out, c_ref) or not torch.equal(c_out2, c_ref)):
            return f"counts {c_out.tolist()} / ref path {c_out2.tolist()} != {c_ref.tolist()}"
        if want_path is not None:
            flag = 2 if counts else 1
            writers = [name for name, f in launched if f == flag]
            if writers != [want_path] or any(f not in (0, flag) for _, f in launched):
                return f"statistics written by {launched}, want one {want_path} launch with flag {flag}"
        return _rel(out, ref)

    fa, sa = {"fuse_align": True}, {"fuse_align": False}
    mask40 = torch.rand(40) < 0.6
    checks["moe_stats_fused_align"] = lambda: moe_stats_case(13, None, fa, want_path="gate_up")
    checks["moe_stats_fused_align_mask"] = lambda: moe_stats_case(13, mask13, fa, want_path="gate_up")
    checks["moe_stats_align"] = lambda: moe_stats_case(13, None, sa, want_path="align")
    checks["moe_stats_align_mask"] = lambda: moe_stats_case(13, mask13, sa, want_path="align")
    checks["moe_stats_shared_fused_align_mask"] = lambda: moe_stats_case(13, mask13, fa, shared=True,
                                                                         want_path="gate_up")
    checks["moe_stats_shared_align_mask"] = lambda: moe_stats_case(13, mask13, sa, shared=True, want_path="align")
    checks["moe_stats_shared_fused_align"] = lambda: moe_stats_case(7, None, fa, shared=True, want_path="gate_up")
    # one expert in every token's slots: 40 of one expert (3 blocks of 16), NK_P2 = 128 inside gate/up
    checks["moe_stats_hot_fused_align"] = lambda: moe_stats_case(40, None, fa, hot=5, want_path="gate_up")
    checks["moe_stats_hot_align"] = lambda: moe_stats_case(40, mask40, sa, hot=5, want_path="align")
    checks["moe_stats_shared_hot_align_mask"] = lambda: moe_stats_case(40, mask40, sa, hot=2, shared=True,
                                                                       want_path="align")
    zeros5 = torch.zeros(5, dtype=torch.bool)
    checks["moe_stats_all_masked"] = lambda: moe_stats_case(5, zeros5, fa, want_path="gate_up")
    checks["moe_stats_shared_all_masked"] = lambda: moe_stats_case(5, zeros5, fa, shared=True, want_path="gate_up")
    checks["moe_stats_shared_all_masked_align"] = lambda: moe_stats_case(5, zeros5, sa, shared=True,
                                                                         want_path="align")
    checks["moe_stats_distinct_only"] = lambda: moe_stats_case(13, mask13, fa, shared=True, counts=False,
                                                               want_path="gate_up")
    checks["moe_stats_distinct_only_align"] = lambda: moe_stats_case(13, mask13, sa, counts=False, want_path="align")
    # no config: the grouping's own threshold (FUSE_ALIGN_MAX_NK routed assignments) picks the path
    checks["moe_stats_default_routing"] = lambda: max(moe_stats_case(3, None, None, shared=True, want_path="gate_up"),
                                                      moe_stats_case(30, mask40[:30], None, shared=True,
                                                                     want_path="align"))
    checks["moe_stats_block32"] = lambda: moe_stats_case(
        13, mask13, {"block_m": 32, "gate_up": (16, 16, 4, 2), "down": (16, 16, 4, 2), "fuse_align": True},
        shared=True, want_path="gate_up")

    def stats_no_tokens_case():  # no assignments: no grouping runs, the statistics are zeros
        d, c = torch.full((), -7, dtype=torch.int64), torch.full((E,), -7, dtype=torch.int64)
        w, ids = route_ref(torch.randn(0, E), K, True)
        fused_moe_triton(torch.randn(0, H), w_gu, w_dn, w, ids, None, stats=(d, c))
        return 0.0 if int(d) == 0 and int(c.abs().sum()) == 0 else f"{int(d)} {c.tolist()}"

    checks["moe_stats_no_tokens"] = stats_no_tokens_case

    def stats_bad_buffers_case():  # wrong dtype / shape: a named error, not a kernel writing past a buffer
        w, ids = route_ref(torch.randn(3, E), K, True)
        bad = [(torch.zeros((), dtype=torch.int32), None), (torch.zeros((), dtype=torch.int64), torch.zeros(E + 1)),
               (torch.zeros((), dtype=torch.int64), torch.zeros(E + 1, dtype=torch.int64)),
               (torch.zeros(2, dtype=torch.int64), None)]
        for stats in bad:
            try:
                fused_moe_triton(torch.randn(3, H), w_gu, w_dn, w, ids, None, stats=stats)
            except ValueError:
                continue
            return f"no error for {[(t.dtype, tuple(t.shape)) for t in stats if t is not None]}"
        return 0.0

    checks["moe_stats_bad_buffers"] = stats_bad_buffers_case

    # ---- per-assignment GEMVs (up to MOE_GEMV_MAX_N tokens by default; config "gemv" forces either path)
    gemv = {"gemv": True}
    mask2 = torch.tensor([True, False])
    checks["moe_gemv_one_token"] = lambda: moe_case(1)
    checks["moe_gemv_two_tokens_mask"] = lambda: moe_case(2, mask2)
    checks["moe_gemv_forced_mask"] = lambda: moe_case(13, mask13, config={"gemv": True, "gemv_tiles": (4, 4, 8, 4)})
    # a program's slice wider than I (16) and H (32): masks cover the tails
    checks["moe_gemv_tiles_past_the_widths"] = lambda: moe_case(5, None, config={"gemv": True,
                                                                                 "gemv_tiles": (32, 4, 64, 4)})
    checks["moe_gemv_all_masked"] = lambda: (lambda o: float(o.abs().max()))(
        fused_moe_triton(torch.randn(2, H), w_gu, w_dn, *route_ref(torch.randn(2, E), K, True),
                         torch.zeros(2, dtype=torch.bool)))
    checks["moe_gemv_shared_one_token"] = lambda: moe_shared_case(1)
    checks["moe_gemv_shared_masked_token"] = lambda: moe_shared_case(1, torch.tensor([False]))  # its shared slot
    checks["moe_gemv_shared_wider"] = lambda: moe_shared_case(13, mask13, config=gemv, inter_s=48)
    checks["moe_gemv_shared_narrower"] = lambda: moe_shared_case(2, mask2, inter_s=8)
    checks["moe_gemv_stats"] = lambda: max(moe_stats_case(1, None, None, shared=True),
                                           moe_stats_case(13, mask13, gemv, shared=True),
                                           moe_stats_case(13, mask13, gemv, hot=3))
    checks["moe_gemv_stats_distinct_only"] = lambda: moe_stats_case(2, mask2, None, shared=True, counts=False)

    def gemv_routing_case():  # which path each call takes: GEMVs up to MOE_GEMV_MAX_N tokens, or as configured
        import kernels.moe_triton as MT

        launched = []

        class Spy:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                def launch(*args, **kw):
                    launched.append(self.name)
                    return self.kernel[grid](*args, **kw)

                return launch

        real = MT._moe_gemv_gate_up_kernel, MT._moe_gate_up_kernel
        MT._moe_gemv_gate_up_kernel, MT._moe_gate_up_kernel = Spy("gemv", real[0]), Spy("grouped", real[1])
        try:
            calls = [(n, None) for n in range(1, MT.MOE_GEMV_MAX_N + 2)] + [(1, {"gemv": False}), (5, gemv),
                                                                             (1, {"fuse_reduce": True}),
                                                                             (1, {"down": (16, 16, 4, 2)})]
            for n, config in calls:
                fused_moe_triton(torch.randn(n, H), w_gu, w_dn, *route_ref(torch.randn(n, E), K, True),
                                 config=config)
        finally:
            MT._moe_gemv_gate_up_kernel, MT._moe_gate_up_kernel = real
        # (a config of the grouped kernels' own keys runs them at any size)
        want = ["gemv"] * MT.MOE_GEMV_MAX_N + ["grouped", "grouped", "gemv", "grouped", "grouped"]
        return 0.0 if launched == want and MT.MOE_GEMV_MAX_N >= 1 else f"{launched} != {want}"

    checks["moe_gemv_routing"] = gemv_routing_case

    def gemv_fuse_reduce_case():  # the GEMVs leave the sum to the reduce kernel: asking for both is an error
        try:
            fused_moe_triton(torch.randn(1, H), w_gu, w_dn, *route_ref(torch.randn(1, E), K, True),
                             config={"gemv": True, "fuse_reduce": True})
        except ValueError as e:
            return 0.0 if "gemv" in str(e) and "fuse_reduce" in str(e) else str(e)
        return "no error"

    checks["moe_gemv_fuse_reduce_refused"] = gemv_fuse_reduce_case

    def shared_elsewhere_case(n, mask, inter_s):  # the shared slot first, not route's last: the same rows
        x = torch.randn(n, H)
        w, ids = route_ref(torch.randn(n, E + 1), K, True, shared=True)
        order = torch.tensor([K] + list(range(K)))
        w, ids = w[:, order].contiguous(), ids[:, order].contiguous()
        ws = (torch.randn(2 * inter_s, H) / H ** 0.5, torch.randn(H, inter_s) / inter_s ** 0.5)
        out = fused_moe_triton(x, w_gu, w_dn, w, ids, mask, config={"gemv": True}, shared=ws)
        return _rel(out, fused_moe_ref(x, w_gu, w_dn, w, ids, mask, shared=ws))

    def gemv_early_case():  # a captured step's order (kernels/pdl.py early_reads): the down GEMV reads its routing
        # and first weight tile before its prologue, a masked assignment's program passes its prologue and returns;
        # the gate/up's shared programs sum before theirs and check the slot's id after it
        import kernels.moe_triton as MT

        real, shared_early, kernel = MT.early_reads, MT.MOE_SHARED_EARLY, MT._moe_gemv_gate_up_kernel
        flags = []

        class Spy:  # the gate/up launch's `early`: the shared sums before the wait where x is no copy made just now
            def __getitem__(self, grid):
                return lambda *args, **kw: (flags.append(kw["early"]), kernel[grid](*args, **kw))[1]

        MT.early_reads, MT.MOE_SHARED_EARLY, MT._moe_gemv_gate_up_kernel = (lambda device: True), True, Spy()
        try:
            moe_case(1)  # no shared expert: nothing early
            moe_shared_case(1)
            moe_shared_case(1, x_stride=2)  # x a strided view: fused_moe copies it, so the copy is read after the wait
            if flags != [0, 1, 0]:
                return f"gate/up early flags {flags} != [0, 1, 0]"
            MT._moe_gemv_gate_up_kernel = kernel
            return max(moe_case(1), moe_case(2, mask2), moe_shared_case(2, mask2),
                       moe_shared_case(1, torch.tensor([False]), inter_s=48),
                       moe_shared_case(2, None, inter_s=8), shared_elsewhere_case(1, None, I),
                       shared_elsewhere_case(2, mask2, 48), shared_elsewhere_case(2, None, 8))
        finally:
            MT.early_reads, MT.MOE_SHARED_EARLY, MT._moe_gemv_gate_up_kernel = real, shared_early, kernel

    checks["moe_gemv_early_reads"] = gemv_early_case

    # ---- paged KV: B=3, q lens {1, 5, 17}, context lens {0, 7, 30}, page size 4, shuffled pages, GQA 2
    HQ, HKV, D, PS = 4, 2, 32, 4

    def paged_batch(q_lens, ctx_lens):
        pages_needed = [-(-(c + t) // PS) for c, t in zip(ctx_lens, q_lens)]
        num_pages = sum(pages_needed) + 3
        perm = torch.randperm(num_pages)
        table = torch.zeros(len(q_lens), max(pages_needed), dtype=torch.int32)
        used = 0
        for i, p in enumerate(pages_needed):
            table[i, :p] = perm[used : used + p].int()
            used += p
        k_cache = torch.randn(num_pages, PS, HKV, D)
        v_cache = torch.randn(num_pages, PS, HKV, D)
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        ctx = torch.tensor(ctx_lens, dtype=torch.int32)
        n = sum(q_lens)
        positions = torch.cat([torch.arange(c, c + t) for c, t in zip(ctx_lens, q_lens)]).long()
        owner = torch.cat([torch.full((t,), i) for i, t in enumerate(q_lens)]).long()
        return table, k_cache, v_cache, cu, ctx, n, positions, owner

    def write_case():
        table, kc, vc, cu, ctx, n, pos, owner = paged_batch([1, 5, 17], [0, 7, 30])
        k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        kc2, vc2 = kc.clone(), vc.clone()
        write_kv_triton(k, v, kc, vc, table, pos, owner)
        write_kv_ref(k, v, kc2, vc2, table, pos, owner)
        return max(_rel(kc, kc2), _rel(vc, vc2))

    checks["write_kv"] = write_case

    def attn_case(q_lens, ctx_lens, plan=None, hints=True, gated=False, **kw):
        table, kc, vc, cu, ctx, n, pos, owner = paged_batch(q_lens, ctx_lens)
        q = torch.randn(n, HQ, D)
        # the gate as the model passes it: the second half of a fused [N, H, 2D] q/gate projection (strided rows)
        gate = torch.randn(n, HQ, 2 * D)[..., D:] * 3 if gated else None
        scale = D ** -0.5
        ref = paged_attention_ref(q, kc, vc, table, cu, ctx, scale, list(q_lens), list(ctx_lens), gate)
        if gated:  # the reference's gating is the model's former o * sigmoid(gate)
            plain = paged_attention_ref(q, kc, vc, table, cu, ctx, scale, list(q_lens), list(ctx_lens))
            assert torch.equal(ref, plain * torch.sigmoid(gate))
        if hints:
            out = paged_attention_triton(q, kc, vc, table, cu, ctx, scale, list(q_lens), list(ctx_lens), gate,
                                         plan=plan, **kw)
        else:
            out = paged_attention_triton(q, kc, vc, table, cu, ctx, scale, None, None, plan=plan)
        return _rel(out, ref)

    checks["attn_default"] = lambda: attn_case([1, 5, 17], [0, 7, 30])
    checks["attn_splits"] = lambda: attn_case([1, 5, 17], [0, 7, 30], plan={"splits": 3, "block_n": 16})
    # 16-row tiles = 8 tokens x 2 heads, one program per request striding over 3 tiles
    checks["attn_small_tiles"] = lambda: attn_case([1, 5, 17], [0, 7, 30],
                                                   plan={"block_m": 16, "tpt": 8, "grid_m": 1, "block_n": 16})
    checks["attn_prefill"] = lambda: attn_case([70, 3], [5, 0])
    checks["attn_no_hints"] = lambda: attn_case([2, 9, 1], [12, 0, 3], hints=False)
    checks["attn_bm128"] = lambda: attn_case([1, 5, 17], [0, 7, 30], plan={"block_m": 128, "tpt": 8, "grid_m": 2,
                                                                        "block_n": 32, "splits": 2})
    checks["attn_fresh_prefill_sdpa"] = lambda: attn_case([70, 81], [0, 0], prefill_sdpa=True)  # fresh prompts
    checks["attn_fresh_prefill_triton"] = lambda: attn_case([70, 81], [0, 0], prefill_sdpa=False)
    checks["attn_gated"] = lambda: attn_case([1, 5, 17], [0, 7, 30], gated=True)  # the epilogue gates
    checks["attn_gated_splits"] = lambda: attn_case([1, 5, 17], [0, 7, 30], plan={"splits": 3, "block_n": 16},
                                                    gated=True)  # the combine kernel gates
    checks["attn_gated_fresh_prefill_sdpa"] = lambda: attn_case([70, 81], [0, 0], prefill_sdpa=True, gated=True)

    def qk_prep_case(d=D, r=D // 4, fused_kv=False, n_rows=None):
        """Ragged rows, a strided q (the fused q/gate projection), partial rotary (R = D / 4 by default);
        fused_kv: k and v as column slices of one [N, 2 HKV D] projection; n_rows=0: no rows at all."""
        from kernels.attention import qk_norm_rope_write_ref
        from kernels.attention_triton import qk_norm_rope_write_triton
        q_lens, ctx_lens = ([1, 5, 17], [0, 7, 30]) if n_rows is None else ([0], [3])
        table, _, _, cu, ctx, n, pos, owner = paged_batch(q_lens, ctx_lens)
        kc, vc = torch.randn(table.numel() + 3, PS, HKV, d), torch.randn(table.numel() + 3, PS, HKV, d)
        q = torch.randn(n, HQ, 2 * d)[..., :d] * 2
        if fused_kv:
            kv = torch.randn(n, 2 * HKV * d + 8)
            k, v = kv[:, :HKV * d].view(n, HKV, d), kv[:, HKV * d: 2 * HKV * d].view(n, HKV, d)
        else:
            k, v = torch.randn(n, HKV, d), torch.randn(n, HKV, d)
        qw, kw = torch.randn(d) * 0.1, torch.randn(d) * 0.1
        ang = pos.float()[:, None] * torch.rand(r // 2)[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        kc2, vc2 = kc.clone(), vc.clone()
        out = qk_norm_rope_write_triton(q, k, v, qw, kw, 1e-6, cos, sin, r, kc, vc, table, pos, owner)
        ref = qk_norm_rope_write_ref(q, k, v, qw, kw, 1e-6, cos, sin, r, kc2, vc2, table, pos, owner)
        if out.shape != (n, HQ, d):
            return f"shape {tuple(out.shape)}"
        return max(_rel(out, ref) if n else 0.0, _rel(kc, kc2), _rel(vc, vc2))

    checks["qk_norm_rope_write"] = qk_prep_case
    # every dim rotated, k/v read in place from one projection; a head dim that is not a power of two; no rows
    checks["qk_norm_rope_write_full_rotary_fused_kv"] = lambda: qk_prep_case(r=D, fused_kv=True)
    checks["qk_norm_rope_write_d80_no_rows"] = lambda: max(qk_prep_case(d=80, r=20), qk_prep_case(n_rows=0))

    def gate_shape_case():  # a gate of another shape (e.g. the [N, H * D] the model once multiplied) is refused
        table, kc, vc, cu, ctx, n, pos, owner = paged_batch([1, 5], [3, 0])
        q = torch.randn(n, HQ, D)
        for fn in (paged_attention_ref, paged_attention_triton):
            try:
                fn(q, kc, vc, table, cu, ctx, D ** -0.5, [1, 5], [3, 0], torch.randn(n, HQ * D))
            except ValueError as e:
                if "gate" not in str(e):
                    return str(e)
                continue
            return f"{fn.__name__}: no error for a [N, H * D] gate"
        return 0.0

    checks["attn_gate_shape_refused"] = gate_shape_case

    results = {}
    for name in CASES:
        try:
            results[name] = float(checks[name]())
        except Exception as exc:  # reported per case by the pytest side
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the pytest fixture does)")
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_checks()))
