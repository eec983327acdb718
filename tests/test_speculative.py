"""Speculative decoding is lossless: greedy output with any drafter and policy equals greedy output without
speculation, token for token (fp32); sampled output follows the same distribution."""

from __future__ import annotations

import gc
import json
import math
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_CONFIG, default_model_dir
from engine.tokenizer import write_byte_tokenizer
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.random_init import init_random_
from workers.weights import load_weights, save_weights

# 9 concurrent requests of different prompt and output lengths, some with repetition for the n-gram drafter
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\nimport os\nimport sys\n",
    "x",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4],
    "class A:\n    def __init__(self):\n        self.a = 1\n",
    "abcabcabcabc",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    [200] * 40,
]
MAX_NEW = [24, 17, 30, 9, 26, 12, 21, 15, 28]


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM()
    return [r.token_ids for r in llm.generate(PROMPTS, [params(n) for n in MAX_NEW])]


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory) -> Path:
    """A copy of the default model with noisy weights: its drafts are accepted only sometimes."""
    src = default_model_dir()
    out = tmp_path_factory.mktemp("perturbed")
    cfg = ModelConfig.from_dir(src)
    model = HybridModel(cfg)
    load_weights(model, src)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.6 * p.std() * torch.randn(p.shape, generator=gen) if p.numel() > 1 else 0.0)
    save_weights(model, out)
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return out


def run(llm: LLM) -> tuple[list[list[int]], list]:
    results = llm.generate(PROMPTS, [params(n) for n in MAX_NEW])
    stats = llm.engine.memory.stats()
    assert stats["used_pages"] == 0 and stats["used_slots"] == 0
    return [r.token_ids for r in results], [r.stats for r in results]


def test_draft_model_equal_to_target_accepts_everything_and_is_lossless(reference):
    tokens, stats = run(LLM(spec="draft", policy="fixed", max_verify_len=5, draft_model=str(default_model_dir())))
    assert tokens == reference
    assert all(s.accepted_tokens == s.draft_tokens > 0 for s in stats)
    assert sum(s.verify_steps for s in stats) < sum(MAX_NEW) / 3  # several tokens per verification


def test_perturbed_draft_model_is_partly_accepted_and_lossless(reference, perturbed_dir):
    tokens, stats = run(LLM(spec="draft", policy="fixed", max_verify_len=4, draft_model=str(perturbed_dir)))
    assert tokens == reference
    drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    assert 0 < accepted < drafted


def test_ngram_drafter_is_lossless(reference):
    tokens, stats = run(LLM(spec="ngram", policy="fixed", max_verify_len=8))
    assert tokens == reference
    assert sum(s.draft_tokens for s in stats) > 0


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 1.0])
def test_replay_drafter_random_acceptance_patterns_are_lossless(reference, acceptance):
    llm = LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=acceptance, max_step_tokens=24)
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:  # only some requests draft: mixed steps
        llm.set_replay_reference(prompt, ref)
    tokens, stats = run(llm)
    assert tokens == reference
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    assert drafted > 0
    assert all(s.draft_tokens == 0 for s in stats[1::2])  # requests without a reference never drafted
    if acceptance == 1.0:
        assert accepted == drafted
    elif acceptance == 0.0:
        assert accepted == 0
    else:
        assert 0 < accepted < drafted


def test_requests_joining_mid_stream_with_chunked_prefill_are_lossless(reference):
    """A small step budget: long prompts are prefilled in chunks while other requests verify drafts."""
    llm = LLM(spec="draft", policy="fixed", max_verify_len=3, draft_model=str(default_model_dir()),
              max_step_tokens=7)
    tokens, _ = run(llm)
    assert tokens == reference


def test_ar_policy_never_drafts(reference):
    tokens, stats = run(LLM(spec="ngram", policy="ar"))
    assert tokens == reference and all(s.draft_tokens == 0 for s in stats)


# ---- sampling: the distribution of the first two tokens ------------------------------------------------

TINY_VOCAB = 12


def _tiny_dir(root: Path, seed: int) -> Path:
    cfg = dict(DEFAULT_CONFIG, vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"], head_dim=8, linear_key_head_dim=8,
               linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, eos_token_id=None)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    save_weights(init_random_(HybridModel(ModelConfig.from_dict(cfg)), seed, matrix_gain=2.0), root)
    write_byte_tokenizer(root)
    return root


def _exact_pair_distribution(model_dir: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t1, t2) from the model itself, [V, V]."""
    llm = LLM(model=str(model_dir))
    runner = llm.engine.executor.runner
    from workers.batch import ForwardBatch

    probs = torch.zeros(TINY_VOCAB, TINY_VOCAB, dtype=torch.float64)
    cache = runner.cache
    for t1 in range(TINY_VOCAB):
        seq = prompt + [t1]
        cache.reset_slots([0])
        batch = ForwardBatch.build([seq], [0], [list(range(8))], [0], "cpu")
        logits = runner.model(batch, cache, torch.arange(len(seq) - 2, len(seq)))
        p = torch.softmax(logits.double() / temperature, dim=-1)
        probs[t1] = p[0, t1] * p[1]
    return probs


def _chi_square_p(observed: Counter, expected: torch.Tensor, n: int, keys: list | None = None) -> float:
    """Goodness of fit with cells of expected count < 5 pooled (`keys`: the observed counts' key of each flattened
    expected cell; default its index)."""
    exp = (expected.flatten() * n).tolist()
    obs = [observed.get(i if keys is None else keys[i], 0) for i in range(len(exp))]
    big = [i for i, e in enumerate(exp) if e >= 5]
    chi2 = sum((obs[i] - exp[i]) ** 2 / exp[i] for i in big)
    rest_e = sum(e for i, e in enumerate(exp) if i not in set(big))
    rest_o = sum(o for i, o in enumerate(obs) if i not in set(big))
    dof = len(big) - 1
    if rest_e > 0:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


def test_sampled_first_two_tokens_follow_the_target_distribution_with_speculation(tmp_path):
    target, draft = _tiny_dir(tmp_path / "target", 11), _tiny_dir(tmp_path / "draft", 12)
    prompt, temperature, n = [1, 2, 3], 1.0, 3000
    expected = _exact_pair_distribution(target, prompt, temperature)
    # 3 tokens: the first comes from the prefill, the second from a verification of one draft
    sp = [SamplingParams(temperature=temperature, max_new_tokens=3, seed=i) for i in range(n)]
    unseeded = [SamplingParams(temperature=temperature, max_new_tokens=3)] * n
    pvalues = {}
    # seeded requests take the keyed path (a draft counts iff it equals the keyed target draw); unseeded ones the
    # rejection rule ("draft-rejection", under the global RNG)
    for name, kwargs in {"off": {}, "draft": {"spec": "draft", "policy": "fixed", "draft_model": str(draft)},
                         "draft-rejection": {"spec": "draft", "policy": "fixed", "draft_model": str(draft)},
                         "ngram": {"spec": "ngram", "policy": "fixed"}}.items():
        llm = LLM(model=str(target), max_verify_len=1, max_running=256, **kwargs)
        torch.manual_seed(5)
        out = llm.generate([prompt] * n, unseeded if name == "draft-rejection" else sp)
        pairs = Counter(r.token_ids[0] * TINY_VOCAB + r.token_ids[1] for r in out)
        pvalues[name] = _chi_square_p(pairs, expected, n)
        if name.startswith("draft"):
            stats = [r.stats for r in out]
            drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
            assert 0 < accepted < drafted  # the rule really ran, both ways
    assert all(p > 0.01 for p in pvalues.values()), pvalues
    # power: a slightly wrong temperature is detected
    wrong = _exact_pair_distribution(target, prompt, 1.3)
    llm = LLM(model=str(target), max_running=256)
    out = llm.generate([prompt] * n, sp)
    pairs = Counter(r.token_ids[0] * TINY_VOCAB + r.token_ids[1] for r in out)
    assert _chi_square_p(pairs, wrong, n) < 0.01
    assert math.isfinite(pvalues["off"])


def test_a_sampled_drafts_confidence_does_not_depend_on_what_was_drawn():
    """Speculative sampling is exact only if whether a draft is verified does not depend on that draft: an unseeded
    sampled row's confidence is a statistic of its distribution (max q), the same whatever its generator draws, and
    its block carries its first draft's confidence at every position (later positions' q depend on earlier draws);
    greedy and seeded rows keep q(d) per draft (their drafts are functions of the context and the seed, and a
    seeded request's output is its keyed draws whatever is verified)."""
    from workers.drafters import DraftRequest, draw_independent, sample_drafts

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 2.0
    greedy, hot, seeded = SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=7)
    drawn, confs = set(), set()
    for g in range(20):
        reqs = [DraftRequest(f"r{i}", [1, 2, 3], 2, [], 0, 4, p, torch.Generator().manual_seed(g))
                for i, p in enumerate((greedy, hot, seeded))]
        toks, dists, conf = sample_drafts(logits, reqs)
        drawn.add(toks[1])
        confs.add(conf[1])
        assert dists[0] is None and dists[1] is not None
        assert conf[1] == pytest.approx(float(dists[1].max()))
        assert conf[0] == pytest.approx(float(torch.softmax(logits[0], -1).max()))
        assert conf[2] == pytest.approx(float(dists[2][toks[2]]))  # seeded: its keyed draw's q(d)
    assert len(drawn) > 3 and len(confs) == 1  # many draws, one confidence
    assert draw_independent([0.9, 0.2, 0.5], sampled=True) == [0.9, 0.9, 0.9]
    assert draw_independent([0.9, 0.2, 0.5], sampled=False) == [0.9, 0.2, 0.5]


