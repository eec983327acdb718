"""Our HybridModel against Hugging Face transformers' own PyTorch Qwen3-Next / Qwen3.5-MoE (the oracle).

Tiny random checkpoints (tests/checkpoints.py) written with `save_pretrained`, re-randomised so that every
layer matters (checked below), run on CPU in fp32. Logits must agree within 1e-4 * max|logits| in: one-shot
prefill, token-by-token decode, chunked prefill, ragged batches over paged KV / GDN slots, and greedy
generation through `engine.LLM`.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
from pathlib import Path

import pytest
import torch

from workers.batch import ForwardBatch
from workers.cache import AttentionKV, ModelCache

pytestmark = pytest.mark.usefixtures("single_thread_torch")

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["qwen3_next", "qwen35_moe"]
PREFILL_CHECKPOINTS = ["qwen3_next", "qwen35_moe", "qwen3_next_alt", "qwen35_moe_tied"]
REL_TOL = 1e-4
PAGE_SIZE = 4


# ------------------------------------------------------------------------------------------------ helpers
def random_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    err = (ours.float() - ref.float()).abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max |diff| {err:.3g} > {REL_TOL} * max|logits| ({scale:.3g})"


def new_cache(model, num_pages: int = 96, num_slots: int = 4, garbage_seed: int | None = None) -> ModelCache:
    """A cache; with `garbage_seed` every page and slot starts full of noise (stale state of other requests):
    a step may only read the pages and slot of its own request (and a new request's slot is reset)."""
    cache = ModelCache(model.config, num_pages, PAGE_SIZE, num_slots, torch.float32, "cpu")
    if garbage_seed is not None:
        gen = torch.Generator().manual_seed(garbage_seed)
        for layer in cache.layers:
            tensors = (layer.k, layer.v) if isinstance(layer, AttentionKV) else (layer.recurrent, layer.conv)
            for t in tensors:
                t.copy_(torch.randn(t.shape, generator=gen) * 3)
    return cache


class PagePool:
    """Hands out page ids in a shuffled order, so every request's pages are non-contiguous and interleaved."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


class Request:
    """One sequence's bookkeeping: tokens cached so far, its KV pages and its GDN slot."""

    def __init__(self, ids: list[int], slot: int, pool: PagePool):
        self.ids, self.slot, self.pool = ids, slot, pool
        self.cached = 0
        self.pages: list[int] = []

    def piece(self, n: int) -> tuple[list[int], int, list[int], int]:
        """The next `n` tokens as (tokens, context_len, page row, slot), allocating pages as needed."""
        end = self.cached + n
        assert end <= len(self.ids)
        while len(self.pages) * PAGE_SIZE < end:
            self.pages.append(self.pool.take())
        return self.ids[self.cached:end], self.cached, list(self.pages), self.slot


def run_step(model, cache: ModelCache, reqs: list[Request], counts: list[int]) -> list[torch.Tensor]:
    """One ForwardBatch feeding counts[i] new tokens of reqs[i]; returns each request's logits [counts[i], V]
    (every new position). Requests with nothing cached start from a reset slot."""
    pieces = [r.piece(n) for r, n in zip(reqs, counts)]
    cache.reset_slots([r.slot for r in reqs if r.cached == 0])
    batch = ForwardBatch.build([p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces],
                               [p[3] for p in pieces], "cpu")
    logits = model(batch, cache, torch.arange(batch.num_tokens))
    for r, n in zip(reqs, counts):
        r.cached += n
    return list(torch.split(logits.float(), counts))


def run_alone(model, ids: list[int], pieces: list[int] | None = None, slot: int = 0) -> torch.Tensor:
    """`ids` through a fresh cache as one request, in `pieces` (default one shot); logits [len(ids), V]."""
    cache = new_cache(model)
    req = Request(ids, slot, PagePool(cache.num_pages, seed=slot + 17))
    return torch.cat([run_step(model, cache, [req], [n])[0] for n in (pieces or [len(ids)])])


def assert_oracle_is_transformers_pytorch(ckpts=None) -> None:
    """The oracle is transformers' own PyTorch code: no Hugging Face hub `kernels`, no flash-linear-attention
    (`fla`), no causal-conv1d package; every swappable function is the transformers module's own; and our
    top-level `kernels/` package is not mistaken for the hub's `kernels`."""
    from transformers.utils.import_utils import is_kernels_available

    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe_mod
    import transformers.models.qwen3_next.modeling_qwen3_next as next_mod

    assert not is_kernels_available(), "transformers would take Hugging Face hub kernels"
    assert importlib.util.find_spec("fla") is None, "flash-linear-attention is installed"
    assert importlib.util.find_spec("causal_conv1d") is None, "causal-conv1d is installed"
    ours = importlib.util.find_spec("kernels")
    if ours is not None:  # `kernels` on sys.path is this repository's package, never the hub's
        assert Path(ours.origin).resolve().is_relative_to(ROOT), ours.origin
    for mod in (next_mod, moe_mod):
        for fname in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                      "causal_conv1d_update", "l2norm"):
            fn = getattr(mod, fname)
            assert fn.__module__ == mod.__name__, (fname, fn.__module__)
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)  # what the fallback wrapper calls
            assert impl.__module__ == mod.__name__ and impl.__name__ == fname, (fname, impl)
    if ckpts is not None:
        for name, mod in (("qwen3_next", next_mod), ("qwen35_moe", moe_mod)):
            hf = ckpts.hf(name)
            assert type(hf).__module__ == mod.__name__
            assert hf.config._attn_implementation == "eager"
            for layer in hf.model.layers:
                for sub in (getattr(layer, "linear_attn", None), layer.mlp, layer.input_layernorm):
                    if sub is not None:
                        assert type(sub).forward.__module__ == mod.__name__, type(sub)


