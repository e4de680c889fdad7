"""The Gradio app and its presentation of the engine's events.

`ui.render`, `ui.trace` and `ui.figures` are pure functions of events (no model, no server);
`ui.app.build_app` lays out the page and wires it to `ui.handlers` (one module per feature),
which keep per-user state in `ui.state` and compute what the page shows in `ui.views`;
`ui.settings` is the one definition of the settings. `ui.server` serves the app with the
OpenAI-compatible HTTP API on one port (`triforce_core.serving` runs the engine for both).
Gradio and plotly are imported only when those are used.
"""

from .render import (
    LEVEL_STYLE,
    context_gauge_html,
    legend_block,
    passages_html,
    segments_html,
    stats_html,
    status_html,
    transcript_html,
)
from .trace import AnswerTrace, RoundStats, Segment

__all__ = [
    "LEVEL_STYLE",
    "AnswerTrace",
    "RoundStats",
    "Segment",
    "build_app",
    "context_gauge_html",
    "legend_block",
    "passages_html",
    "segments_html",
    "stats_html",
    "status_html",
    "transcript_html",
]


def __getattr__(name: str):
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module 'ui' has no attribute {name!r}")
