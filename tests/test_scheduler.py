"""Continuous batching policy: FCFS admission, chunked prefill under the token budget, preemption of the
youngest request on a page shortage, rejection of requests that can never fit."""

from __future__ import annotations

import pickle

import pytest

from scheduler.memory import MemoryManager
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import RequestTooLarge, Scheduler
from scheduler.types import SamplingParams, TokenView


def make(rid: str, prompt_len: int, max_new: int = 8) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new))


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedules and commits one step; completed requests get one sampled token. Returns tokens fed."""
    plan = sched.schedule()
    sched.commit(plan)
    fed = {c.request.request_id: c.num_tokens for c in plan.chunks}
    for c in plan.chunks:
        if c.completes:
            c.request.output_ids.append(7)
            if len(c.request.output_ids) >= c.request.params.max_new_tokens:
                sched.finish(c.request, "length")
    return fed


def test_request_that_can_never_fit_is_rejected_with_a_clear_error():
    sched = Scheduler(MemoryManager(num_pages=4, page_size=4, num_slots=2), 2, 64, max_model_len=1000)
    with pytest.raises(RequestTooLarge, match="needs 5 KV pages but the pool has 4"):
        sched.add(make("big", 15, max_new=5))
    with pytest.raises(RequestTooLarge, match="length limit 1000"):
        Scheduler(MemoryManager(1000, 4, 2), 2, 64, 1000).add(make("long", 999, max_new=2))


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget_while_decodes_continue():
    sched = Scheduler(MemoryManager(64, 4, 4), 4, max_step_tokens=8, max_model_len=512)
    sched.add(make("short", 3))
    assert run_step(sched) == {"short": 3}
    sched.add(make("long", 20))
    fed = [run_step(sched) for _ in range(4)]
    assert fed[0] == {"short": 1, "long": 7}  # the decode keeps going beside the chunk
    assert fed[1] == {"short": 1, "long": 7}
    assert fed[2] == {"short": 1, "long": 6}
    assert fed[3] == {"short": 1, "long": 1}


def test_admission_is_first_come_first_served():
    sched = Scheduler(MemoryManager(64, 4, 2), max_running=2, max_step_tokens=100, max_model_len=512)
    for rid in ("a", "b", "c"):
        sched.add(make(rid, 4))
    assert set(run_step(sched)) == {"a", "b"}
    for step in range(1, 20):
        fed = run_step(sched)
        if "c" in fed:
            break
    # c gets the slot only once a and b (8 tokens each) are done: after 8 steps
    assert step == 8 and not {"a", "b"} & set(fed)


def test_a_waiting_request_that_does_not_fit_blocks_later_ones():
    """No overtaking: a small request behind a big one waits until the big one is admitted."""
    sched = Scheduler(MemoryManager(num_pages=6, page_size=4, num_slots=3), 3, max_step_tokens=100,
                      max_model_len=64)
    sched.add(make("running", 12, max_new=4))  # 3 pages + growth
    run_step(sched)
    sched.add(make("big", 13, max_new=2))  # needs 4 pages: does not fit beside the running one
    sched.add(make("small", 2, max_new=2))  # would fit, but arrived later
    fed = run_step(sched)
    assert "big" not in fed and "small" not in fed
    order = []
    for _ in range(20):
        order += [rid for rid in run_step(sched) if rid in ("big", "small") and rid not in order]
        if not sched.has_work():
            break
    assert order[0] == "big" and "small" in order


def test_page_shortage_preempts_the_youngest_and_it_resumes_later():
    memory = MemoryManager(num_pages=6, page_size=4, num_slots=3)
    sched = Scheduler(memory, 3, max_step_tokens=64, max_model_len=64)
    old, young = make("old", 8, max_new=12), make("young", 8, max_new=12)
    sched.add(old)
    sched.add(young)
    preempted_seen = False
    for _ in range(60):
        if not sched.has_work():
            break
        run_step(sched)
        if young.stats.preemptions:
            preempted_seen = True
        assert memory.stats()["used_pages"] <= 6
    assert preempted_seen and old.stats.preemptions == 0
    assert old.finished and young.finished
    assert len(old.output_ids) == 12 and len(young.output_ids) == 12
    assert memory.stats() == {"free_pages": 6, "used_pages": 0, "free_slots": 3, "used_slots": 0,
                              "running_requests": 0}


@pytest.mark.parametrize("pool_requests", [1.0, 1.3, 1.6, 2.2])
def test_long_prompts_in_a_tight_pool_are_admitted_whole_not_preempted_chunk_by_chunk(pool_requests):
    """A pool of about one long request: a waiting request admitted on its first chunk alone took pages the running
    one grew into, was preempted, re-admitted and preempted again (fed 5x the tokens, ~100 preemptions for 6
    requests). Admission now waits until its whole prompt fits beside what the running requests still need."""
    prompt, max_new, page = 400, 24, 16
    pages = int(pool_requests * -(-(prompt + max_new) // page))
    sched = Scheduler(MemoryManager(pages, page, 8), 8, max_step_tokens=64, max_model_len=2048)
    reqs = [make(f"r{i}", prompt, max_new) for i in range(6)]
    for r in reqs:
        sched.add(r)
    fed = 0
    for _ in range(2000):
        if not sched.has_work():
            break
        fed += sum(run_step(sched).values())
    assert all(r.finished and len(r.output_ids) == max_new for r in reqs)
    assert sum(r.stats.preemptions for r in reqs) == 0
    assert fed == 6 * (prompt + max_new - 1)  # nothing recomputed


def test_a_request_preempted_by_decode_growth_waits_until_its_whole_length_fits():
    """Two requests that fit together at admission but not at their final length: the younger is preempted once
    (decode growth, not admission, ran out of pages) and is not re-admitted while it cannot fit whole."""
    memory = MemoryManager(num_pages=10, page_size=4, num_slots=2)
    sched = Scheduler(memory, 2, max_step_tokens=64, max_model_len=64)
    old, young = make("old", 8, max_new=16), make("young", 8, max_new=16)  # 6 pages each at the end
    sched.add(old)
    sched.add(young)
    for _ in range(200):
        if not sched.has_work():
            break
        run_step(sched)
    assert old.finished and young.finished and len(young.output_ids) == 16
    assert old.stats.preemptions == 0 and young.stats.preemptions == 1


def test_draft_page_reservations_do_not_hold_admission_off():
    """Pages reserved for a decode's drafts come back at every commit: admission counts them as free-to-be (a
    review found the whole-prompt rule waiting for the running request to finish when it drafted)."""
    admitted_at = {}
    for max_draft in (0, 8):
        sched = Scheduler(MemoryManager(num_pages=7, page_size=4, num_slots=2), 2, max_step_tokens=64,
                          max_model_len=64, max_draft=max_draft)
        running, waiting = make("r", 4, max_new=20), make("w", 12, max_new=1)
        sched.add(running)
        run_step(sched)  # (every draft rejected: run_step commits no accepted tokens)
        sched.add(waiting)
        for step in range(1, 30):
            if "w" in run_step(sched):
                admitted_at[max_draft] = step
                break
    assert admitted_at == {0: 1, 8: 1}


def test_abort_of_waiting_and_running_requests_frees_their_memory():
    memory = MemoryManager(16, 4, 1)
    sched = Scheduler(memory, 1, 64, 64)
    a, b = make("a", 5), make("b", 5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert a.finish_reason == b.finish_reason == "abort"
    assert not sched.has_work() and memory.stats()["used_pages"] == 0 and memory.stats()["used_slots"] == 0


def test_step_requests_slice_each_chunk_without_building_the_whole_sequence():
    """Request.ids(start, stop) equals all_ids[start:stop] across the prompt/output boundary; step_requests hands
    the worker each chunk's tokens, its pages and slot, the draft cap and (only where it may draft) the whole
    sequence; a grow within the last page allocates nothing."""
    r = make("a", 5)
    r.output_ids.extend([40, 41, 42])
    for start in range(9):
        for stop in range(start, 10):
            assert r.ids(start, stop) == r.all_ids[start:stop], (start, stop)
    memory = MemoryManager(64, 4, 4)
    sched = Scheduler(memory, 4, max_step_tokens=6, max_model_len=512, max_draft=3)
    long, short = make("long", 9), make("short", 2)
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()  # long: a 6-token chunk (budget 6); short waits
    work = sched.step_requests(plan)
    assert [(w.request_id, w.tokens, w.context_len, w.sample, w.draft_cap, w.all_tokens) for w in work] == \
        [("long", list(range(1, 7)), 0, False, 0, [])]
    assert work[0].pages == memory.table("long").pages and work[0].pages is not memory.table("long").pages
    assert work[0].slot == memory.table("long").slot
    sched.commit(plan)
    run_step(sched)  # long's last 3 prompt tokens + short's prompt: both sample
    plan = sched.schedule()  # two decodes, each may verify drafts
    work = sched.step_requests(plan)
    for w, req in zip(work, (long, short)):
        assert w.tokens == [7] and w.context_len == req.num_tokens - 1 and w.sample
        assert w.draft_cap > 0 and w.all_tokens == req.all_ids
        assert isinstance(w.all_tokens, TokenView) and w.all_tokens._tail is req.output_ids  # a view: no copy
    table = memory.table("long")
    pages = list(table.pages)

    def no_allocation(n):
        raise AssertionError(f"allocate({n}) for a grow within the last page")

    memory.pages.allocate = no_allocation
    memory.grow("long", len(pages) * memory.pages.page_size)  # up to the end of its last page
    assert table.pages == pages and table.num_tokens == len(pages) * memory.pages.page_size


def test_worker_draft_cap_hint_bounds_the_pages_reserved_for_drafts():
    """commit(..., draft_cap_hint): the scheduler reserves pages for at most that many drafts per decode from the
    next step on (never more than max_draft); a step without a hint (None) keeps the last one."""
    memory = MemoryManager(64, 4, 4)
    sched = Scheduler(memory, 4, max_step_tokens=64, max_model_len=512, max_draft=8)
    r = make("a", 4, max_new=32)
    sched.add(r)
    plan = sched.schedule()
    sched.commit(plan)
    r.output_ids.append(7)
    plan = sched.schedule()
    assert plan.chunks[0].draft_cap == 8 and memory.table("a").num_tokens == 4 + 1 + 8
    sched.commit(plan, {}, draft_cap_hint=3)
    r.output_ids.append(7)
    plan = sched.schedule()
    assert plan.chunks[0].draft_cap == 3 and memory.table("a").num_tokens == r.num_tokens + 3
    sched.commit(plan, {}, draft_cap_hint=None)  # no word from the worker: the hint stays
    r.output_ids.append(7)
    assert sched.schedule().chunks[0].draft_cap == 3
    sched.draft_hint = 20  # above max_draft: max_draft
    assert sched._draft_cap(r, 64) == 8
    sched.draft_hint = 3
    sched.finish(r, "abort")  # the engine goes idle: its next batch starts from max_draft again
    r2 = make("b", 4, max_new=32)
    sched.add(r2)
    sched.commit(sched.schedule())
    r2.output_ids.append(7)
    assert sched.draft_hint is None and sched.schedule().chunks[0].draft_cap == 8


def test_token_view_reads_as_the_concatenation_and_keeps_its_length():
    """Request.token_view(): prompt + output without a copy. Every index and slice (negative, open, stepped)
    equals the list's; tokens appended after it was built are not in it; it pickles as a plain list."""
    r = make("a", 5)
    r.output_ids.extend([40, 41, 42])
    view, whole = r.token_view(), r.all_ids
    assert len(view) == len(whole) == 8 and list(view) == whole and view == whole and whole == view
    for i in range(-8, 8):
        assert view[i] == whole[i]
    for start in (None, -9, -3, 0, 2, 5, 7, 9):
        for stop in (None, -9, -1, 0, 3, 5, 6, 8, 12):
            for step in (None, 1, 2, -1):
                assert view[start:stop:step] == whole[start:stop:step], (start, stop, step)
    for bad in (8, -9):
        with pytest.raises(IndexError):
            view[bad]
    assert view != whole[:-1] and view != whole[:-1] + [0] and view != "abcdefgh"
    r.output_ids.append(43)  # a later token is not part of the view
    assert len(view) == 8 and list(view) == whole and view[-1] == 42 and view[5:] == [40, 41, 42]
    assert view.tolist() == whole and view.tolist() is not view.tolist()
    back = pickle.loads(pickle.dumps(view))
    assert type(back) is list and back == whole
    assert "TokenView" in repr(view)



