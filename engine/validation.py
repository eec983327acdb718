"""Checks a GenerateRequest field by field and turns it into engine inputs.

Every failure is an InvalidRequest whose message starts with the field's name (as in the .proto, e.g.
`sampling.top_p`) and states the allowed range and the value given; the server returns it verbatim as
INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from proto.hybridspec.v1 import generation_pb2 as pb
from scheduler.types import InvalidRequest, SamplingParams

MAX_REQUEST_ID_LEN = 256
DEFAULT_MAX_NEW_TOKENS = SamplingParams().max_new_tokens


@dataclass
class ParsedRequest:
    request_id: str  # as the client gave it ("" = none given)
    prompt_ids: list[int]
    params: SamplingParams


def parse_sampling(msg: pb.SamplingParams) -> SamplingParams:
    """Proto SamplingParams -> engine SamplingParams (unset optional fields take their defaults)."""
    kwargs: dict[str, object] = {"stop": list(msg.stop), "ignore_eos": msg.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidRequest as e:
        raise InvalidRequest(f"sampling.{e}", f"sampling.{e.field}") from None


def parse_request(request: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int,
                  max_model_len: int) -> ParsedRequest:
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, got {len(rid)}",
                             "request_id")
    has_text, has_ids = request.HasField("prompt"), len(request.prompt_token_ids) > 0
    if has_text == has_ids:
        raise InvalidRequest("exactly one of prompt or prompt_token_ids must be set, got "
                             + ("both" if has_text else "neither"), "prompt")
    params = parse_sampling(request.sampling)
    if has_text:
        field = "prompt"
        if not request.prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        ids = tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidRequest("prompt must encode to at least one token", "prompt")
    else:
        field = "prompt_token_ids"
        ids = list(request.prompt_token_ids)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidRequest(f"prompt_token_ids[{i}] must be a token id in [0, {vocab_size}), got {t}",
                                     "prompt_token_ids")
    if len(ids) >= max_model_len:
        raise InvalidRequest(f"{field} must be shorter than the model's length limit of {max_model_len} tokens, "
                             f"got {len(ids)} tokens", field)
    if len(ids) + params.max_new_tokens > max_model_len:
        raise InvalidRequest(
            f"sampling.max_new_tokens must be at most {max_model_len - len(ids)} for this prompt ({len(ids)} "
            f"tokens; the model's length limit is {max_model_len}), got {params.max_new_tokens}",
            "sampling.max_new_tokens")
    return ParsedRequest(rid, ids, params)
