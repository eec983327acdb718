"""What a load test sends: prompts (a JSONL file, or random token ids of a sampled length), output lengths (fixed
or sampled) and which streams are cancelled mid-stream, after how many chunks.

Every request is a pure function of (seed, index), so the closed and open loops, and every point of a sweep,
send the same requests in the same order.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

Prompt = str | list[int]

DIST_HELP = ("fixed:N | uniform:LO:HI (integers, both included) | normal:MEAN:STD | exp:MEAN "
             "(samples are rounded and clipped to >= 1)")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths, parsed from "fixed:64", "uniform:16:128", "normal:64:16" or
    "exp:64"."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        parts = spec.strip().split(":")
        kind, nums = parts[0].lower(), parts[1:]
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "exp": 1}
        if kind not in arity:
            raise ValueError(f"unknown length distribution {spec!r}; expected {DIST_HELP}")
        if len(nums) != arity[kind]:
            raise ValueError(f"length distribution {spec!r} needs {arity[kind]} number(s); expected {DIST_HELP}")
        try:
            values = [float(x) for x in nums]
        except ValueError:
            raise ValueError(f"length distribution {spec!r}: not a number; expected {DIST_HELP}") from None
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"length distribution {spec!r}: the numbers must be finite")
        if kind in ("fixed", "uniform") and any(v != int(v) or v < 1 for v in values):
            raise ValueError(f"length distribution {spec!r}: lengths must be integers >= 1")
        if kind == "uniform" and values[0] > values[1]:
            raise ValueError(f"length distribution {spec!r}: LO > HI")
        if kind in ("normal", "exp") and (values[0] <= 0 or (kind == "normal" and values[1] < 0)):
            raise ValueError(f"length distribution {spec!r}: the mean must be > 0 and the deviation >= 0")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        x = rng.gauss(self.a, self.b) if self.kind == "normal" else rng.expovariate(1.0 / self.a)
        return max(1, round(x))

    @property
    def max(self) -> float:
        return {"fixed": self.a, "uniform": self.b}.get(self.kind, float("inf"))


def load_prompts(path: str | Path) -> list[Prompt]:
    """A JSONL file, one object per line with "prompt" (text) or "prompt_token_ids" (a list of ints)."""
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected an object with \"prompt\" or \"prompt_token_ids\"")
            if isinstance(obj.get("prompt"), str) and obj["prompt"]:
                prompts.append(obj["prompt"])
            elif isinstance(obj.get("prompt_token_ids"), list) and obj["prompt_token_ids"] and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in obj["prompt_token_ids"]):
                prompts.append(list(obj["prompt_token_ids"]))
            else:
                raise ValueError(f"{where}: needs a non-empty \"prompt\" string or \"prompt_token_ids\" int list")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: Prompt
    max_new_tokens: int
    cancel_after_chunks: int | None  # leave the stream (cancelling the call) after this many chunks; None = never
    seed: int | None  # the sampling seed (with temperature > 0)


class Workload:
    """Request `i` of a run. `num_requests` known: exactly round(cancel_fraction * num_requests) of them are
    picked for cancellation; unknown (a time-bounded run): each one is, with probability cancel_fraction."""

    def __init__(self, *, vocab_size: int, max_model_len: int, prompts: list[Prompt] | None = None,
                 prompt_len: LengthDist | None = None, max_new_tokens: int = 64,
                 output_len: LengthDist | None = None, cancel_fraction: float = 0.0,
                 num_requests: int | None = None, seed: int = 0, sampling_seeds: bool = False):
        if not 0.0 <= cancel_fraction <= 1.0:
            raise ValueError(f"cancel fraction must be in [0, 1], got {cancel_fraction}")
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.prompts, self.prompt_len = prompts, prompt_len or LengthDist("uniform", 16, 128)
        self.max_new_tokens, self.output_len = max_new_tokens, output_len
        self.cancel_fraction, self.seed, self.sampling_seeds = cancel_fraction, seed, sampling_seeds
        self._cancel: set[int] | None = None
        if num_requests is not None:
            k = round(cancel_fraction * num_requests)
            self._cancel = set(random.Random(f"{seed}/cancel").sample(range(num_requests), k))

    def request(self, i: int) -> RequestSpec:
        rng = random.Random(f"{self.seed}/{i}")
        out_len = self.output_len.sample(rng) if self.output_len else self.max_new_tokens
        out_len = max(1, min(out_len, self.max_model_len - 1))
        if self.prompts:
            prompt: Prompt = self.prompts[i % len(self.prompts)]
        else:
            n = max(1, min(self.prompt_len.sample(rng), self.max_model_len - out_len))
            prompt = [rng.randrange(self.vocab_size) for _ in range(n)]
        cancel = (i in self._cancel) if self._cancel is not None else rng.random() < self.cancel_fraction
        # a 1-token output has no middle: its one chunk is also the last
        after = rng.randint(1, out_len - 1) if cancel and out_len > 1 else None
        seed = rng.randrange(2**62) if self.sampling_seeds else None
        return RequestSpec(i, prompt, out_len, after, seed)
