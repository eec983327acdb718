"""The in-process Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.core import EngineConfig, EngineCore, StepOutput
from scheduler.request import RequestStats
from scheduler.types import InvalidRequest, SamplingParams

SPEC_METHODS = ("off", "ngram", "draft", "mtp", "replay")
POLICIES = ("ar", "fixed", "budget", "hybridspec")
MAX_VERIFY_LEN = 16
AVAILABLE_SPEC = ("off", "ngram", "draft", "mtp", "replay")
AVAILABLE_POLICIES = POLICIES


@dataclass
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    stats: RequestStats = field(default_factory=RequestStats)


class LLM:
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
            raise ValueError("spec='draft' needs draft_model: a model directory with the target's tokenizer")
        self.spec, self.policy, self.max_verify_len = spec, policy, max_verify_len
        self.engine = EngineCore(EngineConfig(model=model, device=device, dtype=dtype, spec=spec,
                                              policy=policy if spec != "off" else "ar",
                                              max_verify_len=max_verify_len, draft_model=draft_model,
                                              **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def set_replay_reference(self, prompt: str | list[int], continuation: list[int]) -> None:
        """Benchmarks (spec='replay'): the reference continuation the replay drafter proposes for a prompt."""
        drafter = getattr(getattr(self.engine.executor, "runner", None), "drafter", None)
        if not hasattr(drafter, "set_reference"):
            raise ValueError("set_replay_reference needs spec='replay' with the local executor")
        drafter.set_reference(self._prompt_ids(prompt), continuation)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Runs one prompt and yields its StepOutputs (new tokens and text) as they are produced."""
        params = params if params is not None else SamplingParams()
        rid, ids = f"llm-{next(self._ids)}", self._prompt_ids(prompt)
        self.last_stream_tokens: list[int] = []
        self.engine.add_request(rid, ids, params)
        try:
            while self.engine.has_work():
                for out in self.engine.step():
                    if out.request_id == rid:
                        self.last_stream_tokens.extend(out.new_token_ids)
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", "prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                 "prompt")
        self.engine.validate_prompt(ids)
        return ids

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerateResult]:
        """Runs every prompt to completion (batched together) and returns one result per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        requests = []
        for prompt, p in zip(prompts, param_list):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
            requests.append((f"llm-{next(self._ids)}", self._prompt_ids(prompt), p))
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
        texts: dict[str, list[str]] = {rid: [] for rid, _, _ in requests}
        results: dict[str, GenerateResult] = {}
        try:
            for rid, ids, p in requests:
                self.engine.add_request(rid, ids, p)
            while self.engine.has_work():
                for out in self.engine.step():
                    tokens[out.request_id].extend(out.new_token_ids)
                    texts[out.request_id].append(out.new_text)
                    if out.finished:
                        results[out.request_id] = GenerateResult(
                            [], tokens[out.request_id], "".join(texts[out.request_id]), out.finish_reason,
                            out.stats or RequestStats())
        finally:
            for rid, _, _ in requests:
                self.engine.abort(rid)  # frees whatever an exception left behind; no-op for finished ones
        for rid, ids, _ in requests:
            results[rid].prompt_token_ids = list(ids)
        return [results[rid] for rid, _, _ in requests]
