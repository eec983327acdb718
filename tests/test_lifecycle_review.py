"""The request lifecycle under concurrency, with speculation on: draft reservations against the other running
requests (token budget, pages, preemption), stop strings / EOS / max_new_tokens inside accepted draft blocks,
aborts at every phase, seeded sampling across batches and preemption, and the async engine's many streams,
cancellations, drain and shutdown. Tiny default model (random weights, byte tokenizer), CPU."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_engine import AsyncEngine, EngineUnavailable
from engine.core import EngineConfig, EngineCore, StepOutput
from engine.default_model import default_model_dir
from scheduler.memory import MemoryManager, OutOfMemory
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.types import SamplingParams
from serving import one_torch_thread, run  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# prompts of different lengths (the first is prefilled in two chunks under a budget of 8 tokens)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2, 3, 1, 2, 3], [3, 4, 5, 3, 4, 5, 3, 4], [100, 101, 102, 103]]
MAX_NEW = [14, 12, 16, 10]
POLICIES = ["fixed", "budget", "hybridspec"]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def make_core(references: list[list[int]] | None = None, prompts: list[list[int]] = PROMPTS, **options) -> EngineCore:
    core = EngineCore(EngineConfig(**options))
    if references is not None and options.get("spec") == "replay":
        for prompt, ref in zip(prompts, references):
            core.executor.runner.drafter.set_reference(prompt, ref)
    return core


def drive(core: EngineCore, on_step=None) -> tuple[dict[str, list[StepOutput]], int]:
    """Steps the core until it is idle: every request's outputs, and the number of steps."""
    outs: dict[str, list[StepOutput]] = {}
    steps = 0
    while core.has_work():
        if on_step is not None:
            on_step(core, steps)
        for out in core.step():
            assert not (outs.get(out.request_id) and outs[out.request_id][-1].finished), "output after the last"
            outs.setdefault(out.request_id, []).append(out)
        steps += 1
    return outs, steps


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_all_free(core: EngineCore) -> None:
    stats = core.memory.stats()
    assert stats["used_pages"] == 0 and stats["used_slots"] == 0 and not core.has_work() and not core.live
    runner = core.executor.runner
    assert not runner.generators and not runner.draft_generators  # per-request worker state forgotten
    drafter = runner.drafter
    assert not getattr(drafter, "cached", None) and not getattr(drafter, "_matched", None)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Plain greedy decoding (no speculation) of PROMPTS, 40 tokens each."""
    core = make_core()
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, greedy(40))
    outs, _ = drive(core)
    return [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))]


# ---- the scheduler: drafts come out of what the running requests' own tokens leave --------------------------

def _request(rid: str, prompt_len: int, max_new: int = 12) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new))


def _prefill_all(sched: Scheduler, requests: list[Request]) -> None:
    for r in requests:
        sched.add(r)
    plan = sched.schedule()
    assert [c.request for c in plan.chunks] == requests and all(c.completes for c in plan.chunks)
    sched.commit(plan)
    for r in requests:
        r.output_ids.append(7)


def test_an_older_requests_drafts_never_get_a_younger_request_preempted():
    """6 pages of 4 tokens, two requests of 9 tokens (3 pages each with the next token): the older one's drafts
    may use only what the younger one's decode token leaves. Before: the older reserved pages for 6 drafts and
    the younger, short of a page for its one token, was preempted (and recomputed later)."""
    memory = MemoryManager(num_pages=6, page_size=4, num_slots=2)
    sched = Scheduler(memory, 2, max_step_tokens=64, max_model_len=64, max_draft=6)
    old, young = _request("old", 8), _request("young", 8)
    _prefill_all(sched, [old, young])
    plan = sched.schedule()
    assert not plan.preempted and young.stats.preemptions == 0
    # the older one's drafts end where its 3rd page ends; the younger one's too (its 3rd page, taken for its token)
    assert [(c.request.request_id, c.num_tokens, c.draft_cap) for c in plan.chunks] == [("old", 1, 3), ("young", 1, 3)]
    assert memory.stats()["free_pages"] == 0
    sched.commit(plan, {"old": 0})  # every draft rejected: the reserved pages go back
    assert memory.table("old").num_tokens == 9 and len(memory.table("old").pages) == 3


def test_drafts_never_take_a_running_requests_token_out_of_the_step():
    """A token budget of 5 and three decodes: each decode gets its token, the drafts get the rest. Before: the
    oldest took 1 + 4 drafts and the two others did not run at all that step."""
    sched = Scheduler(MemoryManager(64, 4, 3), 3, max_step_tokens=5, max_model_len=64, max_draft=6)
    requests = [_request(rid, 1) for rid in ("a", "b", "c")]
    _prefill_all(sched, requests)
    for _ in range(4):
        plan = sched.schedule()
        assert [(c.request.request_id, c.num_tokens, c.draft_cap) for c in plan.chunks] == [
            ("a", 1, 2), ("b", 1, 0), ("c", 1, 0)]
        assert plan.num_tokens + sum(c.draft_cap for c in plan.chunks) == 5
        sched.commit(plan, {"a": 0})
        for r in requests:
            r.output_ids.append(7)


def test_a_younger_requests_prefill_chunk_leaves_an_older_decodes_drafts():
    """Drafts are budgeted in age order: an older decode keeps its drafts while a younger request's long prompt is
    prefilled in chunks (the chunk gets what is left), so its verified blocks, and what a seed gives, do not depend
    on who arrived later. (A first version of the three-pass scheduler gave the chunk the whole budget first: every
    older decode drafted nothing for prompt / max_step_tokens steps, and a seeded `fixed` stream changed.)"""
    sched = Scheduler(MemoryManager(64, 4, 2), 2, max_step_tokens=16, max_model_len=256, max_draft=4)
    old = _request("old", 3)
    _prefill_all(sched, [old])
    young = _request("young", 85)
    sched.add(young)
    for _ in range(3):
        plan = sched.schedule()
        chunks = {c.request.request_id: c for c in plan.chunks}
        assert chunks["old"].num_tokens == 1 and chunks["old"].draft_cap == 4
        assert chunks["young"].num_tokens == 16 - 1 - 4  # the chunk takes what the older decode left
        sched.commit(plan, {"old": 0})
        old.output_ids.append(7)


def test_try_grow_and_grow_upto_are_all_or_nothing_and_reserve_what_fits():
    memory = MemoryManager(num_pages=4, page_size=4, num_slots=2)
    memory.admit("a", 5)  # 2 pages
    memory.admit("b", 4)  # 1 page
    assert memory.try_grow("a", 8) and memory.table("a").pages == [0, 1]  # within its pages
    assert not memory.try_grow("a", 13) and memory.table("a").num_tokens == 8  # needs 2 more, 1 free
    assert memory.grow_upto("a", 9, 20) == 12 and len(memory.table("a").pages) == 3  # as far as the pool allows
    assert memory.grow_upto("b", 4, 4) == 4 and memory.pages.num_free() == 0
    with pytest.raises(OutOfMemory):
        memory.grow_upto("b", 5, 9)
    assert memory.table("b").num_tokens == 4 and memory.table("b").pages == [2]
    with pytest.raises(ValueError, match="below its length"):
        memory.try_grow("a", 3)
    with pytest.raises(KeyError, match="unknown request id"):
        memory.grow_upto("zz", 1, 2)
    memory.shrink("a", 9)
    memory.release("a")
    memory.release("b")
    assert memory.stats()["used_pages"] == 0 and memory.stats()["used_slots"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_rejected_drafts_under_memory_pressure_schedule_exactly_like_plain_decoding(reference, policy):
    """A pool too small for all four requests, every draft rejected: the tokens are plain greedy decoding's, and
    so must be the schedule (steps, preemptions). Before: the drafts' page reservations preempted requests that
    plain decoding kept running (43 steps instead of 40)."""
    options = dict(num_pages=12, page_size=4, max_running=4)
    plain = make_core(**options)
    spec = make_core(reference, spec="replay", policy=policy, max_verify_len=5, replay_acceptance=0.0, **options)
    results = []
    for core in (plain, spec):
        for i, p in enumerate(PROMPTS):
            core.add_request(f"r{i}", p, greedy(20))
        outs, steps = drive(core)
        assert [tokens(outs[f"r{i}"]) for i in range(4)] == [ref[:20] for ref in reference]
        assert_all_free(core)
        results.append((steps, [outs[f"r{i}"][-1].stats.preemptions for i in range(4)]))
    assert sum(results[0][1]) > 0  # the pool really is short
    assert results[1] == results[0]


# ---- stops inside accepted draft blocks --------------------------------------------------------------------

def _ascii_window(ref: list[int], length: int, after: int) -> int:
    """The first index >= after where `length` printable ASCII tokens start (a stop string of several tokens)."""
    for i in range(after, len(ref) - length):
        if all(32 <= t < 127 for t in ref[i:i + length]):
            return i
    raise AssertionError("the reference has no such window")


@pytest.mark.parametrize("policy", POLICIES)
def test_stop_strings_eos_and_max_new_tokens_inside_accepted_blocks(reference, policy):
    """Every draft right (blocks of up to 5 tokens accepted at once): a stop string of several tokens, an EOS and
    max_new_tokens each land inside a block; nothing past them is streamed, the text is cut before the stop and
    never shows it, and the other requests are unaffected."""
    core = make_core(reference, spec="replay", policy=policy, max_verify_len=4, replay_acceptance=1.0)
    tok = core.tokenizer
    ref_text = [tok.decode(r) for r in reference]
    # request 1: a 2-token stop string; request 2: an EOS (a token of its reference made an EOS id); request 3:
    # max_new_tokens inside a block; request 0: a stop string at the last token of the block that ends at index 10
    # under the fixed policy (1 token from the prefill, then blocks of 5)
    start = _ascii_window(reference[1], 2, 3)
    stop1 = tok.decode(reference[1][start:start + 2])
    assert stop1 not in tok.decode(reference[1][:start + 1])
    eos = reference[2][7]
    assert eos not in reference[2][:7] and eos not in reference[0] + reference[1] + reference[3]
    core.eos_ids = core.eos_ids | {eos}
    stop0 = tok.decode(reference[0][10:11])
    assert 0 < reference[0][10] < 128 and stop0 not in tok.decode(reference[0][:10])
    params = [greedy(40, stop=[stop0]), greedy(40, stop=["\x00\x00\x00", stop1]),
              SamplingParams(max_new_tokens=40), greedy(8)]
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        core.add_request(f"r{i}", p, sp)
    outs, _ = drive(core)
    expected = [(11, "stop"), (start + 2, "stop"), (8, "stop"), (8, "length")]
    for i, (n, reason) in enumerate(expected):
        o = outs[f"r{i}"]
        assert tokens(o) == reference[i][:n], f"request {i}"
        assert o[-1].finished and o[-1].finish_reason == reason, f"request {i}"
        text = "".join(x.new_text for x in o)
        if i == 0:
            assert text == ref_text[0][:ref_text[0].index(stop0)]
        elif i == 1:
            assert text == ref_text[1][:ref_text[1].index(stop1)]
            assert all(stop1 not in "".join(x.new_text for x in o[:k]) for k in range(len(o) + 1))
    assert sum(o[-1].stats.accepted_tokens for o in outs.values()) > 0  # blocks were accepted
    assert_all_free(core)


@pytest.mark.parametrize("policy", POLICIES)
def test_max_new_tokens_of_one_and_two_with_speculation(reference, policy):
    core = make_core(reference, spec="replay", policy=policy, max_verify_len=4, replay_acceptance=1.0)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, greedy(1 + i % 2))
    outs, _ = drive(core)
    for i in range(4):
        assert tokens(outs[f"r{i}"]) == reference[i][:1 + i % 2]
        assert [o.finished for o in outs[f"r{i}"]][-1] and outs[f"r{i}"][-1].finish_reason == "length"
    assert_all_free(core)


# ---- aborts at every phase ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, policy", [("replay", "fixed"), ("replay", "hybridspec"), ("draft", "budget")])
def test_abort_at_every_phase_leaves_the_others_lossless_and_frees_everything(reference, spec, policy):
    """Request 3 (waiting at first: 3 running at most) or request 0 (its prompt prefilled in two chunks) is aborted
    before each step in turn: waiting, mid-prefill, mid-decode, right after a speculative step, after it finished
    (a no-op), plus an unknown id. The others' tokens are plain greedy decoding's; all memory and all of the
    worker's per-request state are free at the end."""
    extra = {"draft_model": str(default_model_dir())} if spec == "draft" else {"replay_acceptance": 0.6}
    options = dict(spec=spec, policy=policy, max_verify_len=4, max_step_tokens=8, max_running=3, num_pages=14,
                   page_size=4, **extra)
    core = make_core(reference, **options)
    phases = set()  # where the victim was when aborted
    for victim, abort_steps in (("r3", range(0, 14, 2)), ("r0", range(1, 14, 3))):
        for at in abort_steps:
            for i, p in enumerate(PROMPTS):
                core.add_request(f"r{i}", p, greedy(MAX_NEW[i]))

            def abort(core: EngineCore, step: int) -> None:
                if step == at:
                    live = core.live.get(victim)
                    if live is not None:
                        r = live.request
                        phases.add("waiting" if r.status.value == "waiting" else
                                   "mid-prefill" if r.num_computed < len(r.prompt_ids) else
                                   "after a verification" if r.stats.verify_steps else "decoding")
                    core.abort(victim)
                    core.abort("no-such-request")

            outs, _ = drive(core, abort)
            for i in range(4):
                if f"r{i}" != victim:
                    assert tokens(outs[f"r{i}"]) == reference[i][:MAX_NEW[i]], (victim, at, i)
            assert_all_free(core)
            core.abort(victim)  # finished or aborted already: a no-op
    assert {"waiting", "mid-prefill"} <= phases and phases & {"decoding", "after a verification"}
    if policy == "fixed":
        assert "after a verification" in phases
    assert_all_free(core)


