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
    whole round at once, with two decodes per round instead of two per token (the engine's
    `Committed.text`, on the decoding loop's hot path)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], window: int = 64):
        self.decode = decode
        self.window = window
        self.ids: list[int] = []

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
        ctx = self.ids[-self.window :]
        before = self.decode(ctx) if ctx else ""
        self.ids += [int(t) for t in ids]
        after = self.decode(ctx + [int(t) for t in ids]).rstrip("\ufffd")  # hold back an incomplete character
        stem = before.rstrip("\ufffd")
        return after[len(stem) :] if after.startswith(stem) else after
