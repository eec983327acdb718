"""ModelConfig: the architecture of a hybrid GDN + MoE model, read from a Hugging Face config.json.

Both families share one internal description:
- `qwen3_next` (Qwen3-Next): fused `in_proj_qkvz` / `in_proj_ba` GDN projections, optional dense MLP layers
  (`mlp_only_layers`, `decoder_sparse_step`), `norm_topk_prob` configurable.
- `qwen3_5_moe_text` (Qwen3.5-MoE / Qwen3.6 text model; `qwen3_5_moe` with a `text_config` is accepted too):
  split `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, every layer MoE, top-k always renormalized.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe_text")

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


# What transformers' config classes use for an absent field (Qwen3NextConfig, Qwen3_5MoeTextConfig).
_COMMON_DEFAULTS = {
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}
TRANSFORMERS_DEFAULTS = {
    "qwen3_next": {**_COMMON_DEFAULTS, "vocab_size": 151936, "num_hidden_layers": 48, "num_experts": 512,
                   "num_experts_per_tok": 10, "intermediate_size": 5632},
    "qwen3_5_moe_text": {**_COMMON_DEFAULTS, "vocab_size": 248320, "num_hidden_layers": 40, "num_experts": 256,
                         "num_experts_per_tok": 8},
}


class ConfigError(ValueError):
    """config.json is missing a field, has an unsupported value, or is inconsistent."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _integer(name: str, value, minimum: int) -> int:
    """config.json's integer field `name` (an integral float such as 4.0 too), at least `minimum`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"config.json: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def lfs_pointer_hint(path: Path) -> str:
    """A hint where a model file is a Git LFS pointer (a clone without `git lfs pull`), else ""."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return ""
    if head.startswith(b"version https://git-lfs"):
        return " (it is a Git LFS pointer, not the file: fetch it with `git lfs pull`)"
    return ""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    rms_norm_eps: float
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mixture of experts
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: list[bool]  # per layer: sparse MoE (True) or dense MLP (False)
    intermediate_size: int  # dense MLP width (qwen3_next mlp_only_layers)
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # q (and k) width of a GDN layer
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # v (and z) width of a GDN layer
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the short causal conv: q, k, v
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    def gdn_state_bytes(self) -> int:
        """Bytes of GDN state one request holds across all GDN layers (fp32 recurrent state + conv window)."""
        per_layer = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1) * 4
        return len(self.gdn_layers) * (per_layer + conv)

    def validate(self) -> "ModelConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config.json: {msg}")

        need(self.model_type in SUPPORTED_MODEL_TYPES,
             f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        need(not bad, f"layer_types may only hold {LINEAR_ATTENTION!r} and {FULL_ATTENTION!r}, got {bad}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             "linear_num_value_heads must be a multiple of linear_num_key_heads")
        need(not any(self.moe_layers) or 1 <= self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
             f"got {self.num_experts_per_tok}")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             "head_dim * partial_rotary_factor must be an even number in (0, head_dim]")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(self.linear_conv_kernel_dim >= 2, "linear_conv_kernel_dim must be >= 2")
        return self

    # ---- reading -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if raw.get("model_type") == "qwen3_5_moe":
            if not isinstance(raw.get("text_config"), dict):
                raise ConfigError("config.json: model_type 'qwen3_5_moe' (the multimodal wrapper) needs its text "
                                  f"model's fields in a text_config object, got text_config={raw.get('text_config')!r}")
            # the multimodal wrapper: its text model, tied (or not) as the top level says, as transformers does
            top = raw
            raw = dict(raw["text_config"], model_type="qwen3_5_moe_text")
            raw["tie_word_embeddings"] = top.get("tie_word_embeddings", False)
            if raw.get("eos_token_id") is None:
                raw["eos_token_id"] = top.get("eos_token_id")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json: model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")

        defaults = TRANSFORMERS_DEFAULTS[model_type]

        def get(name: str, default=None):
            """The field, else transformers' default for this model type, else an error naming it."""
            if name in raw and raw[name] is not None:
                return raw[name]
            if default is None:
                default = defaults.get(name)
            if default is None:
                raise ConfigError(f"config.json: required field {name!r} is missing")
            return default

        def integer(name: str, minimum: int = 1, default=None) -> int:
            return _integer(name, get(name, default), minimum)

        def number(name: str, value, low: float, high: float = math.inf, high_inclusive: bool = True) -> float:
            ok = _is_number(value) and low < value and (value <= high if high_inclusive else value < high)
            if not ok:
                bound = "" if high == math.inf else (f" and <= {high}" if high_inclusive else f" and < {high}")
                raise ConfigError(f"config.json: {name} must be a number > {low}{bound}, got {value!r}")
            return float(value)

        def flag(name: str, default: bool) -> bool:
            value = raw.get(name, default)
            value = default if value is None else value
            if not isinstance(value, bool):
                raise ConfigError(f"config.json: {name} must be true or false, got {value!r}")
            return value

        num_layers = integer("num_hidden_layers")
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = _integer("full_attention_interval", raw.get("full_attention_interval", 4), 1)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
        elif not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"config.json: layer_types must be a list of {LINEAR_ATTENTION!r} / {FULL_ATTENTION!r} "
                              f"strings, got {layer_types!r}")
        rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
        rope = raw.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json: {rope_key} must be an object or null, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"config.json: rope_type must be 'default', got {rope_type!r}")
        rope_theta = number("rope_theta", rope.get("rope_theta", raw.get("rope_theta", 10000.0)), 0.0)
        partial = number("partial_rotary_factor",
                         rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)), 0.0, 1.0)
        num_experts = integer("num_experts", minimum=0)
        if model_type == "qwen3_next":
            mlp_only = raw.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(_is_int(i) for i in mlp_only):
                raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
            step = _integer("decoder_sparse_step", raw.get("decoder_sparse_step", 1), 1)
            moe_layers = [i not in set(mlp_only) and num_experts > 0 and (i + 1) % step == 0
                          for i in range(num_layers)]
            norm_topk = flag("norm_topk_prob", True)
        else:
            moe_layers = [True] * num_layers
            norm_topk = True
        if any(moe_layers) and num_experts <= 0:
            raise ConfigError("config.json: num_experts must be > 0 for MoE layers")
        moe = any(moe_layers)
        eos = raw.get("eos_token_id")
        eos_list = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        if not all(_is_int(e) and e >= 0 for e in eos_list):
            raise ConfigError(f"config.json: eos_token_id must be a token id >= 0, a list of them or null, got {eos!r}")
        hidden_act = raw.get("hidden_act", "silu")
        return cls(
            model_type=model_type,
            vocab_size=integer("vocab_size"),
            hidden_size=integer("hidden_size"),
            num_hidden_layers=num_layers,
            layer_types=list(layer_types),
            rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps", 1e-6), 0.0, 1.0, high_inclusive=False),
            num_attention_heads=integer("num_attention_heads"),
            num_key_value_heads=integer("num_key_value_heads"),
            head_dim=integer("head_dim"),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=integer("max_position_embeddings", default=32768),
            attention_bias=flag("attention_bias", False),
            linear_num_key_heads=integer("linear_num_key_heads"),
            linear_num_value_heads=integer("linear_num_value_heads"),
            linear_key_head_dim=integer("linear_key_head_dim"),
            linear_value_head_dim=integer("linear_value_head_dim"),
            linear_conv_kernel_dim=integer("linear_conv_kernel_dim", minimum=2),
            num_experts=num_experts,
            num_experts_per_tok=integer("num_experts_per_tok", minimum=1 if moe else 0),
            moe_intermediate_size=integer("moe_intermediate_size", minimum=1 if moe else 0),
            shared_expert_intermediate_size=integer("shared_expert_intermediate_size", minimum=1 if moe else 0),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            intermediate_size=integer("intermediate_size", minimum=0 if all(moe_layers) else 1)
            if model_type == "qwen3_next" else 0,
            tie_word_embeddings=flag("tie_word_embeddings", False),
            eos_token_ids=[int(e) for e in eos_list],
            hidden_act=hidden_act if isinstance(hidden_act, str) else repr(hidden_act),
        ).validate()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir}: no config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e}){lfs_pointer_hint(path)}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:  # which config.json: the target's or a draft model's
            raise ConfigError(f"{path}{str(e)[len('config.json'):]}" if str(e).startswith("config.json:")
                              else f"{path}: {e}") from None