# ---- sampling: seeds, mixed params ---------------------------------------------------------------------------

def test_seeded_sampling_survives_preemption_and_mixed_batches():
    """Seeded requests with different temperatures / top-k / top-p beside greedy and unseeded ones: each seeded
    stream is the same alone, in the batch, and when preempted and recomputed (no speculation)."""
    params = [SamplingParams(temperature=0.8, top_k=40, max_new_tokens=18, seed=1, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=18, seed=2, ignore_eos=True),
              SamplingParams(temperature=1.2, max_new_tokens=15, ignore_eos=True),  # unseeded
              greedy(16)]

    def run_batch(indices: list[int], **options) -> tuple[dict[str, list[int]], int]:
        core = make_core(**options)
        for i in indices:
            core.add_request(f"r{i}", PROMPTS[i], params[i])
        outs, _ = drive(core)
        assert_all_free(core)
        return {rid: tokens(o) for rid, o in outs.items()}, sum(o[-1].stats.preemptions for o in outs.values())

    alone = {f"r{i}": run_batch([i])[0][f"r{i}"] for i in (0, 1, 3)}
    batch, _ = run_batch([3, 2, 1, 0])
    tight, preemptions = run_batch([3, 2, 1, 0], num_pages=9, page_size=4, max_running=4)
    assert preemptions > 0
    for rid in ("r0", "r1", "r3"):
        assert batch[rid] == alone[rid] == tight[rid], rid


