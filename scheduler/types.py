"""Plain data types shared by the engine, scheduler and workers (no torch here)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, islice

MAX_NEW_TOKENS = 8192
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_SEED = 2**63  # exclusive


class InvalidRequest(ValueError):
    """A request field is out of range or of the wrong type; `.field` names it.

    The message always names the field, the allowed range and the value given, so the
    gRPC layer can return it verbatim as INVALID_ARGUMENT.
    """

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keep `.field` across pickling (Ray executor)
        return (type(self), (str(self), self.field))


def _show(value: object) -> str:
    r = repr(value)
    if len(r) > 60:
        r = r[:57] + "..."
    if isinstance(value, (bool, int, float)) or value is None:
        return r
    return f"{r} ({type(value).__name__})"


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_bool(v: object) -> bool:
    """A bool, or a boolean scalar of an array library (numpy's bool_, which is no bool subclass)."""
    if isinstance(v, bool):
        return True
    dtype = getattr(v, "dtype", None)
    return getattr(dtype, "kind", None) == "b" and getattr(v, "shape", None) == ()


def not_unicode(field: str, text: str) -> str | None:
    """Why `text` is no Unicode text UTF-8 can carry (a lone surrogate: bytes that were not UTF-8, read with
    Python's surrogateescape as the command line and os.environ are, or half of a UTF-16 pair), naming `field`;
    None where it is."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f" (the byte 0x{code - 0xDC00:02x}, which is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        return f"{field} is not valid Unicode text: a lone surrogate U+{code:04X} at character {e.start}{byte}"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options. Validated on construction; change with dataclasses.replace."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = disabled, else >= 1
    max_new_tokens: int = 32  # 1..MAX_NEW_TOKENS
    stop: list[str] = field(default_factory=list)  # <= MAX_STOP_STRINGS, each 1..MAX_STOP_LEN chars
    seed: int | None = None  # same seed => same sampled output; 0 <= seed < 2**63
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "SamplingParams":
        """Check every field (raising InvalidRequest) and normalize numeric types in place."""
        t = self.temperature
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {_show(t)}", "temperature")
        p = self.top_p
        if not (_is_real(p) and 0 < p <= 1):  # NaN fails the comparison
            raise InvalidRequest(f"top_p must be in (0, 1], got {_show(p)}", "top_p")
        k = self.top_k
        if not (_is_int(k) and k >= 0):
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {_show(k)}", "top_k")
        n = self.max_new_tokens
        if not (_is_int(n) and 1 <= n <= MAX_NEW_TOKENS):
            raise InvalidRequest(
                f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {_show(n)}", "max_new_tokens"
            )
        stop = self.stop
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
            shown = f"{len(stop)} strings" if isinstance(stop, (list, tuple)) else _show(stop)
            raise InvalidRequest(f"stop must be a list of at most {MAX_STOP_STRINGS} strings, got {shown}", "stop")
        for i, s in enumerate(stop):
            if not (isinstance(s, str) and 1 <= len(s) <= MAX_STOP_LEN):
                raise InvalidRequest(
                    f"stop[{i}] must be a string of 1 to {MAX_STOP_LEN} characters, got {_show(s)}"
                    + (f" of length {len(s)}" if isinstance(s, str) else ""),
                    "stop",
                )
            if (why := not_unicode(f"stop[{i}]", s)) is not None:
                raise InvalidRequest(why, "stop")
        seed = self.seed
        if seed is not None and not (_is_int(seed) and 0 <= seed < MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2**63) or unset, got {_show(seed)}", "seed")
        if not _is_bool(self.ignore_eos):
            raise InvalidRequest(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}", "ignore_eos")
        # Normalize (e.g. numpy scalars, int temperature, a tuple or caller-owned list of stops).
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "max_new_tokens", int(n))
        object.__setattr__(self, "stop", list(stop))
        object.__setattr__(self, "seed", None if seed is None else int(seed))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        return self


class TokenView(Sequence):
    """A request's prompt followed by its output as one read-only sequence, built in O(1) (nothing is copied): the
    whole sequence a decode's drafter may read (StepRequest.all_tokens). A concatenation copied every running
    request's whole sequence at every step (bench/NOTES.md, 2026-12-01). Its length is fixed when it is built, so
    tokens appended to the output later are not in it (the lists only grow). Indexing gives ints, slicing gives
    lists; it compares equal to any sequence of the same tokens and pickles as a plain list (Ray)."""

    __slots__ = ("_head", "_tail", "_nh", "_n")

    def __init__(self, head: list[int], tail: list[int]):
        self._head, self._tail = head, tail
        self._nh = len(head)
        self._n = self._nh + len(tail)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        nh = self._nh
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= start:
                return []
            if start >= nh:
                return self._tail[start - nh:stop - nh]
            if stop <= nh:
                return self._head[start:stop]
            return self._head[start:] + self._tail[:stop - nh]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(f"token index {index} out of range for {self._n} tokens")
        return self._head[i] if i < nh else self._tail[i - nh]

    def __iter__(self):
        return chain(self._head, islice(self._tail, self._n - self._nh))

    def tolist(self) -> list[int]:
        """The tokens as a new list (one concatenation: ~4x faster than list(view))."""
        return self._head + self._tail[:self._n - self._nh]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._n and self.tolist() == list(other)

    __hash__ = None  # type: ignore[assignment]  # (a view of mutable lists)

    def __reduce__(self):
        return (list, (self.tolist(),))

    def __repr__(self) -> str:
        return f"TokenView({self.tolist()!r})"


@dataclass
class StepRequest:
    """What the worker needs to run one request's part of a step (plain data: crosses to a Ray actor)."""

    request_id: str
    tokens: list[int]  # new tokens fed this step
    context_len: int  # tokens already cached (KV pages and GDN state)
    pages: list[int]  # KV pages, in token order, covering context_len + len(tokens)
    slot: int  # GDN state slot
    sample: bool  # sample the next token after this step (False for a non-final prefill chunk)
    params: SamplingParams
    draft_cap: int = 0  # a decode may verify up to this many drafted tokens (pages are reserved for them)
    # the whole sequence so far, for drafters (decodes that may draft; a TokenView where the scheduler built it)
    all_tokens: Sequence[int] = field(default_factory=list)


@dataclass
class StepResult:
    """Per request that sampled: the new token ids, in order."""

    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    draft_tokens: dict[str, int] = field(default_factory=dict)  # drafted tokens verified, per request
    accepted_tokens: dict[str, int] = field(default_factory=dict)  # of those, accepted
    step_ms: float = 0.0  # time the worker spent on the step
    policy_stats: dict[str, float] = field(default_factory=dict)  # latency-model / calibration error, now and then
    # drafts per request the worker's policy would verify at most at this step's batch size (hybridspec's draft_cap,
    # else its max_verify_len); None: the step says nothing (not a decode step of a drafting worker). The scheduler
    # reserves no more pages than this for the next step's drafts
    draft_cap_hint: int | None = None

    @staticmethod
    def merged(parts: "list[StepResult]") -> "StepResult":
        """One step's results from several workers (expert-parallel ranks, each running its own requests): tokens
        of every request, the slowest rank's time, the first non-empty policy stats, the largest draft-cap hint
        (each rank's policy sees its own batch; a rank without decodes says nothing)."""
        out = StepResult()
        for p in parts:
            out.new_tokens.update(p.new_tokens)
            out.draft_tokens.update(p.draft_tokens)
            out.accepted_tokens.update(p.accepted_tokens)
        out.step_ms = max((p.step_ms for p in parts), default=0.0)
        out.policy_stats = next((p.policy_stats for p in parts if p.policy_stats), {})
        hints = [p.draft_cap_hint for p in parts if p.draft_cap_hint is not None]
        out.draft_cap_hint = max(hints) if hints else None
        return out