def test_partitions_admit_to_the_least_loaded_rank_and_preempt_only_within_a_rank():
    """Two partitions (expert-parallel ranks) of 6 pages: a request short of a page preempts the youngest request
    of its own partition, not the youngest of all, which holds none of its pages."""
    memory = MemoryManager(num_pages=12, page_size=4, num_slots=4, partitions=2)
    sched = Scheduler(memory, 4, max_step_tokens=64, max_model_len=64)
    a, b, c = make("a", 8, max_new=14), make("b", 12, max_new=2), make("c", 8, max_new=14)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)
    # a -> 0; b -> 1 (fewer requests); c: a tie on requests, partition 0 has more free pages (4 against 3)
    assert [memory.part_of(r.request_id) for r in (a, b, c)] == [0, 1, 0]
    young = make("young", 2, max_new=20)  # the youngest of all, in partition 1 (fewer requests), running throughout
    sched.add(young)
    run_step(sched)
    assert memory.part_of("young") == 1
    preempted = []
    for _ in range(80):
        if not sched.has_work():
            break
        plan = sched.schedule()
        preempted += [r.request_id for r in plan.preempted]
        sched.commit(plan)
        for ch in plan.chunks:
            if ch.completes:
                ch.request.output_ids.append(7)
                if len(ch.request.output_ids) >= ch.request.params.max_new_tokens:
                    sched.finish(ch.request, "length")
    # a and c (22 tokens each at the end: 6 pages each) cannot both finish in partition 0's 6 pages: c, the younger
    # of the two, is preempted (and admitted again where its tokens so far fit), never young
    assert preempted and set(preempted) == {"c"}
    assert young.stats.preemptions == b.stats.preemptions == a.stats.preemptions == 0
    assert all(r.finished and len(r.output_ids) == r.params.max_new_tokens for r in (a, b, c, young))
    assert memory.stats()["used_pages"] == 0 and memory.part_load == [0, 0]


