"""One Gated DeltaNet layer's token mixing for plain decode (every request 0 or 1 new token), from the in_proj
outputs to the gated-norm output that out_proj reads: the PyTorch reference of kernels/gdn_decode_triton.py.

It is the four-step chain of the general path, composed from its references (the specification):
    mixed = causal_conv1d_ref(x)                  conv window update + SiLU, [N, C] (C = 2*HK*DK + HV*DV)
    g, beta = gdn_gates_ref(a, b, neg_a, dt_bias)
    o = gdn_recurrent_ref(q, k, v, g, beta)       q/k L2 norm, one delta-rule step on state[slots]
    gated_rmsnorm_ref(o, z, norm_weight, eps)     per value head
with the same write rule (True, False or a [B] mask) for the conv window and the recurrent state. Requests of no
token (a graph bucket's idle ones) read and change nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.conv import causal_conv1d_ref
from kernels.elementwise import gdn_gates_ref
from kernels.gdn import gdn_recurrent_ref
from kernels.norm import gated_rmsnorm_ref


def decode_heads(x: Tensor, a: Tensor, state: Tensor) -> tuple[int, int, int, int]:
    """(HK, HV, DK, DV) from x [N, 2*HK*DK + HV*DV], a [N, HV] and the state pool [S, HV, DK, DV]."""
    heads_v, dim_k, dim_v = a.shape[1], state.shape[2], state.shape[3]
    heads_k = (x.shape[1] - heads_v * dim_v) // (2 * dim_k)
    if 2 * heads_k * dim_k + heads_v * dim_v != x.shape[1] or heads_k == 0 or heads_v % heads_k:
        raise ValueError(f"conv channels {x.shape[1]} do not split into 2*HK*{dim_k} + {heads_v}*{dim_v}")
    return heads_k, heads_v, dim_k, dim_v


def gdn_decode_ref(
    x: Tensor,  # [N, C] conv inputs (q | k | v channels) of the in_proj output
    z: Tensor,  # [N, HV*DV] (or [N, HV, DV]) output gate
    a: Tensor,  # [N, HV] raw decay projection
    b: Tensor,  # [N, HV] raw beta projection
    conv_weight: Tensor,  # [C, K]
    neg_a: Tensor,  # [HV] fp32, -exp(A_log)
    dt_bias: Tensor,  # [HV]
    norm_weight: Tensor,  # [DV]
    eps: float,
    cu_seqlens: Tensor,  # [B+1] int32, every request 0 or 1 token
    conv_state: Tensor,  # [S, C, K-1] pool of conv windows
    state: Tensor,  # [S, HV, DK, DV] fp32 pool
    slots: Tensor,  # [B] int64
    scale: float | None = None,
    write_state: bool | Tensor = True,  # or a [B] bool mask: whose window and state move
    keep_inputs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor, Tensor]:
    """o [N, HV*DV] in x's dtype (out_proj's input); with keep_inputs also the block inputs a commit replays:
    (o, mixed [N, C] conv output (k, v are its column blocks), g [N, HV] fp32, beta [N, HV] in b's dtype)."""
    n = x.shape[0]
    heads_k, heads_v, dim_k, dim_v = decode_heads(x, a, state)
    mixed = causal_conv1d_ref(x, conv_weight, cu_seqlens, conv_state, slots, 1, write_state)  # [N, C]
    q, k, v = torch.split(mixed, [heads_k * dim_k, heads_k * dim_k, heads_v * dim_v], dim=-1)
    q, k, v = q.reshape(n, heads_k, dim_k), k.reshape(n, heads_k, dim_k), v.reshape(n, heads_v, dim_v)
    g, beta = gdn_gates_ref(a, b, neg_a, dt_bias)
    o = gdn_recurrent_ref(q, k, v, g, beta, cu_seqlens, state, slots, 1, scale, True, write_state)  # [N, HV, DV]
    o = gated_rmsnorm_ref(o, z.reshape(n, heads_v, dim_v), norm_weight, eps).reshape(n, heads_v * dim_v)
    return (o, mixed, g, beta) if keep_inputs else o
