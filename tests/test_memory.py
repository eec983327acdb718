import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler.memory import MemoryManager, OutOfMemory, PagePool, RequestTable, SlotPool


def assert_accounting_exact(mm: MemoryManager) -> None:
    """Every page and slot is free or owned by exactly one request, and tables match lengths."""
    owned_pages = [p for t in mm.tables.values() for p in t.pages]
    owned_slots = [t.slot for t in mm.tables.values()]
    assert len(owned_pages) == len(set(owned_pages)), "a page is owned twice"
    assert len(owned_slots) == len(set(owned_slots)), "a slot is owned twice"
    assert all(0 <= p < mm.pages.num_pages for p in owned_pages)
    assert all(s is not None and 0 <= s < mm.slots.num_slots for s in owned_slots)
    assert mm.pages.num_free() + len(owned_pages) == mm.pages.num_pages
    assert mm.slots.num_free() + len(owned_slots) == mm.slots.num_slots
    for t in mm.tables.values():
        assert len(t.pages) == mm.pages.pages_for(t.num_tokens)
    stats = mm.stats()
    assert stats["used_pages"] == len(owned_pages)
    assert stats["used_slots"] == len(owned_slots)
    assert stats["running_requests"] == len(mm.tables)


def assert_all_free(mm: MemoryManager) -> None:
    assert mm.stats() == {
        "free_pages": mm.pages.num_pages,
        "used_pages": 0,
        "free_slots": mm.slots.num_slots,
        "used_slots": 0,
        "running_requests": 0,
    }


# --- PagePool / SlotPool -------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, pages", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pages_for_rounds_up_to_whole_pages(num_tokens: int, pages: int) -> None:
    assert PagePool(num_pages=4, page_size=16).pages_for(num_tokens) == pages


def test_page_pool_hands_out_distinct_ids_until_empty() -> None:
    pool = PagePool(num_pages=5, page_size=4)
    pages = pool.allocate(3) + pool.allocate(2)
    assert sorted(pages) == [0, 1, 2, 3, 4]
    assert pool.num_free() == 0
    assert not pool.can_allocate(1)
    assert pool.can_allocate(0)


def test_page_pool_out_of_memory_says_how_many_asked_and_free() -> None:
    pool = PagePool(num_pages=4)
    pool.allocate(3)
    with pytest.raises(OutOfMemory, match=r"requested 2 page.*only 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free() == 1  # a failed allocation takes nothing


def test_page_pool_double_free_raises_and_frees_nothing() -> None:
    pool = PagePool(num_pages=4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match=f"page {pages[0]} is not allocated"):
        pool.free(pages)
    assert pool.num_free() == 3
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([pages[1], pages[1]])
    assert pool.num_free() == 3


def test_page_pool_rejects_foreign_ids() -> None:
    pool = PagePool(num_pages=4)
    with pytest.raises(ValueError, match=r"page 4 is not an id of this pool \(0..3\)"):
        pool.free([4])
    with pytest.raises(ValueError, match="page -1"):
        pool.free([-1])


def test_page_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PagePool(num_pages=4, page_size=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        PagePool(num_pages=-1)
    with pytest.raises(ValueError, match="negative"):
        PagePool(num_pages=4).allocate(-1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        PagePool(num_pages=4).pages_for(-1)


def test_slot_pool_allocates_each_slot_once_and_reuses_freed_slots() -> None:
    pool = SlotPool(num_slots=2)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1}
    with pytest.raises(OutOfMemory, match=r"requested 1 slot.*only 0 of 2 are free"):
        pool.allocate()
    pool.free(a)
    assert pool.can_allocate()
    assert pool.allocate() == a


def test_slot_pool_double_free_and_foreign_id_raise() -> None:
    pool = SlotPool(num_slots=2)
    slot = pool.allocate()
    pool.free(slot)
    with pytest.raises(ValueError, match=f"slot {slot} is not allocated"):
        pool.free(slot)
    with pytest.raises(ValueError, match="slot 7 is not an id of this pool"):
        pool.free(7)
    assert pool.num_free() == 2


# --- MemoryManager -------------------------------------------------------------------------


def test_admit_allocates_one_slot_and_pages_for_the_prompt() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=2)
    table = mm.admit("a", num_tokens=9)
    assert isinstance(table, RequestTable)
    assert len(table.pages) == 3 and table.num_tokens == 9 and table.slot is not None
    assert mm.table("a") is table
    assert "a" in mm
    assert mm.stats() == {"free_pages": 5, "used_pages": 3, "free_slots": 1, "used_slots": 1, "running_requests": 1}


def test_admit_with_zero_tokens_takes_a_slot_but_no_pages() -> None:
    mm = MemoryManager(num_pages=2, page_size=4, num_slots=1)
    table = mm.admit("a")
    assert table.pages == [] and table.num_tokens == 0
    assert mm.stats()["used_slots"] == 1 and mm.stats()["used_pages"] == 0


def test_release_returns_every_page_and_slot() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=2)
    mm.admit("a", 10)
    mm.admit("b", 5)
    mm.grow("a", 20)
    mm.release("a")
    mm.release("b")
    assert_all_free(mm)
    assert "a" not in mm


