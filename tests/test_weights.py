"""workers.weights / workers.config against checkpoints written by transformers: every layout variant loads
and gives transformers' logits; every broken checkpoint fails with an error that names what is wrong."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints import load_ours, read_tensors, rewrite_tensors
from workers.config import ConfigError, ModelConfig
from workers.model import HybridModel
from workers.weights import WeightsError, load_weights

pytestmark = pytest.mark.usefixtures("single_thread_torch")

REL_TOL = 1e-4


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    from workers.batch import ForwardBatch
    from workers.cache import ModelCache

    cache = ModelCache(model.config, num_pages=32, page_size=4, num_slots=2, dtype=torch.float32, device="cpu")
    pages = [5, 1, 30, 7, 12, 3, 9, 20, 0, 14, 25]
    batch = ForwardBatch.build([ids], [0], [pages], [1], "cpu")
    return model(batch, cache, torch.arange(len(ids))).float()


def assert_matches_oracle(ckpts, name: str, model_dir: Path) -> None:
    ids = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(11)).tolist()
    ours = prefill_logits(load_ours(model_dir), ids)
    ref = ckpts.hf_logits(name, ids)
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= REL_TOL * scale, f"{model_dir.name}: max |diff| {err:.3g} vs max|logits| {scale:.3g}"


def names_exactly(message: str, tensor: str) -> bool:
    """`tensor` appears in `message` as a whole name (experts.1 does not match experts.11)."""
    return re.search(rf"(?<![\w.]){re.escape(tensor)}(?![\w.])", message) is not None


def stored_or_canonical(name: str) -> list[str]:
    """A tensor of a `model.language_model.` checkpoint may be named as stored or as the decoder reads it."""
    if name.startswith("model.language_model."):
        return [name, "model." + name[len("model.language_model."):]]
    return [name]


def load_error(model_dir: Path) -> str:
    model = HybridModel(
        ModelConfig.from_dir(model_dir), torch.float32, "cpu")
    with pytest.raises(WeightsError) as info:
        load_weights(model, model_dir)
    return str(info.value)


# ------------------------------------------------------------------------------------- layouts that load
@pytest.mark.parametrize("name", [
    "qwen3_next_sharded", "qwen35_moe_fused_experts", "qwen35_moe_language_model_prefix", "qwen35_moe_tied",
])
def test_checkpoint_layout_variant_loads_and_matches_transformers(ckpts, name):
    model_dir = ckpts.path(name)
    if name == "qwen3_next_sharded":
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    if name == "qwen35_moe_fused_experts":
        assert "model.layers.0.mlp.experts.gate_up_proj" in read_tensors(model_dir)
    if name == "qwen35_moe_language_model_prefix":
        assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen3_5_moe"
        assert all(k.startswith(("model.language_model.", "lm_head.")) for k in read_tensors(model_dir))
    if name == "qwen35_moe_tied":
        assert "lm_head.weight" not in read_tensors(model_dir)
        assert ModelConfig.from_dir(model_dir).tie_word_embeddings
    assert_matches_oracle(ckpts, name, model_dir)


def test_bfloat16_checkpoint_loads_into_a_float32_model_as_transformers_loads_it(ckpts, tmp_path):
    import copy

    import checkpoints as ck

    dst = tmp_path / "bf16"
    copy.deepcopy(ckpts.hf("qwen3_next")).to(torch.bfloat16).save_pretrained(str(dst))
    ck.write_tokenizer(dst)
    assert all(t.dtype == torch.bfloat16 for t in read_tensors(dst).values())
    ids = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(12)).tolist()
    with torch.no_grad():
        ref = ck.load_hf(dst)(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(load_ours(dst), ids)
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= REL_TOL * scale, f"max |diff| {err:.3g} vs max|logits| {scale:.3g}"


def test_tied_checkpoint_that_also_stores_lm_head_loads(ckpts, tmp_path):
    src = ckpts.path("qwen35_moe_tied")
    dst = rewrite_tensors(src, tmp_path / "tied_with_head",
                          lambda ts: dict(ts, **{"lm_head.weight": ts["model.embed_tokens.weight"].clone()}))
    assert_matches_oracle(ckpts, "qwen35_moe_tied", dst)


@pytest.mark.parametrize("oracle, top_level_tie, text_config_tie", [
    ("qwen35_moe_tied", True, None),  # tied at the top level only: lm_head is the embedding
    ("qwen35_moe", False, True),  # text_config says tied, the top level does not: the stored lm_head is used
])
def test_multimodal_config_ties_embeddings_as_its_top_level_says(ckpts, tmp_path, oracle, top_level_tie,
                                                                  text_config_tie):
    """transformers' Qwen3_5MoeForConditionalGeneration ties lm_head to the embedding by the top-level
    `tie_word_embeddings` of a `qwen3_5_moe` config and ignores the one in `text_config`."""
    import checkpoints as ck

    dst = ck.add_language_model_prefix(ckpts.path(oracle), tmp_path / "wrapped")
    raw = json.loads((dst / "config.json").read_text())
    raw["tie_word_embeddings"] = top_level_tie
    raw["text_config"].pop("tie_word_embeddings", None)
    if text_config_tie is not None:
        raw["text_config"]["tie_word_embeddings"] = text_config_tie
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    assert ("lm_head.weight" in read_tensors(dst)) == (not top_level_tie)
    assert_matches_oracle(ckpts, oracle, dst)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen35_moe_language_model_prefix"])
def test_mtp_and_vision_tensors_are_skipped_not_errors(ckpts, tmp_path, name):
    src = ckpts.path(name)

    def add(ts):
        extra = {
            "mtp.fc.weight": torch.randn(64, 128),
            "mtp.layers.0.input_layernorm.weight": torch.randn(64),
            "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(32, 64),
            "mtp.norm.weight": torch.randn(64),
            "mtp.pre_fc_norm_embedding.weight": torch.randn(64),
        }
        if name != "qwen3_next":
            extra["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4)
        return dict(ts, **extra)

    assert_matches_oracle(ckpts, name, rewrite_tensors(src, tmp_path / "with_mtp", add))


# ------------------------------------------------------------------------------------ broken checkpoints
MISSING = [
    ("qwen3_next", "model.layers.2.self_attn.k_norm.weight"),
    ("qwen3_next", "model.layers.3.linear_attn.A_log"),
    ("qwen3_next", "model.layers.0.linear_attn.conv1d.weight"),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight"),
    ("qwen3_next", "model.layers.3.linear_attn.in_proj_ba.weight"),
    ("qwen3_next", "model.layers.0.mlp.experts.3.up_proj.weight"),
    ("qwen3_next", "model.layers.4.mlp.experts.0.down_proj.weight"),
    ("qwen3_next", "model.layers.1.mlp.down_proj.weight"),
    ("qwen3_next", "model.norm.weight"),
    ("qwen3_next", "lm_head.weight"),
    ("qwen35_moe", "model.layers.1.linear_attn.in_proj_a.weight"),
    ("qwen35_moe", "model.layers.0.mlp.experts.7.gate_proj.weight"),
    ("qwen35_moe", "model.layers.4.mlp.shared_expert_gate.weight"),
    ("qwen35_moe", "model.embed_tokens.weight"),
    ("qwen35_moe_fused_experts", "model.layers.2.mlp.experts.gate_up_proj"),
    ("qwen35_moe_language_model_prefix", "model.language_model.layers.0.linear_attn.in_proj_z.weight"),
]


@pytest.mark.parametrize("name, tensor", MISSING)
def test_missing_tensor_is_named_in_weights_error(ckpts, tmp_path, name, tensor):
    src = ckpts.path(name)
    assert tensor in read_tensors(src)
    broken = rewrite_tensors(src, tmp_path / "missing", lambda ts: {k: v for k, v in ts.items() if k != tensor})
    message = load_error(broken)
    assert any(names_exactly(message, n) for n in stored_or_canonical(tensor)), message
    assert "missing" in message.lower(), message


UNEXPECTED = [
    ("qwen3_next", "model.layers.0.mlp.experts.8.gate_proj.weight", (32, 64)),  # expert beyond num_experts
    ("qwen3_next", "model.layers.5.input_layernorm.weight", (64,)),  # layer beyond num_hidden_layers
    ("qwen3_next", "model.layers.2.self_attn.q_proj.bias", (128,)),  # attention_bias is false
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkv.weight", (80, 64)),  # split projection beside fused
    ("qwen3_next", "lm_head.bias", (128,)),
    ("qwen35_moe", "model.layers.1.mlp.shared_expert.gate_proj.bias", (48,)),
    ("qwen35_moe_language_model_prefix", "model.language_model.layers.0.self_attn.q_proj.weight", (128, 64)),
]


@pytest.mark.parametrize("name, tensor, shape", UNEXPECTED)
def test_unexpected_tensor_is_named_in_weights_error(ckpts, tmp_path, name, tensor, shape):
    src = ckpts.path(name)
    assert tensor not in read_tensors(src)
    broken = rewrite_tensors(src, tmp_path / "extra", lambda ts: dict(ts, **{tensor: torch.randn(shape)}))
    message = load_error(broken)
    assert any(names_exactly(message, n) for n in stored_or_canonical(tensor)), message
    assert "unexpected" in message.lower(), message


MISSHAPED = [
    ("qwen3_next", "model.layers.2.self_attn.q_proj.weight", lambda t: t[:-1]),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", lambda t: t[:-1]),
    ("qwen3_next", "model.layers.3.linear_attn.in_proj_ba.weight", lambda t: t[:, :-1]),
    ("qwen3_next", "model.layers.0.linear_attn.conv1d.weight", lambda t: t[..., :-1]),
    ("qwen3_next", "model.layers.3.mlp.experts.5.down_proj.weight", lambda t: t[:, :-1]),
    ("qwen3_next", "model.embed_tokens.weight", lambda t: torch.cat([t, t[:1]])),
    ("qwen35_moe", "model.layers.1.linear_attn.in_proj_b.weight", lambda t: t[:-1]),
    ("qwen35_moe", "model.layers.0.linear_attn.A_log", lambda t: t[None]),
    ("qwen35_moe_fused_experts", "model.layers.1.mlp.experts.gate_up_proj", lambda t: t[:, :-1]),
    ("qwen35_moe_fused_experts", "model.layers.4.mlp.experts.down_proj", lambda t: t[:-1]),
]


@pytest.mark.parametrize("name, tensor, change", MISSHAPED, ids=[f"{n}-{t}" for n, t, _ in MISSHAPED])
def test_misshaped_tensor_is_named_in_weights_error(ckpts, tmp_path, name, tensor, change):
    src = ckpts.path(name)
    broken = rewrite_tensors(src, tmp_path / "misshaped", lambda ts: dict(ts, **{tensor: change(ts[tensor]).clone()}))
    bad_shape = list(read_tensors(broken)[tensor].shape)
    message = load_error(broken)
    assert names_exactly(message, tensor), message
    assert str(bad_shape) in message or str(tuple(bad_shape)) in message, message


# ----------------------------------------------------------------------------------------- missing files
def test_directory_without_safetensors_raises_file_not_found(qwen3_next_dir, tmp_path):
    shutil.copy2(qwen3_next_dir / "config.json", tmp_path / "config.json")
    model = HybridModel(
        ModelConfig.from_dir(tmp_path), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError) as info:
        load_weights(model, tmp_path)
    message = str(info.value)
    assert "model.safetensors" in message and str(tmp_path) in message, message


def test_directory_with_only_a_pytorch_bin_raises_file_not_found_and_never_unpickles(qwen3_next_dir, tmp_path):
    shutil.copy2(qwen3_next_dir / "config.json", tmp_path / "config.json")
    # a pickle that would create a marker file if anything unpickled it
    marker = tmp_path / "UNPICKLED"

    class Trap:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"trap": Trap()}, tmp_path / "pytorch_model.bin")
    model = HybridModel(
        ModelConfig.from_dir(tmp_path), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError) as info:
        load_weights(model, tmp_path)
    message = str(info.value)
    assert "safetensors" in message and "pytorch_model.bin" in message, message
    assert not marker.exists(), "the pickle checkpoint was unpickled"


def test_sharded_index_naming_a_missing_shard_raises_file_not_found_naming_it(sharded_dir, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(sharded_dir, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (dst / shard).unlink()
    model = HybridModel(
        ModelConfig.from_dir(dst), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError) as info:
        load_weights(model, dst)
    assert shard in str(info.value), str(info.value)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("keep", [4, 4096])
def test_truncated_single_file_is_a_weights_error_naming_the_file(qwen3_next_dir, tmp_path, keep):
    """A partial download (cut inside the header, or inside the data) names the file; no safetensors traceback."""
    dst = _copy_checkpoint(qwen3_next_dir, tmp_path / "cut")
    _truncate(dst / "model.safetensors", keep)
    message = load_error(dst)
    assert str(dst / "model.safetensors") in message and "partial download" in message, message


def test_git_lfs_pointer_in_place_of_the_weights_says_so(qwen3_next_dir, tmp_path):
    dst = _copy_checkpoint(qwen3_next_dir, tmp_path / "lfs")
    (dst / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    message = load_error(dst)
    assert "model.safetensors" in message and "git lfs pull" in message, message


def test_truncated_shard_is_a_weights_error_naming_the_shard(sharded_dir, tmp_path):
    dst = _copy_checkpoint(sharded_dir, tmp_path / "sharded")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[2]
    _truncate(dst / shard, 100)
    assert str(dst / shard) in load_error(dst)


def test_index_mapping_a_tensor_to_a_shard_without_it_names_both(sharded_dir, tmp_path):
    dst = _copy_checkpoint(sharded_dir, tmp_path / "stale")
    path = dst / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == shards[0])
    index["weight_map"][name] = shards[1]
    path.write_text(json.dumps(index))
    message = load_error(dst)
    assert names_exactly(message, name) and shards[1] in message, message


@pytest.mark.parametrize("text", ["{\"metadata\": {}}", "{\"weight_map\": [1]}", "{not json"])
def test_malformed_index_is_a_weights_error_naming_the_index(sharded_dir, tmp_path, text):
    dst = _copy_checkpoint(sharded_dir, tmp_path / "bad_index")
    (dst / "model.safetensors.index.json").write_text(text)
    assert str(dst / "model.safetensors.index.json") in load_error(dst)


def test_random_weights_marker_beside_stored_weights_is_refused_not_preferred(qwen3_next_dir, tmp_path):
    """A stray random_weights.json (a bench model's marker) must not silently replace the stored weights."""
    from workers.weights import RANDOM_WEIGHTS_FILE

    dst = _copy_checkpoint(qwen3_next_dir, tmp_path / "both")
    (dst / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 0}))
    message = load_error(dst)
    assert RANDOM_WEIGHTS_FILE in message and "model.safetensors" in message, message


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_moe", None])
def test_unsupported_model_type_raises_config_error_naming_model_type(qwen3_next_dir, tmp_path, model_type):
    raw = json.loads((qwen3_next_dir / "config.json").read_text())
    if model_type is None:
        del raw["model_type"]
    else:
        raw["model_type"] = model_type  # qwen3_5_moe: the multimodal type, here without a text_config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    message = str(info.value)
    assert "model_type" in message and repr(model_type) in message, message


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", "\xff"])
def test_a_config_that_is_not_a_json_object_is_an_error_naming_the_file(tmp_path, text):
    """A malformed config.json is a ConfigError naming the file, not a bare JSON parser message."""
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value), str(info.value)


