"""Random-weights model directories (bench/bench_model_dir.py): load_weights fills the model with exactly the
bench model's weights (same logits as build_bench_model), the server serves such a directory, and the
full-vocabulary tokenizer round-trips text and decodes every id up to the top of the 248320-token vocab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.bench_model_dir import (build_vocab_tokenizer, decisive_successor, main, repeat_prompts, tiny_config,
                                   write_bench_model_dir)
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from serving import one_torch_thread, run, serving  # noqa: F401  (fixture)
from workers import bench_model
from workers.bench_model import build_bench_model, qwen36_35b_a3b_config
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.weights import RANDOM_WEIGHTS_FILE, WeightsError, load_weights

pytestmark = pytest.mark.usefixtures("single_thread_torch")

QWEN36_VOCAB = 248320


def prefill_logits(model: HybridModel, ids: list[int]) -> torch.Tensor:
    from workers.batch import ForwardBatch
    from workers.cache import ModelCache

    cache = ModelCache(model.config, num_pages=16, page_size=4, num_slots=2, dtype=torch.float32, device="cpu")
    batch = ForwardBatch.build([ids], [0], [[3, 0, 9, 4, 1, 7, 2, 5]], [1], "cpu")
    return model(batch, cache, torch.arange(len(ids))).float()


def loaded(model_dir: Path) -> HybridModel:
    model = HybridModel(ModelConfig.from_dir(model_dir), torch.float32, "cpu")
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("routing", ["zipf", "uniform"])
def test_random_weights_dir_gives_the_bench_models_weights_and_logits(tmp_path, routing):
    cfg = tiny_config(4)
    d = write_bench_model_dir(tmp_path / "m", routing=routing, seed=3, config=cfg)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", RANDOM_WEIGHTS_FILE, "tokenizer.json"]
    ours = loaded(d)
    ref = build_bench_model(config=cfg, routing=routing, seed=3, dtype=torch.float32, device="cpu")
    ref_params = ref.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, ref_params[name]), name
    for a, b in zip(ours.model.layers, ref.model.layers):
        bias_a, bias_b = getattr(a.mlp, "router_bias", None), getattr(b.mlp, "router_bias", None)
        assert (bias_a is None) == (bias_b is None) == (routing == "uniform")
        assert bias_a is None or torch.equal(bias_a, bias_b)
    ids = torch.randint(0, cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(prefill_logits(ours, ids), prefill_logits(ref, ids))
    other = loaded(write_bench_model_dir(tmp_path / "seed4", routing=routing, seed=4, config=cfg))
    assert not torch.equal(prefill_logits(other, ids), prefill_logits(ours, ids))


def test_marker_errors(tmp_path):
    d = write_bench_model_dir(tmp_path / "m", config=tiny_config(2))
    model = HybridModel(ModelConfig.from_dir(d), torch.float32, "cpu")
    with pytest.raises(WeightsError, match="multi-token-prediction"):
        load_weights(model, d, scope="mtp")
    for marker, what in (({"kind": "trained"}, "kind"), ({"kind": "bench", "routing": "zipf2"}, "routing"),
                         ({"kind": "bench", "seed": "x"}, "seed")):
        (d / RANDOM_WEIGHTS_FILE).write_text(json.dumps(marker))
        with pytest.raises(WeightsError, match=what):
            load_weights(model, d)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        write_bench_model_dir(d, config=tiny_config(2))


def test_served_over_grpc(tmp_path, one_torch_thread):
    from clients.client import GenerationClient
    from engine import LLM

    d = write_bench_model_dir(tmp_path / "m", seed=5, config=tiny_config(2))
    llm = LLM(model=str(d), max_model_len=256)
    tok = llm.tokenizer
    assert tok.eos_token_ids == {tiny_config(2).vocab_size - 1}

    async def main():
        async with serving(llm.engine) as (_, target), GenerationClient(target) as client:
            stats = await client.stats()
            by_text = await client.complete("def f(x):", max_new_tokens=8, ignore_eos=True)
            by_ids = await client.complete([1000, 1001, 7], max_new_tokens=6, ignore_eos=True)
            return stats, by_text, by_ids

    stats, by_text, by_ids = run(main(), timeout=60.0)
    assert stats.vocab_size == 1024
    assert len(by_text.token_ids) == 8 and by_text.finish_reason == "length"
    assert by_text.text == tok.decode(by_text.token_ids)
    assert len(by_ids.token_ids) == 6 and by_ids.text == tok.decode(by_ids.token_ids)


def test_decisive_dir_follows_the_successor_chain(tmp_path, one_torch_thread):
    """With decisive logits the greedy continuation of a repeat prompt is the prompt's own chain (what the GPU
    sweep's n-gram workload relies on), and decisive_successor matches make_logits_decisive_."""
    from engine import LLM
    from scheduler.types import SamplingParams

    if not hasattr(bench_model, "make_logits_decisive_"):
        pytest.skip("workers/bench_model.py has no decisive logits")
    cfg = tiny_config(2)
    prompts_file = tmp_path / "prompts.jsonl"
    assert main(["--out", str(tmp_path / "m"), "--tiny", "--layers", "2", "--seed", "2", "--decisive",
                 "--prompts-out", str(prompts_file), "--num-prompts", "3"]) == 0
    prompts = [json.loads(line)["prompt_token_ids"] for line in prompts_file.read_text().splitlines()]
    assert prompts == repeat_prompts(cfg.vocab_size, 2, 3) and all(len(p) == 128 for p in prompts)
    succ = decisive_successor(cfg.vocab_size, 2).tolist()
    llm = LLM(model=str(tmp_path / "m"), max_model_len=512)
    for prompt in prompts[:2]:
        out = llm.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
        assert out[:20] == prompt[16:36]
        assert out == [succ[t] for t in [prompt[-1], *out[:-1]]]


def test_full_vocab_tokenizer_and_config(tmp_path):
    d = write_bench_model_dir(tmp_path / "full", num_layers=40)
    cfg = ModelConfig.from_dir(d)
    ref = qwen36_35b_a3b_config(40)
    assert cfg.eos_token_ids == [QWEN36_VOCAB - 1]
    ref.eos_token_ids = cfg.eos_token_ids
    assert cfg == ref
    tok = Tokenizer.from_dir(d)
    assert tok.vocab_size == QWEN36_VOCAB and tok.eos_token_ids == {QWEN36_VOCAB - 1}
    for text in ("def fibonacci(n):\n    return n", "héllo wörld 😀 \t\x00", ""):
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    top = list(range(QWEN36_VOCAB - 40, QWEN36_VOCAB))
    assert tok.decode([QWEN36_VOCAB - 2, 256]) == f" t{QWEN36_VOCAB - 2} t256"
    assert tok.decode([QWEN36_VOCAB - 1]) == "" and tok.decode([QWEN36_VOCAB - 1], skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in [*top, 0xF0, 0x9F, 0x98, 0x80, 65]) + detok.flush()
    assert streamed == "".join(f" t{i}" for i in top[:-1]) + "😀A"
    with pytest.raises(ValueError):
        build_vocab_tokenizer(100)
