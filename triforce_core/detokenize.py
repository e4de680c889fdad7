"""Incremental detokenization: the text each new token adds, at a cost independent of the
answer's length.

A token's text is the growth of the decoded sequence when the token is appended, so spacing
and characters that span several tokens come out right. Decoding the whole answer for every
token would cost O(answer) per token; only the last `window` tokens are decoded as context
(enough for any tokenizer's merges and multi-byte characters). A token that ends in the middle
of a multi-byte character adds nothing yet; the character comes out with the token that
completes it.
"""

from __future__ import annotations

from typing import Callable, Sequence


class IncrementalDetokenizer:
    """`push` gives each token's own text (for colouring by level); `push_text` the text of a
    whole round at once (the engine's `Committed.text`, on the decoding loop's hot path), with
    one decode per round: its context starts at an anchor that moves half a window at a time, so
    a round's context is the last round's decoded sequence, whose text is kept."""

    def __init__(self, decode: Callable[[Sequence[int]], str], window: int = 64):
        self.decode = decode
        self.window = window
        self.ids: list[int] = []
        self._last: tuple[int, int, str] = (0, 0, "")  # push_text's last context: start, end, its text

    def push(self, ids: Sequence[int]) -> list[str]:
        """The text each of `ids` adds ('' for a token that completes no character yet)."""
        out = []
        for tok in ids:
            ctx = self.ids[-self.window :]
            before = self.decode(ctx) if ctx else ""
            self.ids.append(int(tok))
            after = self.decode(ctx + [int(tok)])
            if after.endswith("\ufffd"):  # incomplete character: wait for the next token
                out.append("")
                continue
            # A completed character also finishes the earlier pending bytes: compare against
            # the undamaged part of `before`.
            stem = before.rstrip("\ufffd")
            out.append(after[len(stem) :] if after.startswith(stem) else after)
        return out

    def push_text(self, ids: Sequence[int]) -> str:
        """The text `ids` add together (what ''.join(push(ids)) gives)."""
        if not ids:
            return ""
        # at least `window` tokens of context, as `push` reads, and less than 1.5 windows
        half = max(self.window // 2, 1)
        start = max(len(self.ids) - self.window, 0) // half * half
        end = len(self.ids)
        if self._last[:2] == (start, end):  # the last round decoded exactly this context
            before = self._last[2]
        else:
            before = self.decode(self.ids[start:]) if end > start else ""
        self.ids += [int(t) for t in ids]
        whole = self.decode(self.ids[start:])
        self._last = (start, len(self.ids), whole)
        after = whole.rstrip("\ufffd")  # hold back an incomplete character
        stem = before.rstrip("\ufffd")
        return after[len(stem) :] if after.startswith(stem) else after
