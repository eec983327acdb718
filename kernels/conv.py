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
    write_state: bool | Tensor = True,  # or a [B] bool mask of the requests whose window moves
) -> Tensor:
    """Returns silu(conv(window ++ x)) for every new row, [N, C], in x's dtype."""
    num_c, kernel = weight.shape
    rows, valid = padded_index(cu_seqlens, max_len)
    xp = to_padded(x, rows, valid).transpose(1, 2)  # [B, C, T]
    window = conv_state[slots].to(x.dtype)  # [B, C, K-1]
    full = torch.cat([window, xp], dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=num_c)  # [B, C, T]
    out = F.silu(out).to(x.dtype).transpose(1, 2)  # [B, T, C]
    if isinstance(write_state, Tensor) or write_state:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
        _advance_window(full, lens, conv_state, slots, write_state if isinstance(write_state, Tensor) else None)
    return out[valid]


def _advance_window(full: Tensor, keep: Tensor, conv_state: Tensor, slots: Tensor, mask: Tensor | None) -> None:
    """The new window of request i is full[i, :, keep_i : keep_i + K - 1] (full = old window ++ new inputs)."""
    num_c, width = full.shape[1], conv_state.shape[-1]
    idx = keep[:, None] + torch.arange(width, device=full.device)[None, :]  # [B, K-1]
    new_window = torch.gather(full, 2, idx[:, None, :].expand(-1, num_c, -1))  # [B, C, K-1]
    if mask is None:
        conv_state[slots] = new_window.to(conv_state.dtype)
    else:
        conv_state[slots[mask]] = new_window[mask].to(conv_state.dtype)


def conv_commit_ref(
    x: Tensor,  # [N, C] the verified block's conv inputs
    cu_seqlens: Tensor,  # [B+1] int32
    keep_lens: Tensor,  # [B] int64 inputs of each block to commit (0..T_i)
    conv_state: Tensor,  # [S, C, K-1] pool, still holding each request's window before the block
    slots: Tensor,  # [B] int64
    max_len: int,
) -> None:
    """Moves each request's window over exactly its first keep_lens[i] inputs."""
    rows, valid = padded_index(cu_seqlens, max_len)
    xp = to_padded(x, rows, valid).transpose(1, 2)  # [B, C, T]
    full = torch.cat([conv_state[slots].to(x.dtype), xp], dim=-1)  # [B, C, K-1+T]
    _advance_window(full, keep_lens.long(), conv_state, slots, None)
