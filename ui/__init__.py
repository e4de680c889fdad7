"""Presentation of the engine's events. Pure functions, no model and no server inside."""

from .render import LEVEL_STYLE, TokenSplitter, ansi, legend_html, terminal_text, tokens_html

__all__ = ["LEVEL_STYLE", "TokenSplitter", "ansi", "legend_html", "terminal_text", "tokens_html"]
