"""Tokenizer wrapper, the embedded byte-level tokenizer, streaming detokenization
and stop-string helpers.

- ``Tokenizer``: wraps a Hugging Face ``tokenizers.Tokenizer`` loaded from a model
  directory's ``tokenizer.json``; knows the EOS id(s) from config.json /
  generation_config.json / well-known special tokens.
- ``build_byte_tokenizer`` / ``write_byte_tokenizer``: the engine's default
  tokenizer: 256 byte-level symbols (ids 0..255 in byte order), no merges, plus
  ``<|endoftext|>`` = 256. Any string round-trips exactly.
- ``IncrementalDetokenizer``: UTF-8-safe streaming decode using a small window
  (prefix offset / read offset, as vLLM and TGI do).
- ``find_stop`` / ``stop_holdback``: stop-string search and the number of trailing
  characters that must be withheld so a partial stop string is never streamed.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Iterable, Protocol

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from workers.config import lfs_pointer_hint

__all__ = [
    "BYTE_EOS_TOKEN",
    "IncrementalDetokenizer",
    "Tokenizer",
    "build_byte_tokenizer",
    "bytes_to_unicode",
    "find_stop",
    "stop_holdback",
    "write_byte_tokenizer",
]

BYTE_EOS_TOKEN = "<|endoftext|>"
# Special tokens that are taken as EOS when no config names one (in this order).
_EOS_TOKEN_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>")
_REPLACEMENT = "\ufffd"


# --------------------------------------------------------------------------- #
# Byte-level tokenizer
# --------------------------------------------------------------------------- #
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (the ByteLevel alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """Deterministic byte-level BPE: ids 0..255 = bytes 0..255, no merges,
    ``<|endoftext|>`` = 256. ByteLevel pre-tokenizer (no prefix space) and decoder."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(BYTE_EOS_TOKEN) == 256
    return tok


def write_byte_tokenizer(dirpath: str | os.PathLike) -> Path:
    """Write the byte tokenizer as ``<dirpath>/tokenizer.json``; returns that path."""
    d = Path(dirpath)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "tokenizer.json"
    build_byte_tokenizer().save(str(path))
    return path


# --------------------------------------------------------------------------- #
# Tokenizer wrapper
# --------------------------------------------------------------------------- #
def _as_id_list(value) -> list[int] | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [value]
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return list(value)
    return None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON in {path}: {e}") from e
    return data if isinstance(data, dict) else None


def _eos_from_dir(d: Path, tok: tokenizers.Tokenizer) -> list[int] | None:
    """Every EOS id the directory names, as transformers' generate stops at them: config.json's (or its text_config's),
    generation_config.json's (often a list: Qwen's chat models end turns with <|im_end|> and text with
    <|endoftext|>) and tokenizer_config.json's eos_token (a token string); None where none names one."""
    ids: list[int] = []
    cfg = _read_json(d / "config.json")
    if cfg is not None:
        found = _as_id_list(cfg.get("eos_token_id"))
        if found is None and isinstance(cfg.get("text_config"), dict):
            found = _as_id_list(cfg["text_config"].get("eos_token_id"))
        ids += found or []
    gen = _read_json(d / "generation_config.json")
    if gen is not None:
        ids += _as_id_list(gen.get("eos_token_id")) or []
    tok_cfg = _read_json(d / "tokenizer_config.json")
    if tok_cfg is not None:
        eos = tok_cfg.get("eos_token")
        name = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(name, str) and (i := tok.token_to_id(name)) is not None:
            ids.append(i)
    return list(dict.fromkeys(ids)) or None


# normalizers that keep every character (their slack: how many input characters may become one), pre-tokenizers that
# drop none, models that never map an unbounded run of text to one token: Tokenizer.chars_per_token_bound
_KEEPING_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _keeping_slack(config: dict) -> int | None:
    """The normalizers' slack where the tokenizer (tokenizer.json's config) keeps every character, else None."""
    def parts(node: dict | None, key: str) -> list[dict]:
        if not node:
            return []
        return [p for child in node.get(key, []) for p in parts(child, key)] if node.get("type") == "Sequence" \
            else [node]

    slack = 1
    for n in parts(config.get("normalizer"), "normalizers"):
        if n.get("type") not in _KEEPING_NORMALIZERS:
            return None
        slack = max(slack, _KEEPING_NORMALIZERS[n["type"]])
    for p in parts(config.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") not in _KEEPING_PRE_TOKENIZERS or str(p.get("behavior", "")).lower() == "removed":
            return None
    model = config.get("model") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in parts(config.get("pre_tokenizer"), "pretokenizers"))
    if model.get("type") == "BPE":  # unknown text: one unknown token a character, unless fused (and no byte fallback)
        if model.get("fuse_unk") and not model.get("byte_fallback") and not byte_level:
            return None
    elif not (model.get("type") == "Unigram" and model.get("byte_fallback")):  # WordPiece, WordLevel: a word -> [UNK]
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or []):
        return None
    return slack


