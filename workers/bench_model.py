"""The benchmark model: Qwen3.6-35B-A3B shapes with random bf16 weights made directly on the GPU.

Random routers touch experts uniformly, which overstates MoE cost growth with tokens (docs/benchmarking.md).
`routing="zipf"` adds a fixed per-expert logit bias -log(rank) so that, with unit-variance router logits,
expert popularity follows Zipf with exponent 1: distinct experts touched by 4 / 16 / 64 / 544 tokens come out
near 17 / 35 / 61 / 121 (top-8 of 256), the paper's skewed-routing row. `routing="uniform"` is the second row.
"""

from __future__ import annotations

import torch

from workers.config import ModelConfig
from workers.model import HybridModel, SparseMoe
from workers.random_init import init_random_

ROUTINGS = ("zipf", "uniform")


def qwen36_35b_a3b_config(num_layers: int = 40, vocab_size: int = 248320) -> ModelConfig:
    """40 layers = 10 x (3 GDN + 1 gated attention), hidden 2048, 256 experts top-8 + shared expert."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return ModelConfig.from_dict({
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 2048,
        "num_hidden_layers": num_layers,
        "layer_types": layer_types,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
    })


def zipf_router_bias(num_experts: int, seed: int, device) -> torch.Tensor:
    """Per-expert bias -log(rank), ranks a fixed random permutation of 1..E."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(num_experts, generator=gen).float() + 1.0
    return (-torch.log(rank)).to(device)


EMBED_SCALE = 32.0  # decisive logits: the token embedding dominates the residual stream this many times over


@torch.no_grad()
def make_logits_decisive_(model: HybridModel, seed: int) -> HybridModel:
    """Greedy next token = a fixed permutation of the current token, by a wide margin.

    Random layers give near-flat logits over 248k tokens, so bf16 rounding that depends on the batch shape
    (a verified block vs a one-token decode) flips greedy tokens within a few steps, and a replay benchmark
    loses its reference (bench/NOTES.md). Here the embeddings are scaled EMBED_SCALE x (every layer sees them
    through an RMSNorm, so the layers' work and cost are unchanged) and the LM head's row v is the embedding of
    token perm[v]: the final hidden state points along embed[x], whose logit beats every other by ~sqrt(H)
    standard deviations. Weights only; shapes, kernels and routing statistics stay those of the bench model."""
    emb = model.model.embed_tokens.weight
    emb.mul_(EMBED_SCALE)
    if model.config.tie_word_embeddings:
        raise ValueError("decisive logits need an untied LM head")
    gen = torch.Generator().manual_seed(seed + 7)
    perm = torch.randperm(emb.shape[0], generator=gen).to(emb.device)
    model.lm_head.weight.copy_(emb[perm] / EMBED_SCALE)
    return model


def build_bench_model(num_layers: int = 40, routing: str = "zipf", dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cuda", seed: int = 0,
                      config: ModelConfig | None = None, decisive: bool = False) -> HybridModel:
    """Random-weight model at Qwen3.6-35B-A3B shapes (or `config`), built in place on `device`.
    `decisive`: greedy tokens robust to bf16 rounding (make_logits_decisive_), for replay benchmarks."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    cfg = config or qwen36_35b_a3b_config(num_layers)
    return fill_bench_weights_(HybridModel(cfg, dtype, device), routing, seed, decisive)


@torch.no_grad()
def fill_bench_weights_(model: HybridModel, routing: str = "zipf", seed: int = 0,
                        decisive: bool = False, local_experts=None) -> HybridModel:
    """Fills an existing HybridModel in place with the bench model's weights (what build_bench_model makes for
    the same config and seed): init_random_, then the Zipf router bias per MoE layer, then (`decisive`)
    make_logits_decisive_. Used by workers/weights.py for random-weights model directories (`local_experts`:
    init_random_'s, an expert-parallel rank's share of the experts)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    init_random_(model, seed, local_experts=local_experts)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoe) and routing == "zipf":
            layer.mlp.router_bias = zipf_router_bias(model.config.num_experts, seed + i, model.device).to(torch.float32)
    if decisive:
        make_logits_decisive_(model, seed)
    return model
