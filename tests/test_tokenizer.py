"""Tests for engine/tokenizer.py: byte tokenizer, Tokenizer wrapper, incremental
detokenizer, stop-string helpers."""

import codecs
import json
import random
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    build_byte_tokenizer,
    bytes_to_unicode,
    find_stop,
    stop_holdback,
    write_byte_tokenizer,
)

FAST = settings(max_examples=40, deadline=None)

# ----------------------------------------------------------------------------- fixtures
_TRAIN_TEXTS = [
    "hello world, héllo wörld!",
    "日本語のテキスト 日本 中文字符 中文",
    "emoji 😀😀 👍🏽 👨‍👩‍👧 🇯🇵 😀😀",
    "café naïve e\u0301 a\u0308 ñ",
    "The quick brown fox jumps over the lazy dog.",
]


def _train_bpe() -> tokenizers.Tokenizer:
    """Small byte-level BPE with merges (deterministic: fixed corpus, no randomness).
    Vocab size is small enough that some merges straddle UTF-8 character boundaries."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(_TRAIN_TEXTS, trainer)
    return tok


BYTE = Tokenizer(build_byte_tokenizer())
BPE = Tokenizer(_train_bpe())
_INV = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tok: Tokenizer, i: int) -> bytes:
    return bytes(_INV[c] for c in tok.id_to_token(i))


# Text with plenty of multi-byte characters: emoji (incl. ZWJ / skin tones / flags),
# CJK, combining marks, plus arbitrary unicode from hypothesis.
_SPECIAL_CHARS = list("😀👍🏽👨‍👩‍👧🇯🇵日本語中文テキスト한국어éñü\u0301\u0308\u200d \n\t\r") + ["\U0010fffd", "\x00"]
texts = st.lists(
    st.one_of(st.text(max_size=8), st.sampled_from(_SPECIAL_CHARS), st.sampled_from(_TRAIN_TEXTS)),
    max_size=12,
).map("".join)
valid_texts = texts.filter(lambda s: "\ufffd" not in s and "<|endoftext|>" not in s)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    outs, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        outs.append(detok.push(ids[i : i + n]))
        i += n
    return outs


# ----------------------------------------------------------------------------- byte tokenizer
def test_byte_tokenizer_layout():
    tok = build_byte_tokenizer()
    table = bytes_to_unicode()
    assert tok.get_vocab_size(with_added_tokens=True) == 257
    assert {table[b] for b in range(256)} == set(pre_tokenizers.ByteLevel.alphabet())
    for b in range(256):
        assert tok.id_to_token(b) == table[b]
    assert tok.token_to_id("<|endoftext|>") == 256
    assert BYTE.encode("A\xe9") == [65, 0xC3, 0xA9]
    assert BYTE.vocab_size == 257 and BYTE.eos_token_id == 256 and BYTE.eos_token_ids == {256}
    # deterministic serialization
    assert build_byte_tokenizer().to_str() == build_byte_tokenizer().to_str()


@FAST
@given(s=texts)
def test_byte_roundtrip(s):
    if "<|endoftext|>" in s:  # literal special-token text encodes to the special id
        return
    ids = BYTE.encode(s)
    assert ids == list(s.encode("utf-8"))
    assert BYTE.decode(ids) == s


@FAST
@given(s=texts)
def test_bpe_roundtrip(s):
    if "<|endoftext|>" in s:
        return
    assert BPE.decode(BPE.encode(s)) == s


def test_write_and_load_byte_tokenizer(tmp_path):
    p = write_byte_tokenizer(tmp_path / "m")
    assert p == tmp_path / "m" / "tokenizer.json" and p.is_file()
    first = p.read_bytes()
    write_byte_tokenizer(tmp_path / "m")
    assert p.read_bytes() == first
    tok = Tokenizer.from_dir(tmp_path / "m")
    assert tok.vocab_size == 257 and tok.eos_token_id == 256
    s = "héllo 😀 日本 e\u0301"
    assert tok.encode(s) == list(s.encode()) and tok.decode(tok.encode(s)) == s


# ----------------------------------------------------------------------------- from_dir / eos
def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_dir(tmp_path / "nope")


def _model_dir(tmp_path, config=None, gen=None):
    write_byte_tokenizer(tmp_path)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_eos_from_config_int(tmp_path):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"model_type": "qwen3_next", "eos_token_id": 7}))
    assert tok.eos_token_id == 7 and tok.eos_token_ids == {7}


def test_eos_from_config_list(tmp_path):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"eos_token_id": [9, 3, 9]}))
    assert tok.eos_token_id == 9 and tok.eos_token_ids == {9, 3}


def test_eos_of_config_and_generation_config_merged(tmp_path):
    """Qwen's chat checkpoints name <|im_end|> in config.json and [<|im_end|>, <|endoftext|>] in
    generation_config.json: a completion stops at either, as transformers' generate stops (it used to run on past
    the generation config's ids whenever config.json named one)."""
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"eos_token_id": [9, 3, 9]}, {"eos_token_id": [1, 9]}))
    assert tok.eos_token_id == 9 and tok.eos_token_ids == {9, 3, 1}


