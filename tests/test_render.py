"""The pure renderers: committed events -> coloured HTML / terminal text."""

from __future__ import annotations

from triforce_core.events import Committed, Drafted, Finished, GenerationStats
from ui import legend_html, terminal_text, tokens_html

WORDS = {5: "Hello", 6: ",", 7: " world", 8: " <b>&"}


def decode(ids):
    return "".join(WORDS[i] for i in ids)


EVENTS = [
    Drafted("draft", (5, 6)),
    Committed((5, 6), ("draft", "retrieval"), "Hello,"),
    Committed((7, 8), ("target", "draft"), " world <b>&"),
    Finished(GenerationStats(1, 4, 0.0, 0.1, 40.0, 2, 2.0)),
]


def test_one_span_per_token_coloured_by_level():
    out = tokens_html(EVENTS, decode)
    assert out.count("<span") == 4
    assert out.index('class="tf-draft"') < out.index('class="tf-retrieval"') < out.index('class="tf-target"')
    assert "&lt;b&gt;&amp;" in out and "<b>" not in out  # model text is escaped
    assert 'title="full target"' in out


def test_terminal_text_and_legend():
    out = terminal_text(EVENTS, decode)
    assert out.startswith("\x1b[32mHello\x1b[0m\x1b[34m,\x1b[0m\x1b[31m world")
    legend = legend_html()
    assert all(name in legend for name in ("small draft", "retrieval draft", "full target"))


def test_incomplete_characters_wait_for_the_next_token():
    pieces = {1: "\ufffd", 2: "é"}
    dec = lambda ids: "é" if ids == [1, 2] else "\ufffd"  # noqa: E731
    out = tokens_html([Committed((1, 2), ("draft", "target"))], dec)
    assert out.count("<span") == 2 and ">é<" in out and "\ufffd" not in out and pieces