def _exact_prefix_distribution(model_dir: Path, prompt: list[int], n: int, temperature: float) -> dict:
    """P(t_1 .. t_n) from the model itself: {token tuple: probability}."""
    llm = LLM(model=str(model_dir))
    runner = llm.engine.executor.runner
    from workers.batch import ForwardBatch

    def next_probs(seq):
        runner.cache.reset_slots([0])
        batch = ForwardBatch.build([seq], [0], [list(range(8))], [0], "cpu")
        logits = runner.model(batch, runner.cache, torch.tensor([len(seq) - 1]))[0]
        return torch.softmax(logits.double() / temperature, dim=-1).tolist()

    out = {(): 1.0}
    for _ in range(n):
        out = {pre + (t,): pr * q for pre, pr in out.items()
               for t, q in enumerate(next_probs(prompt + list(pre)))}
    return out


def test_budget_with_a_sampling_draft_model_follows_the_target_distribution(tmp_path):
    """A steep token cost makes budget verify only some drafts. When it chose them by each sampled draft's own
    q(d), the drafts it kept were the ones the drafter liked, and the output leaned towards them (tokens 1..3 of
    6000 unseeded samples: p = 5e-38 against the exact law). With confidences
    that do not depend on the draws (drafters.draw_independent) the output follows the target."""
    from scheduler.latency_model import TokenCostTable

    target = _tiny_dir(tmp_path / "target", 11)
    draft = tmp_path / "flat"  # the target with its LM head at half scale: a flatter q, the same argmax
    model = HybridModel(ModelConfig.from_dir(target))
    load_weights(model, target)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    draft.mkdir()
    save_weights(model, draft)
    for name in ("config.json", "tokenizer.json"):
        (draft / name).write_bytes((target / name).read_bytes())
    prompt, n = [1, 2, 3], 6000
    exact = _exact_prefix_distribution(target, prompt, 3, 1.0)
    llm = LLM(model=str(target), spec="draft", policy="budget", max_verify_len=3, draft_model=str(draft),
              max_running=256)
    torch.manual_seed(3)
    llm.generate([prompt] * 512, SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True))  # warm-up
    policy = llm.engine.executor.runner.policy
    assert policy.warm()
    steep = TokenCostTable([1, 8192], [1.0, 1.0 + 8191 * 0.006])  # ~6 us a token: drafts must earn their place
    steep.observe = lambda *a, **k: None
    policy.token_costs = steep
    torch.manual_seed(11)
    out = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    drafted = sum(r.stats.draft_tokens for r in out)
    assert 0 < drafted < 3 * n  # (up to 3 drafts a request after the prefill's token: some were left out)
    observed = Counter(tuple(r.token_ids[:3]) for r in out)
    keys = sorted(exact)
    p = _chi_square_p(observed, torch.tensor([[exact[k] for k in keys]]), n, keys)
    assert p > 1e-3, p


@pytest.mark.parametrize("spec", ["draft", "replay"])
def test_unseeded_sampled_blocks_are_planned_without_their_draws_and_get_no_extra_token(perturbed_dir, monkeypatch,
                                                                                        spec):
    """Through the engine (hybridspec, extra tokens sent wherever allowed): an unseeded sampled request's block
    reaches the plan with one confidence for every draft and is never offered the router correction's extra token
    (whose verification would follow the drawn draft's experts); greedy requests still get extra tokens and
    per-draft confidences. The replay drafter draws its drafts too (right or wrong): with beta confidences, which
    follow the draw's p, a sampled request's plan reads the mean acceptance."""
    _send_extra_tokens_everywhere(monkeypatch)
    import workers.policy

    seen = []
    extra = workers.policy.LengthPolicy.extra_tokens
    lengths = workers.policy.LengthPolicy.lengths

    def spy_lengths(self, drafter, caps, confidences, *rest):
        seen.append(("plan", [list(c) for c in confidences]))
        return lengths(self, drafter, caps, confidences, *rest)

    def spy_extra(self, lens, caps):
        seen.append(("extra", list(lens), list(caps)))
        return extra(self, lens, caps)
    monkeypatch.setattr(workers.policy.LengthPolicy, "lengths", spy_lengths)
    monkeypatch.setattr(workers.policy.LengthPolicy, "extra_tokens", spy_extra)
    prompts = ["abcabcabcabc", "The quick brown fox"]
    params_ = [SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True),
               SamplingParams(max_new_tokens=12, ignore_eos=True)]
    if spec == "draft":
        llm = LLM(spec="draft", policy="hybridspec", max_verify_len=4, draft_model=str(perturbed_dir))
    else:  # (a near-greedy temperature: the replay drafter proposes only while the output follows its reference)
        params_[0] = SamplingParams(temperature=0.02, max_new_tokens=12, ignore_eos=True)
        llm = LLM(spec="replay", policy="hybridspec", max_verify_len=4, replay_acceptance=0.7)
        llm.engine.executor.runner.drafter.confidence = "beta"
        reference = LLM().generate(prompts, [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 2)
        for prompt, ref in zip(prompts, reference):
            llm.set_replay_reference(prompt, ref.token_ids)
    torch.manual_seed(0)
    out = llm.generate(prompts, params_)
    assert all(len(r.token_ids) == 12 for r in out)
    plans = [c for kind, c in ((e[0], e[1]) for e in seen) if kind == "plan"]
    extras = [(e[1], e[2]) for e in seen if e[0] == "extra"]
    both = [(c, x) for c, x in zip(plans, extras) if len(c) == 2 and c[0] and c[1]]
    assert both, "both requests drafted in one step"
    for confs, (lens, caps) in both:
        assert len(set(confs[0])) == 1  # the sampled request: one confidence for its block
        assert spec == "draft" or confs[0][0] == 0.7
        assert caps[0] == lens[0]  # no extra token on offer
        assert caps[1] > lens[1]  # the greedy one: below its cap, an extra token on offer
    assert any(len(set(c[1])) > 1 for c, _ in both)  # greedy drafts keep their own confidences
    assert sum(s.accepted_tokens for s in (r.stats for r in out)) > 0


@pytest.mark.parametrize("policy", ["budget", "hybridspec"])
def test_learned_policies_are_lossless_after_warm_up(reference, policy):
    """The latency model warms up on the first steps, then the planner (budget or hybridspec with the router
    correction's extra token) picks the lengths; tokens stay identical."""
    llm = LLM(spec="replay", policy=policy, max_verify_len=6, replay_acceptance=0.7)
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    tokens, stats = run(llm)
    assert tokens == reference
    runner_policy = llm.engine.executor.runner.policy
    assert runner_policy.warm()  # the learned path really ran
    assert sum(s.draft_tokens for s in stats) > 0


def test_router_correction_keeps_extra_tokens_only_when_their_experts_are_covered():
    from kernels.moe import router_correction_ref

    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [4, 5], [3, 2]])  # rows 2 and 3 and 4 are extra tokens
    extra = torch.tensor([False, False, True, True, True])
    mask = router_correction_ref(ids, extra, num_experts=8)
    assert mask.tolist() == [True, True, True, False, True]