def test_seeded_sampling_with_the_fixed_policy_is_reproducible_across_runs_and_batches():
    """With a fixed verification length (no memory or budget pressure) the drafts a seeded request verifies do not
    depend on the batch, and neither do its tokens."""
    sp = SamplingParams(temperature=0.8, max_new_tokens=20, seed=11, ignore_eos=True)
    others = [SamplingParams(temperature=0.5 + 0.2 * i, max_new_tokens=8 + i, seed=i if i % 2 else None,
                             ignore_eos=True) for i in range(3)]

    def run_once(with_others: bool) -> list[int]:
        core = make_core(spec="draft", policy="fixed", max_verify_len=4, draft_model=str(default_model_dir()))
        if with_others:
            for i, p in enumerate(others):
                core.add_request(f"o{i}", PROMPTS[i], p)
        core.add_request("t", PROMPTS[1], sp)
        outs, _ = drive(core)
        assert_all_free(core)
        assert outs["t"][-1].stats.draft_tokens > 0
        return tokens(outs["t"])

    first = run_once(False)
    assert run_once(False) == first == run_once(True)


# ---- the async engine: many streams, cancellations, drain, shutdown -------------------------------------------

def _workload(n: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(5)
    prompts = [rng.choice(PROMPTS) + [rng.randrange(256) for _ in range(rng.randint(0, 6))] for _ in range(n)]
    return prompts, [rng.randint(1, 14) for _ in range(n)]


@pytest.mark.parametrize("policy", ["fixed", "hybridspec"])
def test_many_streams_with_cancellations_at_every_point_are_lossless_and_free_everything(policy):
    """18 concurrent streams on 3 running slots with speculation: some cancelled before they start, after their
    first chunk, mid-stream (task cancel), some leave by closing the generator; the others stream plain greedy
    decoding's tokens; at the end every page, slot and per-request worker state is free."""
    prompts, max_new = _workload(18)
    ref_core = make_core()
    for i, p in enumerate(prompts):
        ref_core.add_request(f"q{i}", p, greedy(max_new[i]))
    ref_outs, _ = drive(ref_core)
    expected = [tokens(ref_outs[f"q{i}"]) for i in range(len(prompts))]

    async def main() -> None:
        core = make_core(expected, prompts, spec="replay", policy=policy, max_verify_len=4, replay_acceptance=0.7,
                         max_running=3, max_step_tokens=16, num_pages=20, page_size=4)
        engine = AsyncEngine(core)
        engine.start()

        async def one(i: int, leave_after: int | None = None) -> tuple[list[int], str | None]:
            got, reason = [], None
            stream = engine.generate(f"c{i}", prompts[i], greedy(max_new[i]))
            chunks = 0
            async for out in stream:
                got += out.new_token_ids
                chunks += 1
                if out.finished:
                    reason = out.finish_reason
                elif leave_after is not None and chunks >= leave_after:
                    await stream.aclose()
                    return got, "left"
            return got, reason

        async def cancelled(i: int, delay: float) -> tuple[list[int], str | None]:
            task = asyncio.create_task(one(i))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return [], "cancelled"

        jobs = []
        for i in range(len(prompts)):
            if i % 6 == 1:
                jobs.append(cancelled(i, 0.0 if i < 9 else 0.03))
            elif i % 6 == 4:
                jobs.append(one(i, leave_after=1 + i % 3))
            else:
                jobs.append(one(i))
        results = await asyncio.gather(*jobs)
        for i, (got, reason) in enumerate(results):
            if reason in ("left", "cancelled"):
                assert got == expected[i][:len(got)]
            else:
                assert (got, reason) == (expected[i], "length"), i
        await engine.wait_idle(10.0)
        await engine.shutdown(shutdown_core=False)  # the engine thread has applied every abort
        assert_all_free(core)
        assert engine.metrics.requests_finished["abort"] >= 3

    run(main(), timeout=60.0)


def test_drain_and_shutdown_end_every_active_stream_and_free_everything():
    """Active speculative streams (more than run at once): drain() lets none finish within its timeout, aborts
    them all (each stream ends with finish_reason "abort"), refuses new requests; shutdown ends the rest."""
    async def main() -> None:
        core = make_core(spec="ngram", policy="hybridspec", max_verify_len=4, max_running=2)
        engine = AsyncEngine(core)
        engine.start()
        ends: dict[int, tuple[str, int]] = {}
        first_chunk = asyncio.Event()

        async def one(i: int) -> None:
            n = 0
            async for out in engine.generate(f"d{i}", PROMPTS[i % 4], greedy(4000)):
                n += len(out.new_token_ids)
                first_chunk.set()
                if out.finished:
                    ends[i] = (out.finish_reason, n)

        tasks = [asyncio.create_task(one(i)) for i in range(5)]
        await asyncio.wait_for(first_chunk.wait(), 20.0)
        assert await engine.drain(0.05) == 5
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        assert sorted(ends) == list(range(5)) and all(reason == "abort" for reason, _ in ends.values())
        with pytest.raises(EngineUnavailable):
            async for _ in engine.generate("late", PROMPTS[0], greedy(2)):
                pass
        await engine.shutdown(shutdown_core=False)
        assert_all_free(core)

        # shutdown without a drain: the streams still in flight end (aborted), none hangs
        engine = AsyncEngine(core)
        engine.start()
        first_chunk.clear()
        ends.clear()
        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.wait_for(first_chunk.wait(), 20.0)
        await engine.shutdown(shutdown_core=False)
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        assert sorted(ends) == [0, 1, 2] and all(reason == "abort" for reason, _ in ends.values())
        assert_all_free(core)

    run(main(), timeout=60.0)



# ---- the Python API (LLM): a failed step, an abort inside a step, several threads ----------------------------

@pytest.fixture(scope="module")
def llm_ngram():
    from engine import LLM

    return LLM(spec="ngram", policy="fixed", max_verify_len=4)


LLM_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]


