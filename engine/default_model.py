"""The embedded default model: what `hybridspec` runs when no model directory is given.

- The trained pair (issue 9), when the repository has `models/target` (training/train.py writes it): a small
  GDN + MoE target trained on the CPython standard library, with its BPE tokenizer and its MTP head (`mtp.*`
  tensors), and `models/draft`, a small draft model with the same tokenizer. `default_speculation()` says how to
  speculate with it (spec "mtp" when the head is there, else "draft").
- Otherwise (and whenever HYBRIDSPEC_DEFAULT_MODEL=random): a tiny GDN + MoE model with random (seeded) weights and
  a byte-level tokenizer, built deterministically on first use under the cache folder; its text is noise.

HYBRIDSPEC_DEFAULT_MODEL = auto (default: trained if present, else random) | trained | random picks one
explicitly (tests that need the random model's exact shapes pin it); HYBRIDSPEC_MODELS points at another
directory holding target/ and draft/ (default: the repository's models/).
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
import tempfile
from pathlib import Path

import torch

from engine.tokenizer import write_byte_tokenizer
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.random_init import init_random_
from workers.weights import save_weights

log = logging.getLogger("hybridspec.model")
_WARNED: set[Path] = set()  # models folders found without a trained target (warned once each)

DEFAULT_MODEL_VERSION = "tiny-gdn-moe-v1"
DEFAULT_SEED = 1234
EOS_ID = 256  # the byte tokenizer's <|endoftext|>

DEFAULT_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 257,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "eos_token_id": EOS_ID,
    "bos_token_id": None,
    "pad_token_id": None,
    "dtype": "float32",
}


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDSPEC_CACHE", Path.home() / ".cache" / "hybridspec"))


def build_default_model(directory: str | Path) -> Path:
    """Writes the default model's files into `directory` (deterministic for a given torch version)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(DEFAULT_CONFIG, indent=2))
    cfg = ModelConfig.from_dict(DEFAULT_CONFIG)
    model = init_random_(HybridModel(cfg, torch.float32, "cpu"), DEFAULT_SEED)
    save_weights(model, directory)
    write_byte_tokenizer(directory)
    return directory


REPO_MODELS = Path(__file__).resolve().parents[1] / "models"


def installed_models_dirs() -> list[Path]:
    """Where a wheel install puts the trained pair (pyproject's data-files): <prefix>/share/hybridspec/models, for
    the environment's prefix and the user scheme's."""
    data = [sysconfig.get_path("data")]
    if f"{os.name}_user" in sysconfig.get_scheme_names():  # (pip install --user)
        data.append(sysconfig.get_path("data", f"{os.name}_user"))
    return [Path(d) / "share" / "hybridspec" / "models" for d in data if d]


def models_root() -> Path:
    """Where the trained embedded models live: $HYBRIDSPEC_MODELS, else the repository's models/ (a checkout, an
    editable install), else an installed wheel's (installed_models_dirs); the repository's where none holds them."""
    env = os.environ.get("HYBRIDSPEC_MODELS")
    if env:
        return Path(env)
    for path in [REPO_MODELS, *installed_models_dirs()]:
        if (path / "target").is_dir():
            return path
    return REPO_MODELS


def _is_model_dir(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def trained_model_dir() -> Path | None:
    """The trained target's directory (models/target), or None when it is not there."""
    path = models_root() / "target"
    return path if _is_model_dir(path) else None


def trained_draft_dir() -> Path | None:
    path = models_root() / "draft"
    return path if _is_model_dir(path) else None


def default_model_dir() -> Path:
    """The embedded default model's directory (see the module docstring for which one)."""
    choice = os.environ.get("HYBRIDSPEC_DEFAULT_MODEL", "auto").strip().lower() or "auto"
    if choice not in ("auto", "trained", "random"):
        raise ValueError(f"HYBRIDSPEC_DEFAULT_MODEL must be auto, trained or random, got {choice!r}")
    if choice != "random":
        trained = trained_model_dir()
        if trained is not None:
            return trained
        if choice == "trained":
            raise FileNotFoundError(f"HYBRIDSPEC_DEFAULT_MODEL=trained but {models_root() / 'target'} holds no "
                                    "model (run training/train.py; see its docstring)")
        # (not silent: a wheel install has no models/, and the random model's text is noise; once per folder)
        missing = models_root() / "target"
        if missing not in _WARNED:
            _WARNED.add(missing)
            log.warning("no trained default model at %s (set HYBRIDSPEC_MODELS to the folder holding target/ and "
                        "draft/, or give a model directory): using the random tiny model, whose text is noise",
                        missing)
    return random_model_dir()


def default_speculation(model_dir: str | Path | None = None) -> dict:
    """How to speculate with the embedded default: {"spec": ..., "draft_model": ...} (engine option names).
    The trained target: "mtp" if its checkpoint has an MTP head, else "draft" with models/draft; anything else
    (the random model, or `model_dir` not the trained target): {"spec": "off", "draft_model": None}."""
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    trained = trained_model_dir()
    if trained is None or model_dir.resolve() != trained.resolve():
        return {"spec": "off", "draft_model": None}
    from workers.mtp import count_mtp_layers

    if count_mtp_layers(trained) > 0:
        return {"spec": "mtp", "draft_model": None}
    draft = trained_draft_dir()
    if draft is not None:
        return {"spec": "draft", "draft_model": str(draft)}
    return {"spec": "off", "draft_model": None}


def random_model_dir() -> Path:
    """The random model's directory, built on first use (atomically, so parallel first uses are safe)."""
    target = cache_root() / DEFAULT_MODEL_VERSION
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        build_default_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
        else:
            os.makedirs(tmp)  # let TemporaryDirectory clean up a (now empty) path
    return target
