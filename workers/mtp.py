"""Qwen3-Next's multi-token-prediction (MTP) head, and the drafter that runs it.

The head (checkpoint tensors `mtp.*`): for the pair (token x_{q}, target hidden state h_{q-1}) it computes
    u = fc([pre_fc_norm_embedding(embed(x_q)), pre_fc_norm_hidden(h_{q-1})])      # [2H] -> [H]
    m = norm(decoder_layer(u))                                                     # one full-attention MoE layer
and the shared LM head turns m into logits for x_{q+1}. Drafting k tokens feeds the head its own m back.
h is the target's final-normed hidden state. The pair for token q sits at index q - 1 of the head's own paged
KV (which mirrors the target's page ids), and that index is also its rotary position; attention is the head's
only state, so rolling back is moving its length (pairs built from drafts are rewritten from target states).
No public Qwen3-Next MTP weights can be checked here: the rotary offset of a real checkpoint is unverified.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.batch import ForwardBatch
from workers.cache import ModelCache
from workers.config import FULL_ATTENTION, ModelConfig
from workers.drafters import Drafter, DraftRequest, Proposal, draw_independent, sample_drafts, unkeyed_sampling
from workers.model import DecoderLayer, HybridModel, Linear, MoEContext, RMSNorm, RotaryEmbedding
from workers.weights import Checkpoint, load_weights


def mtp_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The head's layers: full attention with the target's MoE, `num_layers` of them."""
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, layer_types=[FULL_ATTENTION] * num_layers,
                               moe_layers=[cfg.num_experts > 0] * num_layers)