def test_partitioned_admission_checks_the_whole_prompt_in_the_partition_it_picks():
    """A waiting request goes to the least loaded partition where its whole prompt fits beside what that
    partition's running requests still need (not where its first chunk alone fits); when none has room it waits,
    and the requests behind it wait too (first come, first served)."""
    memory = MemoryManager(num_pages=16, page_size=4, num_slots=8, partitions=2)
    sched = Scheduler(memory, 8, max_step_tokens=64, max_model_len=64)
    for r in (make("x", 26, max_new=3), make("y", 2, max_new=20), make("z", 2, max_new=20)):
        sched.add(r)
    run_step(sched)
    assert [memory.part_of(rid) for rid in ("x", "y", "z")] == [0, 1, 1]  # z: a tie, partition 1 has more free
    sched.max_step_tokens = 7  # late's first chunk (4 tokens, one page) fits in partition 0's last page
    sched.add(make("late", 10, max_new=2))  # its whole prompt needs 3 pages
    assert run_step(sched)["late"] == 4 and memory.part_of("late") == 1  # not the least loaded partition 0
    sched.max_step_tokens = 64
    huge, tiny = make("huge", 30, max_new=2), make("tiny", 1, max_new=2)  # huge: 8 pages, a whole partition
    sched.add(huge)
    sched.add(tiny)
    fed = run_step(sched)
    assert "huge" not in fed and "tiny" not in fed  # tiny would fit, but arrived later
    for _ in range(10):
        fed = run_step(sched)
        if "huge" in fed:
            break
    assert fed["huge"] == 30 and memory.part_of("huge") == 0 and "tiny" in fed  # x finished: partition 0 is empty


