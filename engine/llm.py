"""The in-process Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.core import EngineConfig, EngineCore, StepOutput
from engine.validation import check_length, check_text_size
from scheduler.request import RequestStats
from scheduler.types import InvalidRequest, SamplingParams, not_unicode

SPEC_METHODS = ("off", "ngram", "draft", "mtp", "replay")
POLICIES = ("ar", "fixed", "budget", "hybridspec")
MAX_VERIFY_LEN = 16
AVAILABLE_SPEC = ("off", "ngram", "draft", "mtp", "replay")
AVAILABLE_POLICIES = POLICIES


class RequestFailed(RuntimeError):
    """A request of this LLM was aborted because a step of the engine failed while it ran (an exception or an
    interrupt in another call's step): its worker state (KV pages, GDN state) may be half-updated, so it is not
    continued. The call whose step failed gets that step's own exception."""


@dataclass
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    stats: RequestStats = field(default_factory=RequestStats)


class LLM:
    """One engine in this process. generate and stream may be called from several threads and several streams may
    be open at once: the engine steps one step at a time for all of them (a lock), and each call gets exactly its
    own requests' outputs."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", spec: str = "off",
                 policy: str = "hybridspec", max_verify_len: int = 16, draft_model: str | None = None,
                 **engine_options):
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {SPEC_METHODS}, got {spec!r}")
        if spec not in AVAILABLE_SPEC:
            raise ValueError(f"spec={spec!r} is not implemented in this build yet; available: {AVAILABLE_SPEC}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(max_verify_len, bool) or not isinstance(max_verify_len, int) or not 1 <= max_verify_len <= MAX_VERIFY_LEN:
            raise ValueError(f"max_verify_len must be an integer between 1 and {MAX_VERIFY_LEN}, got {max_verify_len!r}")
        if spec != "off" and policy not in AVAILABLE_POLICIES:
            raise ValueError(f"policy={policy!r} is not implemented in this build yet; with speculation use one of "
                             f"{AVAILABLE_POLICIES}")
        if draft_model is not None and spec not in ("draft", "replay"):
            raise ValueError("draft_model is only used with spec='draft' (or as the replay drafter's cost model)")
        if spec == "draft" and draft_model is None:
            raise ValueError("draft_model is needed with spec='draft': a model directory with the target's tokenizer")
        _check_engine_options(engine_options)
        self.spec, self.policy, self.max_verify_len = spec, policy, max_verify_len
        self.engine = EngineCore(EngineConfig(model=model, device=device, dtype=dtype, spec=spec,
                                              policy=policy if spec != "off" else "ar",
                                              max_verify_len=max_verify_len, draft_model=draft_model,
                                              **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # outputs of this LLM's requests in flight not yet consumed: several streams (and generate calls) may be
        # open at once, and each step's outputs go to their own request's buffer, none dropped
        self._outputs: dict[str, list[StepOutput]] = {}
        self._failed: dict[str, RequestFailed] = {}  # requests aborted by a failed step, to raise in their calls
        # one engine, one step at a time: generate / stream may be called from several threads (each call steps
        # the engine for every request under this lock; a stream holds it only between its outputs)
        self._lock = threading.RLock()
        self.last_stream_tokens: list[int] = []  # the tokens of the latest stream() started

    def set_replay_reference(self, prompt: str | list[int], continuation: list[int]) -> None:
        """Benchmarks (spec='replay'): the reference continuation the replay drafter proposes for a prompt."""
        drafter = getattr(getattr(self.engine.executor, "runner", None), "drafter", None)
        if not hasattr(drafter, "set_reference"):
            raise ValueError("set_replay_reference needs spec='replay' with the local executor")
        drafter.set_reference(self._prompt_ids(prompt), continuation)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Runs one prompt and yields its StepOutputs (new tokens and text) as they are produced. Several streams
        may be open at once (each steps the engine for all of them; none loses outputs)."""
        params = _check_params(params if params is not None else SamplingParams())
        rid, ids = f"llm-{next(self._ids)}", self._prompt_ids(prompt)
        self._check_length(ids, params)
        self.last_stream_tokens = tokens = []
        with self._lock:
            self._add(rid, ids, params)
        try:
            while True:
                with self._lock:
                    out = self._next_output(rid)
                if out is None:
                    return
                tokens.extend(out.new_token_ids)
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._forget(rid)

    def _next_output(self, rid: str) -> StepOutput | None:
        """The request's next output, stepping the engine until there is one (None: the engine has no work left
        and none came: aborted through llm.engine). Raises RequestFailed where a failed step aborted it."""
        while True:
            pending = self._outputs[rid]
            if pending:  # (what steps before a failed one produced is handed out first)
                return pending.pop(0)
            self._raise_if_failed(rid)
            if not self.engine.has_work():
                return None
            self._step()

    def _raise_if_failed(self, rid: str) -> None:
        error = self._failed.get(rid)
        if error is not None:
            raise error

    def _add(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(rid, ids, params)
        self._outputs[rid] = []

    def _forget(self, rid: str) -> None:
        """The request's call ended: its buffer goes, and the engine frees whatever it still holds (a no-op for
        a finished request; an abort that the garbage collector runs inside a step waits for the step's end)."""
        self._outputs.pop(rid, None)
        self._failed.pop(rid, None)
        self.engine.abort(rid)

    def _step(self) -> None:
        """One engine step; each output goes to its request's buffer (outputs of requests this LLM did not add,
        e.g. through llm.engine directly, are theirs to collect and are not kept here). A step that raises (an
        error, KeyboardInterrupt) has left the running requests' worker state unknown: every running request is
        aborted (as the server does), this LLM's others get RequestFailed in their calls, and the exception goes
        on to this call."""
        try:
            outputs = self.engine.step()
        except BaseException as e:
            self._fail_running(e)
            raise
        for out in outputs:
            pending = self._outputs.get(out.request_id)
            if pending is not None:
                pending.append(out)

    def _fail_running(self, error: BaseException) -> None:
        for rid in self.engine.fail_running():
            if rid in self._outputs:
                self._failed[rid] = RequestFailed(f"request {rid} was aborted: a step of the engine failed while it "
                                                  f"ran ({type(error).__name__}: {error})")

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        engine = self.engine
        check_length("prompt", len(ids), params.max_new_tokens, engine.max_model_len, engine.memory_tokens)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", "prompt")
            if (why := not_unicode("prompt", prompt)) is not None:
                raise InvalidRequest(why, "prompt")
            check_text_size("prompt", prompt, self.tokenizer, self.engine.max_model_len, self.engine.memory_tokens)
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            # integer types other than int (numpy's) become ints; anything else is named by validate_prompt
            ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                 "prompt")
        self.engine.validate_prompt(ids)
        return ids

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerateResult]:
        """Runs every prompt to completion (batched together) and returns one result per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # one prompt (its token ids)
        elif not isinstance(prompts, (list, tuple)):
            raise InvalidRequest(f"prompts must be a string, a list of token ids or a list of prompts, got "
                                 f"{type(prompts).__name__}", "prompts")
        params = params if params is not None else SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        requests = []
        for prompt, p in zip(prompts, param_list):
            ids = self._prompt_ids(prompt)
            self._check_length(ids, _check_params(p))
            requests.append((f"llm-{next(self._ids)}", ids, p))
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
        texts: dict[str, list[str]] = {rid: [] for rid, _, _ in requests}
        results: dict[str, GenerateResult] = {}
        try:
            with self._lock:
                for rid, ids, p in requests:
                    self._add(rid, ids, p)
            while True:
                with self._lock:
                    for rid, _, _ in requests:
                        for out in self._outputs.get(rid, ()):
                            tokens[rid].extend(out.new_token_ids)
                            texts[rid].append(out.new_text)
                            if out.finished:
                                results[rid] = GenerateResult([], tokens[rid], "".join(texts[rid]),
                                                              out.finish_reason, out.stats or RequestStats())
                        if rid in self._outputs:
                            self._outputs[rid].clear()
                        if rid not in results:
                            self._raise_if_failed(rid)
                    if len(results) == len(requests) or not self.engine.has_work():
                        break
                    self._step()
        finally:
            with self._lock:
                for rid, _, _ in requests:
                    self._forget(rid)  # frees whatever an exception left behind; no-op for finished ones
        for rid, ids, _ in requests:
            if rid not in results:  # ended without a final output (aborted through llm.engine)
                results[rid] = GenerateResult([], tokens[rid], "".join(texts[rid]), "abort")
            results[rid].prompt_token_ids = list(ids)
        return [results[rid] for rid, _, _ in requests]


def _check_params(params: object) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params


def _check_engine_options(options: dict) -> None:
    """The engine options LLM passes on are EngineConfig's fields (their values: EngineConfig.validate)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device", "dtype", "spec", "policy",
                                                                  "max_verify_len", "draft_model"}
    for name in options:
        if name not in known:
            raise TypeError(f"LLM got an unexpected option {name!r}; engine options are: {', '.join(sorted(known))}")
