"""Where each request's state lives: KV pages for attention layers, one slot for GDN layers.

Pure bookkeeping (no tensors): the worker owns the actual page and slot buffers and
addresses them through the ids handed out here. Accounting is exact: at every moment each
page and slot is either free or owned by exactly one request.

Partitions (expert parallelism: one per rank, each rank holding only its own pools): the page ids and the slot ids
are split into `partitions` equal contiguous ranges; a request gets its slot and every page from one partition,
chosen at admission, so the rank that owns that range holds all of its state. One partition is a single pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OutOfMemory(Exception):
    """An allocation asked for more pages or slots than are free."""


class _IdAllocator:
    """Free list over the ids base..base+total-1, shared by the page and slot pools."""

    def __init__(self, kind: str, total: int, base: int = 0) -> None:
        if total < 0:
            raise ValueError(f"number of {kind}s must be >= 0, got {total}")
        self.kind = kind
        self.total, self.base = total, base
        self.free_ids: deque[int] = deque(range(base, base + total))
        self.used_ids: set[int] = set()

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {self.kind}s, got {n}")
        if n > len(self.free_ids):
            raise OutOfMemory(
                f"requested {n} {self.kind}(s) but only {len(self.free_ids)} of "
                f"{self.total} are free; release or preempt a request first"
            )
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.used_ids.update(ids)
        return ids

    def check_free(self, ids: list[int]) -> None:
        """Raises ValueError unless every id is allocated here (once in ids)."""
        seen: set[int] = set()
        for i in ids:
            if not self.base <= i < self.base + self.total:
                raise ValueError(f"{self.kind} {i} is not an id of this pool "
                                 f"({self.base}..{self.base + self.total - 1})")
            if i not in self.used_ids or i in seen:
                raise ValueError(f"{self.kind} {i} is not allocated (double free?)")
            seen.add(i)

    def free(self, ids: list[int]) -> None:
        """Return ids to the pool; validates all of them before changing anything."""
        self.check_free(ids)
        self.used_ids.difference_update(ids)
        self.free_ids.extend(ids)


class _Partitioned:
    """`partitions` allocators over equal contiguous ranges of the ids 0..total-1."""

    def __init__(self, kind: str, total: int, partitions: int) -> None:
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"partitions must be an integer >= 1, got {partitions!r}")
        if total < 0:
            raise ValueError(f"number of {kind}s must be >= 0, got {total}")
        if total % partitions:
            raise ValueError(f"number of {kind}s ({total}) must be a multiple of partitions ({partitions})")
        self.kind, self.partitions, self.per_part = kind, partitions, total // partitions
        self.parts = [_IdAllocator(kind, self.per_part, p * self.per_part) for p in range(partitions)]

    def part(self, part: int | None) -> _IdAllocator:
        """The allocator of a partition (None: the only one; with several, naming it is required)."""
        if part is None:
            if self.partitions == 1:
                return self.parts[0]
            raise ValueError(f"partition is required with {self.partitions} partitions")
        if not 0 <= part < self.partitions:
            raise ValueError(f"partition must be in [0, {self.partitions}), got {part!r}")
        return self.parts[part]

    def part_of(self, i: int) -> int:
        """The partition of id i (ValueError naming the pool's range when i is not one of its ids)."""
        total = self.per_part * self.partitions
        if not 0 <= i < total:
            raise ValueError(f"{self.kind} {i} is not an id of this pool (0..{total - 1})")
        return i // self.per_part

    def num_free(self, part: int | None = None) -> int:
        if part is None:
            return sum(len(a.free_ids) for a in self.parts)
        return len(self.part(part).free_ids)

    def free(self, ids: list[int]) -> None:
        """Returns ids to their partitions; validates all of them before changing anything."""
        if self.partitions == 1:
            self.parts[0].free(ids)
            return
        groups: dict[int, list[int]] = {}
        for i in ids:
            groups.setdefault(self.part_of(i), []).append(i)
        for p, group in groups.items():
            self.parts[p].check_free(group)
        for p, group in groups.items():
            self.parts[p].free(group)


class _PartitionedPool:
    """What PagePool and SlotPool share over their ids (`_ids`, a _Partitioned)."""

    _ids: _Partitioned

    def part_of(self, i: int) -> int:
        """The partition of id i (ValueError naming the pool's range when i is not one of its ids)."""
        return self._ids.part_of(i)

    def num_free(self, part: int | None = None) -> int:
        """Free ids of one partition (None: of all)."""
        return self._ids.num_free(part)

    def can_allocate(self, n: int = 1, part: int | None = None) -> bool:
        return n <= len(self._ids.part(part).free_ids)


@dataclass
class PagePool(_PartitionedPool):
    """Pool of fixed-size KV pages with ids 0..num_pages-1, in `partitions` equal ranges (module docstring)."""

    num_pages: int
    page_size: int = 16
    partitions: int = 1
    _ids: _Partitioned = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        self._ids = _Partitioned("page", self.num_pages, self.partitions)

    @property
    def pages_per_part(self) -> int:
        return self._ids.per_part

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens of KV (0 for 0)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int, part: int | None = None) -> list[int]:
        """Take n pages of one partition; raises OutOfMemory (and takes none) if fewer are free there."""
        return self._ids.part(part).allocate(n)

    def free(self, pages: list[int]) -> None:
        """Give pages back; a double free or a foreign id raises ValueError and frees none."""
        self._ids.free(pages)


