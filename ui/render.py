"""Events -> coloured text. Pure functions: the same events always give the same output.

Each committed token is coloured by the level that proposed it: the small draft, the retrieval
draft (target weights over the retrieved KV chunks) or the full target (its own token after a
rejection, or a bonus). Rendering reads only `Committed` events; nothing is re-derived from text.
"""

from __future__ import annotations

import html
from typing import Callable, Iterable, Sequence

from triforce_core.events import Committed, Event

# level -> (label, background colour for HTML, ANSI colour for terminals)
LEVEL_STYLE = {
    "draft": ("small draft", "#c8f7c5", "\x1b[32m"),
    "retrieval": ("retrieval draft", "#c5dcf7", "\x1b[34m"),
    "target": ("full target", "#f7c5c5", "\x1b[31m"),
}
_RESET = "\x1b[0m"


class TokenSplitter:
    """Splits committed tokens into (text, level) pieces, incrementally.

    Each token's text is the growth of the decoded prefix, so spacing and characters spread
    over several tokens come out right (an incomplete character is attached to the next token).
    Decoding the whole prefix each time is fine for one answer; `window` bounds the cost by
    decoding only the last tokens.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], window: int = 64):
        self.decode = decode
        self.window = window
        self.ids: list[int] = []

    def push(self, ev: Committed) -> list[tuple[str, str]]:
        out = []
        for tok, level in zip(ev.token_ids, ev.levels):
            ctx = self.ids[-self.window :]
            before = self.decode(ctx) if ctx else ""
            self.ids.append(tok)
            after = self.decode(ctx + [tok])
            if after.endswith("\ufffd"):  # incomplete character: wait for the next token
                out.append(("", level))
                continue
            # a completed character may also finish earlier pending bytes: compare on the
            # undamaged part of `before`
            stem = before.rstrip("\ufffd")
            out.append((after[len(stem) :] if after.startswith(stem) else after, level))
        return out


def _pieces(events: Iterable[Event], decode: Callable[[Sequence[int]], str]) -> list[tuple[str, str]]:
    splitter = TokenSplitter(decode)
    out: list[tuple[str, str]] = []
    for ev in events:
        if isinstance(ev, Committed):
            out += splitter.push(ev)
    return out


def tokens_html(events: Iterable[Event], decode: Callable[[Sequence[int]], str]) -> str:
    """HTML spans, one per committed token, coloured by level (title = level name)."""
    spans = []
    for text, level in _pieces(events, decode):
        label, colour, _ = LEVEL_STYLE[level]
        spans.append(
            f'<span class="tf-{level}" title="{label}" style="background:{colour}">{html.escape(text)}</span>'
        )
    return "".join(spans)


def legend_html() -> str:
    return " ".join(
        f'<span class="tf-{lvl}" style="background:{colour}">{label}</span>'
        for lvl, (label, colour, _) in LEVEL_STYLE.items()
    )


def terminal_text(events: Iterable[Event], decode: Callable[[Sequence[int]], str]) -> str:
    """The same colouring with ANSI escape codes, for a terminal."""
    return ansi(_pieces(events, decode))


def ansi(pieces: Iterable[tuple[str, str]]) -> str:
    return "".join(LEVEL_STYLE[level][2] + text + _RESET for text, level in pieces if text)