def _llm_free(llm) -> bool:
    s = llm.engine.stats()
    return s["free_pages"] == s["total_pages"] and s["free_slots"] == s["total_slots"] and not llm.engine.live


def test_llm_step_failure_aborts_the_other_open_streams_instead_of_corrupting_them(llm_ngram):
    """Before: a step that raised (an interrupt, an OOM) after the forward left the other open streams running on
    half-updated state: wrong tokens without speculation, a ValueError from the page table with it."""
    from engine.llm import RequestFailed

    llm = llm_ngram
    p = greedy(20)
    stream = llm.stream(LLM_PROMPT, p)
    first = next(stream).new_token_ids
    real = llm.engine.executor.execute
    calls = []

    def boom(requests):  # the third step of the generate call below fails after its forward
        result = real(requests)
        calls.append(len(requests))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return result

    llm.engine.executor.execute = boom
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([7, 8, 9], p)
    finally:
        llm.engine.executor.execute = real
    # the two steps before the failed one produced the stream's next outputs: handed out, then the failure
    buffered = [t for _ in range(2) for t in next(stream).new_token_ids]
    with pytest.raises(RequestFailed, match=r"^request llm-\d+ was aborted: a step of the engine failed while it ran "
                                            r"\(KeyboardInterrupt"):
        next(stream)
    assert first and buffered and _llm_free(llm)
    alone = llm.generate(LLM_PROMPT, p)[0].token_ids  # the engine serves on, exactly
    assert alone[:len(first) + len(buffered)] == first + buffered and len(alone) == 20 and _llm_free(llm)


