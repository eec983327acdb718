"""Continuous batching: which requests run in the next step, and how many of their tokens.

First come, first served. Running requests keep their place; each step every running request that has
uncomputed tokens gets them (a decode needs 1; a long prompt is cut into chunks under the per-step token
budget so it does not stall the decodes). Only then do decodes get their draft caps (pages and budget for
speculative tokens), from what is left: drafts never take a running request's own token out of a step nor get
anyone preempted. Waiting requests are admitted in arrival order while a state slot is free and the pages for
their whole prompt are free beyond what the running requests still need for theirs. When a
running request cannot get a page for its own tokens, the youngest running request is preempted: its memory is
released and it goes back to the front of the queue, to be recomputed later.

With a partitioned memory (expert parallelism: one partition per rank) each request lives in one partition: a
waiting request is admitted to the least loaded partition its whole prompt fits in (as above, within that
partition), and a request short of a page preempts the youngest running request of its own partition.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.memory import MemoryManager
from scheduler.request import Request, RequestStatus
from scheduler.types import StepRequest


class RequestTooLarge(ValueError):
    """The request could never fit in the memory pools (or the model's length limit)."""


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token index (into request.all_ids) fed this step == tokens already cached
    num_tokens: int  # tokens fed this step
    draft_cap: int = 0  # a decode may also verify up to this many drafted tokens (pages reserved)

    @property
    def completes(self) -> bool:
        """After this chunk every token of the request is cached, so the step samples its next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    preempted_parts: set[int] = field(default_factory=set)  # memory partitions short of pages this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, memory: MemoryManager, max_running: int, max_step_tokens: int, max_model_len: int,
                 max_draft: int = 0):
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError("max_step_tokens and max_running must be >= 1")
        self.memory = memory
        self.max_draft = max_draft  # longest verification a decode may get (0 = no speculation)
        # the worker's own cap on drafts per request, as its last decode step reported it (StepResult.draft_cap_hint;
        # None: max_draft): pages reserved beyond it would be returned unused at every commit
        self.draft_hint: int | None = None
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
            pool = (f"the pool has {self.memory.pages.num_pages}" if self.memory.partitions == 1 else
                    f"each of the {self.memory.partitions} expert-parallel ranks' pools has "
                    f"{self.memory.pages.pages_per_part}")
            raise RequestTooLarge(
                f"prompt + max_new_tokens = {final_len} tokens needs {self.memory.pages_for(final_len)} KV "
                f"pages but {pool}")

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
        if not self.running:
            self.draft_hint = None  # an idle engine's next batch is not the last one: no stale cap
        plan = StepPlan()
        budget = self.max_step_tokens
        # 1. running requests, oldest first, their own tokens (a decode's 1, a prefill's next chunk); preempt the
        # youngest when a page is missing. A decode's drafts are budgeted here, in age order as before (a younger
        # request's prefill chunk does not switch an older decode's drafts off, nor change what a seed gives), but
        # never from the token every younger running decode needs; their pages come in 2
        drafting = self.max_draft > 0 and self.draft_hint != 0
        younger_decodes = sum(1 for r in self.running if r.num_uncomputed == 1) if drafting else 0
        decodes: list[ScheduledChunk] = []  # (chunks of one token that complete their request: may draft)
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted below while making room for an older request
            uncomputed = request.num_uncomputed
            decode = uncomputed == 1
            if decode and drafting:
                younger_decodes -= 1
            n = min(uncomputed, budget)
            if n == 0:
                continue
            while not self.memory.try_grow(request.request_id, request.num_computed + n):
                victim = self._youngest_beside(request)
                self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            cap = self._draft_cap(request, budget - 1 - younger_decodes) if decode and drafting else 0
            chunk = ScheduledChunk(request, request.num_computed, n, cap)
            plan.chunks.append(chunk)
            if cap:
                decodes.append(chunk)
            budget -= n + cap
        # 2. then the decodes' draft pages, oldest first, from the pages the running requests' own tokens left
        # (fewer drafts where pages are short; the budget they do not use goes back): a reservation for speculative
        # tokens, most of them rejected, never gets anyone preempted
        for chunk in decodes:
            request = chunk.request  # (still running: preemption victims are younger than any planned chunk)
            fed = request.num_computed + 1
            cap = self.memory.grow_upto(request.request_id, fed, fed + chunk.draft_cap) - fed
            budget += chunk.draft_cap - cap
            chunk.draft_cap = cap
        # 3. waiting requests in arrival order while memory, slots and the token budget allow. A request is admitted
        # only when the pages for its whole prompt (and first sampled token) are free beyond those the running
        # requests still need for theirs: admitting on its first chunk alone let it take pages a running request
        # grew into a few steps later, so it was preempted, re-admitted and preempted again, its prefill recomputed
        # each time (a pool of about one long request: 5x the tokens, 100 preemptions for 6 requests)
        owed: list[int] | None = None  # per partition: pages its running requests still need to reach their whole
        # length + 1
        # (a partition that preempted this step admits nobody: it is short of pages; the others still admit)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            n = min(request.num_tokens, budget)
            parts = self.memory.admission_parts(n)
            if plan.preempted_parts:
                parts = [p for p in parts if p not in plan.preempted_parts]
            if not parts:
                break
            if self.running:
                if owed is None:
                    if self.memory.partitions == 1:
                        owed = [sum(self._pages_owed(r) for r in self.running)]
                    else:
                        owed = [0] * self.memory.partitions
                        for r in self.running:
                            owed[self.memory.part_of(r.request_id)] += self._pages_owed(r)
                whole = self._pages_whole(request)
                parts = [p for p in parts if whole + owed[p] <= self.memory.free_pages(p)]
                if not parts:
                    break
                owed[parts[0]] += whole - self.memory.pages_for(n)
            self.waiting.popleft()
            self.memory.admit(request.request_id, n, parts[0])
            request.status, request.num_computed = RequestStatus.RUNNING, 0
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, 0, n))
            budget -= n
        return plan

    def step_requests(self, plan: StepPlan) -> list[StepRequest]:
        """The worker's view of a planned step: one StepRequest per chunk (its tokens, pages, slot, draft cap and,
        where it may draft, the whole sequence for the drafter as a TokenView: no copy)."""
        work = []
        for c in plan.chunks:
            r = c.request
            table = self.memory.table(r.request_id)
            whole = r.token_view() if c.draft_cap else []
            work.append(StepRequest(r.request_id, r.ids(c.start, c.start + c.num_tokens), c.start, list(table.pages),
                                    table.slot, c.completes, r.params, c.draft_cap, whole))
        return work

    def _draft_cap(self, request: Request, budget: int) -> int:
        """Drafts a decode may verify: the configured maximum (or the worker's own cap, draft_hint, if lower),
        within the request's remaining tokens, the model's length limit and the step's token budget."""
        remaining = request.params.max_new_tokens - len(request.output_ids)
        room = self.max_model_len - request.num_tokens
        most = self.max_draft if self.draft_hint is None else min(self.max_draft, self.draft_hint)
        return max(0, min(most, remaining - 1, room - 1, budget))

    def _pages_whole(self, request: Request) -> int:
        """Pages for a request's whole length + 1 (the rest of its prompt or its next token; not past its last)."""
        final = len(request.prompt_ids) + request.params.max_new_tokens
        return self.memory.pages_for(min(request.num_tokens + 1, final))

    def _pages_owed(self, request: Request) -> int:
        """Pages a running request does not hold yet for its whole length + 1; negative where it holds more: the
        pages reserved for its drafts this step, back at the commit (a credit, or drafts would hold admission
        off until a running request finished)."""
        return self._pages_whole(request) - len(self.memory.table(request.request_id).pages)

    def _youngest_beside(self, request: Request) -> Request:
        """The youngest running request whose pages are in the same partition as the request's (the only ones
        whose release gives it a page; the youngest of all with one partition). The request itself at worst."""
        if self.memory.partitions == 1:
            return self.running[-1]
        part = self.memory.part_of(request.request_id)
        return next(r for r in reversed(self.running) if self.memory.part_of(r.request_id) == part)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        plan.preempted_parts.add(self.memory.part_of(request.request_id))
        self.memory.release(request.request_id)
        self.running.remove(request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]
        request.status, request.num_computed = RequestStatus.WAITING, 0
        request.stats.preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def commit(self, plan: StepPlan, accepted: dict[str, int] | None = None, draft_cap_hint: int | None = None) -> None:
        """Marks the step's tokens as cached (called after it ran). A decode that verified drafts keeps its
        token plus the accepted drafts; the pages reserved for rejected ones go back. `draft_cap_hint`: the
        worker's StepResult.draft_cap_hint (None: keep the last one)."""
        if draft_cap_hint is not None:
            self.draft_hint = draft_cap_hint
        accepted = accepted or {}
        for chunk in plan.chunks:
            request = chunk.request
            request.num_computed = chunk.start + chunk.num_tokens + accepted.get(request.request_id, 0)
            if chunk.draft_cap and request.status is RequestStatus.RUNNING:
                self.memory.shrink(request.request_id, request.num_computed)
