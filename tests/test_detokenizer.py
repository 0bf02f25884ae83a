"""Streaming detokenizer and stop strings: equal to a full decode, never half a character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.text.detokenizer import IncrementalDetokenizer, TextStream
from engine.text.tiny_tokenizer import write_tiny_tokenizer
from engine.text.tokenizer import Tokenizer

TEXTS = [
    "Plain ASCII: the quick brown fox.",
    "café crème brûlée, naïve façade",
    "日本語 and 日本 and 東京タワー",
    "emoji 😀 🚀 🦀 👩‍👩‍👧 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓",
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "ü.txt"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("ignis-tiny")
    write_tiny_tokenizer(d)
    return Tokenizer.from_dir(d)


class FakeTokenizer:
    """Token i stands for the bytes pieces[i]; ids in `special` are special tokens."""

    def __init__(self, pieces: list[bytes], special: frozenset[int] = frozenset()) -> None:
        self.pieces = pieces
        self.special_token_ids = special
        self.table: list[object] = [None] * len(pieces)  # filled by token_text, as Tokenizer's

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def token_text(self, i: int) -> str | None:
        try:
            text: str | None = self.pieces[i].decode("utf-8")
        except UnicodeDecodeError:
            text = None
        self.table[i] = text
        return text

    def text_table(self) -> list[object]:
        return self.table


def make_fake(*pieces: bytes | str, special: frozenset[int] = frozenset()) -> FakeTokenizer:
    return FakeTokenizer([p.encode() if isinstance(p, str) else p for p in pieces], special)


def stream_all(stream: TextStream, ids: list[int], step: int = 1) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    for k in range(0, len(ids), step):
        delta, stop = stream.push(ids[k : k + step])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    deltas.append(stream.finish())
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_equals_full_decode(tok: Tokenizer, text: str, step: int) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[k : k + step]) for k in range(0, len(ids), step)]
    deltas.append(detok.finish())
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_texts_really_split_characters(tok: Tokenizer) -> None:
    # Guard for the test above: some tokens must hold only part of a character.
    pieces = [tok.token_bytes(i) for text in TEXTS for i in tok.encode(text)]
    assert any("\ufffd" in p.decode("utf-8", errors="replace") for p in pieces)


def test_partial_character_is_held_back() -> None:
    euro = "€".encode()  # 3 bytes
    fake = make_fake(euro[:1], euro[1:2], euro[2:], "x")
    detok = IncrementalDetokenizer(fake)
    assert [detok.push([0]), detok.push([1]), detok.push([2]), detok.push([3])] == ["", "", "€", "x"]


def test_invalid_bytes_become_replacement_chars_without_stalling() -> None:
    fake = make_fake(b"\x80", "a", b"\xe2\x82", "b", b"\xf0\x9f")
    detok = IncrementalDetokenizer(fake)
    assert detok.push([0]) == "\ufffd"  # a stray continuation byte can never complete
    assert detok.push([1]) == "a"
    assert detok.push([2]) == ""  # could still complete
    assert detok.push([3]) == "\ufffdb"  # it did not
    assert detok.push([4]) == ""
    assert detok.finish() == "\ufffd"  # truncated at the end


def test_random_bytes_match_bytes_decode_replace() -> None:
    rng = random.Random(7)
    alphabet = [b"a", b"\x80", b"\xc3", b"\xa9", b"\xe6\x97", b"\xa5", b"\xf0\x9f\x98", b"\x80", b"\xff", b" "]
    fake = make_fake(*alphabet)
    for _ in range(200):
        ids = [rng.randrange(len(alphabet)) for _ in range(rng.randint(0, 12))]
        detok = IncrementalDetokenizer(fake)
        streamed = "".join(detok.push([i]) for i in ids) + detok.finish()
        assert streamed == b"".join(alphabet[i] for i in ids).decode("utf-8", errors="replace")


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<tool_call>x</tool_call> ok<|im_end|><|endoftext|>")
    for skip in (True, False):
        stream = TextStream(tok, skip_special_tokens=skip)
        deltas, _ = stream_all(stream, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    skipped = "".join(stream_all(TextStream(tok), ids)[0])
    assert skipped == "assistant\n<tool_call>x</tool_call> ok"  # tool markers are not special


def test_stop_string_spanning_tokens_is_excluded(tok: Tokenizer) -> None:
    text = "The answer is 42. END OF ANSWER and then more text"
    ids = tok.encode(text)
    stream = TextStream(tok, stop=["END OF ANSWER"])
    deltas, stop = stream_all(stream, ids)
    assert stop == "END OF ANSWER"
    assert "".join(deltas) == "The answer is 42. "
    assert all("END" not in d for d in deltas)
    # The sequence is over: later tokens and finish() add nothing.
    assert stream.push(tok.encode(" more")) == ("", None)
    assert stream.finish() == ""
    assert stream.stopped_on == "END OF ANSWER"


def test_stop_string_fed_one_byte_at_a_time() -> None:
    fake = make_fake(*[bytes([b]) for b in "a→</s>b".encode()])
    stream = TextStream(fake, stop=["</s>"])
    deltas, stop = stream_all(stream, list(range(len(fake.pieces))))
    assert stop == "</s>"
    assert deltas == ["a", "", "", "→", "", "", "", ""]


def test_held_text_is_released_when_it_stops_matching() -> None:
    fake = make_fake("foo", " ST", "AR", "T", " STO", "P")
    stream = TextStream(fake, stop=["STOP"])
    assert stream.push([0]) == ("foo", None)
    assert stream.push([1]) == (" ", None)  # "ST" might start "STOP"
    assert stream.push([2]) == ("STAR", None)  # "STAR" cannot
    assert stream.push([3]) == ("T", None)
    assert stream.push([4]) == (" ", None)
    assert stream.push([5]) == ("", "STOP")


def test_held_text_is_flushed_on_finish() -> None:
    fake = make_fake("Hello <", "|im")
    stream = TextStream(fake, stop=["<|im_end|>"])
    assert stream.push([0]) == ("Hello ", None)
    assert stream.push([1]) == ("", None)
    assert stream.finish() == "<|im"
    assert stream.stopped_on is None and stream.done


def test_earliest_stop_wins_and_longer_at_same_position() -> None:
    fake = make_fake("abcdef")
    assert TextStream(fake, stop=["de", "bc"]).push([0]) == ("a", "bc")
    assert TextStream(fake, stop=["b", "bcd"]).push([0]) == ("a", "bcd")


def test_stop_at_the_very_start_and_empty_stops_ignored() -> None:
    fake = make_fake("\n\n", "text")
    stream = TextStream(fake, stop=["", "\n\n"])
    assert stream.push([0, 1]) == ("", "\n\n")


def test_no_stops_emits_everything_immediately(tok: Tokenizer) -> None:
    ids = tok.encode("nothing held back")
    stream = TextStream(tok)
    deltas = [stream.push([i])[0] for i in ids]
    assert all(deltas) and stream.finish() == ""


def test_stop_on_special_token_text_when_not_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("done<|im_end|>junk")
    stream = TextStream(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    deltas, stop = stream_all(stream, ids)
    assert "".join(deltas) == "done" and stop == "<|im_end|>"


@pytest.mark.parametrize("stop", [(), ("tool",), ("\n</tool_call>", "ü")])
def test_one_token_at_a_time_is_push_of_one(tok: Tokenizer, stop: tuple[str, ...]) -> None:
    """push_token (the engine's per-step call) says what push([token]) says, token by token."""
    ids = [i for text in TEXTS for i in tok.encode(text)] + sorted(tok.special_token_ids)[:2]
    for skip in (True, False):
        listed, single = TextStream(tok, stop, skip), TextStream(tok, stop, skip)
        for token in ids:
            assert single.push_token(token) == listed.push([token])
        assert single.finish() == listed.finish()


def test_the_table_read_gives_what_the_lookups_give(tok: Tokenizer) -> None:
    """Token by token, twice over the same ids (the first pass fills the tokenizer's table, the second
    reads it): special tokens skipped or kept, ids past the vocabulary dropped, split characters held."""
    rng = random.Random(3)
    ids = [i for text in TEXTS for i in tok.encode(text)]
    special = sorted(tok.special_token_ids)
    for _ in range(30):
        picked = [rng.choice(ids) for _ in range(rng.randint(1, 40))]
        picked.insert(rng.randrange(len(picked) + 1), rng.choice(special))
        picked.insert(rng.randrange(len(picked) + 1), tok.vocab_size + rng.randrange(5))  # a padded embedding's id
        valid = [i for i in picked if i < tok.vocab_size]
        for skip in (True, False):
            for _ in range(2):
                detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                text = "".join(detok.push_token(i) for i in picked) + detok.finish()
                assert text == tok.decode(valid, skip_special_tokens=skip)