@pytest.mark.parametrize("eos", ["<|endoftext|>", {"content": "<|endoftext|>", "special": True}])
def test_eos_from_tokenizer_config(tmp_path, eos):
    d = _model_dir(tmp_path, {"eos_token_id": 7})
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    assert Tokenizer.from_dir(d).eos_token_ids == {7, 256}


@pytest.mark.parametrize("content,hint", [(None, ""), ("version https://git-lfs.github.com/spec/v1\n", "git lfs")])
def test_unreadable_tokenizer_file_is_a_value_error_naming_it(tmp_path, content, hint):
    d = _model_dir(tmp_path, {"eos_token_id": 7})
    file = d / "tokenizer.json"
    file.write_text(content if content is not None else file.read_text()[:200])  # a truncated download
    with pytest.raises(ValueError) as info:
        Tokenizer.from_dir(d)
    assert str(file) in str(info.value) and hint in str(info.value), str(info.value)


def test_eos_from_generation_config(tmp_path):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"model_type": "x", "eos_token_id": None}, {"eos_token_id": [5, 6]}))
    assert tok.eos_token_id == 5 and tok.eos_token_ids == {5, 6}


def test_eos_from_special_token(tmp_path):
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"model_type": "x"}))
    assert tok.eos_token_id == 256 and tok.eos_token_ids == {256}


def test_eos_none_without_candidates():
    tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    t = Tokenizer(tok)
    assert t.eos_token_id is None and t.eos_token_ids == set()


def test_eos_im_end_fallback():
    tok = build_byte_tokenizer()
    tok.add_special_tokens(["<|im_end|>"])
    t = Tokenizer(tok)
    assert t.eos_token_id == 256 and t.eos_token_ids == {256, 257}


