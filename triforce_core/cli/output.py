"""What `generate` and `chat` print while an answer streams: each token's text, coloured on a
terminal by the level that proposed it, and the one-line statistics that go to stderr."""

from __future__ import annotations

import sys

LEVEL_COLOURS = {"lookup": "\x1b[33m", "draft": "\x1b[32m", "retrieval": "\x1b[34m", "target": "\x1b[31m"}


def write_tokens(ev, detok) -> None:
    """Stream a Committed event's text; with a detokenizer (a terminal) each token's text is
    coloured by the level that proposed it."""
    if detok is None:
        sys.stdout.write(ev.text)
    else:
        sys.stdout.write("".join(LEVEL_COLOURS.get(level, "") + text + "\x1b[0m"
                                 for text, level in zip(detok.push(ev.token_ids), ev.levels) if text))
    sys.stdout.flush()


def colour_detokenizer(engine, colour: bool):
    """Per-token text for colouring on a terminal (None: plain text, e.g. a pipe or NO_COLOR)."""
    from ..detokenize import IncrementalDetokenizer

    return IncrementalDetokenizer(engine.detokenize) if colour and engine.tokenizer is not None else None


def stats_line(s: dict) -> str:
    acc = ", ".join(f"{k} {v:.2f}" for k, v in s.get("acceptance", {}).items()) or "n/a"
    return (
        f"[{s['mode']}] {s['new_tokens']} tokens in {s['decode_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s), "
        f"prefill {s['prefill_s']:.2f}s, {s['mean_accepted']:.2f} tokens/target step, acceptance: {acc}"
    )