def test_configs_written_by_transformers_read_as_written(ckpts):
    nxt = ModelConfig.from_dir(ckpts.path("qwen3_next"))
    assert nxt.model_type == "qwen3_next" and nxt.moe_layers == [True, False, True, True, True]
    assert nxt.layer_types[2] == nxt.layer_types[4] == "full_attention" and nxt.rotary_dim == 4
    alt = ModelConfig.from_dir(ckpts.path("qwen3_next_alt"))
    assert alt.moe_layers == [False, True, False, True, False] and not alt.norm_topk_prob
    assert alt.attention_bias and alt.rotary_dim == 8 and alt.rope_theta == 1000.0
    wrapped = ModelConfig.from_dir(ckpts.path("qwen35_moe_language_model_prefix"))
    assert wrapped == ModelConfig.from_dir(ckpts.path("qwen35_moe"))


# config.json values out of range or of the wrong type: a ConfigError naming the field (they used to divide by
# zero, build negative-sized tensors or fail inside int() without naming the field)
BAD_FIELDS = [
    ("num_key_value_heads", 0), ("linear_num_key_heads", 0), ("hidden_size", -64), ("hidden_size", "64x"),
    ("hidden_size", True), ("vocab_size", 0), ("num_hidden_layers", 0), ("head_dim", 0),
    ("max_position_embeddings", 0), ("linear_key_head_dim", 0), ("moe_intermediate_size", 0),
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 99), ("rms_norm_eps", -1), ("rms_norm_eps", "tiny"),
    ("eos_token_id", "</s>"), ("eos_token_id", [1, -2]), ("layer_types", 5), ("mlp_only_layers", 1),
    ("decoder_sparse_step", 0), ("full_attention_interval", 0), ("rope_parameters", ["x"]),
    ("partial_rotary_factor", 2.0), ("norm_topk_prob", "yes"), ("tie_word_embeddings", "no"),
    ("linear_conv_kernel_dim", 1),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_config_field_out_of_range_or_of_the_wrong_type_is_a_config_error_naming_it(qwen3_next_dir, field, value):
    raw = json.loads((qwen3_next_dir / "config.json").read_text())
    raw[field] = value
    if field == "full_attention_interval":
        del raw["layer_types"]  # the interval only counts where no layer_types are given
    if field == "partial_rotary_factor":
        raw.pop("rope_parameters", None)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    assert field in str(info.value), str(info.value)


