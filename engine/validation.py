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


def _token_limit(max_model_len: int, memory_tokens: int | None) -> tuple[int, str]:
    """The most tokens (prompt + completion) one request may hold, and why: the model's length limit or (smaller)
    the KV memory's capacity per request."""
    if memory_tokens is not None and memory_tokens < max_model_len:
        return memory_tokens, f"the KV memory's capacity of {memory_tokens} tokens per request"
    return max_model_len, f"the model's length limit of {max_model_len} tokens"


def check_prompt_len(field: str, prompt_len: int, max_model_len: int, memory_tokens: int | None = None
                     ) -> tuple[int, str]:
    """The prompt alone against the most tokens one request may hold (_token_limit, returned)."""
    limit, why = _token_limit(max_model_len, memory_tokens)
    if prompt_len >= limit:
        raise InvalidRequest(f"{field} must be shorter than {why} (at most {limit - 1} tokens), "
                             f"got {prompt_len} tokens", field)
    return limit, why


def check_length(field: str, prompt_len: int, max_new_tokens: int, max_model_len: int,
                 memory_tokens: int | None = None, max_new_tokens_field: str = "max_new_tokens") -> None:
    """Prompt + completion against the model's length limit and (`memory_tokens`: KV pages x page size, what one
    request may ever hold) the KV memory. `field` names the prompt's field in the message."""
    limit, why = check_prompt_len(field, prompt_len, max_model_len, memory_tokens)
    if prompt_len + max_new_tokens > limit:
        raise InvalidRequest(
            f"{max_new_tokens_field} must be at most {limit - prompt_len} for this prompt ({prompt_len} tokens; "
            f"prompt + {max_new_tokens_field} must be within {why}), got {max_new_tokens}", max_new_tokens_field)


def check_text_size(field: str, text: str, tokenizer: Tokenizer, max_model_len: int,
                    memory_tokens: int | None = None) -> None:
    """Refuses, before tokenizing it, a text prompt too long to fit in any case: one of n characters has at least
    n / tokenizer.chars_per_token_bound tokens (no check where the tokenizer may drop or merge characters without
    limit). (Tokenizing 4 MB took ~9.5 s of CPU here, only for the request to be refused.)"""
    bound = tokenizer.chars_per_token_bound
    if bound is None:
        return
    limit, why = _token_limit(max_model_len, memory_tokens)
    most = (limit - 1) * bound
    if len(text) > most:
        raise InvalidRequest(f"{field} must be shorter than {why} (at most {limit - 1} tokens), got {len(text)} "
                             f"characters, more than {limit - 1} tokens of this tokenizer can hold ({most})", field)


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


@dataclass
class CheckedRequest:
    """A request with every field checked but its text prompt's tokens: `text` still to tokenize (None: `ids`,
    the prompt_token_ids, are checked)."""

    request_id: str
    params: SamplingParams
    field: str  # the prompt's field: "prompt" or "prompt_token_ids"
    text: str | None
    ids: list[int] | None


def check_request(request: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                  memory_tokens: int | None = None) -> CheckedRequest:
    """Every check that needs no tokenization (a text prompt's size against the most any prompt may hold too)."""
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
        if not request.prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        check_text_size("prompt", request.prompt, tokenizer, max_model_len, memory_tokens)
        return CheckedRequest(rid, params, "prompt", request.prompt, None)
    # the count first (a request message may be up to server.MAX_REQUEST_BYTES: copying and scanning millions of
    # ids only to refuse them stalled the event loop for seconds)
    check_prompt_len("prompt_token_ids", len(request.prompt_token_ids), max_model_len, memory_tokens)
    ids = list(request.prompt_token_ids)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"prompt_token_ids[{i}] must be a token id in [0, {vocab_size}), got {t}",
                                 "prompt_token_ids")
    return CheckedRequest(rid, params, "prompt_token_ids", None, ids)


def finish_request(checked: CheckedRequest, ids: list[int], max_model_len: int,
                   memory_tokens: int | None = None) -> ParsedRequest:
    """A checked request with its prompt's token ids (the text's, tokenized): the length checks."""
    if checked.text is not None and not ids:
        raise InvalidRequest("prompt must encode to at least one token", "prompt")
    check_length(checked.field, len(ids), checked.params.max_new_tokens, max_model_len, memory_tokens,
                 "sampling.max_new_tokens")
    return ParsedRequest(checked.request_id, ids, checked.params)


def undecodable_request(data: bytes, error: Exception) -> InvalidRequest:
    """What a GenerateRequest that protobuf cannot parse is told, naming the field where it can: a string field
    (prompt, request_id, sampling.stop[i]) whose bytes are not UTF-8, else the message as a whole."""
    field = _bad_utf8_field(data)
    if field is not None:
        return InvalidRequest(f"{field} must be valid UTF-8 text (proto3 string)", field)
    return InvalidRequest(f"request could not be parsed as a {pb.GenerateRequest.DESCRIPTOR.full_name} "
                          f"({type(error).__name__}: {error})", "request")


def _bad_utf8_field(data: bytes, message=pb.GenerateRequest.DESCRIPTOR, path: str = "",
                    counts: dict[str, int] | None = None) -> str | None:
    """The first string field of a serialized message (walking the wire format by its descriptor's field numbers,
    into its message fields) whose bytes are not UTF-8, as `sampling.stop[i]`; None where none is found (or the wire
    itself is broken). A repeated string's index counts across repeated occurrences of its message, which protobuf
    merges."""
    counts = {} if counts is None else counts
    try:
        for number, value in _length_delimited(data):
            fd = message.fields_by_number.get(number)
            if fd is None:
                continue
            name = f"{path}{fd.name}"
            if fd.message_type is not None:
                found = _bad_utf8_field(value, fd.message_type, f"{name}.", counts)
                if found is not None:
                    return found
            elif fd.type == fd.TYPE_STRING:
                index = counts.get(name, 0)
                counts[name] = index + 1
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
                    return f"{name}[{index}]" if repeated else name
    except ValueError:
        return None
    return None


def _length_delimited(data: bytes):
    """(field number, bytes) of each length-delimited field of a serialized message, skipping the others;
    ValueError on a broken wire."""

    def varint(i: int) -> tuple[int, int]:
        shift = result = 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            b = data[i]
            result |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not b & 0x80:
                return result, i

    i = 0
    while i < len(data):
        key, i = varint(i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = varint(i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = varint(i)
            if i + n > len(data):
                raise ValueError("truncated field")
            yield number, data[i:i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(data):
            raise ValueError("truncated field")
