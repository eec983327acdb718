"""Helpers to move between flat ragged token tensors [N, ...] and padded ones [B, T_max, ...]."""

from __future__ import annotations

import torch
from torch import Tensor


def padded_index(cu_seqlens: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """For a ragged batch, the flat row of every padded slot and whether it is real.

    Returns (rows [B, T_max] int64 clamped into range, valid [B, T_max] bool).
    """
    starts = cu_seqlens[:-1].long()  # [B]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B]
    offs = torch.arange(max_len, device=cu_seqlens.device)  # [T_max]
    valid = offs[None, :] < lens[:, None]  # [B, T_max]
    total = int(cu_seqlens[-1])
    rows = (starts[:, None] + offs[None, :]).clamp(max=max(total - 1, 0))  # [B, T_max]
    return rows, valid


def to_padded(x: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
    """x [N, ...] -> [B, T_max, ...] with zeros in the padding."""
    out = x[rows]  # [B, T_max, ...]
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 1)))
    return torch.where(mask, out, torch.zeros((), dtype=x.dtype, device=x.device))


def from_padded(y: Tensor, valid: Tensor) -> Tensor:
    """[B, T_max, ...] -> [N, ...] keeping the real rows in order."""
    return y[valid]