def test_duplicate_admit_raises_and_keeps_the_first_table() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=2)
    first = mm.admit("a", 4)
    with pytest.raises(ValueError, match="'a' is already admitted"):
        mm.admit("a", 4)
    assert mm.table("a") is first
    assert_accounting_exact(mm)


def test_admit_without_free_slot_raises_out_of_memory_and_takes_no_pages() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    mm.admit("a", 4)
    assert not mm.can_admit(4)
    with pytest.raises(OutOfMemory, match=r"'b'.*1 slot and 1 page.*0 slot\(s\) and 7 page\(s\) are free"):
        mm.admit("b", 4)
    assert "b" not in mm
    assert mm.stats()["free_pages"] == 7


def test_admit_without_enough_pages_raises_out_of_memory_and_takes_no_slot() -> None:
    mm = MemoryManager(num_pages=2, page_size=4, num_slots=2)
    assert not mm.can_admit(9)
    with pytest.raises(OutOfMemory, match=r"3 page\(s\) for 9 tokens"):
        mm.admit("a", 9)
    assert_all_free(mm)


def test_fits_ever_ignores_current_use_but_not_pool_size() -> None:
    mm = MemoryManager(num_pages=4, page_size=4, num_slots=1)
    mm.admit("a", 16)
    assert not mm.can_admit(16)
    assert mm.fits_ever(16)
    assert not mm.fits_ever(17)
    assert not MemoryManager(num_pages=4, page_size=4, num_slots=0).fits_ever(0)


def test_grow_within_a_page_adds_no_page() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    mm.admit("a", 5)
    pages_before = list(mm.table("a").pages)
    mm.grow("a", 8)
    assert mm.table("a").pages == pages_before
    assert mm.table("a").num_tokens == 8


def test_grow_across_page_boundaries_appends_pages_in_order() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    mm.admit("a", 4)
    first = list(mm.table("a").pages)
    mm.grow("a", 13)  # 4 -> 13 tokens: 1 -> 4 pages
    pages = mm.table("a").pages
    assert len(pages) == 4 and pages[:1] == first
    assert mm.table("a").num_tokens == 13
    assert_accounting_exact(mm)


def test_grow_beyond_free_pages_raises_and_changes_nothing() -> None:
    mm = MemoryManager(num_pages=3, page_size=4, num_slots=2)
    mm.admit("a", 4)
    mm.admit("b", 4)
    assert mm.can_grow("a", 8)
    assert not mm.can_grow("a", 9)
    with pytest.raises(OutOfMemory, match=r"requested 2 page"):
        mm.grow("a", 9)
    assert mm.table("a").num_tokens == 4 and len(mm.table("a").pages) == 1
    assert_accounting_exact(mm)