@pytest.mark.parametrize("spec, policy", [("draft", "fixed"), ("replay", "hybridspec"), ("ngram", "budget")])
def test_speculation_under_memory_pressure_preempts_and_stays_lossless(reference, spec, policy):
    """A pool too small for every request's drafts: caps shrink, the youngest requests are preempted and
    recomputed (their drafter state forgotten), and the tokens still equal plain greedy decoding."""
    kwargs = {"draft_model": str(default_model_dir())} if spec == "draft" else {}
    llm = LLM(spec=spec, policy=policy, max_verify_len=6, num_pages=20, page_size=4, max_running=9, **kwargs)
    if spec == "replay":
        for prompt, ref in zip(PROMPTS, reference):
            llm.set_replay_reference(prompt, ref)
    results = llm.generate(PROMPTS, [params(n) for n in MAX_NEW])
    assert [r.token_ids for r in results] == reference
    assert sum(r.stats.preemptions for r in results) > 0
    assert llm.engine.memory.stats()["used_pages"] == 0 and llm.engine.memory.stats()["used_slots"] == 0


@pytest.mark.parametrize("spec, policy", [("ngram", "hybridspec"), ("draft", "budget"), ("draft", "fixed")])
def test_seeded_sampling_gives_the_same_tokens_with_or_without_speculation(perturbed_dir, spec, policy):
    """A seeded sampling request's n-th token is the keyed draw of the target at that index: speculation (any
    drafter, any policy, any lengths), the batch around it and memory pressure leave its tokens exactly those of
    plain decoding with the same seed. (Before: the request's one random stream was consumed in the order its
    blocks used it, so budget/hybridspec gave other tokens in another batch.)"""
    sp = [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=n, seed=100 + i, ignore_eos=True)
          for i, n in enumerate(MAX_NEW)]
    plain = [r.token_ids for r in LLM().generate(PROMPTS, sp)]
    kwargs = {"draft_model": str(perturbed_dir)} if spec == "draft" else {}
    llm = LLM(spec=spec, policy=policy, max_verify_len=6, num_pages=24, page_size=4, max_running=9, **kwargs)
    results = llm.generate(PROMPTS, sp)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.draft_tokens for r in results) > 0
    alone = llm.generate(PROMPTS[3], sp[3])[0].token_ids  # the same request alone
    assert alone == plain[3]


def test_seeded_sampling_with_a_draft_model_is_reproducible(perturbed_dir):
    """Draft tokens come from the request's own seeded stream, not the global RNG."""
    p = SamplingParams(temperature=1.0, max_new_tokens=20, seed=123, ignore_eos=True)
    llm = LLM(spec="draft", policy="fixed", max_verify_len=3, draft_model=str(perturbed_dir))
    torch.manual_seed(1)
    first = llm.generate(["hello world"], p)[0].token_ids
    torch.manual_seed(2)
    second = llm.generate(["hello world", "other"], [p, SamplingParams(temperature=1.0, max_new_tokens=9)])[0]
    assert second.token_ids == first


