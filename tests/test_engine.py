"""The in-process engine and Python API on the embedded default model: batching, preemption, stopping,
seeds, validation and the `hybridspec generate` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM, InvalidRequest, SamplingParams
from engine.default_model import DEFAULT_CONFIG, build_default_model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


PROMPTS = ["def fibonacci(n):", "import os\n", "class A:\n    pass", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def test_default_model_is_built_deterministically(tmp_path):
    a, b = build_default_model(tmp_path / "a"), build_default_model(tmp_path / "b")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert json.loads((a / "config.json").read_text())["model_type"] == DEFAULT_CONFIG["model_type"]


def test_batched_generation_equals_each_prompt_alone(llm):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 12 and r.finish_reason == "length" for r in together)
    assert together[0].text == llm.tokenizer.decode(together[0].token_ids)


def test_memory_shortage_preempts_and_resumes_without_changing_tokens(llm):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ample = llm.generate(PROMPTS, params)
    tight = LLM(num_pages=12, page_size=4, max_running=4)  # 48 token slots for 4 requests of 24-37 tokens
    out = tight.generate(PROMPTS, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in ample]
    assert sum(r.stats.preemptions for r in out) > 0
    stats = tight.engine.memory.stats()
    assert stats["used_pages"] == 0 and stats["used_slots"] == 0


def test_chunked_prefill_gives_the_same_tokens(llm):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    chunked = LLM(max_step_tokens=5)
    assert [r.token_ids for r in chunked.generate(PROMPTS, params)] == [
        r.token_ids for r in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("policy", ["budget", "hybridspec"])
def test_learned_policies_plan_beside_a_long_chunked_prefill(llm, policy):
    """Before (stress audit): `budget` failed every step with "token cost table is empty" once its latency model
    had fitted on prefill chunks alone (a long prompt chunked beside a drafting decode), and went on failing for
    every later request: its token-count table learns only decode and verification steps."""
    long = [20 + i % 200 for i in range(1000)]  # ~16 chunks of 64 tokens beside the short request's decode
    prompts = ["a = 1\na = 1\na = 1\na", long]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True), SamplingParams(max_new_tokens=4, ignore_eos=True)]
    spec = LLM(spec="ngram", policy=policy, max_step_tokens=64)
    got = spec.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in llm.generate(prompts, params)]
    assert got[0].stats.draft_tokens > 0
    assert spec.generate(prompts[:1], params[0])[0].finish_reason == "length"  # and the next request too


def test_seed_reproduces_a_sampled_stream_whatever_else_runs(llm):
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=10, seed=42, ignore_eos=True)
    alone = llm.generate(["hello"], p)[0].token_ids
    mixed = llm.generate(["hello", "world", "hello"],
                         [p, SamplingParams(temperature=1.0, max_new_tokens=5, seed=1), p])
    assert mixed[0].token_ids == alone == mixed[2].token_ids
    other = llm.generate(["hello"], SamplingParams(temperature=0.9, max_new_tokens=10, seed=43, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_string_ends_the_request_and_is_cut_from_the_text(llm):
    base = llm.generate(["abc"], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    text = base.text
    start = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    out = llm.generate(["abc"], SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 16


def test_eos_stops_unless_ignored(llm):
    greedy = llm.generate(["x"], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    eos = greedy.token_ids[5]  # make a token the model surely emits the end-of-sequence token
    first = greedy.token_ids.index(eos)
    saved = llm.engine.eos_ids
    llm.engine.eos_ids = {eos}
    try:
        out = llm.generate(["x"], SamplingParams(max_new_tokens=32))[0]
        ignored = llm.generate(["x"], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    finally:
        llm.engine.eos_ids = saved
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: first + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == greedy.token_ids


@pytest.mark.parametrize(
    "prompt, field",
    [("", "prompt"), ([], "prompt"), ([1, 2, 10_000], "prompt_token_ids"), ([-1], "prompt_token_ids"),
     (3.5, "prompt")],
)
def test_bad_prompts_are_rejected_naming_the_field(llm, prompt, field):
    with pytest.raises(InvalidRequest) as err:
        llm.generate([prompt], SamplingParams())
    assert err.value.field == field and field in str(err.value)
    assert llm.engine.memory.stats()["used_slots"] == 0


def test_too_long_request_is_rejected(llm):
    with pytest.raises(InvalidRequest, match="length limit"):
        llm.generate([[1] * 10], SamplingParams(max_new_tokens=8192))


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "tpu"}, "device must be one of"), ({"dtype": "float16"}, "dtype must be one of"),
    ({"policy": "greedy"}, "policy must be one of"), ({"max_verify_len": 0}, "max_verify_len must be"),
    ({"max_verify_len": 17}, "max_verify_len must be"), ({"spec": "eagle"}, "spec must be one of"),
])
def test_bad_engine_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_cli_generate_in_process_streams_text():
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "def f(x):", "--max-new-tokens", "6",
                           "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def f(x):")
    assert "6 tokens, finish_reason=length" in proc.stderr


def test_cli_reports_bad_input_with_the_field():
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "x", "--max-new-tokens", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --max-new-tokens must be between 1 and 8192, got 0" in proc.stderr


def test_a_started_worker_freezes_its_heap_and_later_garbage_is_still_collected(llm):
    """freeze_heap=True (the default on CUDA): build_runner ends with freeze_heap, the start-up's objects leave
    the cyclic GC's generations (a full collection while serving then walks only what serving made), the engine
    still serves the same tokens; off (the default on CPU) nothing is frozen; a reference cycle made before a
    freeze is collected by the next freeze (it unfreezes first)."""
    import gc
    import weakref

    from engine.executor import freeze_heap

    gc.unfreeze()
    LLM(max_running=2)  # CPU default: the caller's heap is left alone
    assert gc.get_freeze_count() == 0
    frozen = LLM(max_running=2, freeze_heap=True)
    assert gc.get_freeze_count() > 0
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    before = llm.generate(["hello"], params)[0].token_ids
    assert len(before) == 4 and frozen.generate(["hello"], params)[0].token_ids == before
    with pytest.raises(ValueError, match="freeze_heap"):
        LLM(freeze_heap="yes")

    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic GC frees it
    alive = weakref.ref(a)
    frozen = freeze_heap()
    assert frozen > 0 and alive() is not None  # still referenced: frozen with the rest
    del a, b
    freeze_heap()
    assert alive() is None and gc.get_freeze_count() > 0
    gc.unfreeze()  # (the other tests' process as it was)