def test_grow_below_current_length_raises() -> None:
    mm = MemoryManager(num_pages=4, page_size=4, num_slots=1)
    mm.admit("a", 8)
    with pytest.raises(ValueError, match="use shrink"):
        mm.grow("a", 7)


def test_shrink_across_page_boundary_frees_the_pages_past_the_new_length() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    mm.admit("a", 5)
    mm.grow("a", 17)  # 5 pages
    kept = mm.table("a").pages[:2]
    mm.shrink("a", 6)  # rejected draft tokens: back to 2 pages
    assert mm.table("a").pages == kept
    assert mm.table("a").num_tokens == 6
    assert mm.stats()["free_pages"] == 6
    assert_accounting_exact(mm)


def test_shrink_within_a_page_keeps_the_page() -> None:
    """...and gives nothing back to the pool (a spy: free([]) would leave the counts equal too)."""
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    mm.admit("a", 8)
    pages = list(mm.table("a").pages)

    def no_free(ids):
        raise AssertionError(f"free({ids}) for a shrink within the last page")

    mm.pages.free = no_free
    mm.shrink("a", 5)
    assert mm.table("a").pages == pages and mm.table("a").num_tokens == 5


def test_shrink_to_zero_frees_all_pages_but_keeps_the_slot() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=1)
    slot = mm.admit("a", 12).slot
    mm.shrink("a", 0)
    assert mm.table("a").pages == [] and mm.table("a").slot == slot
    assert mm.stats()["free_pages"] == 8 and mm.stats()["used_slots"] == 1


def test_shrink_outside_current_length_raises() -> None:
    mm = MemoryManager(num_pages=4, page_size=4, num_slots=1)
    mm.admit("a", 8)
    with pytest.raises(ValueError, match=r"0..8 tokens, got 9"):
        mm.shrink("a", 9)
    with pytest.raises(ValueError, match=r"got -1"):
        mm.shrink("a", -1)


@pytest.mark.parametrize("op", ["release", "table", "grow", "shrink", "can_grow"])
def test_unknown_request_id_raises_key_error_naming_it(op: str) -> None:
    mm = MemoryManager(num_pages=4, page_size=4, num_slots=1)
    args = {"release": (), "table": (), "grow": (4,), "shrink": (0,), "can_grow": (4,)}[op]
    with pytest.raises(KeyError, match="'ghost'"):
        getattr(mm, op)("ghost", *args)


def test_release_twice_raises_key_error() -> None:
    mm = MemoryManager(num_pages=4, page_size=4, num_slots=1)
    mm.admit("a", 4)
    mm.release("a")
    with pytest.raises(KeyError, match="'a'"):
        mm.release("a")
    assert_all_free(mm)


def test_page_table_rows_follow_the_given_order_and_are_copies() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=3)
    a = mm.admit("a", 8).pages
    b = mm.admit("b", 0).pages
    c = mm.admit("c", 3).pages
    rows = mm.page_table_rows(["c", "a", "b"])
    assert rows == [c, a, b]
    rows[0].append(99)
    assert 99 not in mm.table("c").pages


def test_released_pages_and_slots_are_reused_by_the_next_request() -> None:
    mm = MemoryManager(num_pages=2, page_size=4, num_slots=1)
    mm.admit("a", 8)
    mm.release("a")
    table = mm.admit("b", 8)
    assert sorted(table.pages) == [0, 1] and table.slot == 0


# --- random sequences ----------------------------------------------------------------------


