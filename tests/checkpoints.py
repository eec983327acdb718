"""Tiny random Hugging Face checkpoints of both model families, written by transformers itself.

Every builder makes the model with transformers (`Qwen3NextForCausalLM` / `Qwen3_5MoeForCausalLM`), re-draws
every parameter at a scale where each layer matters, and writes the directory with `save_pretrained` (plus a
small `tokenizer.json`). transformers' own init (std 0.02 matrices, zero-centred norms at 0, router 0.02)
leaves every activation tiny: SiLU and the gates work in their linear range and routing is near uniform, so a
model that got a nonlinearity or a routing detail wrong could still match. `rerandomize_` draws weights at
unit-variance scales instead, and tests/test_model_vs_transformers.py checks that every layer moves the logits,
that routing varies between tokens and that the GDN state remembers past one 64-token chunk.

Variants (each a new directory holding the same weights as the checkpoint it derives from):
- `shard(src, dst)`: save_pretrained with a tiny max_shard_size (model.safetensors.index.json + shards);
- `fuse_experts(src, dst)`: per-expert tensors rewritten as `mlp.experts.gate_up_proj` [E, 2I, H]
  (gate rows then up rows) and `mlp.experts.down_proj` [E, H, I];
- `add_language_model_prefix(src, dst)`: `model.*` tensors renamed `model.language_model.*`, config.json
  wrapped as a multimodal `qwen3_5_moe` config with a `text_config`;
- `rewrite_tensors(src, dst, edit)`: any other edit of the tensor dict (tests of the loader's errors).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 128
TOKENIZER_EOS = "<|endoftext|>"  # id VOCAB - 1; config.json names no eos, so nothing stops at it

# layer pattern GDN, GDN, ATTN, GDN, ATTN
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

QWEN3_NEXT_DEFAULTS = dict(COMMON, mlp_only_layers=[1], intermediate_size=96, norm_topk_prob=True)
QWEN35_MOE_DEFAULTS = dict(COMMON)

ROUTER_GAIN = 3.0  # router logits ~ N(0, 3^2): top-k choices differ from token to token


# ---------------------------------------------------------------------------------------------- weights
@torch.no_grad()
def rerandomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draws every parameter of a transformers Qwen3-Next / Qwen3.5-MoE model so that each layer matters.

    Matrices N(0, 1/fan_in) (embeddings N(0, 1)), zero-centred RMSNorm weights N(0, 0.3^2) (applied as 1 + w),
    the GDN output norm N(1, 0.3^2), decay rates A = 10^U(-2, 0.6) (from ~1 token to hundreds of tokens of
    memory), dt_bias N(0, 0.5^2), router N(0, (3 / sqrt(H))^2).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            value = (torch.rand(shape, generator=gen) * 2.6 - 2.0) * math.log(10.0)
        elif name.endswith("dt_bias"):
            value = normal(shape, 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            value = normal(shape, 0.3, mean=1.0)
        elif p.dim() == 1:  # zero-centred RMSNorms: input/post-attention/final/q_norm/k_norm; or a bias
            value = normal(shape, 0.3)
        elif name.endswith("embed_tokens.weight"):
            value = normal(shape, 1.0)
        elif name.endswith("conv1d.weight"):  # [C, 1, K]
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):  # router [E, H]
            value = normal(shape, ROUTER_GAIN / math.sqrt(shape[-1]))
        else:  # Linear [out, in], experts [E, 2I, H] / [E, H, I], lm_head
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        p.copy_(value.to(p.dtype))
    return model


def write_tokenizer(directory: str | Path, vocab_size: int = VOCAB) -> Path:
    """A byte-level tokenizer.json with exactly `vocab_size` ids: bytes 0..vocab_size-2, then <|endoftext|>."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {b: chr(c) for b, c in zip(bs, cs)}
    tok = tokenizers.Tokenizer(models.BPE(vocab={table[b]: b for b in range(vocab_size - 1)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(TOKENIZER_EOS, special=True, normalized=False)])
    assert tok.token_to_id(TOKENIZER_EOS) == vocab_size - 1
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path


def _save(model, directory: str | Path, seed: int, **save_kwargs) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rerandomize_(model, seed)
    model.eval()
    model.save_pretrained(str(directory), **save_kwargs)
    write_tokenizer(directory, model.config.vocab_size)
    return directory


# ------------------------------------------------------------------------------------------- builders
def make_qwen3_next(directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Tiny random Qwen3-Next (model_type qwen3_next): fused in_proj_qkvz / in_proj_ba, per-expert tensors,
    one dense MLP layer (mlp_only_layers=[1])."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(**dict(QWEN3_NEXT_DEFAULTS, **overrides))
    return _save(Qwen3NextForCausalLM(config).float(), directory, seed)


def make_qwen35_moe(directory: str | Path, seed: int = 1, **overrides) -> Path:
    """Tiny random Qwen3.5-MoE text model (model_type qwen3_5_moe_text): split GDN projections, every layer MoE."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**dict(QWEN35_MOE_DEFAULTS, **overrides))
    return _save(Qwen3_5MoeForCausalLM(config).float(), directory, seed)


def load_hf(directory: str | Path):
    """The transformers model (fp32, CPU, eager attention) for a directory written by a builder above."""
    config = json.loads((Path(directory) / "config.json").read_text())
    if config["model_type"] == "qwen3_next":
        from transformers import Qwen3NextForCausalLM as cls
    elif config["model_type"] == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as cls
    else:
        raise ValueError(f"load_hf: no transformers class for model_type {config['model_type']!r}")
    model = cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def load_ours(directory: str | Path):
    """Our HybridModel (fp32, CPU) for a checkpoint directory, filled by workers.weights.load_weights."""
    from workers.config import ModelConfig
    from workers.model import HybridModel
    from workers.weights import load_weights

    model = HybridModel(ModelConfig.from_dir(directory), torch.float32, "cpu")
    load_weights(model, directory)
    return model


# ------------------------------------------------------------------------------------------- variants
def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("model.safetensors") and not p.name.startswith("model-"):
            shutil.copy2(p, dst / p.name)


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded checkpoint, by its stored name."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(str(directory / shard)))
        return out
    return load_file(str(directory / "model.safetensors"))


def rewrite_tensors(src: str | Path, dst: str | Path,
                    edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """Copies a checkpoint directory, writing `edit(tensors)` as a single model.safetensors."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    tensors = edit(dict(read_tensors(src)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def shard(src: str | Path, dst: str | Path, max_shard_size: str = "20KB") -> Path:
    """The same weights re-saved by transformers as many small shards with model.safetensors.index.json."""
    src, dst = Path(src), Path(dst)
    model = load_hf(src)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dst), max_shard_size=max_shard_size)
    write_tokenizer(dst, model.config.vocab_size)
    assert (dst / "model.safetensors.index.json").is_file() and not (dst / "model.safetensors").exists()
    return dst


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts_in(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in groups.items():
        ids = sorted(experts)
        assert ids == list(range(len(ids))), f"{prefix}: experts {ids}"
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


def fuse_experts(src: str | Path, dst: str | Path) -> Path:
    return rewrite_tensors(src, dst, fuse_experts_in)


def add_language_model_prefix(src: str | Path, dst: str | Path) -> Path:
    """`model.*` -> `model.language_model.*` (lm_head stays), config.json as a multimodal `qwen3_5_moe` config
    whose `text_config` is the original one (what Qwen3.5 checkpoints ship)."""
    src, dst = Path(src), Path(dst)
    rewrite_tensors(src, dst, lambda ts: {
        ("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in ts.items()})
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures", None)
    wrapped = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "transformers_version": text.get("transformers_version"),
    }
    (dst / "config.json").write_text(json.dumps(wrapped, indent=2))
    return dst


def with_mtp_head(src: str | Path, out: str | Path, seed: int = 5) -> Path:
    """`src` (a model directory with model.safetensors) plus a random one-layer MTP head (mtp.* tensors) in `out`."""
    from workers.config import ModelConfig
    from workers.mtp import MTPHead
    from workers.random_init import init_random_

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(src / name, out / name)
    head = init_random_(MTPHead(ModelConfig.from_dir(src), 1, torch.float32, "cpu"), seed=seed)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({k: v.contiguous() for k, v in head.state_dict().items() if k.startswith("mtp.")})
    save_file(tensors, str(out / "model.safetensors"))
    return out