def test_integral_floats_read_as_integers(qwen3_next_dir):
    raw = json.loads((qwen3_next_dir / "config.json").read_text())
    ours = ModelConfig.from_dict(dict(raw, hidden_size=float(raw["hidden_size"])))
    assert ours == ModelConfig.from_dict(raw) and isinstance(ours.hidden_size, int)


# Fields whose value changes no tensor shape: read wrongly, they give another model that still loads.
SHAPELESS_FIELDS = ["num_experts_per_tok", "norm_topk_prob", "rope_parameters", "rms_norm_eps",
                    "max_position_embeddings", "hidden_act"]


@pytest.mark.parametrize("field", SHAPELESS_FIELDS)
@pytest.mark.parametrize("name", ["qwen3_next", "qwen35_moe"])
def test_config_without_a_field_reads_as_transformers_reads_it_or_fails_naming_it(ckpts, name, field):
    """A config.json that leaves out a field that shapes no tensor means transformers' default for it: we must
    read the same architecture, or refuse with a ConfigError that names the field; never silently another model
    that still loads (fields that shape tensors are caught by the loader's shape checks)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    raw = json.loads((ckpts.path(name) / "config.json").read_text())
    if field not in raw:
        pytest.skip(f"{name} has no {field}")
    del raw[field]
    hf_cls = Qwen3NextConfig if raw["model_type"] == "qwen3_next" else Qwen3_5MoeTextConfig
    hf = hf_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "model_type")})
    try:
        ours = ModelConfig.from_dict(raw)
    except ConfigError as e:
        assert field in str(e), str(e)
        return
    rope = hf.rope_parameters
    expected = {
        "layer_types": hf.layer_types, "head_dim": hf.head_dim, "num_key_value_heads": hf.num_key_value_heads,
        "num_experts_per_tok": hf.num_experts_per_tok, "moe_intermediate_size": hf.moe_intermediate_size,
        "shared_expert_intermediate_size": hf.shared_expert_intermediate_size, "rms_norm_eps": hf.rms_norm_eps,
        "linear_conv_kernel_dim": hf.linear_conv_kernel_dim, "max_position_embeddings": hf.max_position_embeddings,
        "attention_bias": hf.attention_bias, "tie_word_embeddings": hf.tie_word_embeddings,
        "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0),
        "hidden_act": hf.hidden_act,
    }
    if name == "qwen3_next":
        expected["norm_topk_prob"] = hf.norm_topk_prob
    got = {k: getattr(ours, k) for k in expected}
    assert got == expected, {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
