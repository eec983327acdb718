"""ForwardBatch: one ragged model step, as tensors.

Each request brings its own number of new tokens (1 for decode, L+1 for verification, many for prefill)
against its own cached state: `context_lens[i]` tokens already in its KV pages (`page_table[i]`) and GDN
state slot `state_slots[i]`. Nothing is padded to a rectangle: the new tokens of all requests are one flat
[N] row, split by `cu_seqlens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ForwardBatch:
    input_ids: Tensor  # [N] int64 new tokens of all requests, request by request
    positions: Tensor  # [N] int64 absolute position of each new token
    request_of_row: Tensor  # [N] int64 which request each token belongs to
    cu_seqlens: Tensor  # [B+1] int32 start of each request's tokens in the flat row
    context_lens: Tensor  # [B] int32 tokens cached before this step
    page_table: Tensor  # [B, max_pages] int32 KV pages of each request, in order
    state_slots: Tensor  # [B] int64 GDN state slot of each request
    query_lens: list[int]  # host copy of the new-token counts
    context_lens_host: list[int]  # host copy of context_lens

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens) if self.query_lens else 0

    def last_token_rows(self) -> Tensor:
        """Flat row of each request's last new token, [B]."""
        return (self.cu_seqlens[1:] - 1).long()

    @classmethod
    def build(
        cls,
        tokens: list[list[int]],
        context_lens: list[int],
        page_rows: list[list[int]],
        state_slots: list[int],
        device: torch.device | str,
    ) -> "ForwardBatch":
        """Host lists -> device tensors. `tokens[i]` are request i's new tokens (at least one)."""
        if not (len(tokens) == len(context_lens) == len(page_rows) == len(state_slots)):
            raise ValueError("tokens, context_lens, page_rows and state_slots must have one entry per request")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("every request in a ForwardBatch needs at least one new token")
        query_lens = [len(t) for t in tokens]
        flat = [tok for t in tokens for tok in t]
        positions = [c + j for c, n in zip(context_lens, query_lens) for j in range(n)]
        owner = [i for i, n in enumerate(query_lens) for _ in range(n)]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        max_pages = max((len(r) for r in page_rows), default=0) or 1
        table = [r + [0] * (max_pages - len(r)) for r in page_rows]
        as_tensor = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
        return cls(
            input_ids=as_tensor(flat, torch.int64),
            positions=as_tensor(positions, torch.int64),
            request_of_row=as_tensor(owner, torch.int64),
            cu_seqlens=as_tensor(cu, torch.int32),
            context_lens=as_tensor(context_lens, torch.int32),
            page_table=as_tensor(table, torch.int32),
            state_slots=as_tensor(state_slots, torch.int64),
            query_lens=query_lens,
            context_lens_host=list(context_lens),
        )
