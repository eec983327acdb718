"""The embedded default model: a tiny GDN + MoE model and a byte-level tokenizer, built deterministically.

`hybridspec` runs out of the box with no model directory: the first use writes a Hugging Face layout
directory (config.json, model.safetensors, tokenizer.json) under the cache folder and every later use
loads it through the normal loader. Its weights are random (seeded), so its text is noise.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from engine.tokenizer import write_byte_tokenizer
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.random_init import init_random_
from workers.weights import save_weights

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


def default_model_dir() -> Path:
    """The default model's directory, built on first use (atomically, so parallel first uses are safe)."""
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