def with_static_graphs(llm: LLM) -> LLM:
    """Steps without a prefill chunk go through the CUDA-graph path's padded static batches (run eagerly here,
    as on CPU there is nothing to capture): the same buckets, padding rows and masks as on the GPU."""
    engine = llm.engine
    width = -(-engine.max_model_len // engine.config.page_size)
    runner = engine.executor.runner
    assert runner.enable_graphs(engine.config.max_running, width, capture=False) is None
    if hasattr(runner.drafter, "enable_graphs"):  # the draft model's steps too
        runner.drafter.enable_graphs(engine.config.max_running, width, engine.config.max_verify_len + 1,
                                     capture=False)
    return llm


def test_graph_path_rolls_back_the_draft_model_on_plain_steps(reference):
    """When a step drafts but verifies nothing (L = 0 everywhere) it is a plain decode graph; the draft model
    must still roll back its proposals there (else its state drifts and acceptance collapses)."""
    llm = with_static_graphs(LLM(spec="draft", policy="fixed", max_verify_len=4, draft_model=str(default_model_dir())))
    runner = llm.engine.executor.runner
    calls = {"n": 0}
    plan = runner.policy.lengths

    def every_other_step_plain(*args, **kwargs):
        calls["n"] += 1
        lengths = plan(*args, **kwargs)
        return [0] * len(lengths) if calls["n"] % 2 else lengths

    runner.policy.lengths = every_other_step_plain
    tokens, stats = run(llm)
    assert tokens == reference
    assert calls["n"] > 2
    assert all(s.accepted_tokens == s.draft_tokens for s in stats)  # draft = target: nothing ever rejected
    assert runner.step_graphs().graphs  # the graph path really ran
    assert runner.drafter.graphs.graphs  # and the draft model's


def _send_extra_tokens_everywhere(monkeypatch) -> None:
    """hybridspec verifies half of each request's drafts and sends the extra token to every request below its cap,
    in batches of any size (the mechanism under test, not the plan or the rule)."""
    import workers.policy
    import workers.runner

    monkeypatch.setattr(workers.policy, "EXTRA_FROM", 1)
    monkeypatch.setattr(workers.runner, "EXTRA_FROM", 1)
    monkeypatch.setattr(workers.policy.LengthPolicy, "lengths", lambda self, drafter, caps, confidences, *_:
                        [min(c, len(conf)) // 2 for c, conf in zip(caps, confidences)])
    monkeypatch.setattr(workers.policy.LengthPolicy, "extra_tokens",
                        lambda self, lengths, caps: {i for i, (n, c) in enumerate(zip(lengths, caps)) if n < c})


@pytest.mark.parametrize("policy, acceptance", [("fixed", 0.6), ("hybridspec", 0.7)])
def test_graph_path_verification_is_lossless(reference, policy, acceptance, monkeypatch):
    """Verification steps in graph buckets (padding requests, padding rows masked out of the MoE, the router
    correction's extra token, the commit as its own graph) give exactly the eager tokens. hybridspec verifies half
    of each request's drafts and sends the extra token to every request below its cap here, in batches of any size
    (its plan, rule and workers.policy.EXTRA_FROM would send few or none at this model's CPU-measured costs): the
    mechanism is what is under test."""
    if policy == "hybridspec":
        _send_extra_tokens_everywhere(monkeypatch)
    monkeypatch.setenv("HYBRIDSPEC_BLOCK_BUCKETS", "3")
    llm = with_static_graphs(LLM(spec="replay", policy=policy, max_verify_len=6, replay_acceptance=acceptance))
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:  # mixed steps: some requests never draft
        llm.set_replay_reference(prompt, ref)
    tokens, stats = run(llm)
    assert tokens == reference
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    graphs = llm.engine.executor.runner.step_graphs()
    # plain decode and verification buckets both ran, verification in the block bucket of 3 tokens a request
    # (its kernels' hint: padding requests in blocks of at most 3) and in the set's own block (7)
    assert {k.max_block for k in graphs.graphs} == {1, 3, 7}
    if policy == "hybridspec":  # plain buckets skip the router correction and the routing counts
        for key, g in graphs.graphs.items():
            assert g.plain == (key.max_block == 1) and g.corrects != g.plain
            assert (g.moe.token_mask is g.moe.row_mask) == g.plain and bool(g.moe.expert_counts) != g.plain
        assert sum(sent for _, sent in llm.engine.executor.runner.policy.extra_keep.values()) > 0  # extra tokens ran


def test_the_greedy_argmax_is_launched_before_the_router_correction_is_read(reference, monkeypatch):
    """With extra tokens sent, the runner launches the greedy rows' argmax before it reads the router correction's
    token mask back: one wait for the forward and the argmax together (launched after that read, the argmax ran
    on an idle device and was waited for again). Tokens stay identical."""
    _send_extra_tokens_everywhere(monkeypatch)
    llm = with_static_graphs(LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7))
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    runner = llm.engine.executor.runner
    steps: list[list[str]] = []  # per step, after its forward: argmax / mask read / choices read, in order
    argmaxed: list[torch.Tensor] = []
    real_argmax, real_tolist, real_flush = torch.Tensor.argmax, torch.Tensor.tolist, runner.flush_learning

    def flush(fold: bool = True) -> None:
        if not fold:  # (inside a step, right after its forward's launch)
            steps.append([])
        real_flush(fold)

    def argmax(self, *args, **kwargs):
        out = real_argmax(self, *args, **kwargs)
        if steps and self.dim() == 2:
            argmaxed.append(out)
            steps[-1].append("argmax")
        return out

    def tolist(self):
        if steps and self.dtype == torch.bool:
            steps[-1].append("mask")
        elif steps and any(self is t for t in argmaxed):
            steps[-1].append("choices")
        return real_tolist(self)
    monkeypatch.setattr(runner, "flush_learning", flush)
    monkeypatch.setattr(torch.Tensor, "argmax", argmax)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    tokens, _ = run(llm)
    assert tokens == reference
    corrected = [s for s in steps if "mask" in s]
    assert corrected and all(s == ["argmax", "mask", "choices"] for s in corrected), steps
    assert sum(sent for _, sent in runner.policy.extra_keep.values()) > 0  # extra tokens ran


def test_small_batches_send_no_extra_token_and_run_no_router_correction(reference):
    """Below the EXTRA_FROM batch-size bucket hybridspec sends no extra token and its verification graphs run no
    router correction (the token mask is the padding mask) and no routing statistics kernels; tokens stay
    identical, and the policy still learns its steps' times (without observed distinct experts)."""
    from workers.policy import EXTRA_FROM

    n = EXTRA_FROM // 2  # a batch of n requests: below the threshold's bucket
    llm = with_static_graphs(LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7))
    for prompt, ref in zip(PROMPTS[:n], reference):
        llm.set_replay_reference(prompt, ref)
    results = llm.generate(PROMPTS[:n], [params(m) for m in MAX_NEW[:n]])
    assert [r.token_ids for r in results] == reference[:n]
    assert sum(r.stats.draft_tokens for r in results) > 0
    runner = llm.engine.executor.runner
    assert runner.policy.extra_keep == {}
    verify = [g for g in runner.step_graphs().graphs.values() if not g.plain]
    assert verify and all(not g.corrects and g.moe.token_mask is g.moe.row_mask for g in verify)
    assert all(not g.counts and not g.moe.expert_counts and not g.moe.distinct_experts for g in verify)
    assert runner.policy.latency.num_samples > 0 and runner.policy.bucket_costs  # served steps were learned


def test_the_startup_profile_gathers_small_batches_statistics_eagerly():
    """The start-up profile's small batches run in graph buckets without statistics kernels: their routing
    statistics come from one untimed eager forward per shape, so the expert estimator and the latency model's
    anchors still see them (and the profile's large batches take theirs from their graphs)."""
    from workers.policy import EXTRA_FROM

    llm = with_static_graphs(LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7))
    runner = llm.engine.executor.runner
    anchors = []
    observe_profile = runner.policy.observe_profile

    def spy(obs, counts):  # (counts copied: a graph's are views of its static outputs, rewritten by its next run)
        anchors.append((len(obs.tokens_per_request), obs.tokens_per_request[0], obs.distinct_experts,
                        [c.clone() for c in counts] if counts else counts))
        observe_profile(obs, counts)
    runner.policy.observe_profile = spy
    runner.profile(max_batch=2 * EXTRA_FROM)  # sizes 1, EXTRA_FROM // 2 and 2 x EXTRA_FROM
    sizes = {b for b, _, _, _ in anchors}
    assert min(sizes) < EXTRA_FROM <= max(sizes)
    top_k = runner.model.config.num_experts_per_tok
    for b, t, distinct, counts in anchors:
        if t > 1:  # verification shapes: statistics of exactly their tokens, for every batch size
            assert distinct and counts and all(int(c.sum()) == b * t * top_k for c in counts), (b, t)
    graphs = runner.step_graphs().graphs
    assert any(g.counts for g in graphs.values()) and any(not g.counts and not g.plain for g in graphs.values())
    assert sum(sum(layer) for layer in runner.policy.estimator.counts) > 0
    # budget's graph set collects no statistics at all: its profile runs no eager forward for them (as before)
    budget = with_static_graphs(LLM(spec="replay", policy="budget", max_verify_len=6, replay_acceptance=0.7))
    runner = budget.engine.executor.runner
    forwards = []
    forward = runner.model.forward
    runner.model.forward = lambda *a, **k: forwards.append(k.get("moe")) or forward(*a, **k)
    runner.profile(max_batch=2 * EXTRA_FROM)
    assert forwards and not any(moe is not None and moe.collect_counts for moe in forwards)  # graph runs only
    assert sum(sum(layer) for layer in runner.policy.estimator.counts) == 0


def test_graph_path_with_a_partly_accepted_draft_model_is_lossless(reference, perturbed_dir):
    """Drafting steps and the draft model's rollback replays also go through (its own) graph buckets."""
    llm = with_static_graphs(LLM(spec="draft", policy="fixed", max_verify_len=4, draft_model=str(perturbed_dir)))
    tokens, stats = run(llm)
    assert tokens == reference
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    assert len(llm.engine.executor.runner.drafter.graphs.graphs) > 1


def test_startup_profile_fits_the_latency_model_before_serving_and_stays_lossless(reference):
    """The learned policies plan from the first step after a start-up profile of synthetic steps on the spare
    page/slot (no exploration with fixed lengths), and no request's state is touched by it."""
    llm = LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7, startup_profile=True,
              max_running=9)
    policy = llm.engine.executor.runner.policy
    assert policy.profiled and policy.latency.fitted and policy.steps == 0 and policy.warm()
    profiled_samples = len(policy.latency.anchors)  # kept in every later fit
    assert profiled_samples >= policy.latency.min_samples and not policy.latency.samples
    # and hybridspec's measured cost per batch-size bucket starts with the profile's batch sizes
    assert set(policy.profile_costs) == {policy.gate.bucket(b) for b in (1, 2, 9)} and not policy.bucket_costs
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    tokens, stats = run(llm)
    assert tokens == reference
    assert sum(s.draft_tokens for s in stats) > 0
    assert len(policy.latency.samples) > 0 and len(policy.latency.anchors) == profiled_samples  # refined online
    # its prediction error and the calibration's reach the engine, and from there the Prometheus metrics
    from engine.metrics import EngineMetrics

    assert llm.engine.policy_stats["latency_samples"] > 0  # reported by the worker (first step, then every 16)
    stats = policy.stats("replay")  # what the worker reports, now
    assert stats["latency_mean_abs_pct"] >= 0 and stats["calibration_samples"] > 0
    text = EngineMetrics(policy=stats).render()
    assert "hybridspec_latency_model_error_mean_pct " in text and "hybridspec_drafter_confidence_ece " in text


