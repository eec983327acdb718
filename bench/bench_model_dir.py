"""Writes a random-weights model directory for the bench model, so `hybridspec serve DIR` serves it.

    python -m bench.bench_model_dir --out DIR --layers 40 [--routing zipf|uniform] [--seed 0] [--decisive]
                                    [--prompts-out FILE --num-prompts N]

The directory holds config.json (Qwen3.6-35B-A3B shapes, `qwen3_5_moe_text`), tokenizer.json and the marker
`random_weights.json` ({"kind": "bench", "routing": ..., "seed": ..., "decisive": ...}), and no safetensors:
workers/weights.py load_weights fills the model in place, on its device, with the weights build_bench_model
makes for the same config and seed (a 40-layer checkpoint would be ~70 GB).

Tokenizer: byte-level, ids 0..255 = bytes 0..255 in byte order (so any text encodes, as the embedded default
model's tokenizer does), ids 256..V-2 placeholder tokens that decode to " t<id>" (never produced by encoding),
and id V-1 = `<|endoftext|>` (special, the EOS named in config.json). Every id of the vocab decodes.

`--prompts-out` (needs `--decisive`): a loadtest prompts JSONL whose greedy continuations repeat the prompt.
With decisive logits the greedy next token is a fixed function of the current one (decisive_successor), so a
prompt [c_0 .. c_{L-1}, c_0 .. c_{R-1}] of the chain c_{i+1} = successor(c_i) continues with c_R, c_{R+1}, ...,
which the prompt already holds: an n-gram drafter's best case (labelled as such wherever it is reported).
`--tiny` writes test-sized shapes instead (CPU tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.tokenizer import BYTE_EOS_TOKEN, bytes_to_unicode  # noqa: E402
from workers.bench_model import ROUTINGS, qwen36_35b_a3b_config  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.weights import RANDOM_WEIGHTS_FILE  # noqa: E402

TINY_VOCAB = 1024


def tiny_config(num_layers: int = 2, vocab_size: int = TINY_VOCAB) -> ModelConfig:
    """Test-sized shapes of the same family (GDN, GDN, GDN, attention, ... as the bench model's pattern)."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if num_layers >= 2 and "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"  # every layer kind is exercised
    return ModelConfig.from_dict({
        "model_type": "qwen3_5_moe_text", "vocab_size": vocab_size, "hidden_size": 64,
        "num_hidden_layers": num_layers, "layer_types": layer_types, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    })


def config_json(cfg: ModelConfig) -> dict:
    """`cfg` (a qwen3_5_moe_text config) as a Hugging Face config.json that reads back as the same config,
    with EOS = the tokenizer's `<|endoftext|>` (id V-1)."""
    if cfg.model_type != "qwen3_5_moe_text":
        raise ValueError(f"only qwen3_5_moe_text configs are written, got {cfg.model_type!r}")
    raw = {
        "model_type": cfg.model_type, "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types), "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "attention_bias": cfg.attention_bias, "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads, "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim, "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act, "eos_token_id": cfg.vocab_size - 1, "torch_dtype": "bfloat16",
    }
    if ModelConfig.from_dict(raw) != dataclasses.replace(cfg, eos_token_ids=[cfg.vocab_size - 1]):
        raise AssertionError("config.json does not read back as the config it was written from")
    return raw


def build_vocab_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level tokenizer covering exactly `vocab_size` ids (see the module docstring)."""
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes, a placeholder, EOS), got {vocab_size}")
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    space = table[ord(" ")]
    for i in range(256, vocab_size - 1):
        vocab[f"{space}t{i}"] = i
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(BYTE_EOS_TOKEN) == vocab_size - 1 and tok.get_vocab_size() == vocab_size
    return tok


def decisive_successor(vocab_size: int, seed: int) -> torch.Tensor:
    """successor[x]: the greedy next token after x of a model with decisive logits
    (workers/bench_model.make_logits_decisive_: LM-head row v = embedding of perm[v], so the winning v has
    perm[v] = x, i.e. v = perm^-1[x]). tests/test_bench_model_dir.py checks it against the model itself."""
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed + 7))
    return torch.argsort(perm)


def repeat_prompts(vocab_size: int, seed: int, num_prompts: int, chain_len: int = 112, repeat_len: int = 16,
                   prompt_seed: int = 0) -> list[list[int]]:
    """Prompts [c_0 .. c_{chain_len-1}, c_0 .. c_{repeat_len-1}] of chains of decisive_successor from random
    starts: the greedy continuation c_{repeat_len}, ... is in the prompt for chain_len - repeat_len tokens."""
    if not 1 <= repeat_len < chain_len:
        raise ValueError("need 1 <= repeat_len < chain_len")
    succ = decisive_successor(vocab_size, seed).tolist()
    rng = random.Random(f"repeat-prompts/{prompt_seed}")
    out = []
    for _ in range(num_prompts):
        chain = [rng.randrange(vocab_size - 1)]  # never start at EOS
        while len(chain) < chain_len:
            chain.append(succ[chain[-1]])
        out.append(chain + chain[:repeat_len])
    return out


def write_bench_model_dir(out: str | Path, *, num_layers: int = 40, routing: str = "zipf", seed: int = 0,
                          decisive: bool = False, config: ModelConfig | None = None) -> Path:
    """Writes config.json, tokenizer.json and random_weights.json into `out` (created); returns it."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    cfg = config or qwen36_35b_a3b_config(num_layers)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in d.glob("*.safetensors*"))
    if stale:
        raise ValueError(f"{d} holds safetensors files {stale}: a random-weights directory must have none")
    (d / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    build_vocab_tokenizer(cfg.vocab_size).save(str(d / "tokenizer.json"))
    marker = {"kind": "bench", "routing": routing, "seed": seed, "decisive": decisive}
    (d / RANDOM_WEIGHTS_FILE).write_text(json.dumps(marker) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_model_dir", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    p.add_argument("--layers", type=int, default=40, help="decoder layers (default 40: the full model)")
    p.add_argument("--routing", default="zipf", choices=ROUTINGS, help="router bias (default zipf)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--decisive", action="store_true",
                   help="decisive logits: greedy tokens robust to bf16 rounding (make_logits_decisive_)")
    p.add_argument("--tiny", action="store_true", help=f"test-sized shapes (hidden 64, vocab {TINY_VOCAB})")
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--prompts-out", default=None, metavar="FILE",
                   help="also write repeat prompts (loadtest JSONL) whose greedy continuation the prompt holds "
                        "(needs --decisive)")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts in --prompts-out (default 256)")
    args = p.parse_args(argv)
    if args.prompts_out and not args.decisive:
        p.error("--prompts-out needs --decisive (otherwise greedy continuations are not predictable)")
    if args.tiny:
        cfg = tiny_config(args.layers, args.vocab_size or TINY_VOCAB)
    else:
        cfg = qwen36_35b_a3b_config(args.layers, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    d = write_bench_model_dir(args.out, routing=args.routing, seed=args.seed, decisive=args.decisive, config=cfg)
    print(f"wrote {d}: {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, routing {args.routing}, "
          f"seed {args.seed}{', decisive logits' if args.decisive else ''}", flush=True)
    if args.prompts_out:
        prompts = repeat_prompts(cfg.vocab_size, args.seed, args.num_prompts)
        with open(args.prompts_out, "w", encoding="utf-8") as f:
            for ids in prompts:
                f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
        print(f"wrote {args.prompts_out}: {len(prompts)} repeat prompts of {len(prompts[0])} tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
