"""The GPU-session bench scripts run end to end in their --tiny CPU mode (a broken script would waste device
time): bench/host_profile.py (host time of a step's parts per policy), bench/step_timeline.py (a step's wall vs GPU
time per part), bench/verify_overhead.py (hybridspec's verification graphs vs budget's), bench/moe_tiles.py (the
MoE's tile candidates, each checked against the reference), bench/host_phases.py (host time by part without a
profiler), bench/router_logits.py (the router's two logits kernels) and bench/small_kernels.py (the route, MoE tail and
norm kernels' warps), bench/lm_head.py (the LM head's fp32 logits against the top-4 recompute),
bench/gdn_verify2.py (every GDN verification variant's check against the reference), bench/moe_gemv.py (the MoE's
GEMV tiles against the grouped path), bench/step_ab.py (a setting's A/B on the graphed step); bench/e2e_merge.py (its
merges, on synthetic results); bench/kernels_table.py (issue 6's table judged against its targets, from earlier runs'
JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
        assert parts["execute (whole step)"] > parts["forward: graphs.run (target + drafter cost)"] > 0
    # budget always plans; hybridspec's gate may measure plain decoding faster on a CPU and stop drafting
    assert report["policies"]["budget"]["parts_ms_per_step"]["plan: lengths"] > 0
    assert report["policies"]["hybridspec"]["parts_ms_per_step"]["gate: should_draft"] > 0
    assert "== hybridspec" in (tmp_path / "host_profile.txt").read_text()


def test_host_phases_tiny_times_each_policys_parts_by_step_kind(tmp_path):
    out = tmp_path / "phases.json"
    run_script("host_phases.py", "--phases-out", str(out), "--concurrency", "1", "--prompt-len", "16", "--max-new",
               "8", "--cell-tokens", "8", "--acceptance", "0.9", "--policies", "budget,hybridspec",
               "--out", str(tmp_path / "e2e"))
    table = json.loads(out.read_text())
    assert table["ar|plain|execute+sync"][1] > 0 and "ar|spec|execute+sync" not in table  # ar never drafts
    for name in ("budget", "hybridspec"):
        total, calls, per, median = table[f"{name}|spec|execute+sync"]
        assert calls > 0 and per == total / calls and 0 < median <= total
        assert 0 < table[f"{name}|spec|ReplayDrafter.propose"][2] < per  # a part of the step
        assert table[f"{name}|spec|lengths"][1] == calls
    assert table["hybridspec|spec|gate: mark"][1] > 0 and "budget|spec|gate: mark" not in table  # budget: no gate
    assert table["ar|plain|cp: between"][1] > 0  # the engine's loop between steps (the graph stamps: CUDA only)
    out2 = tmp_path / "plain.json"
    run_script("host_phases.py", "--phases-out", str(out2), "--force-plain", "--concurrency", "1", "--prompt-len",
               "16", "--max-new", "8", "--cell-tokens", "8", "--policies", "hybridspec", "--out", str(tmp_path / "p"))
    forced = json.loads(out2.read_text())
    assert forced["hybridspec|plain|execute+sync"][1] > 0 and "hybridspec|spec|execute+sync" not in forced


def test_host_phases_records_served_decode_steps_only():
    """A step that captured a graph, a prefill chunk or an unreported batch size adds nothing; a served decode step
    adds each part under its kind (spec when the runner drafted)."""
    import types

    sys.path.insert(0, str(ROOT))
    import bench.host_phases as hp

    ph = hp.Phases()
    ph.policy = "hybridspec"
    decode = [types.SimpleNamespace(tokens=[5], context_len=9)] * hp.KINDS_OF_BATCH[0]
    ph.step.update({"execute+sync": 3.0, "lengths": 0.5})
    ph.record(types.SimpleNamespace(last_step_captured=True, last_draft_width=4), decode)
    ph.record(types.SimpleNamespace(last_step_captured=False, last_draft_width=4),
              [types.SimpleNamespace(tokens=[5, 6], context_len=0)] * hp.KINDS_OF_BATCH[0])
    ph.record(types.SimpleNamespace(last_step_captured=False, last_draft_width=0), decode * 3)  # not a kept size
    assert not ph.acc
    ph.record(types.SimpleNamespace(last_step_captured=False, last_draft_width=4), decode)
    ph.step["execute+sync"] = 5.0
    ph.record(types.SimpleNamespace(last_step_captured=False, last_draft_width=0), decode)
    table = ph.table()
    assert table["hybridspec|spec|execute+sync"] == [3.0, 1, 3.0, 3.0]
    assert table["hybridspec|plain|execute+sync"] == [5.0, 1, 5.0, 5.0] and "hybridspec|spec|lengths" in table
    hp.KINDS_OF_BATCH.append(3)  # a batch of 3: its own kind
    try:
        ph.record(types.SimpleNamespace(last_step_captured=False, last_draft_width=0), decode * 3)
    finally:
        hp.KINDS_OF_BATCH.pop()
    assert ph.table()["hybridspec|plain@3|execute+sync"] == [5.0, 1, 5.0, 5.0]


def test_router_logits_tiny_checks_both_kernels(tmp_path):
    run_script("router_logits.py", "--out", str(tmp_path))
    report = json.loads((tmp_path / "router_logits.json").read_text())
    assert report["bad"] == [] and [r["N"] for r in report["rows"]] == [1, 2, 3, 4, 6]
    for r in report["rows"]:
        assert max(r["gemv_rel_err"], r["dot_rel_err"], r["routed_rel_err"]) < 1e-5


def test_lm_head_tiny_checks_the_recompute_path(tmp_path):
    run_script("lm_head.py", "--out", str(tmp_path))
    report = json.loads((tmp_path / "lm_head.json").read_text())
    assert report["bad"] == [] and [r["M"] for r in report["rows"]] == [1, 3]
    assert all(r["old_argmax_is_exact"] for r in report["rows"])


def test_small_kernels_tiny_checks_every_warp_count(tmp_path):
    run_script("small_kernels.py", "--out", str(tmp_path))
    report = json.loads((tmp_path / "small_kernels.json").read_text())
    assert report["bad"] == [] and {(r["kernel"], r["warps"]) for r in report["rows"]} == {
        *(("route", w) for w in (1, 2, 4, 8)),
        *((k, w) for k in ("moe_tail", "add_rmsnorm", "rmsnorm_head") for w in (1, 2, 4, 8, 16))}
    assert all(r["equal"] for r in report["rows"])


def test_gdn_verify2_tiny_checks_every_variant(tmp_path):
    run_script("gdn_verify2.py", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gdn_verify2.json").read_text())
    from bench.gdn_verify2 import FACTORED
    assert report["errors"] == [] and set(report["checks"]) == {"block", "seq", "f default @17", *FACTORED,
                                                                 "seq mask", f"{next(iter(FACTORED))} mask"}
    for name, check in report["checks"].items():  # bf16 inputs and outputs: one rounding of o
        assert check["o_err"] < 1e-2 and check["state_untouched"], name
        assert check.get("state_err", 0.0) < 1e-5, name  # the masked call's written states (fp32)


def test_verify_overhead_tiny_times_both_graph_sets(tmp_path):
    run_script("verify_overhead.py", "--reps", "1", "--shapes", "1x4,2x3", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "verify_overhead.json").read_text())["rows"]
    assert [(r["B"], r["T"]) for r in rows] == [(1, 4), (2, 3)]
    for r in rows:
        assert min(r["budget"], r["hybridspec"], r["hybridspec+extra"]) > 0
        assert r["hybridspec_over_budget_ms"] == r["hybridspec"] - r["budget"]


def test_step_timeline_tiny_labels_each_part(tmp_path):
    run_script("step_timeline.py", "--concurrency", "2", "--prompt-len", "16", "--max-new", "8",
               "--policies", "ar,budget,hybridspec", "--out", str(tmp_path))
    report = json.loads((tmp_path / "step_timeline.json").read_text())
    assert set(report["policies"]) == {"ar", "budget", "hybridspec"}
    for name, r in report["policies"].items():
        assert r["tokens_match_ar"], name
        assert r["steps"] > 0 and r["wall_ms"] > 0
        assert r["host_ms"]["graph run"] > 0
    host = report["policies"]["budget"]["host_ms"]
    assert host["plan: lengths"] > 0 and host["draft: cost forward"] > 0
    assert report["policies"]["hybridspec"]["host_ms"]["gate"] > 0  # (its gate may stop drafting on a CPU)
    assert "draft: propose" not in report["policies"]["ar"]["host_ms"]  # ar never drafts


def test_step_timeline_attributes_kernels_to_the_part_that_launched_them():
    from bench.step_timeline import STEP, analyse

    def note(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 1,
                "args": {"correlation": corr}}

    def kernel(corr, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    labels = ["draft: cost forward", "graph run", "plan: lengths"]
    trace = {"traceEvents": [
        note(STEP, 0, 10_000), note("draft: cost forward", 100, 500), note("graph run", 200, 100),
        note("plan: lengths", 700, 1000), note("graph run", 2000, 200),
        launch(1, 250), kernel(1, 300, 2000),  # the drafter's graph: 2 ms
        launch(2, 2100), kernel(2, 2300, 5000),  # the target's: 5 ms, starts after the drafter's ends
        launch(3, 20_000), kernel(3, 20_000, 1000),  # outside the step: ignored
        note(STEP, 12_000, 1000)]}
    out = analyse(trace, labels)
    assert out["steps"] == 2
    assert out["gpu_ms"] == {"draft: cost forward": 1.0, "target forward": 2.5}  # means over the two steps
    assert abs(out["gpu_busy_ms"] - 3.5) < 1e-9  # (2 + 5) ms busy in the first step, 0 in the second
    assert abs(out["host_ms"]["plan: lengths"] - 0.5) < 1e-9
    assert abs(out["between_steps_ms"] - 2.0) < 1e-9


def test_e2e_tiny_repeats_alternate_policies_and_sum_their_runs(tmp_path):
    """bench/e2e.py --repeats 2: ar runs in every cell's rounds, each row lists both runs and sums them, speedups
    are over the same cell's ar, speculative runs stay lossless, rows carry tokens per step; ar in --policies and
    --repeats 0 are refused before anything runs."""
    run_script("e2e.py", "--concurrency", "2", "--acceptance", "0.7", "--policies", "fixed4,hybridspec-lean",
               "--repeats", "2", "--prompt-len", "16", "--max-new", "10", "--cell-tokens", "10", "--warm-new", "4",
               "--out", str(tmp_path))
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    cell_ar = next(r for r in rows if r["policy"] == "ar" and r["acceptance"] == 0.7)
    assert len(cell_ar["runs_decode_tokens_per_s"]) == 2
    for policy in ("fixed4", "hybridspec-lean"):
        row = next(r for r in rows if r["policy"] == policy)
        runs = row["runs_decode_tokens_per_s"]
        assert len(runs) == 2 and min(runs) <= row["decode_tokens_per_s"] <= max(runs)  # the sum of both runs
        assert row["speedup_vs_ar"] == row["decode_tokens_per_s"] / cell_ar["decode_tokens_per_s"]
        assert row["greedy_match"] == 1.0 and row["tokens_per_step_mean"] >= 2  # two requests, plus drafts
        assert row["eager_decode_steps"] == 0  # every decode step in a graph bucket (reported when one is not)
        binned = sum(n for n, _ in row["step_ms_by_tokens"].values())  # decode steps (no prefill, no capture)
        assert 0 < binned <= row["steps"] - row["capture_steps"]
        widths = {int(w): n for w, n in row["drafted_width_steps"].items()}  # drafted decode steps by drafts asked
        # (fixed4 drafts every decode step; hybridspec's gate decides from measured times, and on a busy machine may
        # decode a short run plainly)
        assert (widths or policy != "fixed4") and sum(widths.values()) <= binned and max(widths, default=0) <= 16
        # the other decode steps (no drafts) by the graph bucket they ran, with their median ms: both runs pooled
        plain = row["plain_step_ms_by_bucket"]
        assert sum(n for n, _ in plain.values()) == binned - sum(widths.values())
        assert all(k.startswith(("1x", "2x")) and " block " in k and ms > 0 for k, (n, ms) in plain.items())
        # the steps that ran both requests (the closed batch's tail left out): a share of the decode time
        assert row["full_batch_tokens_per_s"] > 0 and 0 < row["full_batch_step_share"] <= 1
        assert row["full_batch_speedup_vs_ar"] == row["full_batch_tokens_per_s"] / cell_ar["full_batch_tokens_per_s"]
        if policy == "hybridspec-lean":  # the latency model's worst samples: [abs %, index, predicted, measured, x]
            worst = row["latency_model_worst"]
            # (the error's stats cover the last `window` samples, the worst list every one: the warm-up's too)
            assert worst and worst[0][0] >= row["latency_model_error_pct"]["max"] * (1 - 1e-3)
            assert 0 < worst[0][1] <= row["latency_model_observed"] and len(worst[0][4]) == 5
        # the host's time between decode steps, outside decode_s: with it the rate is lower
        assert row["between_steps_ms_mean"] > 0
        assert 0 < row["decode_with_between_tokens_per_s"] < row["decode_tokens_per_s"]
        assert row["with_between_speedup_vs_ar"] == (row["decode_with_between_tokens_per_s"]
                                                     / cell_ar["decode_with_between_tokens_per_s"])
        if policy == "fixed4":  # 4 drafts asked, fewer near a request's end (the scheduler's cap)
            assert max(widths) == 4 and widths[4] >= max((n for w, n in widths.items() if w != 4), default=0)
    assert 0 < cell_ar["full_batch_step_share"] <= 1
    for bad in (["--policies", "ar,budget"], ["--repeats", "0"]):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--tiny", *bad, "--out", str(tmp_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and ("--policies" in out.stderr or "--repeats" in out.stderr), out.stderr


def test_e2e_tiny_plain_path_variants(tmp_path):
    """The two A/A variants for the plain path: ar-drafter (ar with the replay drafter attached, never asked: no
    drafts, no draft pages) and hybridspec-plain (the gate decodes every step plainly); both lossless, their rows
    carry their speedup over the cell's ar (run in the cell's round), hybridspec-plain its (zero) speculative
    share."""
    run_script("e2e.py", "--concurrency", "2", "--acceptance", "0.5", "--policies", "ar-drafter,hybridspec-plain",
               "--prompt-len", "16", "--max-new", "12", "--cell-tokens", "12", "--warm-new", "4", "--freeze-heap", "0",
               "--out", str(tmp_path))
    result = json.loads((tmp_path / "e2e.json").read_text())
    rows = result["rows"]
    assert result["meta"]["freeze_heap"] is False  # (the A/B switch; the default is the engine's frozen heap)
    # ar runs in the cell's round also at --repeats 1: the speedups are over that run, not the concurrency's first
    cell_ar = next(r for r in rows if r["policy"] == "ar" and r["acceptance"] == 0.5)
    for policy in ("ar-drafter", "hybridspec-plain"):
        row = next(r for r in rows if r["policy"] == policy)
        assert row["greedy_match"] == 1.0 and row["draft_tokens"] == 0 and row["drafted_width_steps"] == {}
        assert row["speedup_vs_ar"] > 0 and row["tokens_per_step_mean"] == 2  # plain steps of both requests
        # every decode step was plain: all of them by bucket, ar's too (its plain steps in the same buckets)
        buckets = row["plain_step_ms_by_bucket"]
        assert sum(n for n, _ in buckets.values()) == sum(n for n, _ in row["step_ms_by_tokens"].values())
        assert set(buckets) <= set(cell_ar["plain_step_ms_by_bucket"]) | {"eager"}
    assert len(cell_ar["runs_decode_tokens_per_s"]) == 1
    for policy in ("ar-drafter", "hybridspec-plain"):
        row = next(r for r in rows if r["policy"] == policy)
        assert row["speedup_vs_ar"] == row["decode_tokens_per_s"] / cell_ar["decode_tokens_per_s"]
    plain = next(r for r in rows if r["policy"] == "hybridspec-plain")
    assert plain["speculative_step_share"] == 0.0 and "latency_model_error_pct" in plain
    assert "latency_model_error_pct" not in next(r for r in rows if r["policy"] == "ar-drafter")


def test_e2e_measured_runs_start_from_a_frozen_heap_or_a_collected_one():
    """bench/e2e.py's measured_start: --freeze-heap 1 freezes the heap as a started engine on CUDA does (the
    default), 0 collects and leaves it in the collector's generations."""
    import argparse
    import gc

    sys.path.insert(0, str(ROOT))
    from bench.e2e import measured_start

    try:
        measured_start(argparse.Namespace(freeze_heap=1))
        assert gc.get_freeze_count() > 0
        measured_start(argparse.Namespace(freeze_heap=0))
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_moe_tiles_tiny_checks_every_candidate_against_the_reference(tmp_path):
    """Every tile candidate bench/moe_tiles.py times on the GPU compiles and equals fused_moe_ref (interpreter)."""
    from bench.moe_tiles import candidates

    subprocess.run([sys.executable, str(ROOT / "bench" / "moe_tiles.py"), "--tiny", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    errors = json.loads((tmp_path / "moe_tiles.json").read_text())["tiny_errors"]
    assert len(errors) == 2 * len(candidates()) and max(errors.values()) < 1e-4


def test_moe_gemv_tiny_checks_every_variant_against_both_paths(tmp_path):
    """Every GEMV tile variant bench/moe_gemv.py times on the GPU equals the grouped path and the reference."""
    from bench.moe_gemv import VARIANTS

    run_script("moe_gemv.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "moe_gemv.json").read_text())["rows"]
    assert {(r["N"], r["variant"]) for r in rows} == {(n, v) for n in (1, 2) for v in ("grouped", *VARIANTS)}
    assert all(r["max_abs_diff_vs_grouped"] < 1e-5 and r["max_abs_diff_vs_ref"] < 1e-5 for r in rows)


def test_step_ab_tiny_alternates_the_setting_and_restores_it(tmp_path):
    """The script's plumbing (on CPU the model runs the PyTorch references: the setting cannot change the steps)."""
    run_script("step_ab.py", "--set", "kernels.moe_triton.MOE_GEMV_MAX_N=0,1", "--new", "6", "--rounds", "2",
               "--out", str(tmp_path))
    report = json.loads((tmp_path / "step_ab.json").read_text())
    assert [r["MOE_GEMV_MAX_N"] for r in report["rows"]] == [0, 1, 1, 0]
    assert all(r["greedy_match_vs_first"] == 1.0 and r["step_ms_median"] > 0 for r in report["rows"])
    assert set(report["median_step_ms"]) == {"MOE_GEMV_MAX_N=0", "MOE_GEMV_MAX_N=1"} and report["restored"]
    # two settings moving together: configuration i is each one's i-th value
    run_script("step_ab.py", "--set", "kernels.moe_triton.MOE_GEMV_MAX_N=0,2", "--set",
               "kernels.gdn_decode_triton.DECODE_SHORT_CHAIN=0,1", "--new", "4", "--rounds", "2",
               "--out", str(tmp_path))
    report = json.loads((tmp_path / "step_ab.json").read_text())
    assert [(r["config"], r["MOE_GEMV_MAX_N"], r["DECODE_SHORT_CHAIN"]) for r in report["rows"]] == [
        (0, 0, 0), (1, 2, 1), (1, 2, 1), (0, 0, 0)]
    assert set(report["median_step_ms"]) == {"MOE_GEMV_MAX_N=0, DECODE_SHORT_CHAIN=0",
                                             "MOE_GEMV_MAX_N=2, DECODE_SHORT_CHAIN=1"} and report["restored"]
    for args, why in ((["kernels.moe_triton.NO_SUCH=0,1"], "has no NO_SUCH"),
                      (["kernels.moe_triton.MOE_GEMV_MAX_N=0,1", "kernels.moe_triton.MOE_SHARED_EARLY=0,1,0"],
                       "the same number of values"),
                      (["kernels.moe_triton.MOE_GEMV_MAX_N=0,1", "kernels.moe_triton.MOE_GEMV_MAX_N=1,0"],
                       "no two of the same name")):
        cmd = [sys.executable, str(ROOT / "bench" / "step_ab.py"), "--tiny", "--out", str(tmp_path)]
        for a in args:
            cmd += ["--set", a]
        bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and why in bad.stderr


def _e2e_part(conc, rates, commit="abc", wall=1.0):
    """A synthetic e2e.json: ar's decode tok/s and each (policy, acceptance)'s."""
    rows = [{"policy": "ar", "concurrency": c, "acceptance": None, "decode_tokens_per_s": rates[("ar", c)]}
            for c in conc]
    rows += [{"policy": p, "concurrency": c, "acceptance": a, "decode_tokens_per_s": v}
             for (p, c, a), v in ((k, v) for k, v in rates.items() if k[0] != "ar") if c in conc]
    return {"meta": {"commit": commit, "layers": 2, "device": "cpu", "wall_s": wall,
                     "max_new": {str(c): 8 for c in conc}, "graphs_captured": 3}, "rows": rows}


def test_e2e_merge_parts_and_mean_of_runs(tmp_path):
    """bench/e2e_merge.py: one run's processes concatenated (a concurrency in two parts is refused), repeated runs
    averaged as speedups over each run's own ar (a cell missing from a run is refused)."""
    from bench.e2e_merge import main, mean_of_runs, merge_processes

    run1 = {("ar", 1): 100.0, ("hybridspec", 1, 0.85): 200.0, ("ar", 4): 300.0, ("hybridspec", 4, 0.85): 450.0}
    run2 = {("ar", 1): 50.0, ("hybridspec", 1, 0.85): 150.0, ("ar", 4): 200.0, ("hybridspec", 4, 0.85): 400.0}
    parts = [_e2e_part([1], run1, wall=2.0), _e2e_part([4], run1, wall=3.0)]
    merged = merge_processes(parts, note="one run")
    assert merged["meta"]["wall_s"] == 5.0 and merged["meta"]["max_new"] == {"1": 8, "4": 8}
    assert merged["meta"]["note"] == "one run" and len(merged["rows"]) == 4
    with pytest.raises(ValueError, match="more than one part"):
        merge_processes([parts[0], parts[0]])
    mean = mean_of_runs([merged, _e2e_part([1, 4], run2, commit="def")])
    got = {(r["policy"], r["concurrency"]): r["decode_tokens_per_s"] for r in mean["rows"]}
    assert got == {("ar", 1): 1.0, ("ar", 4): 1.0, ("hybridspec", 1): (2.0 + 3.0) / 2, ("hybridspec", 4): (1.5 + 2.0) / 2}
    assert mean["meta"]["commit"] == "abc + def (mean of runs)"
    with pytest.raises(ValueError, match="different cells"):
        mean_of_runs([merged, _e2e_part([1], run2)])
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(part))
    main([str(p) for p in paths] + ["--out", str(tmp_path / "run.json")])
    assert json.loads((tmp_path / "run.json").read_text())["rows"] == merged["rows"]


def test_kernels_summary_judges_each_target_from_the_parts_json(tmp_path):
    """bench/kernels_table.py (issue 6's one command) summarises its three parts' JSON against the issue's targets: from
    files of earlier GPU runs (bench/results), a part without a file is `not measured`, an unknown part is named."""
    res = ROOT / "bench" / "results"
    gdn = json.loads((res / "kernels_gdn.json").read_text())
    # a GDN table that has the factored kernel (what bench/kernels_gdn.py writes since 2026-12-02) is judged by it
    for row in gdn["table"]:
        row["factored_verify"] = 7.4 if (row["B"], row["T"]) == (1, 16) else 70.0
    (tmp_path / "gdn.json").write_text(json.dumps(gdn))
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--out", str(tmp_path / "s"),
                    "--summary-only", str(tmp_path / "gdn.json"), str(res / "kernels_moe_attn.json"),
                    str(res / "step_profile_40layers_graphs_h100_5d8ded4.json")], check=True, cwd=ROOT,
                   capture_output=True, timeout=120)
    rows = {(r["part"], r["case"].split(" (")[0].split(",")[0]): r
            for r in json.loads((tmp_path / "s" / "kernels_summary.json").read_text())["rows"]}
    assert rows[("GDN verify", "B=1 T=16")]["verdict"] == "met"  # 7.4 <= 10 us
    assert rows[("GDN verify", "B=32 T=16")]["verdict"] == "missed"  # 70 > 60 us
    assert rows[("GDN verify", "B=8 T=4")]["verdict"] == ""  # no target there
    assert rows[("MoE", "zipf N=1")]["verdict"] == "missed"  # 25.1 / 11.7 us = 2.15x
    assert rows[("MoE", "zipf N=64")]["verdict"] == "met" and rows[("MoE", "zipf N=272")]["verdict"] == ""
    assert rows[("AR step", "B=1")]["ours"].startswith("3.025 ms (2.16x floor)")
    assert rows[("AR step", "B=1")]["verdict"] == "missed"
    assert any(part == "attention" for part, _ in rows)
    for part in ("gdn", "moe_attn", "step"):  # each part's own errors and its checks' worst error
        assert rows[(part, "errors / checks")]["verdict"] in ("ok", "errors")
    assert "worst check error" in rows[("moe_attn", "errors / checks")]["ours"]
    assert (tmp_path / "s" / "kernels_summary.md").read_text().startswith("| part | case |")
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--out", str(tmp_path / "m"),
                    "--summary-only", "-", "-", "-"], check=True, cwd=ROOT, capture_output=True, timeout=120)
    verdicts = {r["verdict"] for r in json.loads((tmp_path / "m" / "kernels_summary.json").read_text())["rows"]}
    assert verdicts == {"not measured"}
    (tmp_path / "cut.json").write_text('{"table": [')  # a part killed mid-write: not measured, not a crash
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--out", str(tmp_path / "c"),
                    "--summary-only", str(tmp_path / "cut.json"), "-", "-"], check=True, cwd=ROOT,
                   capture_output=True, timeout=120)
    gone = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--summary-only",
                           str(tmp_path / "nope.json"), "-", "-"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert gone.returncode != 0 and "nope.json" in gone.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--parts", "gdn,nope", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "nope" in bad.stderr and "moe_attn" in bad.stderr
    dry = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--dry-run", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert [line.split()[2].split("/")[-1] for line in dry.stdout.splitlines()] == \
        ["kernels_gdn.py", "kernels_moe_attn.py", "step_profile.py"]


