"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

`processed_probs` is the single definition of "the distribution a request samples from";
speculative rejection sampling must apply it to both draft and target logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scheduler.types import SamplingParams


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`; None (use the global RNG) when unseeded."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed))
    return g


_MASK64 = (1 << 64) - 1


def keyed_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (the request's seed, the token's index in its sequence): splitmix64 of a
    counter, so a seeded request draws the same noise for its n-th token whatever else is batched with it, however
    its tokens were split into steps and whatever was drafted before it (acceptance.accept_sampling's keyed path)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def keyed_choice(probs: Tensor, keys: list[tuple[int, int]]) -> list[int]:
    """probs [R, V] (zeros allowed), keys [R] of (seed, sequence index) -> one token per row: argmax of p / E with
    E ~ Exp(1) per token drawn from the row's keyed generator (the exponential race, Gumbel-max's twin: an exact
    draw from p; a token of probability 0 is never chosen). A drafter's q and the target's p at the same key race
    the same E, so their draws agree where q is close to p. The rows' draws are read back at once."""
    race = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)  # [R, V]
    for r, (seed, position) in enumerate(keys):
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(keyed_seed(seed, position))
        race[r].exponential_(generator=gen)
    return (probs.float() / race).argmax(dim=-1).tolist()


def processed_probs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k then top-p.

    Tokens are ranked by a stable descending sort, so ties break toward the lower token id
    (as argmax does) and top_k=1 always keeps exactly the argmax token. top-k keeps the first
    k ranks; top-p keeps the smallest prefix of ranks whose cumulative probability (after
    top-k) reaches top_p, always including the first. Everything else is exactly 0.
    """
    if not temperature > 0:
        raise ValueError(f"processed_probs needs temperature > 0, got {temperature!r}")
    x = logits.float()
    # Shift before scaling so a tiny temperature cannot turn finite logits into inf - inf.
    x = torch.sub(x, x.amax(dim=-1, keepdim=True)).div_(temperature)
    vocab = x.shape[-1]
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not (use_k or use_p):
        return torch.softmax(x, dim=-1)
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    if use_k:
        xs[..., top_k:] = float("-inf")
    if use_p:
        ps = torch.softmax(xs, dim=-1)
        # Mass strictly before each rank (exactly 0 for the first, so it is always kept).
        before = ps.cumsum(dim=-1).sub_(ps)
        xs.masked_fill_(before >= top_p, float("-inf"))
    ps = torch.softmax(xs, dim=-1)
    return torch.empty_like(ps).scatter_(-1, order, ps)


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """Logits [B, V] -> token ids [B] (int64, on logits' device).

    Rows with temperature 0 take the argmax (one vectorized call, no randomness consumed);
    the others draw from `processed_probs` with their own generator, one row at a time, so
    a seeded request gets the same tokens whatever else is in the batch.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(f"got {batch} logit rows, {len(params)} params, {len(generators)} generators")
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    # argmax on the raw dtype equals argmax in fp32 (widening is exact) and avoids a copy.
    if len(greedy) == batch:
        return logits.argmax(dim=-1)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if greedy:
        idx = torch.tensor(greedy, dtype=torch.int64, device=logits.device)
        out[idx] = logits.index_select(0, idx).argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        probs = processed_probs(logits[i : i + 1], p.temperature, p.top_k, p.top_p)
        out[i : i + 1] = torch.multinomial(probs, 1, generator=generators[i]).view(1)
    return out