def test_bucketprofile_times_the_blocks_that_fill_each_token_bucket():
    """hybridspec-bucketprofile: at every batch size it profiles, the start-up profile also times the uniform blocks
    whose tokens fill a graph token bucket exactly (so the cost table has a measured point at the top of each bucket a
    plan may fill); plain hybridspec's profile keeps its six lengths."""
    from workers.graphs import token_buckets

    shapes = {}
    for policy in ("hybridspec", "hybridspec-bucketprofile"):
        llm = with_static_graphs(LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7))
        runner = llm.engine.executor.runner
        if policy != "hybridspec":
            runner.policy.ablate("bucketprofile")
        seen = shapes[policy] = set()
        observe_profile = runner.policy.observe_profile
        runner.policy.observe_profile = lambda obs, counts, seen=seen, real=observe_profile: (
            seen.add((len(obs.tokens_per_request), obs.tokens_per_request[0])), real(obs, counts))[1]
        runner.profile(max_batch=8)
    block = 7
    plain = {(b, t) for b in (1, 2, 8) for t in (1, 2, 3, 5, 7)}  # {1, 2, block // 4, block // 2, 3 block // 4, block}
    assert shapes["hybridspec"] == plain
    buckets = set(token_buckets(8 * block))
    fills = {(b, t) for b in (1, 2, 8) for t in range(1, block + 1) if b * t in buckets}
    assert (8, 6) in fills and (2, 6) in fills and (8, 4) in fills and (8, 5) not in fills  # 48, 12 and 32 rows
    assert shapes["hybridspec-bucketprofile"] == plain | fills


def test_a_bucket_that_fails_to_capture_runs_eagerly_and_stays_eager(reference):
    """A capture can fail while serving (out of memory, a kernel that cannot be captured): that step and that
    bucket's later steps run eagerly instead of failing the requests."""
    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.8))
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    graphs = llm.engine.executor.runner.step_graphs()
    build = graphs._new

    def failing_for_verification(key):
        if key.max_block > 1:
            raise RuntimeError("simulated capture failure")
        return build(key)

    graphs._new = failing_for_verification
    tokens, stats = run(llm)
    assert tokens == reference
    assert sum(s.accepted_tokens for s in stats) > 0
    assert graphs.failed and all(k.max_block > 1 for k in graphs.failed)
    assert all(k.max_block == 1 for k in graphs.graphs)  # plain decode buckets still in graphs


def test_replay_drafter_confidence_models():
    """`noise`: every draft right with the acceptance, confidences uninformative; `beta`: the same mean acceptance,
    per-token acceptance spread by a Beta law and reported by the confidence (right drafts more confident than
    wrong ones); bad settings name the field and its range."""
    from workers.drafters import DraftRequest, ReplayDrafter

    ref = list(range(1, 4001))
    for kind in ("noise", "beta"):
        d = ReplayDrafter(0.7, 5000, seed=3, confidence=kind)
        d.set_reference([0], ref)
        prop = d.propose([DraftRequest("r", [0], 1, [], 0, 4000, SamplingParams())])
        right = [t == r for t, r in zip(prop.tokens[0], ref)]
        conf = prop.confidence[0]
        assert abs(sum(right) / len(right) - 0.7) < 0.03, (kind, sum(right) / len(right))
        mean_right = sum(c for c, ok in zip(conf, right) if ok) / sum(right)
        mean_wrong = sum(c for c, ok in zip(conf, right) if not ok) / (len(right) - sum(right))
        if kind == "noise":
            assert abs(mean_right - mean_wrong) < 0.02
        else:
            assert mean_right > mean_wrong + 0.2, (mean_right, mean_wrong)
    with pytest.raises(ValueError, match="replay confidence must be one of"):
        ReplayDrafter(0.7, 10, confidence="oracle")
    with pytest.raises(ValueError, match="replay concentration must be > 0"):
        ReplayDrafter(0.7, 10, confidence="beta", concentration=0.0)


def test_replay_drafter_common_draws_fix_each_positions_outcome():
    """draws='common': the draft for position t of a request is right or wrong whatever was drawn before (two
    policies drafting different lengths meet the same outcomes), at the acceptance rate overall, with
    uninformative confidences; other requests get other outcomes."""
    from workers.drafters import DraftRequest, ReplayDrafter

    ref = list(range(1, 3001))

    def outcomes(d, rid, start, k):
        prop = d.propose([DraftRequest(rid, [0] + ref[:start], start + 1, [], 0, k, SamplingParams())])
        return [t == r for t, r in zip(prop.tokens[0], ref[start:])], prop.confidence[0]

    a = ReplayDrafter(0.7, 5000, seed=3, draws="common")
    b = ReplayDrafter(0.7, 5000, seed=3, draws="common")
    for d in (a, b):
        d.set_reference([0], ref)
    outcomes(b, "r0", 0, 7)  # b's random stream moves on; its outcomes must not
    right_a, conf = outcomes(a, "r0", 10, 2500)
    right_b = outcomes(b, "r0", 10, 16)[0] + outcomes(b, "r0", 26, 2484)[0]
    assert right_a == right_b
    assert abs(sum(right_a) / len(right_a) - 0.7) < 0.03
    mean_right = sum(c for c, ok in zip(conf, right_a) if ok) / sum(right_a)
    mean_wrong = sum(c for c, ok in zip(conf, right_a) if not ok) / (len(right_a) - sum(right_a))
    assert abs(mean_right - mean_wrong) < 0.02
    assert outcomes(a, "r1", 10, 200)[0] != right_a[:200]  # another request: other outcomes
    with pytest.raises(ValueError, match="replay draws must be one of"):
        ReplayDrafter(0.7, 10, draws="crn")


def test_replay_drafter_common_draws_with_beta_confidences():
    """draws='common' with beta confidences: a position's p, its outcome and its confidence are the same whatever
    was drafted before and however the drafts were split into steps (chunk boundaries included), the mean
    acceptance holds, confidences stay informative (right drafts more confident), and another request or seed
    meets other draws."""
    from workers.drafters import DraftRequest, ReplayDrafter

    ref = list(range(1, 3001))

    def draft(d, rid, start, k):
        prop = d.propose([DraftRequest(rid, [0] + ref[:start], start + 1, [], 0, k, SamplingParams())])
        return [t == r for t, r in zip(prop.tokens[0], ref[start:])], prop.confidence[0]

    a = ReplayDrafter(0.7, 5000, seed=3, confidence="beta", draws="common")
    b = ReplayDrafter(0.7, 5000, seed=3, confidence="beta", draws="common")
    for d in (a, b):
        d.set_reference([0], ref)
    a.COMMON_CHUNK = b.COMMON_CHUNK = 64  # small chunks: the long draft crosses many boundaries
    draft(b, "r0", 0, 7)
    right_a, conf_a = draft(a, "r0", 10, 2500)
    parts = [draft(b, "r0", s, k) for s, k in ((10, 16), (26, 50), (76, 1), (77, 2433))]
    assert right_a == sum((p[0] for p in parts), [])
    assert conf_a == sum((p[1] for p in parts), [])
    b.release(["r0"])  # a released request's tables are rebuilt the same
    assert draft(b, "r0", 100, 300) == (right_a[90:390], conf_a[90:390])
    assert abs(sum(right_a) / len(right_a) - 0.7) < 0.03
    mean_right = sum(c for c, ok in zip(conf_a, right_a) if ok) / sum(right_a)
    mean_wrong = sum(c for c, ok in zip(conf_a, right_a) if not ok) / (len(right_a) - sum(right_a))
    assert mean_right > mean_wrong + 0.2, (mean_right, mean_wrong)
    assert draft(a, "r1", 10, 200)[1] != conf_a[:200]
    other = ReplayDrafter(0.7, 5000, seed=4, confidence="beta", draws="common")
    other.set_reference([0], ref)
    assert draft(other, "r0", 10, 200)[1] != conf_a[:200]