class Tokenizer:
    """A model's tokenizer: ``encode`` (no special tokens added) / ``decode``."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_token_ids: Iterable[int] | None = None):
        self.hf = tok
        ids = list(eos_token_ids) if eos_token_ids is not None else []
        if not ids:
            ids = [i for name in _EOS_TOKEN_NAMES if (i := tok.token_to_id(name)) is not None]
        self._eos_list: list[int] = list(dict.fromkeys(ids))
        self._chars_bound: int | None | bool = False  # chars_per_token_bound, computed on first use (False: not yet)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        d = Path(path)
        file = d / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(errno.ENOENT, "tokenizer.json not found", str(file))
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a truncated or foreign file
            raise ValueError(f"{file}: not a readable tokenizers file ({e}){lfs_pointer_hint(file)}") from e
        return cls(tok, _eos_from_dir(d, tok))

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """The embedded default (byte) tokenizer; EOS = ``<|endoftext|>`` (256)."""
        return cls(build_byte_tokenizer())

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_list[0] if self._eos_list else None

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_list)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_released(self, text: str) -> list[int]:
        """encode's ids, computed with the GIL released (tokenizers' batch path): called from a worker thread, a
        long prompt's tokenization does not stall the event loop or the engine's thread (encode holds the GIL
        throughout: ~0.2 s for 120k tokens on this repo's CPU, and no other Python thread runs meanwhile)."""
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def chars_per_token_bound(self) -> int | None:
        """At most how many characters of a prompt one token can stand for, where this tokenizer keeps every character
        (up to a composing normalizer's merges), else None. A prompt of n characters then has at least n / this
        many tokens (engine.validation.check_text_size refuses a hopeless one untokenized). The bound: the longest
        token string of the vocabulary and the added tokens (a byte-level token's string has one character per byte,
        and its text no more characters than bytes; byte-fallback tokens such as <0x41> only overestimate), times
        the normalizer's slack (NFC / NFKC merge a letter and its marks, Hangul jamo 3 -> 1: 4). None where a part
        may drop or merge characters without limit: a normalizer that replaces, strips or removes accents, a
        pre-tokenizer that removes what it splits on (whitespace splitting, BERT's), a model that maps unknown text
        to one token (WordPiece, WordLevel, Unigram or BPE with fused unknowns and no byte fallback), added tokens
        that swallow whitespace (lstrip / rstrip)."""
        if self._chars_bound is False:
            config = json.loads(self.hf.to_str())
            slack = _keeping_slack(config)
            if slack is None:
                self._chars_bound = None
            else:
                longest = max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)
                self._chars_bound = max(1, longest) * slack
        return self._chars_bound

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self._eos_list)})"


# --------------------------------------------------------------------------- #
# Streaming detokenization
# --------------------------------------------------------------------------- #
class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams text from token ids without ever emitting a broken UTF-8 character.

    Only a window ``ids[prefix:]`` is decoded per push. ``prefix`` and ``read`` are
    token offsets where the decoded text ends on a complete character; the tokens in
    ``ids[prefix:read]`` are already emitted and give the decoder left context
    (needed by e.g. SentencePiece-style decoders). ``sent`` counts characters of the
    window's text already emitted. A trailing U+FFFD run (an incomplete multi-byte
    sequence) is held back; complete characters before it are emitted at once.
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = True, max_window: int = 64):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._max_window = max_window
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, ids: int | Iterable[int]) -> str:
        """Add token ids; return the newly completed text (possibly '')."""
        if isinstance(ids, int):
            self.ids.append(ids)
        else:
            self.ids.extend(ids)
        text = self._decode(self.ids[self._prefix :])
        complete = not text.endswith(_REPLACEMENT)
        stable = text if complete else text.rstrip(_REPLACEMENT)
        out = stable[self._sent :]
        self._sent = max(self._sent, len(stable))
        n = len(self.ids)
        if complete:
            if n > self._read:
                # Slide: the old read offset becomes the new window start.
                self._prefix, self._read = self._read, n
                self._sent = len(self._decode(self.ids[self._prefix :]))
        elif n - self._prefix > self._max_window:
            self._realign(text)
        return out

    def _realign(self, text: str) -> None:
        # Pathological case: many pushes in a row ended mid-character. Find a recent
        # token boundary that ends on a complete character and restart the window there.
        for j in range(len(self.ids) - 1, max(self._read, len(self.ids) - 8), -1):
            head = self._decode(self.ids[self._prefix : j])
            if not head.endswith(_REPLACEMENT) and text.startswith(head) and len(head) <= self._sent:
                self._sent -= len(head)
                self._prefix = self._read = j
                return

    def flush(self) -> str:
        """Return whatever is left (an invalid tail decodes with U+FFFD)."""
        text = self._decode(self.ids[self._prefix :])
        out = text[self._sent :]
        self._prefix = self._read = len(self.ids)
        self._sent = 0
        return out


# --------------------------------------------------------------------------- #
# Stop strings
# --------------------------------------------------------------------------- #
def find_stop(text: str, stops: Iterable[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    best = None
    for s in stops:
        if s:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
    return best


def stop_holdback(text: str, stops: Iterable[str]) -> int:
    """Number of trailing characters of ``text`` that could begin a stop string
    (a proper prefix of one) and so must not be streamed yet."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
