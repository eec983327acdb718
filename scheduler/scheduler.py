"""Continuous batching: which requests run in the next step, and how many of their tokens.

First come, first served. Running requests keep their place; each step every running request that has
uncomputed tokens gets them (a decode needs 1; a long prompt is cut into chunks under the per-step token
budget so it does not stall the decodes). Waiting requests are admitted in arrival order while a state slot
and pages are free. When a running request cannot get a page, the youngest running request is preempted:
its memory is released and it goes back to the front of the queue, to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.memory import MemoryManager
from scheduler.request import Request, RequestStatus


class RequestTooLarge(ValueError):
    """The request could never fit in the memory pools (or the model's length limit)."""


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token index (into request.all_ids) fed this step == tokens already cached
    num_tokens: int  # tokens fed this step

    @property
    def completes(self) -> bool:
        """After this chunk every token of the request is cached, so the step samples its next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, memory: MemoryManager, max_running: int, max_step_tokens: int, max_model_len: int):
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError("max_step_tokens and max_running must be >= 1")
        self.memory = memory
        self.max_running, self.max_step_tokens, self.max_model_len = max_running, max_step_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (oldest first)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Raises RequestTooLarge when the request can never be served."""
        final_len = len(request.prompt_ids) + request.params.max_new_tokens
        if final_len > self.max_model_len:
            raise RequestTooLarge(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.params.max_new_tokens}) "
                f"must be at most the model's length limit {self.max_model_len}, got {final_len}")
        if not self.memory.fits_ever(final_len):
            raise RequestTooLarge(
                f"prompt + max_new_tokens = {final_len} tokens needs {self.memory.pages.pages_for(final_len)} KV "
                f"pages but the pool has {self.memory.pages.num_pages}")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (stop, length or abort) wherever it is and frees its memory."""
        if request.status is RequestStatus.RUNNING:
            self.memory.release(request.request_id)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_step_tokens
        # 1. running requests, oldest first; preempt the youngest when a page is missing
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted below while making room for an older request
            n = min(request.num_uncomputed, budget)
            if n == 0:
                continue
            while not self.memory.can_grow(request.request_id, request.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self.memory.grow(request.request_id, request.num_computed + n)
            plan.chunks.append(ScheduledChunk(request, request.num_computed, n))
            budget -= n
        # 2. waiting requests in arrival order while memory, slots and the token budget allow
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not plan.preempted:
            request = self.waiting[0]
            n = min(request.num_tokens, budget)
            if not self.memory.can_admit(n):
                break
            self.waiting.popleft()
            self.memory.admit(request.request_id, n)
            request.status, request.num_computed = RequestStatus.RUNNING, 0
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, 0, n))
            budget -= n
        return plan

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.memory.release(request.request_id)
        self.running.remove(request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]
        request.status, request.num_computed = RequestStatus.WAITING, 0
        request.stats.preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def commit(self, plan: StepPlan) -> None:
        """Marks the planned tokens as cached (called after the step ran)."""
        for chunk in plan.chunks:
            chunk.request.num_computed = chunk.start + chunk.num_tokens
