"""The hybrid Gated-DeltaNet + MoE decoder (Qwen3-Next / Qwen3.5-MoE), run over ragged batches.

Parameter names follow the Hugging Face checkpoints (`model.layers.{i}.linear_attn.in_proj_qkv.weight`, ...)
with one canonical layout for both families: GDN projections split as in Qwen3.5 (qkv, z, b, a) and
experts fused as 3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
workers.weights converts the other layouts on load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import dispatch
from kernels.moe import ROUTER_LOGITS_MAX_N, router_correction_ref
from workers.batch import ForwardBatch
from workers.cache import AttentionKV, GDNScratch, GDNState, ModelCache, StepScratch
from workers.config import FULL_ATTENTION, ModelConfig


@dataclass
class MoEContext:
    """Per-forward MoE bookkeeping. In: `extra_rows` [N] bool marks each verifying request's extra token.
    Out: `token_mask` [N] bool after the router correction at the first MoE layer (False = masked out of all
    later expert work), and the distinct experts touched per MoE layer (device scalars) and with collect_counts
    its per-expert counts: on a local layer written by the fused MoE's grouping (`mask_and_stats`), under
    expert parallelism by a kernel of their own (`mask_for`)."""

    extra_rows: Tensor | None = None
    row_mask: Tensor | None = None  # [N] bool, False = a padding row of a captured graph (never any expert work)
    token_mask: Tensor | None = None
    distinct_experts: list[Tensor] = field(default_factory=list)
    collect_counts: bool = False  # also keep each layer's per-expert token counts (routing statistics)
    expert_counts: list[Tensor] = field(default_factory=list)
    # distinct experts per layer: only hybridspec's latency model reads them (a kernel a layer for nothing in the
    # other policies' steps)
    collect_distinct: bool = True
    # optional static outputs of the fused statistics (a captured graph's): distinct [MoE layers] int64 and counts
    # [MoE layers, E] int64; layer i writes row i, so the step's statistics are one tensor each, read without a
    # torch.stack of 40 small tensors (~0.1 ms of host a step on the H200 host) and with one device copy at most
    distinct_out: Tensor | None = None
    counts_out: Tensor | None = None
    _rows_out: int = 0  # layers whose statistics went into the static outputs

    def _all_static(self, out: Tensor | None, recorded: list[Tensor]) -> bool:
        """Whether every recorded layer's statistic is its row of the static output `out` (and every row is one)."""
        return out is not None and self._rows_out == len(recorded) == len(out)

    def stacked_distinct(self) -> Tensor:
        """[MoE layers] the distinct experts per layer, as one tensor (the static output itself where every layer
        wrote into it: valid until the next forward writes it again)."""
        if self._all_static(self.distinct_out, self.distinct_experts):
            return self.distinct_out
        return torch.stack(self.distinct_experts)

    def counts_view(self) -> "Tensor | list[Tensor]":
        """The per-expert counts per layer: the static [MoE layers, E] output where every layer wrote into it,
        else the list (LengthPolicy.keep_counts copies either)."""
        return self.counts_out if self._all_static(self.counts_out, self.expert_counts) else self.expert_counts

    def mask_for(self, ids: Tensor, num_experts: int, stats: bool = True) -> Tensor | None:
        """One MoE layer's routing (ids [N, k]) -> the token mask its experts run with, recording what the
        latency model learns (`stats=False`: not here, the caller has fused_moe write them: `mask_and_stats`).
        The first call applies the router correction (padding rows cover nothing).
        Device ops only: no host sync, so it can be captured in a CUDA graph."""
        if self.token_mask is None and (self.extra_rows is not None or self.row_mask is not None):
            if self.extra_rows is None:
                self.token_mask = self.row_mask
            else:
                real = ids if self.row_mask is None else torch.where(self.row_mask[:, None], ids, num_experts)
                self.token_mask = router_correction_ref(real, self.extra_rows, num_experts)
                if self.row_mask is not None:
                    self.token_mask = self.token_mask & self.row_mask
        mask = self.token_mask
        if not stats:
            return mask
        if self.collect_counts:  # one kernel for both statistics
            distinct, counts = dispatch.expert_counts(ids, mask, num_experts)
            self.expert_counts.append(counts)
            self.distinct_experts.append(distinct)
        elif self.collect_distinct:
            self.distinct_experts.append(dispatch.distinct_experts(ids, mask, num_experts))
        return mask

    def mask_and_stats(self, ids: Tensor, num_experts: int) -> tuple[Tensor | None, tuple | None]:
        """`mask_for` without its statistics kernel: (token mask, `stats` for dispatch.fused_moe or None). The
        statistics buffers (distinct experts [] int64, per-expert counts [E] int64 without collect_counts: None)
        join distinct_experts / expert_counts here, in layer order as mask_for's; fused_moe's grouping fills them
        from the histogram it computes anyway (no launch of their own, no host sync, capturable)."""
        mask = self.mask_for(ids, num_experts, stats=False)
        if not (self.collect_counts or self.collect_distinct):
            return mask, None
        i = len(self.distinct_experts)
        static = self.distinct_out is not None and i == self._rows_out and i < len(self.distinct_out) and \
            (not self.collect_counts or (self.counts_out is not None and self.counts_out.shape[-1] == num_experts))
        if static:  # row i of the static outputs (fused_moe writes through the views)
            self._rows_out += 1
            distinct = self.distinct_out[i]
            counts = self.counts_out[i] if self.collect_counts else None
        else:
            distinct = torch.empty((), dtype=torch.int64, device=ids.device)
            counts = torch.empty(num_experts, dtype=torch.int64, device=ids.device) if self.collect_counts else None
        self.distinct_experts.append(distinct)
        if counts is not None:
            self.expert_counts.append(counts)
        return mask, (distinct, counts)