@dataclass
class SlotPool(_PartitionedPool):
    """Pool of per-request GDN state slots (recurrent state + conv window), ids 0..num_slots-1, in `partitions`
    equal ranges (module docstring)."""

    num_slots: int
    partitions: int = 1
    _ids: _Partitioned = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._ids = _Partitioned("slot", self.num_slots, self.partitions)

    @property
    def slots_per_part(self) -> int:
        return self._ids.per_part

    def allocate(self, part: int | None = None) -> int:
        """Take one slot of a partition; raises OutOfMemory if none is free there."""
        return self._ids.part(part).allocate(1)[0]

    def free(self, slot: int) -> None:
        """Give a slot back; a double free or a foreign id raises ValueError."""
        self._ids.free([slot])


@dataclass
class RequestTable:
    """One request's memory: its KV pages in token order and its GDN state slot, all of one partition.

    Invariant kept by MemoryManager: len(pages) == pages_for(num_tokens).
    """

    pages: list[int]
    slot: int | None
    num_tokens: int  # tokens whose KV is stored (the cached length)
    part: int = 0  # the partition its slot and pages come from


class MemoryManager:
    """Owns a PagePool and a SlotPool and the per-request tables, keyed by request id (str). With partitions > 1
    each request lives in one partition (module docstring): num_pages and num_slots are the totals."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, partitions: int = 1) -> None:
        self.pages = PagePool(num_pages, page_size, partitions)
        self.slots = SlotPool(num_slots, partitions)
        self.partitions = partitions
        self.tables: dict[str, RequestTable] = {}
        self.part_load = [0] * partitions  # admitted requests per partition

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tables

    def pages_for(self, num_tokens: int) -> int:
        return self.pages.pages_for(num_tokens)

    def part_of(self, request_id: str) -> int:
        return self.table(request_id).part

    def free_pages(self, part: int | None = None) -> int:
        """Free pages of a partition (None: of all)."""
        return self.pages.num_free(part)

    def _fits(self, num_pages: int, part: int) -> bool:
        return self.slots.can_allocate(1, part) and self.pages.can_allocate(num_pages, part)

    def can_admit(self, num_tokens: int, part: int | None = None) -> bool:
        """Whether a new request needing one slot and pages for num_tokens fits now (in that partition; None: in
        any)."""
        need = self.pages.pages_for(num_tokens)
        return any(self._fits(need, p) for p in (range(self.partitions) if part is None else (part,)))

    def admission_parts(self, num_tokens: int) -> list[int]:
        """The partitions a new request needing pages for num_tokens fits in now, the least loaded first (fewest
        requests, then most free pages, then the lowest index; admit with no partition takes the first)."""
        need = self.pages.pages_for(num_tokens)
        fits = [p for p in range(self.partitions) if self._fits(need, p)]
        return sorted(fits, key=lambda p: (self.part_load[p], -self.pages.num_free(p), p))

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether the request would fit in empty pools (one partition's); if not, it must be rejected, not
        queued."""
        return self.slots.slots_per_part >= 1 and self.pages.pages_for(num_tokens) <= self.pages.pages_per_part

    def admit(self, request_id: str, num_tokens: int = 0, part: int | None = None) -> RequestTable:
        """Allocate a slot and pages for num_tokens, in the given partition (None: the least loaded that fits);
        all or nothing."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} is already admitted; release it first")
        num_pages = self.pages.pages_for(num_tokens)
        asked = part
        if part is None:
            fits = self.admission_parts(num_tokens)
            part = fits[0] if fits else None
        if part is None or not self.can_admit(num_tokens, part):
            if asked is None and self.partitions > 1:
                free = "no partition has them free (" + ", ".join(
                    f"{p}: {self.slots.num_free(p)} slot(s), {self.pages.num_free(p)} page(s)"
                    for p in range(self.partitions)) + ")"
            else:
                where = f" of partition {part}" if self.partitions > 1 else ""
                free = f"{self.slots.num_free(part)} slot(s) and {self.pages.num_free(part)} page(s){where} are free"
            raise OutOfMemory(
                f"cannot admit request {request_id!r}: it needs 1 slot and {num_pages} page(s) "
                f"for {num_tokens} tokens, but {free}"
            )
        table = RequestTable(pages=self.pages.allocate(num_pages, part), slot=self.slots.allocate(part),
                             num_tokens=num_tokens, part=part)
        self.tables[request_id] = table
        self.part_load[part] += 1
        return table

    def can_grow(self, request_id: str, new_num_tokens: int) -> bool:
        """Whether grow(request_id, new_num_tokens) would find enough free pages."""
        table = self.table(request_id)
        extra = self.pages.pages_for(new_num_tokens) - len(table.pages)
        return self.pages.can_allocate(max(extra, 0), table.part)

    def grow(self, request_id: str, new_num_tokens: int) -> None:
        """Append pages so they cover new_num_tokens and set the length; all or nothing."""
        table = self.table(request_id)
        if new_num_tokens < table.num_tokens:
            raise ValueError(
                f"grow of request {request_id!r} to {new_num_tokens} tokens is below its "
                f"length {table.num_tokens}; use shrink to roll back"
            )
        extra = self.pages.pages_for(new_num_tokens) - len(table.pages)
        if extra > 0:  # (most decode steps stay within their last page)
            table.pages.extend(self.pages.allocate(extra, table.part))
        table.num_tokens = new_num_tokens

    def try_grow(self, request_id: str, new_num_tokens: int) -> bool:
        """grow(request_id, new_num_tokens) if the free pages allow it (True); else False, and nothing changes.
        (The scheduler's per-request step path: one call where can_grow + grow looked the table up twice.)"""
        table = self.tables.get(request_id) or self.table(request_id)
        if new_num_tokens < table.num_tokens:
            raise ValueError(
                f"grow of request {request_id!r} to {new_num_tokens} tokens is below its "
                f"length {table.num_tokens}; use shrink to roll back"
            )
        extra = -(-new_num_tokens // self.pages.page_size) - len(table.pages)
        if extra > 0:  # (most decode steps stay within their last page)
            if extra > self.pages.num_free(table.part):
                return False
            table.pages.extend(self.pages.allocate(extra, table.part))
        table.num_tokens = new_num_tokens
        return True

    def grow_upto(self, request_id: str, least: int, most: int) -> int:
        """Grows the request to the longest length in [least, most] that its pages and the free pages can hold
        (an optional reservation, e.g. pages for drafts); returns that length. Raises OutOfMemory (and changes
        nothing) when not even `least` fits."""
        table = self.tables.get(request_id) or self.table(request_id)
        if least < table.num_tokens:
            raise ValueError(
                f"grow of request {request_id!r} to {least} tokens is below its "
                f"length {table.num_tokens}; use shrink to roll back"
            )
        page_size, held = self.pages.page_size, len(table.pages)
        if least <= most <= held * page_size:  # within its pages (most steps)
            new_num_tokens = most
        else:
            new_num_tokens = min(max(most, least), (held + self.pages.num_free(table.part)) * page_size)
        if new_num_tokens < least:
            raise OutOfMemory(
                f"cannot grow request {request_id!r} to {least} tokens: it holds {held} page(s) and "
                f"{self.pages.num_free(table.part)} are free"
            )
        extra = -(-new_num_tokens // page_size) - held
        if extra > 0:
            table.pages.extend(self.pages.allocate(extra, table.part))
        table.num_tokens = new_num_tokens
        return new_num_tokens

    def shrink(self, request_id: str, new_num_tokens: int) -> None:
        """Roll the length back to new_num_tokens and free the pages past it."""
        table = self.table(request_id)
        if not 0 <= new_num_tokens <= table.num_tokens:
            raise ValueError(
                f"shrink of request {request_id!r} must go to 0..{table.num_tokens} tokens, "
                f"got {new_num_tokens}; use grow to extend"
            )
        keep = self.pages.pages_for(new_num_tokens)
        if keep < len(table.pages):  # (most shrinks free nothing: the rejected drafts stayed in the last page)
            self.pages.free(table.pages[keep:])
            del table.pages[keep:]
        table.num_tokens = new_num_tokens

    def release(self, request_id: str) -> None:
        """Free every page and the slot of a finished, aborted or preempted request."""
        table = self.table(request_id)
        self.pages.free(table.pages)
        if table.slot is not None:
            self.slots.free(table.slot)
        del self.tables[request_id]
        self.part_load[table.part] -= 1

    def table(self, request_id: str) -> RequestTable:
        try:
            return self.tables[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def page_table_rows(self, request_ids: list[str]) -> list[list[int]]:
        """Page ids per request, in the given order (copies, safe to hand to the worker)."""
        return [list(self.table(rid).pages) for rid in request_ids]

    def stats(self) -> dict[str, int]:
        free_pages, free_slots = self.pages.num_free(), self.slots.num_free()
        return {
            "free_pages": free_pages,
            "used_pages": self.pages.num_pages - free_pages,
            "free_slots": free_slots,
            "used_slots": self.slots.num_slots - free_slots,
            "running_requests": len(self.tables),
        }