class MemoryManagerMachine(RuleBasedStateMachine):
    """Drives requests through admit/grow/shrink/release, mirroring lengths in a plain dict."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = MemoryManager(num_pages=12, page_size=4, num_slots=4)
        self.lengths: dict[str, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 60))
    def admit(self, num_tokens: int) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        before = self.mm.stats()
        if self.mm.can_admit(num_tokens):
            self.mm.admit(request_id, num_tokens)
            self.lengths[request_id] = num_tokens
        else:
            with pytest.raises(OutOfMemory):
                self.mm.admit(request_id, num_tokens)
            assert self.mm.stats() == before and request_id not in self.mm

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), extra=st.integers(0, 24))
    def grow(self, data: st.DataObject, extra: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.lengths)))
        new_length = self.lengths[request_id] + extra
        before = self.mm.stats()
        if self.mm.can_grow(request_id, new_length):
            self.mm.grow(request_id, new_length)
            self.lengths[request_id] = new_length
        else:
            with pytest.raises(OutOfMemory):
                self.mm.grow(request_id, new_length)
            assert self.mm.stats() == before

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.lengths)))
        new_length = data.draw(st.integers(0, self.lengths[request_id]))
        self.mm.shrink(request_id, new_length)
        self.lengths[request_id] = new_length

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.mm.release(request_id)
        del self.lengths[request_id]

    @invariant()
    def accounting_is_exact(self) -> None:
        assert_accounting_exact(self.mm)
        assert {rid: t.num_tokens for rid, t in self.mm.tables.items()} == self.lengths

    def teardown(self) -> None:
        for request_id in list(self.lengths):
            self.mm.release(request_id)
            assert_accounting_exact(self.mm)
        assert_all_free(self.mm)


MemoryManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_random_admit_grow_shrink_release_keeps_accounting_exact = MemoryManagerMachine.TestCase


def run_random_sequence(mm: MemoryManager, seed: int, steps: int, longest: int, check=None) -> None:
    """Random admits, decode growth (up to 16 drafts), rollbacks and releases; exact accounting after each (and
    `check(mm)`); everything free at the end."""
    rng = random.Random(seed)
    lengths: dict[str, int] = {}
    for step in range(steps):
        op = rng.choice(["admit", "grow", "grow", "shrink", "release"]) if lengths else "admit"
        request_id = rng.choice(sorted(lengths)) if lengths else ""
        if op == "admit":
            num_tokens = rng.randint(0, longest)
            if mm.can_admit(num_tokens):
                mm.admit(f"r{step}", num_tokens)
                lengths[f"r{step}"] = num_tokens
        elif op == "grow":
            new_length = lengths[request_id] + rng.randint(0, 17)  # one decode step with up to 16 drafts
            if mm.can_grow(request_id, new_length):
                mm.grow(request_id, new_length)
                lengths[request_id] = new_length
        elif op == "shrink":
            new_length = rng.randint(max(0, lengths[request_id] - 17), lengths[request_id])
            mm.shrink(request_id, new_length)
            lengths[request_id] = new_length
        else:
            mm.release(request_id)
            del lengths[request_id]
        assert_accounting_exact(mm)
        if check is not None:
            check(mm)
    for request_id in list(lengths):
        mm.release(request_id)
    assert_all_free(mm)


def test_long_seeded_random_sequence_ends_with_everything_free() -> None:
    run_random_sequence(MemoryManager(num_pages=64, page_size=16, num_slots=8), seed=0, steps=3000, longest=200)


# --- partitions (expert parallelism: one per rank) -----------------------------------------------------------


def test_partitioned_pools_split_ids_into_equal_ranges_and_keep_each_request_in_one() -> None:
    mm = MemoryManager(num_pages=12, page_size=4, num_slots=4, partitions=2)
    assert mm.pages.pages_per_part == 6 and mm.slots.slots_per_part == 2
    a = mm.admit("a", 9)  # the least loaded partition: 0 (ties: most free pages, then the lowest index)
    b = mm.admit("b", 5)  # now 1 has fewer requests
    assert (a.part, b.part) == (0, 1)
    assert all(0 <= p < 6 for p in a.pages) and a.slot in (0, 1)
    assert all(6 <= p < 12 for p in b.pages) and b.slot in (2, 3)
    mm.grow("b", 24)  # 6 pages: the whole of partition 1
    assert all(6 <= p < 12 for p in mm.table("b").pages) and mm.free_pages(1) == 0
    assert not mm.can_grow("b", 25)  # partition 0's free pages are not b's
    with pytest.raises(OutOfMemory):
        mm.grow("b", 25)
    assert mm.can_admit(4) and not mm.can_admit(4, part=1) and mm.admission_parts(4) == [0]
    with pytest.raises(OutOfMemory, match="of partition 1"):
        mm.admit("c", 4, part=1)
    assert mm.grow_upto("a", 9, 40) == 24  # drafts' pages only from a's own partition
    first = mm.table("b").pages[0]
    mm.shrink("b", 3)
    assert mm.table("b").pages == [first] and mm.free_pages(1) == 5
    assert mm.part_load == [1, 1]
    assert_accounting_exact(mm)
    for rid in ("a", "b"):
        mm.release(rid)
    assert_all_free(mm)
    assert mm.part_load == [0, 0]


def test_partitioned_pool_sizes_must_divide_and_frees_validate_across_partitions() -> None:
    with pytest.raises(ValueError, match=r"number of pages \(10\) must be a multiple of partitions \(3\)"):
        MemoryManager(num_pages=10, page_size=4, num_slots=3, partitions=3)
    with pytest.raises(ValueError, match=r"number of slots \(4\) must be a multiple of partitions \(3\)"):
        MemoryManager(num_pages=9, page_size=4, num_slots=4, partitions=3)
    with pytest.raises(ValueError, match="partitions must be an integer >= 1, got 0"):
        PagePool(8, 4, partitions=0)
    pool = PagePool(8, 4, partitions=2)
    low, high = pool.allocate(2, part=0), pool.allocate(2, part=1)
    assert low == [0, 1] and high == [4, 5] and pool.part_of(5) == 1
    with pytest.raises(ValueError, match="page 6 is not allocated"):
        pool.free([low[0], 6])  # the second id is free: nothing is freed
    assert pool.num_free() == 4 and pool.num_free(0) == 2
    with pytest.raises(ValueError, match=r"page 8 is not an id of this pool \(0..7\)"):
        pool.free([8])
    with pytest.raises(ValueError, match=r"partition must be in \[0, 2\), got 2"):
        pool.allocate(1, part=2)
    pool.free(low + high)
    assert pool.num_free() == 8


def test_partitioned_random_sequence_keeps_every_request_inside_its_partition() -> None:
    def inside(mm: MemoryManager) -> None:
        for t in mm.tables.values():
            assert {mm.pages.part_of(p) for p in t.pages} <= {t.part} and mm.slots.part_of(t.slot) == t.part
        assert mm.part_load == [sum(t.part == p for t in mm.tables.values()) for p in range(3)]

    run_random_sequence(MemoryManager(num_pages=48, page_size=16, num_slots=6, partitions=3), seed=1, steps=2000,
                        longest=120, check=inside)


def test_several_partitions_need_the_partition_named_and_say_where_nothing_fits() -> None:
    mm = MemoryManager(num_pages=8, page_size=4, num_slots=2, partitions=2)
    with pytest.raises(ValueError, match="partition is required with 2 partitions"):
        mm.pages.allocate(1)
    with pytest.raises(ValueError, match="partition is required with 2 partitions"):
        mm.slots.can_allocate()
    mm.admit("a", 16)
    mm.admit("b", 12)
    with pytest.raises(OutOfMemory, match=r"no partition has them free \(0: 0 slot\(s\), 0 page\(s\), "
                                          r"1: 0 slot\(s\), 1 page\(s\)\)"):
        mm.admit("c", 1)
    assert "c" not in mm and mm.part_load == [1, 1]