def _derived(module: nn.Module, name: str, source: Tensor, fn) -> Tensor:
    """fn(source), computed once and kept until `source` changes (new storage or an in-place write, e.g. a
    weight load): per-step conversions of constant weights are kernels and HBM traffic for nothing."""
    key = (source.data_ptr(), source._version, source.dtype, source.device)
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, fn(source))
        module.__dict__[name] = cached
    return cached[1]


def _decode_fusable(dim_v: int, state_dtype: torch.dtype) -> bool:
    """The fused GDN decode kernel's shapes: a power-of-two value head dim and an fp32 state (else the four kernels)."""
    return dim_v > 0 and dim_v & (dim_v - 1) == 0 and state_dtype == torch.float32


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def local_expert_rows(model: nn.Module, local_experts) -> dict[str, list[int]]:
    """{"model.layers.i.mlp.experts": the global expert ids this rank keeps} from `local_experts`, one id list per
    MoE layer of the decoder in layer order (expert parallelism: ExpertShard.local_experts)."""
    prefixes = [f"model.layers.{i}.mlp.experts" for i, layer in enumerate(model.model.layers)
                if isinstance(layer.mlp, SparseMoe)]
    if len(local_experts) != len(prefixes):
        raise ValueError(f"local_experts has {len(local_experts)} lists, the model {len(prefixes)} MoE layers")
    return {p: [int(e) for e in keep] for p, keep in zip(prefixes, local_experts)}