# ------------------------------------------------------------------------------------------------- oracle
def test_oracle_is_transformers_own_pytorch_implementation(ckpts):
    assert_oracle_is_transformers_pytorch(ckpts)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen35_moe", "qwen3_next_alt"])
def test_every_layer_of_the_random_checkpoints_changes_the_logits(ckpts, name):
    """Zeroing any one token mixer or MLP/MoE moves the logits by > 5% of their range, and routing varies from
    token to token: no layer is negligible, so none can be wrong unnoticed."""
    hf = ckpts.hf(name)
    ids = torch.tensor([random_ids(70, seed=5)])
    with torch.no_grad():
        ref = hf(ids).logits[0]
        scale = ref.abs().max()
        for i, layer in enumerate(hf.model.layers):
            mixer = (layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj).weight
            mlp = layer.mlp.experts.down_proj if hasattr(layer.mlp, "experts") else layer.mlp.down_proj.weight
            for part, w in (("token mixer", mixer), ("mlp", mlp)):
                saved = w.clone()
                try:
                    w.zero_()
                    change = ((hf(ids).logits[0] - ref).abs().max() / scale).item()
                finally:
                    w.copy_(saved)
                assert change > 0.05, f"layer {i} {part}: zeroing it changes the logits by only {change:.3g}"
            if hasattr(layer.mlp, "gate"):
                seen = {}

                def keep_ids(module, args, out):
                    seen["ids"] = out[2]  # (router logits, top-k weights, top-k ids); returns None: output kept

                hook = layer.mlp.gate.register_forward_hook(keep_ids)
                try:
                    hf(ids)
                finally:
                    hook.remove()
                choices = {tuple(sorted(row)) for row in seen["ids"].tolist()}
                assert len(choices) >= 8, f"layer {i}: only {len(choices)} distinct expert sets over 70 tokens"
                assert len(set(seen["ids"].flatten().tolist())) == hf.config.num_experts


@pytest.mark.parametrize("name", ARCHS)
def test_gdn_state_of_the_random_checkpoints_carries_the_first_token_past_one_chunk(ckpts, name):
    """With attention switched off, changing token 0 still moves the logits at positions 64..69: the GDN state
    has a memory longer than one 64-token chunk, so a wrong chunk-to-chunk carry would show."""
    hf = ckpts.hf(name)
    ids = torch.tensor([random_ids(70, seed=5)])
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 128
    attn = [layer.self_attn.o_proj.weight for layer in hf.model.layers if hasattr(layer, "self_attn")]
    saved = [w.clone() for w in attn]
    with torch.no_grad():
        try:
            for w in attn:
                w.zero_()
            a, b = hf(ids).logits[0], hf(other).logits[0]
        finally:
            for w, s in zip(attn, saved):
                w.copy_(s)
    change = ((a[64:] - b[64:]).abs().max() / a.abs().max()).item()
    assert change > 2e-3, f"token 0 moves positions 64.. by only {change:.3g} of the logit range"


# ------------------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("length", [1, 20, 70])
@pytest.mark.parametrize("name", PREFILL_CHECKPOINTS)
def test_prefill_logits_at_every_position_match_transformers(ckpts, name, length):
    """One-shot prefill of 1 token, 20 tokens (GDN recurrent form) and 70 tokens (chunked form, two chunks)."""
    assert_oracle_is_transformers_pytorch()
    ids = random_ids(length, seed=100 + length)
    ours = run_alone(ckpts.ours(name), ids)
    assert_logits_close(ours, ckpts.hf_logits(name, ids), f"{name} prefill of {length}")


# ------------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("prefill, steps", [(6, 30), (70, 4)])
@pytest.mark.parametrize("name", ARCHS)
def test_token_by_token_decode_matches_transformers_at_every_step(ckpts, name, prefill, steps):
    """Prefill, then one token per step (context_len = tokens so far), crossing KV page boundaries; each step's
    logits equal transformers' logits at that position of the whole sequence."""
    model = ckpts.ours(name)
    ids = random_ids(prefill + steps, seed=200 + prefill)
    ref = ckpts.hf_logits(name, ids)
    cache = new_cache(model, garbage_seed=1)
    req = Request(ids, slot=2, pool=PagePool(cache.num_pages, seed=3))
    out = run_step(model, cache, [req], [prefill])[0]
    assert_logits_close(out, ref[:prefill], f"{name} prefill of {prefill}")
    for t in range(prefill, prefill + steps):
        out = run_step(model, cache, [req], [1])[0]
        assert_logits_close(out, ref[t:t + 1], f"{name} decode step at position {t}")


