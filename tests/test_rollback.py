"""State layer invariants: verification never writes GDN state, the commit replays exactly the accepted
tokens, and after any step sequence every request's KV prefix, GDN state and conv window equal those of
plain one-token-at-a-time decoding over the same tokens. After all requests end, every page and slot is free.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import gdn
from scheduler.memory import MemoryManager
from workers.batch import ForwardBatch
from workers.cache import AttentionKV, GDNState, ModelCache, StepScratch
from workers.config import ModelConfig
from workers.model import HybridModel
from workers.random_init import init_random_

PAGE = 4
TOL = 1e-5  # absolute, or relative to the tensor's scale where that exceeds 1
# The test model uses matrix gain 0.5: with gain 1 the random layers amplify the fp32 rounding differences between
# a ragged block and one-token GEMMs to ~3e-5 in later layers' KV (the same sequences in float64 agree to 4e-7);
# a rollback bug is O(1) either way.


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    torch.testing.assert_close(actual, expected, atol=tol * max(1.0, expected.abs().max().item()), rtol=0)

TINY = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "max_position_embeddings": 512,
}


@pytest.fixture(autouse=True)
def token_by_token_gdn_form(monkeypatch):
    """Pin the rollback logic at 1e-5: every block uses the token-by-token GDN form here (the chunked
    prefill form differs from it by rounding, which tests/test_kernels_reference.py bounds separately)."""
    monkeypatch.setattr(gdn, "CHUNKED_FORM_MIN_LEN", 10**9)


@pytest.fixture(scope="module")
def model() -> HybridModel:
    torch.manual_seed(0)
    return init_random_(HybridModel(ModelConfig.from_dict(TINY)), seed=7, matrix_gain=0.5)


class PlainDecoder:
    """The oracle: every request alone, fed one token at a time (always writing state), in its own slot and
    contiguous pages. It follows each request's committed tokens incrementally."""

    def __init__(self, model: HybridModel, max_requests: int = 8, pages_per_request: int = 64):
        self.model, self.per = model, pages_per_request
        self.cache = ModelCache(model.config, max_requests * pages_per_request, PAGE, max_requests,
                                torch.float32, "cpu")
        self.slot_of: dict[str, int] = {}
        self.fed: dict[str, int] = {}

    def pages(self, rid: str) -> list[int]:
        base = self.slot_of[rid] * self.per
        return list(range(base, base + self.per))

    def follow(self, rid: str, tokens: list[int]) -> tuple[list[int], int]:
        """Feeds the tokens not yet fed; returns (pages, slot) of the request in the oracle cache."""
        if rid not in self.slot_of:
            self.slot_of[rid] = len(self.slot_of)
            self.fed[rid] = 0
            self.cache.reset_slots([self.slot_of[rid]])
        slot = self.slot_of[rid]
        for i in range(self.fed[rid], len(tokens)):
            self.model(ForwardBatch.build([[tokens[i]]], [i], [self.pages(rid)], [slot], "cpu"), self.cache)
        self.fed[rid] = len(tokens)
        return self.pages(rid), slot


