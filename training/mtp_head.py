"""A trainable twin of the engine's MTP head (workers/mtp.py MTPHead), in plain PyTorch.

Same parameter names and shapes as MTPHead's `mtp.*` tensors, same computation, batched over [B, T] windows
instead of the engine's ragged paged batches: for the pairs (x_q, h_{q-1}) of a window, at rotary positions
0..T-1 (pair q sits at index q - 1),
    u = fc([pre_fc_norm_embedding(embed(x_q)), pre_fc_norm_hidden(h_{q-1})])
    m = norm(decoder_layer(u))        # one causal full-attention layer with the target's MoE (+ shared expert)
and the target's (frozen, shared) LM head turns m into logits for x_{q+1}. Its state_dict() is what the engine
loads (`load_weights(MTPHead, dir, scope="mtp")`); tests/test_training.py checks that the engine's head gives
the same outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.norm import rmsnorm_ref
from workers.config import ModelConfig


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # zero-centred: x / rms(x) * (1 + weight)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm_ref(x, self.weight, self.eps)


def _linear(d_in: int, d_out: int, std: float = 0.02) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class _Attention(nn.Module):
    """Gated attention: q/k RMSNorm, partial rotary (rotate-half), GQA, sigmoid output gate; causal."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.attention_bias:
            raise ValueError("the trainable MTP head has no attention biases")
        h, d, kv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = h, kv, d, cfg.rotary_dim
        self.q_proj = _linear(cfg.hidden_size, h * d * 2)
        self.k_proj = _linear(cfg.hidden_size, kv * d)
        self.v_proj = _linear(cfg.hidden_size, kv * d)
        self.o_proj = _linear(h * d, cfg.hidden_size)
        self.q_norm = _Norm(d, cfg.rms_norm_eps)
        self.k_norm = _Norm(d, cfg.rms_norm_eps)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r, half = self.rotary_dim, self.rotary_dim // 2
        x_rot, x_pass = x[..., :r], x[..., r:]
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos[:, None], sin[:, None]).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim))
        k = self._rope(k, cos[:, None], sin[:, None]).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.heads != self.kv_heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                           scale=self.head_dim ** -0.5)
        o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(o)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inner), _linear(hidden, inner), \
            _linear(inner, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _SparseMoe(nn.Module):
    """Softmax top-k router over fp32 logits, experts computed densely (few, small experts), shared expert
    with a sigmoid gate. `aux` keeps the last forward's load-balancing loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, e
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.randn(e, h) * 0.02)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.02)
        self.shared_expert = _MLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = _linear(h, 1)
        self.aux = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)  # [N, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(1, ids, weights).to(x.dtype)  # [N, E]
        gate, up = torch.einsum("nh,eoh->neo", x, self.experts.gate_up_proj.to(x.dtype)).chunk(2, dim=-1)
        y = torch.einsum("nei,ehi->neh", F.silu(gate) * up, self.experts.down_proj.to(x.dtype))
        routed = (y * dense[..., None]).sum(1)
        frac = torch.zeros_like(probs).scatter(1, ids, 1.0).mean(0) / self.top_k  # share of assignments
        self.aux = self.num_experts * (frac.detach() * probs.mean(0)).sum()
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared).view(shape)


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _SparseMoe(cfg)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainableMTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int = 1):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.mtp = nn.Module()
        self.mtp.fc = _linear(2 * h, h)
        self.mtp.pre_fc_norm_embedding = _Norm(h, cfg.rms_norm_eps)
        self.mtp.pre_fc_norm_hidden = _Norm(h, cfg.rms_norm_eps)
        self.mtp.layers = nn.ModuleList([_DecoderLayer(cfg) for _ in range(num_layers)])
        self.mtp.norm = _Norm(h, cfg.rms_norm_eps)
        r = cfg.rotary_dim
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2).float() / r)),
                             persistent=False)

    def forward(self, embed: Tensor, hidden: Tensor) -> Tensor:
        """embed, hidden [B, T, H] (embeddings of x_q and the paired h_{q-1}) -> m [B, T, H]."""
        u = torch.cat([self.mtp.pre_fc_norm_embedding(embed), self.mtp.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.mtp.fc(u)
        freqs = torch.arange(x.shape[1], device=x.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.mtp.layers:
            x = layer(x, cos, sin)
        return self.mtp.norm(x)

    def aux_loss(self) -> Tensor:
        return sum(layer.mlp.aux for layer in self.mtp.layers)

    def mtp_tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        """The `mtp.*` checkpoint tensors (what the engine's MTPHead loads)."""
        return {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()
                if k.startswith("mtp.")}