@pytest.mark.parametrize("name", ARCHS)
def test_decode_matches_transformers_own_cached_decode(ckpts, name):
    """The same against transformers' incremental path (its DynamicCache with conv and recurrent states)."""
    hf = ckpts.hf(name)
    model = ckpts.ours(name)
    ids = random_ids(16, seed=300)
    prompt = 9
    cache = new_cache(model)
    req = Request(ids, slot=1, pool=PagePool(cache.num_pages, seed=4))
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prompt]]), use_cache=True)
        hf_cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        ours = run_step(model, cache, [req], [prompt])[0]
        assert_logits_close(ours[-1:], out.logits[0, -1:], f"{name} prefill")
        for t in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[t]]]), cache=hf_cache, use_cache=True)
            hf_cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            ours = run_step(model, cache, [req], [1])[0]
            assert_logits_close(ours, out.logits[0], f"{name} cached decode at position {t}")


# ---------------------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("pieces", [(5, 1, 17, 40, 7), (33, 2, 35)])
@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_in_uneven_pieces_equals_one_shot_prefill(ckpts, name, pieces):
    """Pieces below and above the 32-token switch to the chunked GDN form, starting mid-page and mid-chunk."""
    model = ckpts.ours(name)
    ids = random_ids(sum(pieces), seed=400 + len(pieces))
    one_shot = run_alone(model, ids)
    chunked = run_alone(model, ids, list(pieces), slot=3)
    assert_logits_close(chunked, one_shot, f"{name} prefill in pieces {pieces} vs one shot")
    assert_logits_close(chunked, ckpts.hf_logits(name, ids), f"{name} prefill in pieces {pieces} vs transformers")


# ----------------------------------------------------------------------------------------- ragged batches
@pytest.mark.parametrize("name", ARCHS)
def test_ragged_batch_of_three_matches_each_request_alone(ckpts, name):
    """Three prompts (3, 17, 45 tokens) in one ForwardBatch, each with its own slot and interleaved,
    non-contiguous pages of 4 tokens, in a cache full of stale noise; then mixed steps: decode 1 / feed 5 /
    decode 1 (recurrent GDN form), and decode / decode / feed 2 next to a new 38-token prompt (chunked form
    starting from the others' states)."""
    model = ckpts.ours(name)
    cache = new_cache(model, garbage_seed=7)
    pool = PagePool(cache.num_pages, seed=8)
    lens = [3, 17, 45]
    seqs = [random_ids(n + 8, seed=500 + n) for n in lens]
    reqs = [Request(s, slot, pool) for s, slot in zip(seqs, [3, 0, 2])]

    first = run_step(model, cache, reqs, lens)
    for r, n, out in zip(reqs, lens, first):
        alone = run_alone(model, r.ids[:n])
        assert_logits_close(out, alone, f"{name} request of {n} in the batch vs alone")
        assert_logits_close(out, ckpts.hf_logits(name, r.ids[:n]), f"{name} request of {n} vs transformers")
    assert len({p for r in reqs for p in r.pages}) == sum(len(r.pages) for r in reqs)

    def check(outs, counts, what):
        for r, n, out in zip(reqs, counts, outs):
            ref = ckpts.hf_logits(name, r.ids[:r.cached])[r.cached - n:r.cached]
            assert_logits_close(out, ref, f"{name} {what}: request at {r.cached - n}+{n}")

    counts = [1, 5, 1]
    check(run_step(model, cache, reqs, counts), counts, "mixed step 1/5/1")

    newcomer = Request(random_ids(38, seed=600), slot=1, pool=pool)
    reqs.append(newcomer)
    counts = [1, 1, 2, 38]
    check(run_step(model, cache, reqs, counts), counts, "mixed step 1/1/2 + new prompt of 38")


# ---------------------------------------------------------------------------------------- generation (LLM)
def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    assert hf.generation_config.eos_token_id is None and hf.config.eos_token_id is None  # nothing stops it early
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == max_new_tokens
    return new


@pytest.fixture(scope="module")
def llms(ckpts):
    from engine import LLM

    made = {}

    def get(name):
        if name not in made:
            made[name] = LLM(model=str(ckpts.path(name)))
        return made[name]

    return get


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_generate_matches_transformers_generate(ckpts, llms, name):
    from engine import SamplingParams

    prompt = random_ids(20, seed=700)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    got = llms(name).generate([prompt], params)[0].token_ids
    assert got == hf_greedy(ckpts.hf(name), prompt, 16)


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_generate_of_prompts_of_different_lengths_in_one_call_matches_transformers(ckpts, llms, name):
    from engine import SamplingParams

    prompts = [random_ids(n, seed=800 + n) for n in (3, 17, 45, 70)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    results = llms(name).generate(prompts, params)
    assert len(results) == len(prompts)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(ckpts.hf(name), prompt, 16), f"prompt of {len(prompt)} tokens"
