"""Where an answer's text reaches a stop text, the answer ends: the tokens before it are kept.

    stop = StopText(("\\nQuestion:",), decode)
    keep = stop.push(new_tokens)      # None: go on; n: keep new_tokens[:n], the answer ends
    stop.cut                          # then: the character where the answer's text is cut
    cut_text(text, stops, stopped)    # an answer's whole text, cut where its stop text begins

A model without a chat template answers in a plain layout ("Question: ... Answer:" turns,
`prompting.render_prompt`) and, left alone, goes on to write the next question itself: the
answer ends where its text reaches "\\nQuestion:" (`prompting.answer_stops`). The decision is
made on the committed tokens only, after they are committed as they would have been without a
stop, so decoding stays exact: the answer's tokens are a prefix of those the same generation
gives without it. The tokens kept are those whose text begins before the stop text (one that
holds the stop's first characters and the answer's last ones stays; its text is cut there);
the caches are then rolled back to them as after a rejection. A stop text that spans rounds
began in tokens committed before it was seen (" Yes", "\n", then "Question:"): those stay, and
the answer's text is cut before them (`cut_text`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..detokenize import IncrementalDetokenizer


class StopText:
    """Watches an answer's committed tokens for the first of `stops` (see the module docstring).
    `answer_ids`: the answer's tokens so far (a continued answer's first part)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str],
                 answer_ids: Sequence[int] = ()):
        self.stops = tuple(s for s in stops if s)
        if not self.stops:
            raise ValueError("a stop text must not be empty")
        self.decode = decode
        self.ids = [int(t) for t in answer_ids]
        self.text = decode(self.ids).rstrip("\ufffd") if self.ids else ""
        self._detok = IncrementalDetokenizer(decode)
        self._detok.ids = list(self.ids)
        self.longest = max(len(s) for s in self.stops)
        self.cut: int | None = None  # the character of the answer's text where a stop text begins

    def push(self, new: Sequence[int]) -> int | None:
        """How many of `new` (the round's committed tokens) the answer keeps where their text
        reaches a stop text (the answer then ends), else None (all kept, the answer goes on)."""
        if self.cut is not None:
            return 0
        before = len(self.text)
        self.text += self._detok.push_text(new)
        start = max(before - self.longest + 1, 0)
        found = [at for at in (self.text.find(s, start) for s in self.stops) if at >= 0]
        if not found:
            self.ids += [int(t) for t in new]
            return None
        self.cut = min(found)
        keep = 0  # the fewest of `new` whose text, after the answer's, covers the text before the stop
        while keep < len(new) and len(self.decode(self.ids + list(new[:keep])).rstrip("\ufffd")) < self.cut:
            keep += 1
        self.ids += [int(t) for t in new[:keep]]
        return keep


def cut_text(text: str, stops: Sequence[str], stopped: bool) -> str:
    """`text` (an answer's) cut where the first of `stops` begins, and the whitespace before it
    dropped; `stopped`: the answer ended at a stop text, so an end of `text` that begins one (its
    first characters, committed before the rest was seen) is cut too."""
    found = [at for at in (text.find(s) for s in stops if s) if at >= 0]
    if found:
        return text[: min(found)].rstrip()
    if stopped:
        for at in range(max(len(text) - max((len(s) for s in stops), default=0), 0), len(text)):
            if any(s.startswith(text[at:]) for s in stops):
                return text[:at].rstrip()
    return text
