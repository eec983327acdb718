"""Drafters: propose(batch, k) -> tokens [B, k], acceptance estimates [B, k] (and draft probabilities).

- `ngram`: prompt / context lookup, no weights.
- `draft`: a small model loaded by this engine, with its own paged KV and GDN state that roll back exactly
  like the target's (replay of the accepted drafts from a saved state).
- `replay` (benchmarks only): proposes a given reference continuation, each token right with a set
  probability, and spends a real drafter forward; rows that use it are labelled "replay acceptance".
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from scheduler.types import SamplingParams
from workers.batch import ForwardBatch
from workers.cache import GDNState, ModelCache, StepScratch
from workers.model import HybridModel
from workers.sampling import keyed_choice, processed_probs


@dataclass
class DraftRequest:
    """One request to draft for: its committed tokens and the pending one (last sampled, not yet cached)."""

    request_id: str
    token_ids: Sequence[int]  # every token of the request so far, the pending one last (a list or TokenView)
    num_cached: int  # tokens in the target's cache (= len(token_ids) - 1 for a decode)
    pages: list[int]  # target pages (the draft model mirrors them) covering num_cached + 1 + k
    slot: int
    k: int  # tokens to propose (the cap on this request's verification length)
    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own draft-sampling stream


@dataclass
class Proposal:
    tokens: list[list[int]]  # [B][k_i]
    # [B][k_i] the drafter's estimate that each token is accepted; for sampled drafts independent of what was drawn
    # (draw_independent: the plan's lengths may depend on them)
    confidence: list[list[float]]
    probs: list[Tensor | None] = field(default_factory=list)  # [B] of [k_i, V] draft distributions or None


def sample_drafts(logits: Tensor, requests: list[DraftRequest], step: int = 0
                  ) -> tuple[list[int], list[Tensor | None], list[float]]:
    """One draft token per request from a model drafter's logits [B, V] (`step`: drafts already proposed for each
    of them): greedy rows take the argmax (all read back at once), sampled rows draw from the request's processed
    distribution with its own draft stream, seeded ones with the target's keyed noise at that token's sequence
    index (acceptance: the keyed path). Returns tokens, the draft distribution q of sampled rows (None for greedy:
    a point mass), confidences: q(d) for greedy and seeded rows (their tokens are functions of the context and the
    seed); an unseeded sampled row's max q, a statistic of its distribution, never of the drawn token (the
    proposer then keeps its first draft's for the whole block: draw_independent)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
    best = probs.max(dim=-1)  # greedy token and its probability, per row
    toks, conf = best.indices.tolist(), best.values.tolist()
    dists: list[Tensor | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if r.params.temperature > 0:
            q = processed_probs(logits[i:i + 1], r.params.temperature, r.params.top_k, r.params.top_p)[0]
            if r.params.seed is not None:
                toks[i] = keyed_choice(q[None], [(r.params.seed, len(r.token_ids) + step)])[0]
            else:
                toks[i] = int(torch.multinomial(q, 1, generator=r.generator))
            # (an unseeded draw's own q(d) must not reach the plan: draw_independent; a seeded one's may)
            conf[i], dists[i] = float(q.max() if unkeyed_sampling(r.params) else q[toks[i]]), q
    return toks, dists, conf


def unkeyed_sampling(params: SamplingParams) -> bool:
    """A sampled request without a seed: its output follows the target's distribution under speculation only if
    what is verified does not depend on its drafts' draws (draw_independent). A greedy request's output is the
    argmax and a seeded one's its keyed draws, whatever is verified."""
    return params.temperature > 0 and params.seed is None


def draw_independent(confidence: list[float], sampled: bool) -> list[float]:
    """A block's confidences as the plan may read them. Speculative sampling is exact only if whether draft j is
    verified does not depend on draft j itself: with a sampled draft (d_j ~ q_j), verifying it when q_j(d_j) is
    high and not when it is low skews the output towards tokens the drafter likes (p = (0.5, 0.5), q = (0.9, 0.1),
    verify only d = a: P(a) = 0.55). The joint plan reads every draft's confidence at once, and q_{j+1} depends on
    d_j, so a sampled block gets its first draft's confidence (max q_1, a function of the committed context) at
    every position: its lengths then depend on nothing this step drew for it (the calibrator's per-position maps
    turn it into each position's acceptance). Greedy drafts are functions of the context, and a seeded request's
    output is its keyed draws whatever is verified (acceptance.py's keyed path): theirs stay per draft."""
    if not sampled or not confidence:
        return confidence
    return [confidence[0]] * len(confidence)


class Drafter:
    name = "base"
    # whether propose() runs on the device and reads its drafts back before it returns (so the device has done
    # everything queued before it): the runner then times its drafting with events (ModelRunner._DraftTimer)
    reads_back = False
    # whether its drafts are random draws even where it reports no distribution (probs None): the runner then treats
    # an unseeded sampled request's block as it treats a sampled draft model's (draw_independent, no extra token)
    draws_at_random = False

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        raise NotImplementedError

    def commit(self, requests: list[DraftRequest], accepted: list[int]) -> None:
        """Told how many of each request's proposals were accepted (stateful drafters roll back here)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests."""


class NgramDrafter(Drafter):
    """Finds the longest suffix (max_n down to min_n tokens) that occurred earlier in the request's tokens and
    proposes what followed it. Confidence: a prior by match length, decaying with the position."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # (a TokenView: many slices below)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow, n
        return [], 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens, conf = [], []
        for r in requests:
            follow, n = self.lookup(r.token_ids, r.k) if r.k > 0 else ([], 0)
            base = 1.0 - 0.5 ** n if n else 0.0  # longer matches are likelier to continue
            tokens.append(follow)
            conf.append([base * (0.9 ** j) for j in range(len(follow))])
        return Proposal(tokens, conf, [None] * len(requests))


REPLAY_CONFIDENCE = ("noise", "beta")
REPLAY_DRAWS = ("stream", "common")
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-mixed 64-bit value from any 64-bit input."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """_mix64 elementwise on uint64 (products wrap mod 2^64, as the masked Python ints)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class ReplayDrafter(Drafter):
    """Benchmarks only. For a request whose prompt has a reference continuation, proposes the reference's next
    tokens; each is kept right with probability p, else replaced by a different token, so the mean per-token
    acceptance of a greedy target that follows the reference is `acceptance`. `cost_model` (optional) is run on
    the drafted block so a real drafter's forward is spent.

    confidence="noise": p = acceptance for every token, confidence = p + N(0, noise): the confidence says
    nothing about which drafts are right (every draft looks alike; adaptive lengths have nothing to exploit).
    confidence="beta": each token's p ~ Beta(acceptance * concentration, (1 - acceptance) * concentration)
    (mean `acceptance`; smaller concentration = more spread), confidence = p + N(0, noise): an informative,
    calibrated-up-to-noise confidence, as a real drafter's probability of its token is (easy tokens near 1,
    hard ones low).
    draws="common": whether the draft for position t of a request is right is fixed by (seed, request id, t),
    not by the order of the random stream: every policy run on the same requests meets the same right and wrong
    drafts at the same positions (common random numbers), so policies compare without the luck of their own
    draws (with "stream", one run's mean accepted length moves by ~5% at 2k tokens). With beta confidences the
    token's p and its confidence's noise are fixed by (seed, request id, t) too (drawn per request in chunks of
    COMMON_CHUNK positions from a generator seeded by the request's key and the chunk's index)."""

    COMMON_CHUNK = 1024

    name = "replay"
    draws_at_random = True  # right or wrong, and the wrong token, are drawn (a greedy target's output is exact anyway)

    def __init__(self, acceptance: float, vocab_size: int, seed: int = 0, noise: float = 0.1,
                 cost_model: "DraftModelDrafter | None" = None, confidence: str = "noise",
                 concentration: float = 2.0, draws: str = "stream"):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"replay acceptance must be in [0, 1], got {acceptance}")
        if confidence not in REPLAY_CONFIDENCE:
            raise ValueError(f"replay confidence must be one of {REPLAY_CONFIDENCE}, got {confidence!r}")
        if not concentration > 0.0:
            raise ValueError(f"replay concentration must be > 0, got {concentration}")
        if draws not in REPLAY_DRAWS:
            raise ValueError(f"replay draws must be one of {REPLAY_DRAWS}, got {draws!r}")
        self.draws, self.seed = draws, seed
        self.acceptance, self.vocab, self.noise = acceptance, vocab_size, noise
        self.confidence, self.concentration = confidence, concentration
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)  # draws="common": the confidences' noise
        self.references: dict[tuple[int, ...], list[int]] = {}
        # request -> [prompt length, reference continuation, output tokens checked against it] (None: no reference)
        self._matched: dict[str, list | None] = {}
        self._keys: dict[str, int] = {}  # request -> its common-draws key
        # draws="common", beta: request -> chunk index -> ([COMMON_CHUNK] p, [COMMON_CHUNK] N(0, 1) noise)
        self._beta_chunks: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self.cost_model = cost_model
        self.reads_back = cost_model is not None

    def enable_graphs(self, max_batch: int, max_pages_per_request: int, max_block: int, capture: bool = True) -> None:
        """The cost model's forwards in CUDA graphs (see DraftModelDrafter.enable_graphs)."""
        if self.cost_model is not None:
            self.cost_model.enable_graphs(max_batch, max_pages_per_request, max_block, capture)

    def set_reference(self, prompt_ids: list[int], continuation: list[int]) -> None:
        self.references[tuple(prompt_ids)] = list(continuation)

    def _reference_for(self, request_id: str, tokens: list[int], k: int) -> list[int] | None:
        """The next k tokens of the reference, while the request's output still follows it (the output is checked
        against the reference once per token: rolled-back tokens are checked again, nothing is rescanned)."""
        if request_id not in self._matched:  # found once per request
            found = next(((len(p), c) for p, c in self.references.items() if tuple(tokens[:len(p)]) == p), None)
            self._matched[request_id] = None if found is None else [found[0], found[1], 0]
        state = self._matched[request_id]
        if state is None:
            return None
        n, cont, checked = state  # `checked` output tokens known to follow the reference
        done = len(tokens) - n
        if done > len(cont):
            return None
        checked = min(checked, done)
        if tokens[n + checked:] != cont[checked:done]:
            return None  # diverged from the reference
        state[2] = done
        return cont[done:done + k]

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._matched.pop(rid, None)
            self._keys.pop(rid, None)
            self._beta_chunks.pop(rid, None)

    def _token_acceptance(self) -> float:
        a = self.acceptance
        if self.confidence == "noise" or a in (0.0, 1.0):
            return a
        return self.rng.betavariate(a * self.concentration, (1.0 - a) * self.concentration)

    def _request_key(self, request_id: str) -> int:
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = _mix64(zlib.crc32(request_id.encode())
                                                  ^ (self.seed * 0x9E3779B97F4A7C15 & _MASK64))
        return key

    def _beta_common(self, request_id: str, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """draws="common", beta: ([n] p, [n] standard normal noise) of a request's positions first .. first + n - 1,
        each fixed by (seed, request id, position): chunk c of COMMON_CHUNK positions comes from a generator
        seeded by (request key, c), whatever was asked before."""
        chunks = self._beta_chunks.setdefault(request_id, {})
        key, size = self._request_key(request_id), self.COMMON_CHUNK
        a, c = self.acceptance * self.concentration, (1.0 - self.acceptance) * self.concentration
        ps, zs = [], []
        for ci in range(first // size, (first + n - 1) // size + 1):
            if ci not in chunks:
                g = np.random.default_rng([key, ci])
                chunks[ci] = (g.beta(a, c, size) if 0.0 < self.acceptance < 1.0 else np.full(size, self.acceptance),
                              g.standard_normal(size))
            lo, hi = max(first, ci * size) - ci * size, min(first + n, (ci + 1) * size) - ci * size
            ps.append(chunks[ci][0][lo:hi])
            zs.append(chunks[ci][1][lo:hi])
        return np.concatenate(ps), np.concatenate(zs)

    def _propose_common(self, requests: list[DraftRequest]) -> tuple[list[list[int]], list[list[float]]]:
        """draws="common" for every draft of the step at once (numpy): the draft at position t of a request is
        right iff mix(key, t) < p (noise: p = acceptance; beta: the position's own p, _beta_common), a wrong one
        is the reference token + 1 + mix(mix(key, t)) mod (V - 1); the confidences are p + N(0, noise) (noise:
        from the drafter's own stream, as they carry nothing; beta: the position's own noise)."""
        aheads = [self._reference_for(r.request_id, r.token_ids, r.k) or [] for r in requests]
        lens = [len(a) for a in aheads]
        n = sum(lens)
        if n == 0:
            return [[] for _ in requests], [[] for _ in requests]
        keys = np.repeat(np.array([self._request_key(r.request_id) for r in requests], dtype=np.uint64), lens)
        first = np.repeat(np.array([len(r.token_ids) for r in requests], dtype=np.int64), lens)  # [n]
        starts = np.repeat(np.cumsum([0] + lens[:-1]), lens)  # [n] each draft's request's first flat index
        pos = (first + np.arange(n) - starts).astype(np.uint64)  # [n] absolute positions
        x = _mix64_np(keys ^ (pos * np.uint64(0xD1B54A32D192ED03)))  # [n]
        if self.confidence == "beta":
            tables = [self._beta_common(r.request_id, len(r.token_ids), m) for r, m in zip(requests, lens) if m]
            p = np.concatenate([t[0] for t in tables])  # [n]
            noise = np.concatenate([t[1] for t in tables]) * self.noise  # [n]
        else:
            p, noise = self.acceptance, self.np_rng.normal(0.0, self.noise, n)
        right = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < p
        ref = np.fromiter(itertools.chain.from_iterable(aheads), np.int64, count=n)
        wrong = (ref + 1 + (_mix64_np(x) % np.uint64(self.vocab - 1)).astype(np.int64)) % self.vocab
        toks = np.where(right, ref, wrong).tolist()
        conf = np.clip(p + noise, 0.0, 1.0).tolist()
        bounds = np.cumsum([0] + lens).tolist()
        return ([toks[lo:hi] for lo, hi in zip(bounds, bounds[1:])],
                [conf[lo:hi] for lo, hi in zip(bounds, bounds[1:])])

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        if self.draws == "common":
            tokens, conf = self._propose_common(requests)
        else:
            tokens, conf = [], []
            for r in requests:
                ahead = self._reference_for(r.request_id, r.token_ids, r.k) or []
                out, c = [], []
                for j in range(min(r.k, len(ahead))):
                    p = self._token_acceptance()
                    right = self.rng.random() < p
                    tok = ahead[j] if right else (ahead[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                    out.append(tok)
                    c.append(min(1.0, max(0.0, p + self.rng.gauss(0.0, self.noise))))
                tokens.append(out)
                conf.append(c)
        if self.cost_model is not None:
            self.cost_model.spend_forward(requests, tokens)
        # an unseeded sampled request: a beta confidence follows the drawn p that decided right or wrong, so its
        # plan reads the mean acceptance instead (draw_independent's reason)
        conf = [[self.acceptance] * len(c) if unkeyed_sampling(r.params) else c for r, c in zip(requests, conf)]
        return Proposal(tokens, conf, [None] * len(requests))


class DraftModelDrafter(Drafter):
    """A small model with the target's tokenizer. Its cache mirrors the target's page ids and slot ids; a
    second bank of slots holds each request's last safe GDN state while it drafts, and `commit` restores it
    and replays exactly the accepted drafts in one ragged forward (the target's rollback, by replay)."""

    name = "draft"
    reads_back = True

    def __init__(self, model: HybridModel, num_pages: int, page_size: int, num_slots: int):
        self.model = model
        self.num_slots = num_slots
        # one spare page and slot past the mirrored ranges (and the backup bank): padding of captured graphs
        self.cache = ModelCache(model.config, num_pages + 1, page_size, 2 * num_slots + 1, model.dtype,
                                model.device)
        self.graphs = None  # StepGraphs for spend_forward (enable_graphs)
        self.cached: dict[str, int] = {}  # tokens of each request in the draft cache (its GDN state covers them)
        self.drafted: dict[str, list[int]] = {}

    def _forward(self, blocks: list[list[int]], contexts: list[int], requests: list[DraftRequest]) -> Tensor:
        """[B, V] logits at each block's last token; every request's state advances."""
        if self.graphs is not None:
            out = self.graphs.step(blocks, contexts, [r.pages for r in requests], [r.slot for r in requests],
                                   [True] * len(blocks))
            if out is not None:  # None: no bucket holds the blocks (or it could not be captured): eager
                last = torch.tensor([len(b) for b in blocks], device=out.logits.device).cumsum(0) - 1
                return out.logits.index_select(0, last)
        batch = ForwardBatch.build(blocks, contexts, [r.pages for r in requests], [r.slot for r in requests],
                                   self.model.device)
        return self.model(batch, self.cache)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens = {r.request_id: [] for r in requests}
        conf = {r.request_id: [] for r in requests}
        probs: dict[str, list[Tensor]] = {r.request_id: [] for r in requests}
        active = [r for r in requests if r.k > 0]
        if active:
            for r in active:
                if r.request_id not in self.cached:
                    self.cache.reset_slots([r.slot])
                    self.cached[r.request_id] = 0
            # catch up on everything not seen yet, up to and including the pending token (which is always kept)
            logits = self._forward([r.token_ids[self.cached[r.request_id]:] for r in active],
                                   [self.cached[r.request_id] for r in active], active)
            for r in active:
                self.cached[r.request_id] = len(r.token_ids)
            self._copy_slots([r.slot for r in active], to_backup=True)
            live = list(active)
            for j in range(max(r.k for r in active)):
                toks, dists, cs = sample_drafts(logits, live, j)
                for r, t, d, c in zip(live, toks, dists, cs):
                    tokens[r.request_id].append(t)
                    conf[r.request_id].append(c)
                    if d is not None:
                        probs[r.request_id].append(d)
                live = [r for r in live if len(tokens[r.request_id]) < r.k]
                if not live:
                    break
                logits = self._forward([[tokens[r.request_id][-1]] for r in live],
                                       [len(r.token_ids) + j for r in live], live)
            for r in active:
                self.drafted[r.request_id] = tokens[r.request_id]
        return Proposal([tokens[r.request_id] for r in requests],
                        [draw_independent(conf[r.request_id], unkeyed_sampling(r.params)) for r in requests],
                        [torch.stack(probs[r.request_id]) if probs[r.request_id] else None for r in requests])

    def _copy_slots(self, slots: list[int], to_backup: bool) -> None:
        for layer in self.cache.layers:
            if isinstance(layer, GDNState):
                idx = torch.tensor(slots, device=layer.recurrent.device)
                src, dst = (idx, idx + self.num_slots) if to_backup else (idx + self.num_slots, idx)
                layer.recurrent[dst] = layer.recurrent[src]
                layer.conv[dst] = layer.conv[src]

    def commit(self, requests: list[DraftRequest], accepted: list[int]) -> None:
        """Back to the state after the pending token; then replay the accepted drafts the draft has already
        fed itself (all but its last proposal), so its cache covers exactly the committed tokens."""
        done = [(r, a) for r, a in zip(requests, accepted) if r.request_id in self.drafted]
        if not done:
            return
        self._copy_slots([r.slot for r, _ in done], to_backup=False)
        replay = [(r, self.drafted.pop(r.request_id)[:min(a, r.k - 1)]) for r, a in done]
        replay = [(r, toks) for r, toks in replay if toks]
        if replay:
            self._forward([t for _, t in replay], [self.cached[r.request_id] for r, _ in replay],
                          [r for r, _ in replay])
            for r, toks in replay:
                self.cached[r.request_id] += len(toks)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.cached.pop(rid, None)
            self.drafted.pop(rid, None)

    def spend_forward(self, requests: list[DraftRequest], tokens: list[list[int]]) -> None:
        """The replay drafter's cost: one forward of each drafted block through this model, keeping no state, and
        its tokens read back to the host, as a real drafter's drafts are before the step's plan (the host waits
        for the forward; it does not plan while the drafter runs)."""
        blocks = [[r.token_ids[-1]] + t for r, t in zip(requests, tokens)]
        out = None
        if self.graphs is not None:
            out = self.graphs.step(blocks, [r.num_cached for r in requests], [r.pages for r in requests],
                                   [r.slot for r in requests], [False] * len(blocks))
        if out is not None:
            logits = out.logits
        else:
            batch = ForwardBatch.build(blocks, [r.num_cached for r in requests], [r.pages for r in requests],
                                       [r.slot for r in requests], self.model.device)
            logits = self.model(batch, self.cache, write=False, scratch=StepScratch({}))
        logits.argmax(dim=-1).tolist()  # [rows] token ids to the host

    def enable_graphs(self, max_batch: int, max_pages_per_request: int, max_block: int, capture: bool = True) -> None:
        """CUDA graphs for drafting steps, rollback replays and spend_forward (the replay drafter's cost),
        captured per bucket on first use (`capture=False`: the same padded batches eagerly, for tests)."""
        from workers.graphs import StepGraphs

        self.graphs = StepGraphs(self.model, self.cache, max_block=max_block, spare_page=self.cache.num_pages - 1,
                                 spare_slot=self.cache.num_slots - 1, page_table_width=max_pages_per_request,
                                 max_tokens=max_batch * max_block, capture=capture, commits=False)