def test_a_preemption_in_one_partition_does_not_hold_admission_off_in_the_others():
    """A request short of a page in partition 0 preempts there; partition 1, with room, still admits the same step
    (the preempted request, now in partition 1, and the one behind it). With one partition a preemption stops
    every admission of its step, as before."""
    memory = MemoryManager(num_pages=8, page_size=4, num_slots=4, partitions=2)
    sched = Scheduler(memory, 4, max_step_tokens=64, max_model_len=64)
    old, filler, young = make("old", 7, max_new=8), make("filler", 12, max_new=1), make("young", 7, max_new=8)
    for r in (old, filler, young):
        sched.add(r)
    run_step(sched)  # filler takes partition 1's pages, so young joins old in partition 0; filler then finishes
    assert filler.finished and memory.part_of("old") == memory.part_of("young") == 0 and memory.free_pages(0) == 0
    run_step(sched)  # each feeds its 8th token: still within its 2 pages
    sched.add(make("late", 3, max_new=2))
    plan = sched.schedule()  # old's 9th token needs a page of partition 0: young is preempted
    assert [r.request_id for r in plan.preempted] == ["young"] and plan.preempted_parts == {0}
    admitted = {c.request.request_id for c in plan.chunks if c.start == 0}
    assert admitted == {"young", "late"} and memory.part_of("young") == memory.part_of("late") == 1
