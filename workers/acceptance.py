"""Acceptance of drafted tokens against the target's distributions (lossless).

Greedy: the longest prefix of drafts equal to the target's argmax, then the target's own token.
Sampling: the standard rejection rule. Draft token d_j (drawn from q_j) is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the replacement is drawn from (p_j - q_j)+ renormalised;
when every draft is accepted a bonus token is drawn from p_{L+1}. p and q are `processed_probs` of the target
and draft logits with the request's own temperature / top-k / top-p. A drafter that proposes deterministic
tokens (n-gram lookup, replay) has q_j = one-hot(d_j).

Seeded sampling requests take the keyed path instead: the token at sequence index n is the exponential race of
p at that index with noise from a generator keyed by (seed, n) (sampling.keyed_choice: an exact draw from p), and a
draft counts iff it equals that draw (the first mismatch is replaced by it; a bonus token is the next index's draw).
The output is then exactly the plain keyed sampling of the target, token for token, whatever was drafted, batched
or preempted: lossless, and a seed gives the same tokens. One-hot drafts are accepted with probability p(d), as
by the rejection rule; a model drafter draws its seeded drafts from q with the same keyed noise
(drafters.sample_drafts), so where q is close to p its drafts mostly equal the target's draws.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scheduler.types import SamplingParams
from workers.sampling import keyed_choice, processed_probs


def accept_greedy(choices: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """choices: the target's argmax at the block's L+1 positions (read back for the whole step at once);
    drafts [L]. Returns (accepted count a, the a+1 new tokens)."""
    a = 0
    while a < len(drafts) and drafts[a] == choices[a]:
        a += 1
    return a, drafts[:a] + [choices[a]]


def accept_sampling(target_logits: Tensor, drafts: list[int], draft_probs: Tensor | None, params: SamplingParams,
                    generator: torch.Generator | None, position: int | None = None) -> tuple[int, list[int]]:
    """Rejection sampling. target_logits [L+1, V]; draft_probs [L, V] (processed) or None for one-hot drafts.
    `position`: the sequence index of the token the first row predicts; with a seed, the keyed path (module
    docstring)."""
    p = processed_probs(target_logits, params.temperature, params.top_k, params.top_p)  # [L+1, V]
    if params.seed is not None and position is not None:
        draws = keyed_choice(p, [(params.seed, position + j) for j in range(len(drafts) + 1)])
        a = 0
        while a < len(drafts) and drafts[a] == draws[a]:
            a += 1
        return a, drafts[:a] + [draws[a]]
    device = p.device
    for j, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        ratio = min(1.0, float(p[j, d]) / q_d) if q_d > 0 else 0.0
        u = float(torch.rand((), generator=generator, device=device))
        if u < ratio:
            continue
        residual = p[j].clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = (residual - draft_probs[j]).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q on the support: any draw from p is exact
            residual = p[j]
        token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return j, drafts[:j] + [token]
    bonus = int(torch.multinomial(p[len(drafts)], 1, generator=generator))
    return len(drafts), drafts + [bonus]


def accept(target_logits: Tensor, choices: list[int] | None, drafts: list[int], draft_probs: Tensor | None,
           params: SamplingParams, generator: torch.Generator | None,
           position: int | None = None) -> tuple[int, list[int]]:
    """target_logits [L+1, V]; choices: their argmax as host ints (needed for greedy requests only); `position`:
    the sequence index of the token the first row predicts (seeded sampling's keyed draws)."""
    if params.temperature == 0:
        return accept_greedy(choices if choices is not None else target_logits.argmax(dim=-1).tolist(), drafts)
    return accept_sampling(target_logits, drafts, draft_probs, params, generator, position)