def test_hybridspec_asks_the_drafter_only_for_its_draft_cap(reference, monkeypatch):
    """The runner passes hybridspec's draft cap (workers.policy.LengthPolicy.draft_cap) to the drafter: no request
    is asked for more drafts than the cap, and tokens stay identical."""
    import workers.policy

    monkeypatch.setattr(workers.policy.LengthPolicy, "draft_cap", lambda self, batch_size: 2)
    llm = LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.9)
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    drafter = llm.engine.executor.runner.drafter
    asked = []
    propose = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda reqs: asked.extend(r.k for r in reqs) or propose(reqs))
    tokens, stats = run(llm)
    assert tokens == reference
    assert asked and max(asked) == 2 and sum(s.draft_tokens for s in stats) > 0


def test_the_startup_profile_collects_routing_statistics_even_where_serving_does_not():
    """hybridspec-nocounts serves without routing statistics, but its start-up profile still feeds the expert
    estimator (and serving stays without them afterwards)."""
    llm = LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.7)
    runner = llm.engine.executor.runner
    runner.set_policy("hybridspec", 6)
    runner.policy.ablate("nocounts")
    assert not runner.policy.collects_routing
    runner.profile(max_batch=2)
    assert runner.policy.profiled and not runner.policy.collects_routing
    assert sum(sum(layer) for layer in runner.policy.estimator.counts) > 0


def test_graph_padding_blocks_are_no_longer_than_the_real_blocks():
    """A bucket's padding goes to its last requests in blocks no longer than the step's longest real block where
    its requests suffice (the sequential GDN kernel walks a request's tokens in order: a longer padding block would
    be the step's critical path), else in the fewest equal blocks; every padding token is placed."""
    from workers.graphs import StepGraphs, token_buckets

    pad = StepGraphs._padding_lens
    assert pad(3, 10, 12, 17, 4) == [0, 0, 0, 0, 4, 4, 4]  # blocks of the longest real block (4)
    assert pad(3, 10, 12, 17, 1) == [0, 2, 2, 2, 2, 2, 2]  # too few requests for blocks of 1: ceil(12 / 7)
    assert pad(0, 4, 0, 17, 5) == [0, 0, 0, 0]
    assert pad(2, 4, 9, 5, 1) == [4, 5]  # never longer than the bucket's max block
    with pytest.raises(RuntimeError, match="too few padding requests"):
        pad(2, 4, 11, 5, 1)
    # a bucket has enough padding requests for its largest padding in blocks of PAD_BLOCK
    _check_padding_requests(token_buckets(64 * 17))


def test_verification_buckets_take_the_smallest_block_that_holds_the_step(monkeypatch):
    """A verification step's graph is the one of the smallest block bucket (BLOCK_BUCKETS below the set's
    max_block, then max_block) that holds its longest block: the kernels' tiles follow the graph's block.
    HYBRIDSPEC_BLOCK_BUCKETS switches them ("0": none) and names what it allows."""
    from workers.graphs import StepGraphs, block_buckets, token_buckets

    def blocks(max_block: int) -> list[int]:
        graphs = StepGraphs.__new__(StepGraphs)
        graphs.max_block, graphs.width, graphs.tokens, graphs.failed = max_block, 64, token_buckets(64 * 17), {}
        graphs.blocks = sorted(b for b in block_buckets() if b < max_block) + [max_block]
        return [graphs.bucket(4, 4 * n, n, 8).max_block for n in range(1, max_block + 1)]

    assert blocks(17) == [1] + [8] * 7 + [16] * 8 + [17]
    assert blocks(5) == [1, 5, 5, 5, 5]  # a set with a small block keeps its own
    monkeypatch.setenv("HYBRIDSPEC_BLOCK_BUCKETS", "0")
    assert blocks(17) == [1] + [17] * 16
    monkeypatch.setenv("HYBRIDSPEC_BLOCK_BUCKETS", "4,12")
    assert blocks(17) == [1] + [4] * 3 + [12] * 8 + [17] * 5
    for bad in ("1", "a,8", ""):
        monkeypatch.setenv("HYBRIDSPEC_BLOCK_BUCKETS", bad)
        with pytest.raises(ValueError, match="HYBRIDSPEC_BLOCK_BUCKETS must be"):
            block_buckets()


def _check_padding_requests(tokens):
    from workers.graphs import PAD_BLOCK, BucketKey, StepGraphs

    pad = StepGraphs._padding_lens
    for max_block in (1, 5, 17):
        for i in range(1, len(tokens)):
            graphs = StepGraphs.__new__(StepGraphs)
            graphs.tokens = tokens
            key = BucketKey(64, tokens[i], max_block)
            p = graphs._pad_requests(key)
            largest = tokens[i] - tokens[i - 1] - 1
            assert p * min(max_block, PAD_BLOCK) >= largest
            assert max(pad(0, p, largest, max_block, 1), default=0) <= min(max_block, PAD_BLOCK)


def record_eager_steps(runner) -> list[bool]:
    """Wraps runner.execute: the returned list gets each step's last_step_eager."""
    flags: list[bool] = []
    execute = runner.execute

    def recording(*args, **kwargs):
        result = execute(*args, **kwargs)
        flags.append(runner.last_step_eager)
        return result

    runner.execute = recording
    return flags


def test_graph_buckets_past_max_graphs_replace_the_least_recently_used(reference, monkeypatch):
    """A graph set meets more buckets than it keeps in a long run (batch x tokens x block x page width): past
    max_graphs the least recently used graph is dropped and the new bucket captured, so no step falls back to an
    eager forward (measured at 4031e7c: a set past its 96 graphs ran eager steps, 0.73x ar at c=64); tokens stay
    the eager ones."""
    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.6))
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:
        llm.set_replay_reference(prompt, ref)
    import workers.graphs

    graphs = llm.engine.executor.runner.step_graphs()
    graphs.max_graphs = 2
    monkeypatch.setattr(workers.graphs, "EVICT_EVERY", 0)  # every new bucket may evict (the rate limit: below)
    calls = {"none": 0, "all": 0}
    run_bucket = graphs.run

    def counting(*args, **kwargs):
        out = run_bucket(*args, **kwargs)
        calls["all"] += 1
        calls["none"] += out is None
        return out

    graphs.run = counting
    eager_flags = record_eager_steps(llm.engine.executor.runner)
    tokens, stats = run(llm)
    assert eager_flags and not any(eager_flags)
    assert tokens == reference
    assert calls["all"] > 0 and calls["none"] == 0  # every decode/verify step ran in a bucket
    assert graphs.evictions > 0 and len(graphs.graphs) <= 2
    # rate limit: with a full set, a new bucket within EVICT_EVERY runs of the last eviction runs eagerly (None)
    monkeypatch.setattr(workers.graphs, "EVICT_EVERY", 10 ** 6)
    monkeypatch.setattr(workers.graphs, "STALE_RUNS_PER_GRAPH", 10 ** 6)  # (every graph is in the recent window)
    graphs._runs_since_evict = 0
    evictions, calls["none"] = graphs.evictions, 0
    llm2_tokens, _ = run(llm)
    assert llm2_tokens == reference and graphs.evictions == evictions
    assert calls["none"] > 0 and len(graphs.graphs) <= 2
    assert any(eager_flags)  # the runner reports those steps (bench/e2e.py counts them per row)
    # ... but after a change of load (the recent window's buckets fit in the set, the least recently used graph is
    # none of them) the earlier load's graph is dropped at once (bench/NOTES.md run 25's one-process c=64 cells)
    monkeypatch.setattr(workers.graphs, "STALE_RUNS_PER_GRAPH", 4)
    graphs._runs_since_evict, calls["none"] = 0, 0
    lru = next(iter(graphs.graphs))
    graphs._recent.clear()
    graphs._recent_count.clear()
    assert graphs._load_changed()
    eager_flags.clear()
    llm3_tokens, _ = run(llm)
    assert llm3_tokens == reference and graphs.evictions > evictions and lru not in graphs.graphs
    with pytest.raises(ValueError, match="max_graphs must be >= 2"):
        type(graphs)(graphs.model, graphs.cache, max_block=2, spare_page=0, spare_slot=0, page_table_width=1,
                     max_tokens=4, max_graphs=1)