def put_experts_(model: nn.Module, name: str, rows: Tensor) -> None:
    """Replaces the expert tensor `name` ("...mlp.experts.gate_up_proj") with `rows` ([E_local, ...], moved to
    the model's device and dtype): an expert-parallel rank's share, the full tensor never allocated on the
    device."""
    module, attr = name.rsplit(".", 1)
    setattr(model.get_submodule(module), attr,
            nn.Parameter(rows.to(device=model.device, dtype=model.dtype).contiguous(), requires_grad=False))


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, dtype, device, bias: bool = False):
        super().__init__()
        self.weight = _param(d_out, d_in, dtype=dtype, device=device)
        self.bias = _param(d_out, dtype=dtype, device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # F.linear, or on the Triton path at 1..kernels.gemv.SMALL_N_MAX rows the one-launch GEMV
        return dispatch.linear(x, self.weight, self.bias)


@dataclass
class FusedLinears:
    """Linears that read the same input, with weights (and biases) stored as row blocks of one tensor: one GEMM
    instead of several per step. Each Linear keeps its own parameter (a view of its block), so checkpoint names,
    loading and saving are unchanged."""

    weight: Tensor  # [sum(sizes), d_in]
    bias: Tensor | None
    sizes: list[int]  # each Linear's rows, then the padding rows if any
    count: int  # Linears

    @classmethod
    def of(cls, linears: list["Linear"], align: int = 8) -> "FusedLinears":
        """The fused output is padded with zero rows to a multiple of `align` columns: a misaligned leading
        dimension (the shared expert's gate + up + 1 gate logit) makes cuBLAS pick slow unaligned kernels."""
        sizes = [lin.weight.shape[0] for lin in linears]
        total = -(-sum(sizes) // align) * align
        if total > sum(sizes):
            sizes = sizes + [total - sum(sizes)]
        w0 = linears[0].weight
        weight = torch.zeros(total, w0.shape[1], dtype=w0.dtype, device=w0.device)
        has_bias = linears[0].bias is not None
        bias = torch.zeros(total, dtype=w0.dtype, device=w0.device) if has_bias else None
        start = 0
        for lin, n in zip(linears, sizes):
            lin.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
            if has_bias:
                lin.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
            start += n
        return cls(weight, bias, sizes, len(linears))

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x [N, d_in] -> one [N, size_i] output per Linear (column slices of one product)."""
        if x.shape[0] == 1 and len(self.sizes) > self.count:
            # one row: cuBLAS runs a GEMV, which on the unpadded width took 3.9 us against 11.6 us for the GEMM
            # it picked on the padded one (shared expert, H200, bench/NOTES.md); the first rows are contiguous
            # (dispatch.linear: the Triton GEMV on the Triton path, which reads no padding rows either)
            real = sum(self.sizes[:self.count])
            bias = self.bias[:real] if self.bias is not None else None
            return torch.split(dispatch.linear(x, self.weight[:real], bias), self.sizes[:self.count], dim=-1)
        return torch.split(dispatch.linear(x, self.weight, self.bias), self.sizes, dim=-1)[:self.count]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return dispatch.rmsnorm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the first `rotary_dim` dims of each head (rotate-half convention)."""

    def __init__(self, rotary_dim: int, theta: float, device):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, R]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Gated full attention: GQA, q/k RMSNorm, partial rotary, sigmoid output gate, paged KV."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype, device):
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, cfg.num_key_value_heads, d
        self.q_proj = Linear(cfg.hidden_size, h * d * 2, dtype, device, cfg.attention_bias)  # query and gate
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * d, dtype, device, cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * d, dtype, device, cfg.attention_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, dtype, device, cfg.attention_bias)
        self.qkv = FusedLinears.of([self.q_proj, self.k_proj, self.v_proj])
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.norm_eps = cfg.rms_norm_eps  # both norms' (qk_norm_rope_write takes one)
        self.rope = rope

    def forward(self, x: Tensor, batch: ForwardBatch, kv: AttentionKV, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x)  # one GEMM for q_proj, k_proj, v_proj
        q, gate = q.view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)  # [N, H, D] each
        # q_norm + rope, k_norm + rope, and this step's k, v into their pages: one launch on the Triton path
        q = dispatch.qk_norm_rope_write(q, k.view(n, self.kv_heads, self.head_dim),
                                        v.view(n, self.kv_heads, self.head_dim), self.q_norm.weight,
                                        self.k_norm.weight, self.norm_eps, cos, sin, self.rope.rotary_dim, kv.k,
                                        kv.v, batch.page_table, batch.positions, batch.request_of_row)
        o = dispatch.paged_attention(q, kv.k, kv.v, batch.page_table, batch.cu_seqlens, batch.context_lens,
                                     self.head_dim ** -0.5, batch.query_lens, batch.context_lens_host,
                                     gate)  # [N, H, D], times sigmoid(gate)
        return self.o_proj(o.reshape(n, -1))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer: projections, short causal conv + SiLU, gated delta rule, gated RMSNorm."""

    # plain decode (at most one token per request) runs conv, gates, delta rule and gated norm as one launch
    # (dispatch.gdn_decode); HYBRIDSPEC_GDN_DECODE_FUSED=0 (read at import) keeps the four kernels, for A/B runs
    DECODE_FUSED = os.environ.get("HYBRIDSPEC_GDN_DECODE_FUSED", "1") != "0"

    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        hidden = cfg.hidden_size
        self.in_proj_qkv = Linear(hidden, cfg.conv_dim, dtype, device)
        self.in_proj_z = Linear(hidden, self.value_dim, dtype, device)
        self.in_proj_b = Linear(hidden, self.hv, dtype, device)
        self.in_proj_a = Linear(hidden, self.hv, dtype, device)
        self.in_proj = FusedLinears.of([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim, dtype=dtype, device=device)
        self.dt_bias = _param(self.hv, dtype=dtype, device=device)
        self.A_log = _param(self.hv, dtype=dtype, device=device)
        self.norm = nn.Module()
        self.norm.weight = _param(self.dv, dtype=dtype, device=device)
        self.eps = cfg.rms_norm_eps
        self.out_proj = Linear(self.value_dim, hidden, dtype, device)

    def forward(self, x: Tensor, batch: ForwardBatch, state: GDNState, write: bool | Tensor = True,
                scratch: dict | None = None, layer_index: int = -1) -> Tensor:
        """`write`: True, or a [B] mask of the requests whose state this forward advances; the others keep
        S_0 and their block inputs go into `scratch[layer_index]` for the commit."""
        n = x.shape[0]
        conv_in, z, b, a = self.in_proj(x)  # one GEMM; conv_in [N, conv_dim], z [N, HV*DV], b, a [N, HV]
        if self.DECODE_FUSED and batch.max_query_len == 1 and _decode_fusable(self.dv, state.recurrent.dtype):
            return self._decode(conv_in, z, b, a, batch, state, write, scratch, layer_index)
        mixed = dispatch.causal_conv1d(conv_in, self.conv1d.weight[:, 0, :], batch.cu_seqlens, state.conv,
                                  batch.state_slots, batch.max_query_len, write)  # [N, conv_dim]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk)
        v = v.reshape(n, self.hv, self.dv)
        neg_a = _derived(self, "_neg_a", self.A_log, lambda x: -x.float().exp())  # [HV]
        g, beta = dispatch.gdn_gates(a, b, neg_a, self.dt_bias)  # [N, HV] fp32 log decay, [N, HV] beta
        o = dispatch.gdn(q, k, v, g, beta, batch.cu_seqlens, state.recurrent, batch.state_slots,
                    batch.max_query_len, write_state=write)  # [N, HV, DV]
        if scratch is not None:
            scratch[layer_index] = GDNScratch(conv_in, k, v, g, beta)
        z = z.view(n, self.hv, self.dv)
        o = dispatch.gated_rmsnorm(o, z, self.norm.weight, self.eps)
        return self.out_proj(o.reshape(n, self.value_dim))

    def _decode(self, conv_in: Tensor, z: Tensor, b: Tensor, a: Tensor, batch: ForwardBatch, state: GDNState,
                write: bool | Tensor, scratch: dict | None, layer_index: int) -> Tensor:
        """`forward` for blocks of at most one token, in one launch (the same write rule; with `scratch` the
        kernel also stores the block inputs the commit replays: a graph's plain-decode step always keeps them)."""
        n = conv_in.shape[0]
        neg_a = _derived(self, "_neg_a", self.A_log, lambda x: -x.float().exp())  # [HV]
        out = dispatch.gdn_decode(conv_in, z, a, b, self.conv1d.weight[:, 0, :], neg_a, self.dt_bias,
                                  self.norm.weight, self.eps, batch.cu_seqlens, state.conv, state.recurrent,
                                  batch.state_slots, write_state=write, keep_inputs=scratch is not None)
        if scratch is None:
            return self.out_proj(out)  # [N, HV*DV]
        o, mixed, g, beta = out
        _, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        scratch[layer_index] = GDNScratch(conv_in, k.reshape(n, self.hk, self.dk), v.reshape(n, self.hv, self.dv),
                                          g, beta)
        return self.out_proj(o)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, dtype, device):
        super().__init__()
        self.gate_proj = Linear(hidden, inner, dtype, device)
        self.up_proj = Linear(hidden, inner, dtype, device)
        self.down_proj = Linear(inner, hidden, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Softmax top-k router, routed experts (fused 3-D weights), shared expert with a sigmoid gate.

    Local (non-EP) layers of up to SHARED_FUSE_MAX_N tokens run the shared expert as one more expert of the fused
    MoE (issue 6): the router's logits over E + 1 rows (its rows and the shared gate's: a cached [E + 1, H] copy
    of the router weight, ~1 MiB bf16 a layer at Qwen3.6-35B-A3B shapes), routing slot k = (id E, sigmoid(gate logit)), one fused_moe call for routed +
    shared, then the residual add + next norm (`_forward_fused`). Larger steps and expert parallelism keep the
    shared expert's own GEMMs (cuBLAS at prefill sizes; EP keeps it on the local rank). Both forms give every row
    the same value: masked rows (padding, rejected extra tokens) get no routed work in either, and the shared
    expert in both (in the fused one their shared slot stays: its weights are read for the batch anyway)."""

    # tokens up to which the shared expert joins the fused MoE (benches vary it; HYBRIDSPEC_MOE_SHARED_MAX_N, read at
    # import, for A/B runs without a code change: 0 keeps the shared expert's own GEMMs)
    SHARED_FUSE_MAX_N = int(os.environ.get("HYBRIDSPEC_MOE_SHARED_MAX_N", "64"))
    # routing statistics (MoEContext) written by fused_moe's grouping (issue 7) instead of a kernel of their own
    # per layer in MoEContext.mask_for; expert parallelism keeps that kernel. HYBRIDSPEC_MOE_FUSED_STATS=0 (read at
    # import) for A/B runs: the separate kernel everywhere
    FUSED_STATS = os.environ.get("HYBRIDSPEC_MOE_FUSED_STATS", "1") != "0"
    # the fused path's expert sum, residual add and next norm in one kernel (dispatch.fused_moe_add_rmsnorm);
    # HYBRIDSPEC_MOE_REDUCE_NORM=0 (read at import) keeps the reduce and the residual + norm apart, for A/B runs
    REDUCE_NORM = os.environ.get("HYBRIDSPEC_MOE_REDUCE_NORM", "1") != "0"

    def __init__(self, cfg: ModelConfig, dtype, device, experts_device=None):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Module()
        self.gate.weight = _param(e, h, dtype=dtype, device=device)
        self.experts = nn.Module()
        # experts_device "meta": no storage until the loader puts this rank's experts there (expert parallelism)
        self.experts.gate_up_proj = _param(e, 2 * i, h, dtype=dtype, device=experts_device or device)
        self.experts.down_proj = _param(e, h, i, dtype=dtype, device=experts_device or device)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype, device)
        self.shared_expert_gate = Linear(h, 1, dtype, device)
        self.shared_in = FusedLinears.of([self.shared_expert.gate_proj, self.shared_expert.up_proj,
                                          self.shared_expert_gate])
        # benchmarks only: a fixed per-expert logit bias that gives random-weight routers realistic skew
        self.register_buffer("router_bias", None, persistent=False)
        self.ep = None  # expert parallelism: this rank's shard + exchange (workers/expert_parallel.py), else local

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k], expert ids [N, k])."""
        # fp32 router logits: bf16 ones tie often among hundreds of experts, and a tie broken differently by two
        # kernels sends a token to another expert (the weights are tiny: E x H)
        # (torch.mm(x, w.t(), out_dtype=torch.float32) skips the fp32 copy of x but ran as two cuBLAS kernels of
        # 12.4 + 5.4 us per layer at B=1 on the H200 against ~4.5 us for copy + fp32 GEMV: bench/NOTES.md, 69c5b6d;
        # few tokens on the Triton path: one kernel reading the bf16 inputs, kernels.moe_triton.router_logits_triton)
        if dispatch.use_triton(x) and x.shape[0] <= ROUTER_LOGITS_MAX_N:
            logits = dispatch.router_logits(x, self.gate.weight)  # [N, E] fp32
        else:
            logits = F.linear(x.float(), _derived(self, "_gate_f32", self.gate.weight, lambda w: w.float()))
        return dispatch.route(logits, self.top_k, self.renormalize, x.dtype, self.router_bias)  # bias, cast fused

    def route_shared(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k + 1], ids [N, k + 1]): `route`'s k slots, then the shared expert's (id E,
        sigmoid of its gate logit, an fp32 logit from the same kernel as the router's)."""
        if dispatch.use_triton(x) and x.shape[0] <= ROUTER_LOGITS_MAX_N:
            logits = dispatch.router_logits(x, self._router_shared(fp32=False))  # [N, E + 1] fp32
        else:
            logits = F.linear(x.float(), self._router_shared(fp32=True))
        return dispatch.route(logits, self.top_k, self.renormalize, x.dtype, self.router_bias, shared=True)

    def forward(self, x: Tensor, ctx: MoEContext | None = None, residual: Tensor | None = None,
                norm: "RMSNorm | None" = None) -> Tensor | tuple[Tensor, Tensor]:
        """routed + shared expert output [N, H]; plus `residual` when given (fused into the last kernel). With
        `norm` (and `residual`): (s, norm(s)) for s = residual + experts, the next layer's input norm in the
        same kernel."""
        if self.ep is None and x.shape[0] <= self.SHARED_FUSE_MAX_N:
            return self._forward_fused(x, ctx, residual, norm)
        weights, ids = self.route(x)
        if self.ep is not None:  # routed experts on their owners' ranks (all-to-all), shared expert here
            out = self.ep(self, x, weights, ids, ctx)
            out = out if residual is None else residual + out
            return out if norm is None else (out, norm(out))
        token_mask, stats = self._mask_stats(ctx, ids, self.experts.gate_up_proj.shape[0])
        routed = dispatch.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, token_mask,
                                    stats=stats)
        gate_logit, shared = self._shared(x)
        if residual is None:
            return routed + torch.sigmoid(gate_logit) * shared
        if norm is not None:
            return dispatch.moe_residual_rmsnorm(residual, routed, gate_logit, shared, norm.weight, norm.eps)
        return dispatch.moe_residual(residual, routed, gate_logit, shared)

    def _forward_fused(self, x: Tensor, ctx: MoEContext | None, residual: Tensor | None,
                       norm: "RMSNorm | None") -> Tensor | tuple[Tensor, Tensor]:
        """`forward` with the shared expert as expert id E of the fused MoE: router logits, route, the expert
        launches, then the residual add (+ norm). With a residual and a norm the experts' reduction, the add and
        the norm are one launch (dispatch.fused_moe_add_rmsnorm: the same values as fused_moe + add_rmsnorm). The
        router correction and the routing statistics see the k routed slots only."""
        weights, ids = self.route_shared(x)  # [N, k + 1]
        num_experts = self.experts.gate_up_proj.shape[0]
        token_mask, stats = self._mask_stats(ctx, ids[:, :self.top_k], num_experts)
        if residual is not None and norm is not None and self.REDUCE_NORM:  # the sum, the add and the norm: one kernel
            return dispatch.fused_moe_add_rmsnorm(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                                                  token_mask, self.shared_weights(), stats, residual, norm.weight,
                                                  norm.eps)
        out = dispatch.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, token_mask,
                                 shared=self.shared_weights(), stats=stats)
        if residual is None:
            return out
        if norm is not None:
            return dispatch.add_rmsnorm(residual, out, norm.weight, norm.eps)
        return residual + out

    def _mask_stats(self, ctx: MoEContext | None, ids: Tensor, num_experts: int) -> tuple[Tensor | None, tuple | None]:
        """(token mask, fused_moe's `stats`) of a local layer: the routing statistics from the MoE's own grouping
        (FUSED_STATS), else from MoEContext.mask_for's kernel (stats None)."""
        if ctx is None:
            return None, None
        if self.FUSED_STATS:
            return ctx.mask_and_stats(ids, num_experts)
        return ctx.mask_for(ids, num_experts), None

    def _router_shared(self, fp32: bool) -> Tensor:
        """The router's rows and the shared expert's gate row as one [E + 1, H] weight (in fp32 with `fp32`), made
        once and kept until either source changes (new storage or an in-place write, e.g. a weight load)."""
        gate, sgate = self.gate.weight, self.shared_expert_gate.weight
        key = (gate.data_ptr(), gate._version, sgate.data_ptr(), sgate._version, gate.dtype, gate.device)
        name = "_router_shared_f32" if fp32 else "_router_shared_w"
        cached = self.__dict__.get(name)
        if cached is None or cached[0] != key:
            w = torch.cat([gate, sgate.to(gate.dtype)])
            cached = (key, w.float() if fp32 else w)
            self.__dict__[name] = cached
        return cached[1]

    def shared_weights(self) -> tuple[Tensor, Tensor]:
        """The shared expert as fused_moe's `shared`: (gate rows then up rows [2I_s, H], down [H, I_s]). The gate
        and up rows are adjacent in shared_in's fused weight: a view of them (no copy); else a copy made once and
        kept until either changes."""
        gp, up = self.shared_expert.gate_proj.weight, self.shared_expert.up_proj.weight
        down = self.shared_expert.down_proj.weight
        key = (gp.data_ptr(), up.data_ptr(), down.data_ptr(), gp.dtype, gp.device)
        cached = self.__dict__.get("_shared_weights")
        adjacent = (gp.stride() == up.stride() and gp.stride(-1) == 1 and gp.shape == up.shape
                    and up.data_ptr() == gp.data_ptr() + gp.shape[0] * gp.stride(0) * gp.element_size())
        if adjacent:
            if cached is None or cached[0] != key:
                cached = (key, (gp.as_strided((2 * gp.shape[0], gp.shape[1]), gp.stride()), down))
                self.__dict__["_shared_weights"] = cached
            return cached[1]
        key = key + (gp._version, up._version)
        if cached is None or cached[0] != key:
            cached = (key, (torch.cat([gp, up]), down))
            self.__dict__["_shared_weights"] = cached
        return cached[1]

    def _shared(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(gate logit [N, 1], ungated shared-expert output [N, H]): one GEMM for its gate/up projections and
        its own gate logit, one launch for the activation."""
        gate, up, gate_logit = self.shared_in(x)
        return gate_logit, self.shared_expert.down_proj(dispatch.silu_mul(gate, up))

    def shared_output(self, x: Tensor) -> Tensor:
        """The shared expert, gated."""
        gate_logit, shared = self._shared(x)
        return torch.sigmoid(gate_logit) * shared


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rope: RotaryEmbedding, dtype, device, experts_device=None):
        super().__init__()
        self.kind = cfg.layer_types[index]
        if self.kind == FULL_ATTENTION:
            self.self_attn = Attention(cfg, rope, dtype, device)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype, device)
        if cfg.moe_layers[index]:
            self.mlp: nn.Module = SparseMoe(cfg, dtype, device, experts_device)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: Tensor, batch: ForwardBatch, state, cos: Tensor, sin: Tensor,
                write: bool | Tensor = True, scratch: dict | None = None, layer_index: int = -1,
                moe: MoEContext | None = None, h: Tensor | None = None,
                next_norm: RMSNorm | None = None) -> tuple[Tensor, Tensor | None]:
        """x [N, H] -> (x after this layer, next_norm(it) or None). `h`: input_layernorm(x) when the previous
        layer already computed it (fused into its last kernel)."""
        if h is None:
            h = self.input_layernorm(x)
        if self.kind == FULL_ATTENTION:
            h = self.self_attn(h, batch, state, cos, sin)
        else:
            h = self.linear_attn(h, batch, state, write, scratch, layer_index)
        norm = self.post_attention_layernorm
        x, h = dispatch.add_rmsnorm(x, h, norm.weight, norm.eps)  # the residual add and the norm: one kernel
        if isinstance(self.mlp, SparseMoe):  # x + experts (and the next norm) in the MoE's last kernel
            out = self.mlp(h, moe, residual=x, norm=next_norm)
            return out if next_norm is not None else (out, None)
        x = x + self.mlp(h)
        return x, (next_norm(x) if next_norm is not None else None)


class HybridModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. `forward` runs one ragged step."""

    LM_HEAD_FP32_OUT = os.environ.get("HYBRIDSPEC_LM_HEAD_FP32_OUT", "1") != "0"  # `logits`: fp32 from the GEMM

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 experts_device: torch.device | str | None = None):
        """`experts_device` "meta": the routed experts get no storage (load_weights / init_random_ with
        `local_experts` then place only this rank's); None: on `device` with the rest."""
        super().__init__()
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, device)
        self.model.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, self.rope, dtype, device, experts_device) for i in range(cfg.num_hidden_layers)]
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, device)

    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache, logit_rows: Tensor | None = None,
                write: bool | Tensor = True, scratch: StepScratch | None = None,
                return_hidden: bool = False, moe: MoEContext | None = None,
                all_rows_into: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Runs every request's new tokens against its cached state and returns logits [M, V] for the flat
        rows in `logit_rows` (default: every request's last token).

        KV of every new token is written to its pages (rollback = the length moves back). GDN state and conv
        windows advance only for requests selected by `write` (True = all, or a [B] bool mask); the others
        are left at S_0 with their block inputs in `scratch`, to be advanced by `commit`. `moe` carries the
        router correction of extra verification tokens and collects distinct experts per MoE layer.
        `all_rows_into` ([N, V] fp32): logits of every row are written there (captured graphs' shared output).
        """
        if scratch is None and not (write is True):
            raise ValueError("a forward that does not write every request's GDN state needs a StepScratch")
        x = F.embedding(batch.input_ids, self.model.embed_tokens.weight)  # [N, H]
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        layers_scratch = scratch.layers if scratch is not None else None
        layers, h = self.model.layers, None
        for i, (layer, state) in enumerate(zip(layers, cache.layers)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            x, h = layer(x, batch, state, cos, sin, write, layers_scratch, i, moe, h, next_norm)
        hidden = self.model.norm(x) if return_hidden else None  # every row's (the MTP head's input)
        if all_rows_into is not None:
            logits = self.logits(hidden if hidden is not None else self.model.norm(x), out=all_rows_into)
        else:
            rows = batch.last_token_rows() if logit_rows is None else logit_rows
            h = hidden[rows] if hidden is not None else self.model.norm(x[rows])
            logits = self.logits(h)
        return (logits, hidden) if return_hidden else logits

    def logits(self, h: Tensor, exact_top: int = 4, out: Tensor | None = None) -> Tensor:
        """fp32 logits [M, V] (into `out` when given). bf16 logits over a vocabulary of 10^5 tie often, and greedy
        decoding must not depend on how a kernel breaks the tie: on CUDA the GEMM writes fp32 (fp32 sums of the
        exact bf16 products, one kernel); elsewhere (or HYBRIDSPEC_LM_HEAD_FP32_OUT=0) the bf16 logits' top
        `exact_top` candidates are recomputed in fp32 (a top-k, a gather and a scatter over the vocabulary)."""
        weight = self.lm_head_weight()
        if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and self.LM_HEAD_FP32_OUT:
            return torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)  # [M, V] fp32
        logits = F.linear(h, weight)
        logits = logits.float() if out is None else out.copy_(logits)
        if h.dtype != torch.float32 and h.shape[0] > 0:
            top = logits.topk(exact_top, dim=-1).indices  # [M, k]
            exact = torch.einsum("mh,mkh->mk", h.float(), weight[top].float())
            logits.scatter_(1, top, exact)
        return logits

    @torch.inference_mode()
    def commit(self, batch: ForwardBatch, cache: ModelCache, scratch: StepScratch, keep_lens: Tensor,
               written: bool | Tensor = False) -> None:
        """S_0 -> S_a for every request the forward did not write: replays its first keep_lens[i] tokens
        (0..T_i) onto its GDN states and conv windows. Requests in `written` are left alone."""
        keep = keep_lens.long().clone()
        if isinstance(written, Tensor):
            keep[written] = 0  # a zero-length replay leaves an already advanced state as it is
        elif written:
            return
        for i, block in scratch.layers.items():
            state = cache.layers[i]
            dispatch.gdn_commit(block.k, block.v, block.g, block.beta, batch.cu_seqlens, keep, state.recurrent,
                           batch.state_slots, batch.max_query_len)
            dispatch.conv_commit(block.conv_in, batch.cu_seqlens, keep, state.conv, batch.state_slots,
                            batch.max_query_len)
