"""Request: one generation's lifecycle as the scheduler sees it (token ids only, no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.types import SamplingParams, TokenView


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no memory (new or preempted)
    RUNNING = "running"  # holds a state slot and KV pages
    FINISHED = "finished"


@dataclass
class RequestStats:
    draft_tokens: int = 0  # tokens proposed by a drafter and verified
    accepted_tokens: int = 0  # of those, accepted
    verify_steps: int = 0  # steps in which this request verified at least one draft token
    preemptions: int = 0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # tokens whose KV and GDN state are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stats: RequestStats = field(default_factory=RequestStats)
    arrival_s: float = field(default_factory=time.monotonic)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_view(self) -> TokenView:
        """all_ids as an O(1) read-only view (no copy): its length is fixed now."""
        return TokenView(self.prompt_ids, self.output_ids)

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode's token is in output_ids: a step's per-request
        slice was a copy of the whole sequence)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
