"""Short causal depthwise conv1d with SiLU over a ragged batch, continuing each request's conv window.

Each request keeps a window of its last K-1 conv inputs (a slot in `conv_state` [S, C, K-1]); a step feeds
T_i new inputs, gets T_i outputs, and (when `write_state`) the window moves to the last K-1 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.ragged import padded_index, to_padded


def causal_conv1d_ref(
    x: Tensor,  # [N, C] new inputs of all requests
    weight: Tensor,  # [C, K]
    cu_seqlens: Tensor,  # [B+1] int32
    conv_state: Tensor,  # [S, C, K-1] pool of windows
    slots: Tensor,  # [B] int64 slot of each request
    max_len: int,  # max T_i (host int)
    write_state: bool = True,
) -> Tensor:
    """Returns silu(conv(window ++ x)) for every new row, [N, C], in x's dtype."""
    num_c, kernel = weight.shape
    rows, valid = padded_index(cu_seqlens, max_len)
    xp = to_padded(x, rows, valid).transpose(1, 2)  # [B, C, T]
    window = conv_state[slots].to(x.dtype)  # [B, C, K-1]
    full = torch.cat([window, xp], dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=num_c)  # [B, C, T]
    out = F.silu(out).to(x.dtype).transpose(1, 2)  # [B, T, C]
    if write_state:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
        # the new window is full[:, :, len_i : len_i + K - 1]
        idx = lens[:, None] + torch.arange(kernel - 1, device=x.device)[None, :]  # [B, K-1]
        new_window = torch.gather(full, 2, idx[:, None, :].expand(-1, num_c, -1))  # [B, C, K-1]
        conv_state[slots] = new_window.to(conv_state.dtype)
    return out[valid]