def test_a_capture_out_of_memory_shrinks_the_set_and_captures_instead_of_running_eagerly(reference, monkeypatch):
    """A capture that runs out of memory (bench/NOTES.md: c=16 at 40 layers on an H100, 8 buckets eager at ~10x a
    graphed step for the rest of the run) now gives the least recently used graphs back one at a time until it
    fits, and the set keeps at most what memory held; only a set of fewer than 2 graphs gives the bucket up."""
    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.6))
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:
        llm.set_replay_reference(prompt, ref)
    import workers.graphs

    monkeypatch.setattr(workers.graphs, "EVICT_EVERY", 0)
    graphs = llm.engine.executor.runner.step_graphs()
    new = graphs._new
    calls = {"n": 0}

    def short_of_memory(key):
        calls["n"] += 1
        if calls["n"] in (4, 5):  # the fourth capture here, and its first retry after one graph went back
            calls.setdefault("held", len(graphs.graphs))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (test)")
        return new(key)

    graphs._new = short_of_memory
    eager_flags = record_eager_steps(llm.engine.executor.runner)
    tokens, _ = run(llm)
    assert tokens == reference
    assert calls["n"] > 5 and not graphs.failed and eager_flags and not any(eager_flags)
    # two graphs went back before the capture fitted: the set keeps what memory held with it
    assert calls["held"] >= 3 and graphs.max_graphs == calls["held"] - 1 and graphs.evictions >= 2
    assert len(graphs.graphs) <= calls["held"] - 1
    # with no graph held there is nothing to give back: the bucket runs eagerly, as before
    graphs.graphs.clear()
    key = workers.graphs.BucketKey(1, 1, 1, 4)
    assert graphs._capture_after_oom(key, "x") is None and key in graphs.failed


def test_a_capture_that_fits_only_without_the_sets_pool_drops_every_graph_and_captures_in_a_new_pool(reference):
    """On an H100 at c=16 (bench/NOTES.md 2026-12-07 22:06) the eviction loop stopped at one graph, whose private
    pool (2.5 GiB) stayed reserved while the capture lacked 20 MiB: the bucket ran eagerly. The last graph now goes
    too, with the pool (a new one for the capture), and the set keeps its max_graphs; a capture that does not fit an
    empty set still runs its bucket eagerly."""
    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.6))
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:
        llm.set_replay_reference(prompt, ref)
    import workers.graphs

    tokens, _ = run(llm)
    assert tokens == reference
    graphs = llm.engine.executor.runner.step_graphs()
    held, limit, evictions = len(graphs.graphs), graphs.max_graphs, graphs.evictions
    assert held >= 2
    graphs.pool = ("a pool", 1)  # (CPU graphs capture nothing: a stand-in for the pool the set's graphs use)
    new = graphs._new
    seen, attempts = [], []

    class Attempt:  # what a failed capture leaves in its frames (its graph, which holds a use of the pool)
        pass

    def fits_only_in_an_empty_set(key):
        seen.append((len(graphs.graphs), graphs.pool))
        assert all(ref() is None for ref in attempts)  # nothing of an earlier attempt lives on into a retry
        if graphs.graphs:
            attempt = Attempt()
            attempts.append(weakref.ref(attempt))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (test)")
        return new(key)

    graphs._new = fits_only_in_an_empty_set
    key = workers.graphs.BucketKey(4, 24, 6, 4)
    gc.disable()  # (a failed attempt must go when its error does, not at a later cyclic collection)
    try:
        g = graphs._capture_after_oom(key, "first")
        assert len(attempts) == held - 1 and not any(ref() is not None for ref in attempts)  # all gone
    finally:
        gc.enable()
    assert g is not None and key not in graphs.failed
    # one retry after each graph went back; the last with no graph left and no pool
    assert [n for n, _ in seen] == list(range(held - 1, -1, -1))
    assert seen[-1][1] is None and all(p == ("a pool", 1) for _, p in seen[:-1])
    assert graphs.evictions == evictions + held and graphs.max_graphs == limit
    graphs.graphs[key] = g  # (run() files it) the set serves on from the new graph
    graphs._new = new
    graphs.failed.clear()
    eager_flags = record_eager_steps(llm.engine.executor.runner)
    tokens, _ = run(llm)
    assert tokens == reference and eager_flags and not any(eager_flags)
    # a capture that does not fit even with every graph and the pool given back: its bucket runs eagerly
    assert len(graphs.graphs) >= 2

    def never_fits(key):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    graphs._new = never_fits
    assert graphs._capture_after_oom(key, "x") is None and key in graphs.failed
    assert not graphs.graphs and graphs.pool is None and "out of memory (test)" in graphs.failed[key]


def test_a_capture_short_of_memory_drops_the_other_policies_graph_sets_first(reference, monkeypatch):
    """The runner keeps a graph set per configuration (policy flags, drafter needs): after a policy swap the old
    set's graphs hold their pool. A capture of the new set that runs out of memory drops the other sets first and
    captures again, before giving back any graph of its own; the runner's capture count never goes down (a step
    that captured is no measurement of a step)."""
    import workers.graphs

    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.6))
    for prompt, ref in list(zip(PROMPTS, reference))[::2]:
        llm.set_replay_reference(prompt, ref)
    runner = llm.engine.executor.runner
    tokens, _ = run(llm)
    assert tokens == reference
    old = runner.step_graphs()
    old.captures = 5  # (CPU graphs capture nothing: what a GPU's set would have counted)
    before = runner.captures_total()
    runner.set_policy("hybridspec", 6)  # extra token and routing statistics: another graph set
    new = workers.graphs.StepGraphs._new
    short = {"n": 0}

    def short_while_the_old_set_lives(self, key):
        if self is not old and any(g is old for g in runner._graphs.values()):
            short["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (test)")
        return new(self, key)

    monkeypatch.setattr(workers.graphs.StepGraphs, "_new", short_while_the_old_set_lives)
    eager_flags = record_eager_steps(runner)
    tokens, _ = run(llm)
    current = runner.step_graphs()
    assert tokens == reference and short["n"] == 1 and list(runner._graphs.values()) == [current]
    assert not current.failed and current.evictions == 0 and eager_flags and not any(eager_flags)
    assert runner.captures_total() >= before == 5


def test_graph_set_keeps_the_rate_limit_for_a_working_set_larger_than_the_set():
    """The eviction rule's load-change test on a bare StepGraphs state: a window whose buckets fit in the set and
    miss the least recently used graph is a change of load; a window with more buckets than the set (a working
    set that would thrash) or one that still uses that graph is not."""
    from collections import Counter, OrderedDict, deque

    import workers.graphs as wg

    g = object.__new__(wg.StepGraphs)
    g.max_graphs = 3
    g.graphs = OrderedDict((k, None) for k in ("a", "b", "c"))  # "a" least recently used
    g._recent, g._recent_count = deque(), Counter()
    for k in ["d", "e", "b", "c"] * 2:
        g._note_recent(k)
    assert not g._load_changed()  # d, e, b, c: four buckets in the window, the set holds three
    g._recent, g._recent_count = deque(), Counter()
    for k in ["d", "b", "c"]:
        g._note_recent(k)
    assert g._load_changed()  # three buckets, "a" not among them
    g._note_recent("a")
    assert not g._load_changed()  # "a" ran in the window
    for _ in range(wg.STALE_RUNS_PER_GRAPH * g.max_graphs):
        g._note_recent("d")
    assert g._load_changed() and list(g._recent_count) == ["d"]  # the window holds the last 12 runs only


