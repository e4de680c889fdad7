"""Plotly figures of one answer: the retrieval map, acceptance over time, speed. Pure functions."""

from __future__ import annotations

from typing import Callable, Sequence

import plotly.graph_objects as go

from triforce_core.config import CacheConfig
from triforce_core.decoding.events import ChunksSelected

from .render import LEVEL_STYLE
from .trace import RoundStats

# Transparent backgrounds: a chart shows the page's own, light or dark (the dark theme also gives its
# text the page's colour: assets/app.css, "dark mode").
_LAYOUT = dict(margin=dict(l=48, r=16, t=40, b=40), height=300, template="plotly_white", font=dict(size=12),
               paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)")
LEVEL_LINE = {"retrieval": "#2f6fb5", "target": "#c0392b"}  # by *verifying* level

# token span (start, end) -> (where, text): e.g. ("page 3", "the chunk's text")
Labeler = Callable[[int, int], tuple[str, str]]
# Bars in the retrieval map at most: at 64K tokens a selection spans thousands of chunks, and a
# bar each makes a megabyte of figure the browser redraws on every refresh.
MAP_MAX_BARS = 1024


def _binned(selection: ChunksSelected, max_bars: int) -> list[tuple[int, int, int, int]]:
    """(start, end, count, chunks): the chosen chunks, merged into bins of whole chunks when
    there are more than `max_bars`; a bin's count is its most chosen chunk's."""
    spans = list(zip(selection.chunk_token_spans, selection.scores_or_counts))
    if len(spans) <= max_bars:
        return [(a, b, n, 1) for (a, b), n in spans]
    chunk = max(selection.chunk_size, 1)
    width = chunk * -(-max(selection.context_tokens, 1) // (chunk * max_bars))  # whole chunks per bin
    bins: dict[int, list[int]] = {}
    for (a, b), n in spans:
        lo, hi, top, k = bins.get(a // width, [a, b, n, 0])
        bins[a // width] = [min(lo, a), max(hi, b), max(top, n), k + 1]
    return [tuple(v) for _, v in sorted(bins.items())]


def empty_figure(title: str, message: str) -> go.Figure:
    fig = go.Figure(layout=dict(title=dict(text=title), **_LAYOUT))
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def retrieval_map_figure(
    selection: ChunksSelected | None,
    labeler: Labeler | None = None,
    document_span: tuple[int, int] | None = None,
    refreshes: int = 0,
) -> go.Figure:
    """Which KV chunks the retrieval level reads, over the sequence positions.

    One bar per chosen chunk; its height is the share of (layer, KV head) pairs that chose it,
    so "while answering, the model looked here" reads as tall bars over the document.
    """
    title = "Retrieval map"
    if selection is None:
        return empty_figure(title, "No retrieval selection yet: ask a question in triforce or retrieval mode.")
    heads = max(selection.heads_total, 1)
    xs, widths, ys, hover = [], [], [], []
    bars = _binned(selection, MAP_MAX_BARS)
    for start, end, count, chunks in bars:
        xs.append((start + end) / 2)
        widths.append(max(end - start, 1))
        ys.append(count / heads)
        where, text = labeler(start, min(end, start + 2 * selection.chunk_size)) if labeler is not None else ("", "")
        text = text.replace("\n", " ").strip()
        if len(text) > 120:
            text = text[:117] + "…"
        chosen = f"chosen by {count} of {heads} heads" if chunks == 1 else (
            f"{chunks} chunks chosen here, the most by {count} of {heads} heads")
        hover.append(
            f"tokens {start}–{end}" + (f" · {where}" if where else "") + f"<br>{chosen}"
            + (f"<br>«{_escape(text)}»" if text else "")
        )
    fig = go.Figure(
        go.Bar(
            x=xs, y=ys, width=widths, hovertext=hover, hoverinfo="text",
            marker=dict(color=ys, colorscale="Blues", cmin=0, cmax=1, line=dict(width=0)),
            name="chosen chunks",
        ),
        layout=_LAYOUT,
    )
    span = "the whole context fits the budget" if selection.dense else (
        f"{len(selection.chunk_token_spans)} chunks of {selection.chunk_size} tokens, budget {selection.budget}"
        + (f", shown in {len(bars)} bins" if len(bars) < len(selection.chunk_token_spans) else "")
    )
    when = "after the prompt" if selection.step == 0 else f"refreshed at round {selection.step}"
    fig.update_layout(
        title=dict(text=f"{title}: {span} ({when}{f', refresh {refreshes}' if refreshes else ''})"),
        bargap=0, showlegend=False,
    )
    fig.update_yaxes(title="share of heads", range=[0, 1.05])
    fig.update_xaxes(title="position in the context (tokens)", range=[0, max(selection.context_tokens, 1)])
    if document_span is not None and document_span[1] > document_span[0]:
        fig.add_vrect(
            x0=document_span[0], x1=document_span[1], fillcolor="#f6e7a8", opacity=0.35, line_width=0,
            layer="below", annotation_text="document", annotation_position="top left",
        )
    return fig


def top_passages(
    selection: ChunksSelected | None,
    labeler: Labeler | None,
    document_span: tuple[int, int] | None,
    k: int = 3,
    max_chars: int = 160,
) -> list[tuple[str, str, float]]:
    """The k document chunks chosen by the largest share of heads: (where, text, share).

    Chunks outside the document (the chat template, the question, the answer) are skipped, and
    so are the ones every head keeps anyway: the first chunk (the attention sink) and the
    recent tokens.
    """
    if selection is None or labeler is None or document_span is None or selection.dense:
        return []
    lo, hi = document_span
    recent = CacheConfig(budget=selection.budget, chunk_size=selection.chunk_size).recent
    hi = min(hi, selection.context_tokens - recent)
    heads = max(selection.heads_total, 1)
    ranked = sorted(
        ((count, start, end) for (start, end), count in zip(selection.chunk_token_spans, selection.scores_or_counts)
         if start > 0 and lo <= start and end <= hi),
        key=lambda c: (-c[0], c[1]),
    )
    out = []
    width = end_pad = max(selection.chunk_size, 1) * 2  # a little context on each side
    for count, start, end in ranked[:k]:
        where, _ = labeler(start, end)
        _, text = labeler(max(lo, start - width), min(hi, end + end_pad))
        text = " ".join(text.split())
        out.append((where, text[:max_chars] + ("…" if len(text) > max_chars else ""), count / heads))
    return out


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def acceptance_figure(rounds: Sequence[RoundStats], smooth: int = 8) -> go.Figure:
    """Acceptance per verifying level over the rounds (moving average) and tokens per round."""
    title = "Acceptance over time"
    if not rounds:
        return empty_figure(title, "Acceptance appears here while an answer streams.")
    x = [r.index for r in rounds]
    fig = go.Figure(layout=_LAYOUT)
    fig.add_trace(
        go.Bar(x=x, y=[r.committed for r in rounds], name="tokens per round", marker_color="#d9d9d9", yaxis="y2")
    )
    for level, colour in LEVEL_LINE.items():
        ratios = [
            (r.accepted.get(level, 0), r.proposed.get(level, 0)) for r in rounds
        ]
        if not any(p for _a, p in ratios):
            continue
        ys = []
        for i in range(len(ratios)):
            window = ratios[max(0, i - smooth + 1) : i + 1]
            acc, prop = sum(a for a, _ in window), sum(p for _, p in window)
            ys.append(acc / prop if prop else None)
        name = "lookup / small draft accepted by retrieval" if level == "retrieval" else "proposals accepted by target"
        fig.add_trace(go.Scatter(x=x, y=ys, mode="lines", name=name, line=dict(color=colour, width=2)))
    fig.update_layout(
        title=dict(text=f"{title} (moving average over {smooth} rounds)"),
        yaxis=dict(title="acceptance", range=[0, 1.02]),
        yaxis2=dict(title="tokens / round", overlaying="y", side="right", showgrid=False, rangemode="tozero"),
        xaxis=dict(title="round (one target forward)"),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def speed_figure(runs: Sequence[tuple[str, float]], note: str = "") -> go.Figure:
    """Decode speed (tokens/s) of this answer and, once measured, the autoregressive baseline;
    `note` qualifies the title (e.g. a stepped answer's waits for Step left out)."""
    title = "Decode speed" + (f" ({note})" if note else "")
    if not runs:
        return empty_figure(title, "Speed appears here when an answer finishes.")
    colours = [LEVEL_STYLE["target"][1] if "autoregressive" in name else "#7fb3e6" for name, _ in runs]
    fig = go.Figure(
        go.Bar(
            x=[v for _, v in runs], y=[n for n, _ in runs], orientation="h", marker_color=colours,
            text=[f"{v:.1f} tok/s" for _, v in runs], textposition="auto",
        ),
        layout=_LAYOUT,
    )
    fig.update_layout(title=dict(text=title), height=220, xaxis=dict(title="tokens / s", rangemode="tozero"))
    return fig
