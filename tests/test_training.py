"""The training script (issue 9) on toy sizes: a BPE tokenizer and a GDN + MoE target and draft trained on the
standard library sources, written in the Hugging Face layout that both this engine and transformers load."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

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


def test_trained_mtp_head_matches_the_engines_head_and_reports_accuracy(trained):
    """The head written into the target's checkpoint is workers/mtp.py's MTPHead exactly: the engine's head,
    loaded from the file, gives the trainable twin's outputs on the same (x_q, h_{q-1}) pairs."""
    from safetensors.torch import load_file

    from training.mtp_head import TrainableMTPHead
    from workers.mtp import MTPHead, count_mtp_layers

    target = trained / "target"
    metrics = json.loads((trained / "metrics.json").read_text())
    assert 0.0 <= metrics["mtp"]["heldout_top1"] <= 1.0 and metrics["mtp"]["last_loss"] < metrics["mtp"]["first_loss"]
    assert count_mtp_layers(target) == 1
    cfg = ModelConfig.from_dir(target)
    ours = HybridModel(cfg)
    load_weights(ours, target)
    engine_head = MTPHead(cfg, 1, torch.float32, "cpu")
    load_weights(engine_head, target, scope="mtp")
    twin = TrainableMTPHead(cfg)
    mtp = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items() if k.startswith("mtp.")}
    assert set(mtp) == set(twin.mtp_tensors()) == {k for k in engine_head.state_dict() if k.startswith("mtp.")}
    twin.load_state_dict(mtp, strict=False)
    ids = LLM(model=str(target)).tokenizer.encode("import sys\n\n\ndef main(argv):\n    return len(argv)\n")
    cache = ModelCache(cfg, 16, 16, 1, torch.float32, "cpu")
    cache.reset_slots([0])
    _, hidden = ours(ForwardBatch.build([ids], [0], [list(range(16))], [0], "cpu"), cache,
                     torch.arange(len(ids)), return_hidden=True)
    pairs = ids[1:]
    head_cache = ModelCache(engine_head.config, 16, 16, 1, torch.float32, "cpu")
    got = engine_head(F.embedding(torch.tensor(pairs), ours.model.embed_tokens.weight), hidden[:-1],
                      ForwardBatch.build([pairs], [0], [list(range(16))], [0], "cpu"), head_cache)
    with torch.no_grad():
        expected = twin(F.embedding(torch.tensor([pairs]), ours.model.embed_tokens.weight), hidden[None, :-1])[0]
    assert (got - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))


def test_trained_mtp_head_speculates_losslessly(trained):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["import os\n", "def main():\n    ", "class A:\n    def f(self):\n        return"]
    target = str(trained / "target")
    base = [r.token_ids for r in LLM(model=target).generate(prompts, params)]
    for policy in ("fixed", "hybridspec"):
        llm = LLM(model=target, spec="mtp", policy=policy, max_verify_len=4)
        out = llm.generate(prompts, params)
        assert [r.token_ids for r in out] == base, policy
        assert sum(r.stats.draft_tokens for r in out) > 0
        assert llm.engine.memory.stats()["used_pages"] == 0


def test_trained_pair_becomes_the_embedded_default(trained, monkeypatch, caplog):
    from engine import default_model as dm

    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(trained))
    monkeypatch.delenv("HYBRIDSPEC_DEFAULT_MODEL", raising=False)
    assert dm.default_model_dir() == trained / "target"
    assert dm.default_speculation() == {"spec": "mtp", "draft_model": None}
    from engine.cli import _speculation  # `hybridspec serve` / `generate` without a model directory

    assert _speculation(None, None, None) == ("mtp", None)
    assert _speculation(str(trained / "target"), None, None) == ("off", None)  # a model directory: off
    assert _speculation(None, "ngram", None) == ("ngram", None)  # asked for explicitly
    assert _speculation(None, "draft", None) == ("draft", str(trained / "draft"))  # the pair's own draft model
    assert _speculation(None, "draft", "/elsewhere") == ("draft", "/elsewhere")
    assert _speculation(str(trained / "target"), "draft", None) == ("draft", None)  # (refused later, by name)
    llm = LLM(**dm.default_speculation())
    assert llm.engine.model_dir == trained / "target" and llm.tokenizer.vocab_size == 512
    out = llm.generate("def f(x):\n", SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    monkeypatch.setenv("HYBRIDSPEC_DEFAULT_MODEL", "random")  # the explicit way back to the random model
    assert dm.default_model_dir() == dm.random_model_dir()
    assert dm.default_speculation() == {"spec": "off", "draft_model": None}
    monkeypatch.setenv("HYBRIDSPEC_DEFAULT_MODEL", "auto")
    monkeypatch.setenv("HYBRIDSPEC_MODELS", str(trained / "nowhere"))  # no trained models: the random fallback,
    with caplog.at_level(logging.WARNING, logger="hybridspec.model"):  # not a silent one (a wheel has no models/)
        assert dm.default_model_dir() == dm.random_model_dir()
    assert any("no trained default model at" in r.getMessage() and "HYBRIDSPEC_MODELS" in r.getMessage()
               for r in caplog.records), caplog.records
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridspec.model"):  # once per folder, not per lookup
        assert dm.default_model_dir() == dm.random_model_dir()
    assert not caplog.records


def test_a_wheel_carries_the_trained_pair_and_the_default_finds_it_installed(tmp_path, monkeypatch):
    """A wheel install had no models/ (the pair lives beside the packages in a checkout): it served the random model.
    The wheel now installs the pair under <prefix>/share/hybridspec/models, where models_root looks after the
    repository's own models/."""
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from engine import default_model as dm

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # (a copy: setuptools builds inside the source tree)
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("hybridspec-*.whl")))
    data = "hybridspec-0.1.0.data/data/share/hybridspec/models/"
    pair = [f"{part}/{name}" for part in ("target", "draft")
            for name in ("config.json", "model.safetensors", "tokenizer.json")]
    for name in pair:
        assert wheel.read(data + name) == (root / "models" / name).read_bytes(), name
    # installed: the data files under a prefix, no repository models/ beside the packages
    prefix_models = tmp_path / "prefix" / "share" / "hybridspec" / "models"
    for name in pair:
        (prefix_models / name).parent.mkdir(parents=True, exist_ok=True)
        (prefix_models / name).write_bytes(wheel.read(data + name))
    import sysconfig  # (where pip puts a wheel's data files: the environment's data path)

    assert Path(sysconfig.get_path("data")) / "share" / "hybridspec" / "models" in dm.installed_models_dirs()
    monkeypatch.delenv("HYBRIDSPEC_MODELS", raising=False)
    monkeypatch.delenv("HYBRIDSPEC_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(dm, "REPO_MODELS", tmp_path / "site-packages" / "models")  # (not there)
    monkeypatch.setattr(dm, "installed_models_dirs", lambda: [tmp_path / "nowhere", prefix_models])
    assert dm.models_root() == prefix_models
    assert dm.default_model_dir() == prefix_models / "target"
    assert dm.default_speculation() == {"spec": "mtp", "draft_model": None}
