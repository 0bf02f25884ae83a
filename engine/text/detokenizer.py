"""Streaming detokenization: token ids in, text deltas out, with stop strings.

Works on bytes: each new token contributes `Tokenizer.token_bytes(id)`, fed to
an incremental UTF-8 decoder, so a step costs O(new tokens) rather than
re-decoding the sequence. The decoder holds back an incomplete character until
its last byte arrives, and turns bytes that can never complete into U+FFFD
exactly as `bytes.decode(errors="replace")` would.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol


class TokenSource(Protocol):
    """What the detokenizer needs from a tokenizer (engine.text.tokenizer.Tokenizer)."""

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def token_bytes(self, i: int) -> bytes: ...

    def token_text(self, i: int) -> str | None:
        """token_bytes(i) decoded, when they are whole UTF-8 characters on their own; else None."""
        ...

    def text_table(self) -> Sequence[object]:
        """What token_text reads and fills: entry i is token i's text (a str) once looked up, anything
        else where it is not whole characters or not looked up yet (it may be shorter than the vocabulary)."""
        ...


class IncrementalDetokenizer:
    """Turns ids into text deltas; never emits half a UTF-8 character."""

    # Slots, and a token's text read straight off the tokenizer's table while no character is
    # unfinished: one call a token on the decode road (two calls and a dict were ~1 µs a token there).
    __slots__ = ("_skip", "_utf8", "_token_bytes", "_token_text", "_decode", "_texts", "_known", "_unfinished")

    def __init__(self, tokenizer: TokenSource, skip_special_tokens: bool = True) -> None:
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Bound once: every token.
        self._token_bytes, self._token_text, self._decode = tokenizer.token_bytes, tokenizer.token_text, self._utf8.decode
        self._texts = tokenizer.text_table()
        self._known = len(self._texts)  # ids the table covers
        self._unfinished = False  # the decoder holds the first bytes of a character

    def push(self, ids: Iterable[int]) -> str:
        """Append ids; return the text they complete (possibly ""): the incremental decoder holds an
        incomplete character across tokens, so token by token gives the text their bytes give."""
        return "".join([self.push_token(i) for i in ids])

    def push_token(self, token: int) -> str:
        """push([token]), without the iteration (one token a step is the common case)."""
        if not self._unfinished and 0 <= token < self._known:
            text = self._texts[token]
            if text.__class__ is str and token not in self._skip:  # whole characters, looked up before
                return text
        return self._push_looked_up(token)

    def _push_looked_up(self, token: int) -> str:
        if token in self._skip:
            return ""
        if not self._unfinished:  # no character left unfinished: a token of whole characters is its own text
            text = self._token_text(token)
            if text is not None:
                return text
        data = self._token_bytes(token)
        if not data:
            return ""
        text = self._decode(data, False)
        self._unfinished = bool(self._utf8.buffer)
        return text

    def finish(self) -> str:
        """Flush: bytes of a character that never completed become U+FFFD."""
        self._unfinished = False
        return self._utf8.decode(b"", final=True)


def _held_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = max((len(s) for s in stops), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class TextStream:
    """Detokenizer plus stop strings, for one generated sequence.

    Text that could be the start of a stop string is held back until it either
    completes the stop string (then the stop and everything after it are
    dropped) or can no longer do so (then it is emitted). So a stop string that
    spans tokens never leaks, even in part.
    """

    def __init__(self, tokenizer: TokenSource, stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        # Empty stop strings would match everywhere; OpenAI ignores them too.
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._held = ""
        self.stopped_on: str | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        """True once a stop string matched or finish() ran; later pushes are ignored."""
        return self._finished or self.stopped_on is not None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    @property
    def push_plain(self) -> Callable[[int], str]:
        """A token's text for a stream without stop strings: nothing is ever held back there, so this is
        what push_token's text would be, without the tuple and the checks (the decode road, per token)."""
        if self._stops:
            raise ValueError("a stream with stop strings holds text back: use push_token")
        return self._detok.push_token

    def push(self, ids: Iterable[int]) -> tuple[str, str | None]:
        """Append ids; return (text safe to emit now, the stop string matched or None)."""
        if self.done:
            # The sequence already ended; a token sampled in the same step is dropped.
            return "", None
        return self._take(self._detok.push(ids))

    def push_token(self, token: int) -> tuple[str, str | None]:
        """push([token]), without the iteration."""
        if self.done:
            return "", None
        return self._take(self._detok.push_token(token))

    def _take(self, new: str) -> tuple[str, str | None]:
        text = self._held + new if self._held else new
        if not self._stops:
            self._held = ""
            return text, None
        # Any match lies inside `text`: whatever was emitted earlier could not
        # have started a stop string, or it would have been held.
        match = self._first_stop(text)
        if match is not None:
            at, stop = match
            self._held = ""
            self.stopped_on = stop
            return text[:at], stop
        keep = _held_length(text, self._stops)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # Earliest match wins; at the same position, the longer stop string.
        best: tuple[int, str] | None = None
        for s in self._stops:
            at = text.find(s)
            if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(s) > len(best[1]))):
                best = (at, s)
        return best

    def finish(self) -> str:
        """End of generation for another reason (length, eos): emit what was held back."""
        if self.done:
            return ""
        self._finished = True
        text = self._held + self._detok.finish()
        self._held = ""
        # The flush may only add U+FFFD, which cannot complete a stop string
        # unless a stop string contains it; check anyway for exactness.
        match = self._first_stop(text) if self._stops else None
        if match is not None:
            self.stopped_on = match[1]
            return text[: match[0]]
        return text
