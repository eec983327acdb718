"""The MTP drafter: loads the checkpoint's mtp.* head, pairs each committed token with the target's hidden
state, drafts from its own outputs, and stays lossless."""

from __future__ import annotations


import pytest
import torch

from checkpoints import with_mtp_head
from engine import LLM, SamplingParams
from engine.default_model import default_model_dir
from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.config import ModelConfig
from workers.drafters import DraftRequest
from workers.model import HybridModel
from workers.mtp import MTPDrafter, MTPHead
from workers.weights import WeightsError, load_weights

PROMPTS = ["def f(x):\n    return x", "import os\n", [7, 8, 9, 7, 8, 9, 7], "a" * 33]
MAX_NEW = [20, 9, 15, 12]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return with_mtp_head(default_model_dir(), tmp_path_factory.mktemp("with_mtp"))


def test_mtp_head_loads_and_greedy_output_is_lossless(mtp_dir):
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    base = [r.token_ids for r in LLM(model=str(mtp_dir)).generate(PROMPTS, sp)]
    llm = LLM(model=str(mtp_dir), spec="mtp", policy="fixed", max_verify_len=3)
    out = llm.generate(PROMPTS, sp)
    assert [r.token_ids for r in out] == base
    assert sum(r.stats.draft_tokens for r in out) > 0
    assert llm.engine.memory.stats()["used_pages"] == 0


def test_checkpoint_without_mtp_tensors_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs a checkpoint with mtp\.\* tensors"):
        LLM(spec="mtp", policy="fixed")
    with pytest.raises(WeightsError, match="no mtp"):
        load_weights(MTPHead(ModelConfig.from_dir(default_model_dir()), 1, torch.float32, "cpu"),
                     default_model_dir(), scope="mtp")


def test_mtp_draft_uses_the_true_token_hidden_pairs(mtp_dir):
    """After the drafter observed a prefill, its first draft equals a from-scratch head run over every
    (x_q, h_{q-1}) pair of the prompt plus the pending token."""
    cfg = ModelConfig.from_dir(mtp_dir)
    target = HybridModel(cfg)
    load_weights(target, mtp_dir)
    drafter = MTPDrafter(target, mtp_dir, num_pages=16, page_size=4, num_slots=2)
    cache = ModelCache(cfg, 16, 4, 2, torch.float32, "cpu")
    cache.reset_slots([1])
    prompt, pages = [5, 9, 2, 7, 7, 1, 30], [3, 0, 5, 6]
    batch = ForwardBatch.build([prompt], [0], [pages], [1], "cpu")
    logits, hidden = target(batch, cache, torch.arange(len(prompt)), return_hidden=True)
    drafter.observe([("r", prompt, hidden, 0, pages, 1)])
    pending = int(logits[-1].argmax())
    proposal = drafter.propose([DraftRequest("r", prompt + [pending], len(prompt), pages, 1, 1,
                                             SamplingParams())])
    # from scratch: pairs (x_1, h_0) ... (x_6, h_5), (pending, h_6) in one head forward on a fresh cache
    fresh = ModelCache(drafter.head.config, 16, 4, 2, torch.float32, "cpu")
    toks = prompt[1:] + [pending]
    m = drafter.head(torch.nn.functional.embedding(torch.tensor(toks), target.model.embed_tokens.weight),
                     hidden, ForwardBatch.build([toks], [0], [pages], [1], "cpu"), fresh)
    expected = int(torch.nn.functional.linear(m[-1], target.lm_head_weight()).argmax())
    assert proposal.tokens[0] == [expected]
    # sampled, unseeded: a block of several drafts carries its first draft's confidence, max q (drafters.
    # draw_independent), whatever the request's stream draws; a seeded one keeps each draw's q(d)
    for seed in (None, 4):
        blocks = set()
        for g in range(6):
            gen = torch.Generator().manual_seed(g)
            p = drafter.propose([DraftRequest("r", prompt + [pending], len(prompt), pages, 1, 3,
                                              SamplingParams(temperature=1.5, seed=seed), gen)])
            q = p.probs[0]  # [3, V] the draft distributions
            if seed is None:
                assert p.confidence[0] == [pytest.approx(float(q[0].max()))] * 3
                blocks.add(tuple(p.tokens[0]))
            else:
                assert p.confidence[0] == [pytest.approx(float(q[j, t])) for j, t in enumerate(p.tokens[0])]
        assert seed is not None or len(blocks) > 1  # the draws differed, the confidences did not


def test_mtp_under_memory_pressure_preempts_and_stays_lossless(mtp_dir):
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    base = [r.token_ids for r in LLM(model=str(mtp_dir)).generate(PROMPTS, sp)]
    llm = LLM(model=str(mtp_dir), spec="mtp", policy="fixed", max_verify_len=4, num_pages=12, page_size=4)
    out = llm.generate(PROMPTS, sp)
    assert [r.token_ids for r in out] == base
    assert sum(r.stats.preemptions for r in out) > 0
    assert llm.engine.memory.stats()["used_slots"] == 0


def test_mtp_drafting_steps_through_graph_buckets_are_lossless(mtp_dir):
    """The head's drafting steps go through its own graph buckets (padded static batches, run eagerly on CPU):
    same tokens as plain decoding, and the same drafts as the eager head."""
    from test_speculative import with_static_graphs

    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    base = [r.token_ids for r in LLM(model=str(mtp_dir)).generate(PROMPTS, sp)]
    eager = LLM(model=str(mtp_dir), spec="mtp", policy="fixed", max_verify_len=3).generate(PROMPTS, sp)
    llm = with_static_graphs(LLM(model=str(mtp_dir), spec="mtp", policy="fixed", max_verify_len=3))
    out = llm.generate(PROMPTS, sp)
    assert [r.token_ids for r in out] == base
    assert [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in out] == \
        [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in eager]
    assert llm.engine.executor.runner.drafter.graphs.graphs  # the head's graph path really ran


def test_mtp_steps_never_time_a_gate_cycle_on_the_host_clock(mtp_dir, monkeypatch):
    """The MTP drafter pairs every step's committed tokens with the target's hidden states after the read-back (a
    head forward on the device), plain steps too: no hybridspec gate cycle may start or end on the host clock
    (workers/runner.py _StepEnds.resumed(host=...)), checked with the gate's CUDA paths on host-timed stand-in
    events; the output stays lossless."""
    from gate_clocks import record_cycle_clocks

    _, markers = record_cycle_clocks(monkeypatch)
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    base = [r.token_ids for r in LLM(model=str(mtp_dir)).generate(PROMPTS, sp)]
    llm = LLM(model=str(mtp_dir), spec="mtp", policy="hybridspec", max_verify_len=3)
    assert [r.token_ids for r in llm.generate(PROMPTS, sp)] == base
    assert markers and not any(markers)  # every cycle start an event
