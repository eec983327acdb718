"""bench/acceptance.py (issue 9) in its tiny mode on a --tiny trained pair: every drafter under every policy,
acceptance counted, outputs equal to `ar` (fp32 CPU greedy speculation is lossless), JSON written."""

from __future__ import annotations

import json

import pytest

from bench.acceptance import main as bench_main
from bench.acceptance import policy_runs
from training.train import main as train_main


@pytest.fixture(scope="module")
def trained(tmp_path_factory, single_thread_torch):
    out = tmp_path_factory.mktemp("pair")
    assert train_main(["--out", str(out), "--tiny", "--steps", "15", "--data-mb", "0.3", "--seq-len", "64",
                       "--batch", "8", "--device", "cpu"]) == 0
    return out


def test_acceptance_bench_tiny_reports_every_drafter_and_policy_losslessly(trained, tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert bench_main(["--models", str(trained), "--tiny", "--concurrency", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    labels = [label for label, _, _ in policy_runs(8)]
    assert {"fixed4", "fixed8", "budget", "hybridspec"} <= set(labels)
    assert [(r["drafter"], r["policy"]) for r in runs] == [("none", "ar")] + [
        (d, p) for d in ("ngram", "draft", "mtp") for p in labels]
    for r in runs:
        assert r["output_tokens"] == report["prompts"] * report["max_new_tokens"] and r["tokens_per_s"] > 0
        assert r["lossless"], r
        if r["drafter"] != "none":
            assert 0 <= r["accepted"] <= r["drafted"] and r["speedup"] > 0
    for d in ("draft", "mtp"):
        assert sum(r["drafted"] for r in runs if r["drafter"] == d) > 0
        assert report["summary"][d]["acceptance_rate_fixed4"] is not None
    assert report["prompt_files"] and "training" in report
    table = capsys.readouterr().out
    assert "speedup" in table and "mtp" in table
