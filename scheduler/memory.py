"""Where each request's state lives: KV pages for attention layers, one slot for GDN layers.

Pure bookkeeping (no tensors): the worker owns the actual page and slot buffers and
addresses them through the ids handed out here. Accounting is exact: at every moment each
page and slot is either free or owned by exactly one request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OutOfMemory(Exception):
    """An allocation asked for more pages or slots than are free."""


class _IdAllocator:
    """Free list over the ids 0..total-1, shared by the page and slot pools."""

    def __init__(self, kind: str, total: int) -> None:
        if total < 0:
            raise ValueError(f"number of {kind}s must be >= 0, got {total}")
        self.kind = kind
        self.total = total
        self.free_ids: deque[int] = deque(range(total))
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

    def free(self, ids: list[int]) -> None:
        """Return ids to the pool; validates all of them before changing anything."""
        seen: set[int] = set()
        for i in ids:
            if not 0 <= i < self.total:
                raise ValueError(f"{self.kind} {i} is not an id of this pool (0..{self.total - 1})")
            if i not in self.used_ids or i in seen:
                raise ValueError(f"{self.kind} {i} is not allocated (double free?)")
            seen.add(i)
        self.used_ids.difference_update(ids)
        self.free_ids.extend(ids)


@dataclass
class PagePool:
    """Pool of fixed-size KV pages with ids 0..num_pages-1."""

    num_pages: int
    page_size: int = 16
    _ids: _IdAllocator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        self._ids = _IdAllocator("page", self.num_pages)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens of KV (0 for 0)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def num_free(self) -> int:
        return len(self._ids.free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free()

    def allocate(self, n: int) -> list[int]:
        """Take n pages; raises OutOfMemory (and takes none) if fewer are free."""
        return self._ids.allocate(n)

    def free(self, pages: list[int]) -> None:
        """Give pages back; a double free or a foreign id raises ValueError and frees none."""
        self._ids.free(pages)


@dataclass
class SlotPool:
    """Pool of per-request GDN state slots (recurrent state + conv window), ids 0..num_slots-1."""

    num_slots: int
    _ids: _IdAllocator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._ids = _IdAllocator("slot", self.num_slots)

    def num_free(self) -> int:
        return len(self._ids.free_ids)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= self.num_free()

    def allocate(self) -> int:
        """Take one slot; raises OutOfMemory if none is free."""
        return self._ids.allocate(1)[0]

    def free(self, slot: int) -> None:
        """Give a slot back; a double free or a foreign id raises ValueError."""
        self._ids.free([slot])


@dataclass
class RequestTable:
    """One request's memory: its KV pages in token order and its GDN state slot.

    Invariant kept by MemoryManager: len(pages) == pages_for(num_tokens).
    """

    pages: list[int]
    slot: int | None
    num_tokens: int  # tokens whose KV is stored (the cached length)


class MemoryManager:
    """Owns a PagePool and a SlotPool and the per-request tables, keyed by request id (str)."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int) -> None:
        self.pages = PagePool(num_pages, page_size)
        self.slots = SlotPool(num_slots)
        self.tables: dict[str, RequestTable] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tables

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new request needing one slot and pages for num_tokens fits now."""
        return self.slots.can_allocate(1) and self.pages.can_allocate(self.pages.pages_for(num_tokens))

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether the request would fit in empty pools; if not, it must be rejected, not queued."""
        return self.slots.num_slots >= 1 and self.pages.pages_for(num_tokens) <= self.pages.num_pages

    def admit(self, request_id: str, num_tokens: int = 0) -> RequestTable:
        """Allocate a slot and pages for num_tokens; all or nothing."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} is already admitted; release it first")
        num_pages = self.pages.pages_for(num_tokens)
        if not self.can_admit(num_tokens):
            raise OutOfMemory(
                f"cannot admit request {request_id!r}: it needs 1 slot and {num_pages} page(s) "
                f"for {num_tokens} tokens, but {self.slots.num_free()} slot(s) and "
                f"{self.pages.num_free()} page(s) are free"
            )
        table = RequestTable(pages=self.pages.allocate(num_pages), slot=self.slots.allocate(), num_tokens=num_tokens)
        self.tables[request_id] = table
        return table

    def can_grow(self, request_id: str, new_num_tokens: int) -> bool:
        """Whether grow(request_id, new_num_tokens) would find enough free pages."""
        table = self.table(request_id)
        extra = self.pages.pages_for(new_num_tokens) - len(table.pages)
        return self.pages.can_allocate(max(extra, 0))

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
            table.pages.extend(self.pages.allocate(extra))
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
            if extra > self.pages.num_free():
                return False
            table.pages.extend(self.pages.allocate(extra))
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
            new_num_tokens = min(max(most, least), (held + self.pages.num_free()) * page_size)
        if new_num_tokens < least:
            raise OutOfMemory(
                f"cannot grow request {request_id!r} to {least} tokens: it holds {held} page(s) and "
                f"{self.pages.num_free()} are free"
            )
        extra = -(-new_num_tokens // page_size) - held
        if extra > 0:
            table.pages.extend(self.pages.allocate(extra))
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