def count_mtp_layers(model_dir: str | Path) -> int:
    names = Checkpoint(model_dir).names()
    found = {int(m.group(1)) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
    return max(found) + 1 if found else 0


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int, dtype, device):
        super().__init__()
        self.config = mtp_config(cfg, num_layers)
        h = cfg.hidden_size
        self.mtp = nn.Module()
        self.mtp.fc = Linear(2 * h, h, dtype, device)
        self.mtp.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.mtp.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, device)
        self.mtp.layers = nn.ModuleList([DecoderLayer(self.config, i, self.rope, dtype, device)
                                         for i in range(num_layers)])
        self.mtp.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.dtype, self.device = dtype, torch.device(device)

    @torch.inference_mode()
    def forward(self, embed: Tensor, hidden: Tensor, batch: ForwardBatch, cache: ModelCache,
                moe: MoEContext | None = None) -> Tensor:
        """embed [N, H] = embeddings of the input tokens, hidden [N, H] = the paired hidden states.
        Returns the head's normed output m [N, H] (writes the head's KV for every row)."""
        u = torch.cat([self.mtp.pre_fc_norm_embedding(embed), self.mtp.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.mtp.fc(u)
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        for layer, state in zip(self.mtp.layers, cache.layers):
            x, _ = layer(x, batch, state, cos, sin, moe=moe)
        return self.mtp.norm(x)


class _HeadStep(nn.Module):
    """The MTP head with HybridModel's step signature, so workers/graphs.py can capture its drafting steps: the
    paired hidden states come from a static buffer (`hidden_in`, filled before each replay), the output is the
    head's m (as the "hidden" output) and its logits through the target's LM head (into the graphs' buffer)."""

    def __init__(self, head: MTPHead, target: HybridModel, max_rows: int):
        super().__init__()
        self.head, self.target = head, target
        self.config, self.dtype, self.device = target.config, target.dtype, target.device
        self.hidden_in = torch.zeros(max_rows, target.config.hidden_size, dtype=target.dtype, device=target.device)

    def forward(self, batch: ForwardBatch, cache: ModelCache, logit_rows=None, write=True, scratch=None,
                return_hidden: bool = False, moe: MoEContext | None = None, all_rows_into: Tensor | None = None):
        n = batch.input_ids.shape[0]
        embed = F.embedding(batch.input_ids, self.target.model.embed_tokens.weight)
        m = self.head(embed, self.hidden_in[:n], batch, cache, moe)
        logits = self.target.logits(m, out=all_rows_into)  # fp32 from the LM head's GEMM on CUDA (HybridModel.logits)
        return (logits, m) if return_hidden else logits


class MTPDrafter(Drafter):
    """Drafts with the target's MTP head. It needs the target's hidden states of committed tokens: the runner
    passes them to `observe` after every step."""

    name = "mtp"
    reads_back = True
    needs_hidden = True

    def __init__(self, target: HybridModel, model_dir: str | Path, num_pages: int, page_size: int, num_slots: int):
        layers = count_mtp_layers(model_dir)
        if layers == 0:
            raise ValueError(f"spec 'mtp' needs a checkpoint with mtp.* tensors; {model_dir} has none")
        self.target = target
        self.head = MTPHead(target.config, layers, target.dtype, target.device)
        load_weights(self.head, model_dir, scope="mtp")
        # one spare page and slot past the mirrored ranges: padding of captured graphs
        self.cache = ModelCache(self.head.config, num_pages + 1, page_size, num_slots + 1, target.dtype,
                                target.device)
        self.pairs: dict[str, int] = {}  # pairs in the head's cache (= committed tokens - 1)
        self.last_hidden: dict[str, Tensor] = {}  # target hidden state of the last committed token
        self.graphs = None  # StepGraphs over _HeadStep for the drafting steps (enable_graphs)
        self._step: _HeadStep | None = None

    def enable_graphs(self, max_batch: int, max_pages_per_request: int, max_block: int, capture: bool = True) -> None:
        """CUDA graphs for drafting steps (one token per request, `capture=False`: the same padded batches
        eagerly, for tests). Observing committed tokens stays eager (its blocks are as long as a prefill)."""
        from workers.graphs import StepGraphs

        self._step = _HeadStep(self.head, self.target, max_batch * max_block)
        self.graphs = StepGraphs(self._step, self.cache, max_block=max_block, spare_page=self.cache.num_pages - 1,
                                 spare_slot=self.cache.num_slots - 1, page_table_width=max_pages_per_request,
                                 max_tokens=max_batch * max_block, return_hidden=True, capture=capture,
                                 commits=False)

    def _embed(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.target.device)
        return F.embedding(ids, self.target.model.embed_tokens.weight)

    def _run(self, tokens: list[list[int]], hiddens: list[Tensor], starts: list[int],
             requests: list[tuple[list[int], int]]) -> Tensor:
        """One ragged head forward; returns m at every row [N, H]."""
        batch = ForwardBatch.build(tokens, starts, [p for p, _ in requests], [s for _, s in requests],
                                   self.target.device)
        flat = [t for block in tokens for t in block]
        return self.head(self._embed(flat), torch.cat(hiddens), batch, self.cache)

    def observe(self, items: list[tuple[str, list[int], Tensor, int, list[int], int]]) -> None:
        """After a step: (request id, tokens committed this step, their target hidden states [n, H], position of
        the first one, pages, slot). Writes the pairs (x_q, h_{q-1}) into the head's cache."""
        blocks, hiddens, starts, where = [], [], [], []
        for rid, tokens, hidden, first, pages, slot in items:
            if first == 0:
                self.pairs[rid] = 0
                prev = None
            else:
                prev = self.last_hidden.get(rid)
            q0 = first if prev is not None else first + 1  # the very first token has no pair
            pair_tokens = tokens[q0 - first:]
            pair_hidden = ([prev[None]] if prev is not None else []) + ([hidden[:len(tokens) - 1]]
                                                                        if len(tokens) > 1 else [])
            self.last_hidden[rid] = hidden[-1].clone()
            if not pair_tokens:
                continue
            ph = torch.cat(pair_hidden)[-len(pair_tokens):]
            blocks.append(pair_tokens)
            hiddens.append(ph)
            starts.append(q0 - 1)
            where.append((pages, slot))
            self.pairs[rid] = q0 - 1 + len(pair_tokens)
        if blocks:
            self._run(blocks, hiddens, starts, where)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens = {r.request_id: [] for r in requests}
        conf = {r.request_id: [] for r in requests}
        probs: dict[str, list[Tensor]] = {r.request_id: [] for r in requests}
        live = [r for r in requests if r.k > 0 and r.request_id in self.last_hidden]
        inputs = {r.request_id: (r.token_ids[-1], self.last_hidden[r.request_id]) for r in live}
        step = 0
        while live:
            tokens_in = [[inputs[r.request_id][0]] for r in live]
            hiddens_in = [inputs[r.request_id][1][None] for r in live]
            starts = [r.num_cached - 1 + step for r in live]
            out = None
            if self.graphs is not None:
                self._step.hidden_in[:len(live)].copy_(torch.cat(hiddens_in))
                out = self.graphs.step(tokens_in, starts, [r.pages for r in live], [r.slot for r in live],
                                       [True] * len(live))
            if out is not None:  # rows == requests (one token each)
                m, logits = out.hidden, out.logits
            else:
                m = self._run(tokens_in, hiddens_in, starts, [(r.pages, r.slot) for r in live])
                logits = self.target.logits(m)  # [B, V] fp32
            toks, dists, cs = sample_drafts(logits, live, step)
            for i, (r, tok, dist, c) in enumerate(zip(live, toks, dists, cs)):
                tokens[r.request_id].append(tok)
                conf[r.request_id].append(c)
                if dist is not None:
                    probs[r.request_id].append(dist)
                inputs[r.request_id] = (tok, m[i].clone())  # (a graph's output buffer is reused next step)
            step += 1
            live = [r for r in live if len(tokens[r.request_id]) < r.k]
        return Proposal([tokens[r.request_id] for r in requests],
                        [draw_independent(conf[r.request_id], unkeyed_sampling(r.params)) for r in requests],
                        [torch.stack(probs[r.request_id]) if probs[r.request_id] else None for r in requests])

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.pairs.pop(rid, None)
            self.last_hidden.pop(rid, None)