def test_llm_stream_collected_inside_a_step_is_aborted_after_the_step(llm_ngram, monkeypatch):
    """Before: a stream abandoned in a reference cycle, finalized by the garbage collector inside another call's
    step, removed its request from the engine mid-step: KeyError in that unrelated call."""
    llm = llm_ngram
    p = greedy(12)
    reference = llm.generate([7, 8, 9], p)[0].token_ids
    stream = llm.stream(LLM_PROMPT, p)
    next(stream)
    real = llm.engine.executor.execute

    def execute_then_collect(requests):
        result = real(requests)
        stream.close()  # what the collector does to an unreachable generator (its finally runs here)
        return result

    monkeypatch.setattr(llm.engine.executor, "execute", execute_then_collect)
    assert llm.generate([7, 8, 9], p)[0].token_ids == reference
    monkeypatch.setattr(llm.engine.executor, "execute", real)
    assert _llm_free(llm)


def test_llm_called_from_several_threads_gives_every_call_its_own_exact_output(llm_ngram):
    """Before: the threads' steps interleaved on one engine: KeyError in every call."""
    import threading

    llm = llm_ngram
    prompts = [[7, 8, 9], LLM_PROMPT, [40, 41, 40, 41], [5] * 6]
    expected = {i: llm.generate(q, greedy(10 + i))[0].token_ids for i, q in enumerate(prompts)}
    got: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for k in range(3):
                if k == 1:  # a stream among the generate calls
                    got[(i, k)] = [t for o in llm.stream(prompts[i], greedy(10 + i)) for t in o.new_token_ids]
                else:
                    got[(i, k)] = llm.generate(prompts[i], greedy(10 + i))[0].token_ids
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == {(i, k): expected[i] for i in range(len(prompts)) for k in range(3)}
    assert _llm_free(llm)