# ----------------------------------------------------------------------------- incremental detok
def test_emoji_split_over_byte_tokens():
    ids = BYTE.encode("a😀b")
    assert ids == [97, 0xF0, 0x9F, 0x98, 0x80, 98]
    d = IncrementalDetokenizer(BYTE)
    assert [d.push([i]) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert d.flush() == ""


def test_complete_chars_not_held_behind_partial():
    d = IncrementalDetokenizer(BYTE)
    # one push completes 'é' and starts an emoji: 'é' comes out right away
    assert d.push([0xC3]) == ""
    assert d.push([0xA9, 0xF0, 0x9F]) == "é"
    assert d.push([0x98, 0x80]) == "😀"


def test_long_partial_chain_realigns_window():
    # pushes that each end mid-character; a tiny max_window forces realignment
    d = IncrementalDetokenizer(BYTE, max_window=2)
    pushes = [[0xC3], [0xA9, 0xE2], [0x82, 0xAC, 0xF0], [0x9F, 0x98, 0x80], [97]]
    assert [d.push(p) for p in pushes] == ["", "é", "€", "😀", "a"]
    assert d.flush() == ""
    assert len(d.ids) - d._prefix <= 4


def test_invalid_bytes_flush_matches_decode():
    for ids in ([0xE2, 0x82], [0xFF, 97, 0xC3], [97, 0xF0, 0x9F, 98], [0x80, 0x80]):
        d = IncrementalDetokenizer(BYTE)
        out = "".join(d.push([i]) for i in ids) + d.flush()
        assert out == BYTE.decode(ids)
    d = IncrementalDetokenizer(BYTE)
    assert d.push([0xE2, 0x82]) == ""
    assert d.flush() == "\ufffd"


def test_special_tokens_skipped_and_kept():
    ids = BYTE.encode("hi") + [256] + BYTE.encode("!")
    d = IncrementalDetokenizer(BYTE)
    assert "".join(d.push([i]) for i in ids) + d.flush() == "hi!"
    d = IncrementalDetokenizer(BYTE, skip_special_tokens=False)
    assert "".join(d.push([i]) for i in ids) + d.flush() == "hi<|endoftext|>!"


@pytest.mark.parametrize("tok", [BYTE, BPE], ids=["byte", "bpe"])
@FAST
@given(s=valid_texts, seed=st.integers(0, 2**32 - 1), win=st.sampled_from([1, 2, 64]))
def test_incremental_matches_full_decode(tok, s, seed, win):
    ids = tok.encode(s)
    d = IncrementalDetokenizer(tok, max_window=win)
    rng = random.Random(seed)
    utf8 = codecs.getincrementaldecoder("utf-8")()
    emitted, i = "", 0
    while i < len(ids):
        chunk = ids[i : i + rng.choice([1, 1, 1, 2, 3, 5])]
        i += len(chunk)
        out = d.push(chunk)
        assert "\ufffd" not in out
        emitted += out
        # every completed character is out immediately, nothing more
        expected_so_far = "".join(utf8.decode(token_bytes(tok, t)) for t in chunk)
        assert out == expected_so_far
    assert d.flush() == ""
    assert emitted == tok.decode(ids) == s


def test_bpe_has_merges_straddling_characters():
    # guard: the trained tokenizer really exercises partial-character tokens
    ids = BPE.encode("テキスト😀🇯🇵")
    assert any(not _is_utf8(token_bytes(BPE, i)) for i in ids)
    assert len(ids) < len("テキスト😀🇯🇵".encode())


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 256), max_size=60), seed=st.integers(0, 2**32 - 1), win=st.sampled_from([2, 4, 64]))
def test_incremental_arbitrary_bytes(ids, seed, win):
    d = IncrementalDetokenizer(BYTE, max_window=win)
    out = "".join(stream(d, ids, random.Random(seed))) + d.flush()
    assert out == BYTE.decode(ids)


class _CountingDecode:
    def __init__(self, tok):
        self.tok, self.max_len = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_len = max(self.max_len, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("tok", [BYTE, BPE], ids=["byte", "bpe"])
def test_decode_window_stays_small(tok):
    text = "".join(_TRAIN_TEXTS) * 20
    ids = tok.encode(text)
    counter = _CountingDecode(tok)
    d = IncrementalDetokenizer(counter)
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert out == text
    assert len(ids) > 1000 and counter.max_len <= 10


# ----------------------------------------------------------------------------- stop strings
def test_find_stop():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("hello", []) is None
    assert find_stop("hello", [""]) is None
    assert find_stop("a<|end|>b", ["<|end|>"]) == 1


def test_stop_holdback():
    assert stop_holdback("abc <|e", ["<|end|>"]) == 3
    assert stop_holdback("abc", ["c d"]) == 1
    assert stop_holdback("abc", ["xyz"]) == 0
    assert stop_holdback("xab", ["ab"]) == 0  # full match is find_stop's job
    assert stop_holdback("aa", ["aab", "ab"]) == 2
    assert stop_holdback("", ["ab"]) == 0
    assert stop_holdback("abc", []) == 0


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab<|>", max_size=30),
    stops=st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streaming_with_stops_never_leaks_partial(text, stops):
    # Stream char by char; emit only what can't be (part of) a stop string; stop at
    # the first stop string that completes, truncating at its start.
    emitted, result = "", text
    for n in range(1, len(text) + 1):
        cur = text[:n]
        idx = find_stop(cur, stops)
        safe = idx if idx is not None else n - stop_holdback(cur, stops)
        assert safe >= len(emitted)  # streamed text is never retracted
        emitted = cur[:safe]
        if idx is not None:
            result = cur[:idx]
            break
    assert result.startswith(emitted)
    assert find_stop(result, stops) is None
    if result == text:  # no stop: at the end the holdback is released
        assert text.startswith(emitted)
        assert len(text) - len(emitted) == stop_holdback(text, stops)
    else:
        assert emitted == result
