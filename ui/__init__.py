"""Presentation of the engine's events, and the Gradio app.

`ui.render`, `ui.trace` and `ui.figures` are pure functions of events (no model, no server);
`ui.app.build_app` builds the Gradio app and `ui.server` serves it with the OpenAI-compatible
HTTP API on one port (`triforce_core.serving` runs the engine for both). Gradio and plotly are
imported only when those are used, so the terminal chat stays light.
"""

from .render import (
    LEVEL_STYLE,
    TokenSplitter,
    ansi,
    context_gauge_html,
    legend_block,
    legend_html,
    segments_html,
    stats_html,
    status_html,
    terminal_text,
    tokens_html,
    transcript_html,
)
from .trace import AnswerTrace, RoundStats, Segment

__all__ = [
    "LEVEL_STYLE",
    "AnswerTrace",
    "RoundStats",
    "Segment",
    "TokenSplitter",
    "ansi",
    "build_app",
    "context_gauge_html",
    "legend_block",
    "legend_html",
    "segments_html",
    "stats_html",
    "status_html",
    "terminal_text",
    "tokens_html",
    "transcript_html",
]


def __getattr__(name: str):
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module 'ui' has no attribute {name!r}")