def test_kernels_run_reports_a_failed_part_not_an_earlier_runs_numbers(tmp_path):
    """A part that fails (here kernels_gdn.py on a machine without CUDA) is `not measured` with its exit status,
    and a JSON an earlier run left in its directory is not summarised (it is removed before the part runs)."""
    (tmp_path / "gdn").mkdir()
    (tmp_path / "gdn" / "kernels_gdn.json").write_text(json.dumps({"table": [{"B": 1, "T": 16, "verify": 1.0}]}))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_table.py"), "--parts", "gdn", "--out",
                          str(tmp_path), "--part-timeout-s", "300"], cwd=ROOT, capture_output=True, text=True,
                         timeout=400, check=True)
    summary = json.loads((tmp_path / "kernels_summary.json").read_text())
    assert {r["verdict"] for r in summary["rows"]} == {"not measured"}
    assert "exit 1" in summary["sources"]["gdn"] and "not asked for" in summary["sources"]["step"]
    assert not (tmp_path / "gdn" / "kernels_gdn.json").exists()
    log = (tmp_path / "gdn" / "log.txt").read_text()
    assert "CUDA" in log and "is not a package" not in log, run.stdout  # it got past its imports (see below)


def test_bench_scripts_import_the_repositorys_packages_not_their_neighbours():
    """Run as a script, a bench file has bench/ as sys.path[0]: every script that imports one of the repository's
    packages puts the root first, before that import (no bench/ file may stand for a package, and none needs
    PYTHONPATH), and no bench/ file is named like a package (tests put bench/ on sys.path, and processes they spawn
    inherit it: a bench/kernels.py broke the expert-parallel tests' gloo ranks)."""
    import ast

    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() or p.name in ("bench", "kernels")}
    bad = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        src = path.read_text()
        if "__main__" not in src:  # a module the scripts import (bench/cell.py), after their own insert
            continue
        first = min((node.lineno for node in ast.walk(ast.parse(src))
                     if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ours for a in node.names)
                     or isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     and node.module.split(".")[0] in ours), default=None)
        insert = next((i for i, line in enumerate(src.splitlines(), 1) if "sys.path.insert(0" in line), None)
        if first is not None and (insert is None or insert > first):
            bad.append(f"{path.name}: first import of ours at line {first}, root inserted at {insert}")
    assert "kernels" in ours and "workers" in ours
    assert not bad, bad
    assert not [p.name for p in (ROOT / "bench").glob("*.py") if p.stem in ours]