def assert_same_state(spec: ModelCache, pages: list[int], slot: int, ref: ModelCache, ref_pages: list[int],
                      ref_slot: int, length: int) -> None:
    pos = torch.arange(length)
    for a, b in zip(spec.layers, ref.layers):
        if isinstance(a, AttentionKV):
            rows_a = torch.tensor(pages)[pos // PAGE] * PAGE + pos % PAGE
            rows_b = torch.tensor(ref_pages)[pos // PAGE] * PAGE + pos % PAGE
            for x, y in ((a.k, b.k), (a.v, b.v)):
                close(x.flatten(0, 1)[rows_a], y.flatten(0, 1)[rows_b])
        else:
            assert isinstance(a, GDNState)
            close(a.recurrent[slot], b.recurrent[ref_slot])
            close(a.conv[slot], b.conv[ref_slot])


class Harness:
    """Drives requests through prefill, verification steps with random acceptance, and preemption."""

    def __init__(self, model: HybridModel, num_pages: int = 96, num_slots: int = 4):
        self.model = model
        self.memory = MemoryManager(num_pages, PAGE, num_slots)
        self.cache = ModelCache(model.config, num_pages, PAGE, num_slots, torch.float32, "cpu")
        self.tokens: dict[str, list[int]] = {}  # committed tokens per request (state covers all of them)
        self.resident: set[str] = set()

    def admit(self, rid: str, prompt: list[int]) -> None:
        self.tokens[rid] = list(prompt)

    def step(self, plan: dict[str, tuple[list[int], int]], rng: random.Random) -> None:
        """plan[rid] = (block tokens, tokens to keep). Non-resident requests are (re)prefilled first, in the
        same ragged forward as the verifying ones."""
        items = []  # (rid, new tokens, context, write, keep)
        for rid, (block, keep) in plan.items():
            if rid not in self.resident:
                history = self.tokens[rid]
                self.memory.admit(rid, len(history))
                self.cache.reset_slots([self.memory.table(rid).slot])
                self.resident.add(rid)
                items.append((rid, history, 0, True, len(history)))
            else:
                ctx = self.memory.table(rid).num_tokens
                self.memory.grow(rid, ctx + len(block))
                items.append((rid, block, ctx, False, keep))
        rng.shuffle(items)
        tables = [self.memory.table(rid) for rid, *_ in items]
        batch = ForwardBatch.build([it[1] for it in items], [it[2] for it in items], [t.pages for t in tables],
                                   [t.slot for t in tables], "cpu")
        write = torch.tensor([it[3] for it in items])
        scratch = StepScratch({})
        self.model(batch, self.cache, torch.arange(batch.num_tokens), write=write, scratch=scratch)
        keep = torch.tensor([it[4] for it in items])
        self.model.commit(batch, self.cache, scratch, keep, written=write)
        for rid, new, ctx, wrote, n in items:
            if not wrote:
                self.tokens[rid].extend(new[:n])
                self.memory.shrink(rid, ctx + n)

    def preempt(self, rid: str) -> None:
        self.memory.release(rid)
        self.resident.discard(rid)

    def finish(self, rid: str) -> None:
        if rid in self.resident:
            self.preempt(rid)
        del self.tokens[rid]

    def check(self, oracle: PlainDecoder) -> None:
        for rid in self.resident:
            table = self.memory.table(rid)
            assert table.num_tokens == len(self.tokens[rid])
            ref_pages, ref_slot = oracle.follow(rid, self.tokens[rid])
            assert_same_state(self.cache, table.pages, table.slot, oracle.cache, ref_pages, ref_slot,
                              len(self.tokens[rid]))


def test_verification_forward_leaves_gdn_state_untouched(model):
    h = Harness(model)
    h.admit("a", [1, 2, 3, 4, 5])
    h.step({"a": ([], 0)}, random.Random(0))
    before = [(s.recurrent.clone(), s.conv.clone()) for s in h.cache.layers if isinstance(s, GDNState)]
    table = h.memory.table("a")
    h.memory.grow("a", 5 + 6)
    batch = ForwardBatch.build([[7, 8, 9, 10, 11, 12]], [5], [table.pages], [table.slot], "cpu")
    model(batch, h.cache, torch.arange(6), write=torch.tensor([False]), scratch=StepScratch({}))
    after = [(s.recurrent, s.conv) for s in h.cache.layers if isinstance(s, GDNState)]
    for (r0, c0), (r1, c1) in zip(before, after):
        assert torch.equal(r0, r1) and torch.equal(c0, c1)


@pytest.mark.parametrize("keep", [1, 3, 17])  # 1 = zero drafts accepted, 17 = all 16 accepted
def test_commit_matches_plain_decode_for_zero_some_and_all_accepted(model, keep):
    h, oracle = Harness(model), PlainDecoder(model)
    h.admit("a", [3, 1, 4, 1, 5, 9, 2, 6])
    h.step({"a": ([], 0)}, random.Random(0))
    block = [random.Random(keep).randrange(64) for _ in range(17)]
    h.step({"a": (block, keep)}, random.Random(0))
    h.check(oracle)


def test_logits_of_verified_block_equal_plain_decode_logits(model):
    """Verification outputs come from S_0 for every position of the block: same as decoding one by one."""
    prompt, block = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]
    cache = ModelCache(model.config, 16, PAGE, 1, torch.float32, "cpu")
    cache.reset_slots([0])
    model(ForwardBatch.build([prompt], [0], [[0, 1, 2, 3]], [0], "cpu"), cache)
    batch = ForwardBatch.build([block], [len(prompt)], [[0, 1, 2, 3]], [0], "cpu")
    verify = model(batch, cache, torch.arange(len(block)), write=torch.tensor([False]), scratch=StepScratch({}))
    plain = ModelCache(model.config, 16, PAGE, 1, torch.float32, "cpu")
    plain.reset_slots([0])
    expected = []
    for i, tok in enumerate(prompt + block):
        out = model(ForwardBatch.build([[tok]], [i], [list(range(8))], [0], "cpu"), plain)
        if i >= len(prompt):
            expected.append(out[0])
    torch.testing.assert_close(verify, torch.stack(expected), atol=1e-4, rtol=1e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_step_sequences_match_plain_decoding_and_free_everything(model, seed):
    rng = random.Random(seed)
    h, oracle = Harness(model), PlainDecoder(model)
    waiting = {f"r{i}": [rng.randrange(64) for _ in range(rng.randint(1, 40))] for i in range(4)}
    for rid, prompt in waiting.items():
        h.admit(rid, prompt)
    for _ in range(rng.randint(2, 6)):
        live = list(h.tokens)
        if not live:
            break
        plan = {}
        for rid in live:
            if rng.random() < 0.15:
                continue  # sits this step out
            draft_len = rng.choice([0, 0, 1, 3, 7, 16, rng.randint(0, 16)])  # 0 = no draft this step
            block = [rng.randrange(64) for _ in range(draft_len + 1)]
            keep = rng.choice([1, draft_len + 1, rng.randint(1, draft_len + 1)])  # 0 accepted / all / some
            plan[rid] = (block, keep)
        if plan:
            h.step(plan, rng)
        h.check(oracle)
        if rng.random() < 0.3 and h.resident:
            h.preempt(rng.choice(sorted(h.resident)))  # resumes by recomputation at its next step
        if rng.random() < 0.2:
            h.finish(rng.choice(sorted(h.tokens)))
    for rid in list(h.tokens):
        h.finish(rid)
    stats = h.memory.stats()
    assert stats["used_pages"] == 0 and stats["used_slots"] == 0 and stats["running_requests"] == 0


def test_gdn_state_bytes_per_request_are_the_same_for_max_verification_length_4_and_16(model):
    """One state per request whatever the verification length; the block scratch is O(tokens) and per step."""
    per_request, scratch_per_token = [], []
    for max_verify in (4, 16):
        h = Harness(model)
        h.admit("a", [1, 2, 3])
        h.step({"a": ([], 0)}, random.Random(0))
        table = h.memory.table("a")
        block = list(range(max_verify + 1))
        h.memory.grow("a", 3 + len(block))
        batch = ForwardBatch.build([block], [3], [table.pages], [table.slot], "cpu")
        scratch = StepScratch({})
        model(batch, h.cache, torch.arange(len(block)), write=torch.tensor([False]), scratch=scratch)
        per_request.append(h.cache.gdn_bytes_per_request())
        scratch_per_token.append(scratch.nbytes() / len(block))
    assert per_request[0] == per_request[1] == model.config.gdn_state_bytes()
    assert scratch_per_token[0] == scratch_per_token[1]  # scratch grows with L, linearly, and only per step
