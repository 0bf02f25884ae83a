"""Prompt lookup ("n-gram") drafting: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, longest n first.

Agents re-send files, echo tool output and edit code in place, so what comes next has often been
seen before in the prompt or the output. The search runs in C: the token history is kept as a byte
array of 4-byte ids (appended to as tokens come, never rebuilt) and searched with `bytes.rfind`, so
a step costs microseconds even at 100k tokens of context.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence

from engine.kv.chain_hash import MEDIA_KEY_BASE

MAX_NGRAM = 4  # the longest suffix looked up (the most specific match is tried first)
MIN_NGRAM = 2  # one token alone matches too often to predict anything


class TokenHistory:
    """One sequence's tokens as 4-byte ids in a byte array, kept in step with its token list by `sync`."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data = bytearray()

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the history up to `tokens` (the sequence's list; it only ever grows at the end): the new
        tokens are appended, nothing before them is copied again."""
        have = len(self._data) // 4
        if len(tokens) < have:  # cannot happen to a sequence's tokens; start again rather than be wrong
            self._data.clear()
            have = 0
        if len(tokens) > have:
            self._data += array("I", tokens[have:]).tobytes()  # unsigned: an image's key ids are >= 2^31

    def propose(self, k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
        """Up to `k` tokens continuing the latest earlier occurrence of the history's last n tokens (n from
        `max_ngram` down to `min_ngram`); [] when no suffix recurs."""
        data = self._data
        count = len(data) // 4
        if k <= 0 or count <= min_ngram:
            return []
        for n in range(min(max_ngram, count - 1), min_ngram - 1, -1):
            suffix = bytes(data[(count - n) * 4:])
            limit = (count - 1) * 4  # a match ends before the last token, so a token follows it
            while (at := data.rfind(suffix, 0, limit)) >= 0:
                if at % 4 == 0:  # on a token boundary: a real match of n tokens
                    follow = at + 4 * n
                    draft = array("I", data[follow:follow + 4 * k]).tolist()
                    # an image's span is no tokens to draft: the draft ends where one begins
                    return list(itertools.takewhile(lambda t: t < MEDIA_KEY_BASE, draft))
                limit = at + 4 * n - 1  # straddles two tokens: look again for one starting before it
        return []
