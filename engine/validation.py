"""Checks a GenerateRequest field by field and turns it into engine inputs.

Every failure is an InvalidRequest whose message starts with the field's name (as in the .proto, e.g.
`sampling.top_p`) and states the allowed range and the value given; the server returns it verbatim as
INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

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


def _unknown_field_numbers(msg: Message) -> list[int]:
    """Field numbers present on the wire that this server's .proto does not define (parsed, kept aside by protobuf)."""
    try:
        from google.protobuf import unknown_fields
    except ImportError:  # protobuf < 4.22: the (since removed) message method
        return sorted({f.field_number for f in msg.UnknownFields()})  # type: ignore[attr-defined]
    return sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})


def reject_unknown_fields(msg: Message, path: str = "") -> None:
    """A field this server does not know (a newer client's option) is refused, never silently ignored: it would
    change what the client asked for without telling it. Checks `msg` and the messages set inside it."""
    numbers = _unknown_field_numbers(msg)
    name = path or msg.DESCRIPTOR.name
    if numbers:
        known = ", ".join(f"{f.name} = {f.number}" for f in msg.DESCRIPTOR.fields)
        shown = ", ".join(map(str, numbers))
        raise InvalidRequest(
            f"{name} has field number{'s' if len(numbers) > 1 else ''} {shown}, which this server does not support; "
            f"the fields of {msg.DESCRIPTOR.full_name} it knows are: {known}", name)
    for fd, value in msg.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if fd.message_type is not None and not repeated:
            reject_unknown_fields(value, f"{path}.{fd.name}" if path else fd.name)


def check_length(field: str, prompt_len: int, max_new_tokens: int, max_model_len: int,
                 memory_tokens: int | None = None, max_new_tokens_field: str = "max_new_tokens") -> None:
    """Prompt + completion against the model's length limit and (`memory_tokens`: KV pages x page size, what one
    request may ever hold) the KV memory. `field` names the prompt's field in the message."""
    limit, why = max_model_len, f"the model's length limit of {max_model_len} tokens"
    if memory_tokens is not None and memory_tokens < max_model_len:
        limit, why = memory_tokens, f"the KV memory's capacity of {memory_tokens} tokens per request"
    if prompt_len >= limit:
        raise InvalidRequest(f"{field} must be shorter than {why} (at most {limit - 1} tokens), "
                             f"got {prompt_len} tokens", field)
    if prompt_len + max_new_tokens > limit:
        raise InvalidRequest(
            f"{max_new_tokens_field} must be at most {limit - prompt_len} for this prompt ({prompt_len} tokens; "
            f"prompt + {max_new_tokens_field} must be within {why}), got {max_new_tokens}", max_new_tokens_field)


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
                  max_model_len: int, memory_tokens: int | None = None) -> ParsedRequest:
    """`memory_tokens`: the most tokens (prompt + completion) one request can ever hold in the KV pool."""
    reject_unknown_fields(request)
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, got {len(rid)}",
                             "request_id")
    has_text, has_ids = request.HasField("prompt"), len(request.prompt_token_ids) > 0
    if has_text == has_ids:
        raise InvalidRequest("exactly one of prompt (a non-empty string) or prompt_token_ids (a non-empty list of "
                             "token ids) must be set, got " + ("both" if has_text else "neither"), "prompt")
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
    check_length(field, len(ids), params.max_new_tokens, max_model_len, memory_tokens, "sampling.max_new_tokens")
    return ParsedRequest(rid, ids, params)
