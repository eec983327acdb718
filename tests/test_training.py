"""The training script (issue 9) on toy sizes: a BPE tokenizer and a GDN + MoE target and draft trained on the
standard library sources, written in the Hugging Face layout that both this engine and transformers load."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from training.train import main as train_main
from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.weights import load_weights


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert train_main(["--out", str(out), "--tiny", "--steps", "25", "--data-mb", "0.4", "--seq-len", "64",
                       "--batch", "8", "--device", "cpu"]) == 0
    return out


def test_training_lowers_the_loss_and_reports_heldout_perplexity(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    for name in ("target", "draft"):
        assert metrics[name]["last_loss"] < metrics[name]["first_loss"] - 0.3
        assert 1.0 < metrics[name]["heldout_ppl"] < metrics["vocab"]
    assert metrics["heldout_files"] > 0 and metrics["bytes"] < 16 * 1024 * 1024


def test_engine_and_transformers_give_the_same_logits_on_the_trained_target(trained):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    target = trained / "target"
    hf = Qwen3_5MoeForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ours = HybridModel(ModelConfig.from_dir(target))
    load_weights(ours, target)
    ids = LLM(model=str(target)).tokenizer.encode("def add(a, b):\n    return a + b\n")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    cache = ModelCache(ours.config, 16, 16, 1, torch.float32, "cpu")
    cache.reset_slots([0])
    got = ours(ForwardBatch.build([ids], [0], [list(range(16))], [0], "cpu"), cache, torch.arange(len(ids)))
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_trained_draft_model_speculates_losslessly(trained):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["import os\n", "def main():\n    "]
    base = [r.token_ids for r in LLM(model=str(trained / "target")).generate(prompts, params)]
    spec = LLM(model=str(trained / "target"), spec="draft", policy="fixed", max_verify_len=4,
               draft_model=str(trained / "draft")).generate(prompts, params)
    assert [r.token_ids for r in spec] == base
    assert sum(r.stats.accepted_tokens for r in spec) > 0  # a trained draft agrees with the target sometimes