def test_token_buckets_step_by_halves_and_thirds():
    from workers.graphs import token_buckets

    assert token_buckets(1088) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                                   1088]
    assert token_buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]


def test_extra_token_buckets_join_the_graphs_buckets_and_stay_lossless(reference, monkeypatch):
    """HYBRIDSPEC_TOKEN_BUCKETS_EXTRA adds token buckets below a set's limit to the halves and thirds (an A/B switch:
    at c=64 a uniform plan of 4 drafts is 320 tokens, padded to 384 without it), names what it allows, keeps
    enough padding requests in every bucket, and verification steps in an extra bucket give the eager tokens."""
    import workers.graphs as wg

    monkeypatch.setenv("HYBRIDSPEC_TOKEN_BUCKETS_EXTRA", "448,320")
    assert wg.extra_token_buckets() == (320, 448)
    monkeypatch.setenv("HYBRIDSPEC_TOKEN_BUCKETS_EXTRA", "0")
    assert wg.extra_token_buckets() == ()
    for bad in ("", "x", "320,0", "-4"):
        monkeypatch.setenv("HYBRIDSPEC_TOKEN_BUCKETS_EXTRA", bad)
        with pytest.raises(ValueError, match="HYBRIDSPEC_TOKEN_BUCKETS_EXTRA must be"):
            wg.extra_token_buckets()
    monkeypatch.setattr(wg, "EXTRA_TOKEN_BUCKETS", (320, 384, 448, 5000))
    assert wg.token_buckets(1088) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448,
                                      512, 768, 1024, 1088]
    assert wg.token_buckets(300)[-3:] == [192, 256, 300]  # none past the limit, which stays the last bucket
    _check_padding_requests(wg.token_buckets(1088))
    monkeypatch.setattr(wg, "EXTRA_TOKEN_BUCKETS", (5,))  # a bucket the test's small verification steps land in
    llm = with_static_graphs(LLM(spec="replay", policy="fixed", max_verify_len=6, replay_acceptance=0.6))
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    tokens, _ = run(llm)
    assert tokens == reference
    graphs = llm.engine.executor.runner.step_graphs()
    assert 5 in graphs.tokens and any(k.tokens == 5 and k.max_block > 1 for k in graphs.graphs)


def test_the_runner_times_each_drafting_for_hybridspec(reference, monkeypatch):
    """Every drafted step reports the drafter's time and its rows (each request's drafts + its pending token) to
    the policy, which learns hybridspec's drafting cost per batch-size bucket and the rest of the step; tokens
    stay identical."""
    llm = LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.9)
    for prompt, ref in zip(PROMPTS, reference):
        llm.set_replay_reference(prompt, ref)
    runner = llm.engine.executor.runner
    proposed, reported = [], []
    propose, observe = runner.drafter.propose, runner.policy.observe_draft

    def spy_propose(reqs):
        out = propose(reqs)
        proposed.append(sum(len(t) + 1 for t in out.tokens if t))
        return out

    def spy_observe(batch_size, rows, ms):
        reported.append((rows, ms))
        observe(batch_size, rows, ms)
    monkeypatch.setattr(runner.drafter, "propose", spy_propose)
    monkeypatch.setattr(runner.policy, "observe_draft", spy_observe)
    tokens, _ = run(llm)
    assert tokens == reference
    assert proposed and [rows for rows, _ in reported] == proposed
    assert all(ms is not None and ms >= 0 for rows, ms in reported if rows)
    assert all(ms is None for rows, ms in reported if not rows)  # nothing drafted: not a sample
    assert runner.policy.draft_costs and all(cost.measured for cost in runner.policy.draft_costs.values())
    assert runner.policy.rest_overhead_ms and all(v >= 0 for v in runner.policy.rest_overhead_ms.values())


def test_the_gate_reserves_no_draft_pages_for_steps_it_decodes_plainly(monkeypatch):
    """Where hybridspec's gate has measured plain decoding faster, the runner's draft-cap hint is 0 for the steps the
    gate will decode plainly, so the scheduler reserves no draft pages for them; the gate still decides every such
    step (also the first decode step after a step with a prefill, which reports no hint), its probes still come (a
    hint > 0 before each), and the output stays identical. The gate's cycle times are fixed (a drafted cycle 30 ms,
    a plain one 10 ms, at replay acceptance 0: one token a request either way), so plain decoding wins whatever
    the host's load; three requests with at most two running: the third's prefill joins a decode step late."""
    prompts, max_new = ["def f(x):\n    return x\n", "abcabcabc", "x = 1\n"], [120, 150, 60]
    reference = [r.token_ids for r in LLM().generate(prompts, [params(n) for n in max_new])]
    llm = LLM(spec="replay", policy="hybridspec", max_verify_len=6, replay_acceptance=0.0, max_running=2)
    for prompt, ref in zip(prompts, reference):
        llm.set_replay_reference(prompt, ref)
    runner = llm.engine.executor.runner
    policy = runner.policy
    observe_cycle = policy.observe_cycle
    monkeypatch.setattr(policy, "observe_cycle",
                        lambda b, drafted, tokens, ms: observe_cycle(b, drafted, tokens, 30.0 if drafted else 10.0))
    asked = []  # the gate's decisions and peeks during the current step
    should_draft = policy.should_draft
    monkeypatch.setattr(policy, "should_draft", lambda *a, **k: asked.append("decide") or should_draft(*a, **k))
    steps = []  # (decode only, max draft cap asked, drafted, hint returned, batch size, gate consulted)
    execute = runner.execute

    def spy(requests):
        asked.clear()
        misses = policy.gate_hint_misses
        result = execute(requests)
        steps.append((all(len(r.tokens) == 1 and r.context_len > 0 for r in requests),
                      max(r.draft_cap for r in requests), bool(result.draft_tokens), result.draft_cap_hint,
                      len(requests), "decide" in asked or policy.gate_hint_misses > misses))
        return result
    monkeypatch.setattr(runner, "execute", spy)
    assert [r.token_ids for r in llm.generate(prompts, [params(n) for n in max_new])] == reference
    hinted = [i for i, s in enumerate(steps) if s[3] == 0]
    assert len(hinted) > len(steps) // 2, steps  # most steps once plain decoding has won
    after = [steps[i + 1] for i in hinted if i + 1 < len(steps) and steps[i + 1][0]]
    assert after and all(cap == 0 and not drafted for _, cap, drafted, *_ in after)  # nothing reserved, no drafts
    # every decode step was decided by the gate, those after a step with a prefill (no hint: the last one holds) too
    mixed = [i for i, s in enumerate(steps) if not s[0] and i > hinted[0]]
    assert mixed and all(steps[i + 1][5] for i in mixed if i + 1 < len(steps) and steps[i + 1][0]), steps
    assert all(s[5] for s in steps[hinted[0] + 1:] if s[0])
    # the gate's probes of speculation still come: steps that asked the drafter again (the plan may then verify
    # nothing at this acceptance), each announced by the hint of the step before
    probes = [i for i, s in enumerate(steps) if s[1] > 0 and s[0] and i > hinted[0] + 1]
    assert probes and all(steps[i - 1][3] != 0 or not steps[i - 1][0] for i in probes), steps
    # a peek misses only where the next step's batch differs (here: when a request finishes or joins)
    sizes = [s[4] for s in steps]
    assert policy.gate_hint_misses <= sum(a != b for a, b in zip(sizes, sizes[1:]))