def test_length_bound_oracle_beats_every_fixed_length_and_equals_it_without_information(tmp_path):
    """bench/length_bound.py: the oracle (it knows each draft's p) is >= every fixed length, equals the best fixed
    length when every p is the same (noise: nothing to adapt to), gains with informative p (beta); the rules on
    calibrated confidences (rate: hybridspec's objective, ratio: budget's) are never above it, plan alike without
    information and differ with it (the rate ahead); the script prints the table and writes the JSON; a bad curve
    names the flag."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import length_bound as lb
    finally:
        sys.path.remove(str(ROOT / "bench"))
    curve = {1: 3.0, 5: 6.5, 9: 7.4, 17: 8.3}
    for kind, acc in (("noise", 0.85), ("noise", 0.7), ("beta", 0.85), ("beta", 0.5)):
        r = lb.bound(curve, kind, acc, steps=4000)
        fixed = {k: r[k] for k in ["ar"] + [f"fixed{k}" for k in range(1, 17)]}
        assert r["oracle"] >= max(fixed.values()) - 1e-9, (kind, acc, r)
        assert r["rate"] <= r["oracle"] + 1e-9 and r["ratio"] <= r["oracle"] + 1e-9
        if kind == "noise":
            assert r["rate"] == pytest.approx(r["ratio"], rel=2e-3)  # calibrated: every draft alike, one plan
            assert r["oracle"] >= 1.0 - 1e-9  # L = 0 (plain decoding) is one of its choices
            assert r["oracle_over_best_fixed"] == pytest.approx(1.0), r
        else:
            assert r["oracle_over_best_fixed"] > 1.03, r
            if acc == 0.85:  # strong and weak steps: the rate plans longer and shorter than the ratio, and gains
                assert r["rate_over_ratio"] > 1.01 and r["rate_mean_len"] < r["ratio_mean_len"], r
    # the rates themselves: fixed16 at acceptance a yields (1 + sum_j a^j) tokens in T(17)
    r = lb.bound(curve, "noise", 0.85, steps=200)
    assert r["fixed16"] == pytest.approx((1 + sum(0.85 ** j for j in range(1, 17))) / 8.3 * 3.0)
    out = tmp_path / "bound.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "length_bound.py"), "--curve", "1:3,5:6.5,17:8.3",
                          "--acceptance", "0.85", "--steps", "500", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "| beta | 0.85 |" in res.stdout and len(json.loads(out.read_text())["rows"]) == 2
    # the curve from an e2e JSON: T(1) from ar's rows only, T(n >= 2) from fixed rows (the learned policies' only
    # with --rows all, where the fixed rows lack the count), each count's medians weighted by their steps
    rows = [{"policy": "ar", "concurrency": 1, "step_ms_by_tokens": {"1": [100, 3.0]}},
            {"policy": "budget", "concurrency": 1, "step_ms_by_tokens": {"1": [50, 4.0], "9": [40, 7.5],
                                                                         "17": [30, 9.0]}},
            {"policy": "fixed16", "concurrency": 1, "step_ms_by_tokens": {"17": [30, 8.0], "5": [2, 6.0]}},
            {"policy": "fixed16", "concurrency": 1, "step_ms_by_tokens": {"17": [10, 8.4]}},
            {"policy": "fixed4", "concurrency": 4, "step_ms_by_tokens": {"5": [90, 20.0]}}]
    assert lb.curve_from_e2e(rows) == pytest.approx({1: 3.0, 17: 8.1})
    assert lb.curve_from_e2e(rows, fill_from_all=True) == pytest.approx({1: 3.0, 9: 7.5, 17: 8.1})
    with pytest.raises(ValueError, match="no c=1 ar row"):
        lb.curve_from_e2e(rows[1:])
    with pytest.raises(ValueError, match="step_ms_by_tokens must map tokens"):
        lb.curve_from_e2e(rows[:1] + [{"policy": "fixed4", "concurrency": 1, "step_ms_by_tokens": {"5": 6.0}}])
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "length_bound.py"), "--curve", "5:6.5,17:8.3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--curve needs tokens >= 1 including 1" in bad.stderr


def test_kernels_gdn_table_modes_call_each_kernel_with_arguments_it_takes(monkeypatch):
    """Every timed mode of bench/kernels_gdn.py's table binds to its kernel's signature (run 2026-12-07 on an H100
    lost the whole GDN table to `gdn_commit_verify_triton() got an unexpected keyword argument 'impl'`)."""
    import importlib.util
    import inspect

    import torch

    spec = importlib.util.spec_from_file_location("bench_kernels_gdn_signatures", ROOT / "bench" / "kernels_gdn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    real, called = mod.gt, []

    class Binder:  # stands for kernels.gdn_triton: checks each call's arguments against the real signature
        def __getattr__(self, name):
            def call(*args, **kwargs):
                inspect.signature(getattr(real, name)).bind(*args, **kwargs)
                called.append(name)
            return call

    monkeypatch.setattr(mod, "gt", Binder())
    t, cu = 4, torch.tensor([0, 4, 8])
    blk = tuple(torch.zeros(8) for _ in range(5)) + (cu,)
    keep = torch.full((2,), t)
    ctx = dict(blk=blk, pool=torch.zeros(3), sl=torch.tensor([0, 1]), t=t, keep=keep, mask=keep > 0,
               starts=cu[:-1])
    for mode in (*mod.TABLE_MODES, "verify_mask"):
        mod.run_mode(mode, dict(mod.TABLE_CFG), ctx)
    assert {"gdn_triton", "gdn_commit_triton", "gdn_commit_verify_triton"} <= set(called), called
