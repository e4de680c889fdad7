"""The app's HTML pieces: an answer's segments coloured by level, the legend, the transcript,
the context gauge, the status line, tables and the most-read passages. Pure functions: the
same input always gives the same markup, and every text from a model or a user is escaped.

Each committed token is coloured by the level that proposed it: the context lookup (copied
from an earlier match in the context), the small draft, the retrieval draft (target weights
over the retrieved KV chunks) or the full target (its own token after a rejection, or a bonus).
"""

from __future__ import annotations

import html
from typing import Sequence

# level -> (label, colour); app.css colours the tokens with the same colours
LEVEL_STYLE = {
    "lookup": ("context lookup", "#f7e6b0"),
    "draft": ("small draft", "#c8f7c5"),
    "retrieval": ("retrieval draft", "#c5dcf7"),
    "target": ("full target", "#f7c5c5"),
}


def segments_html(segments, teaching: bool = False, key: int | None = None, token_class: str = "tf-tok") -> str:
    """An answer's segments (see `ui.trace`) as HTML, one span per token; `teaching` adds
    rejected drafts and round marks. The transcript shows answers as Markdown
    (`ui.answer_html`) and this token-by-token form under them, with `token_class` "tf-seg".

    With `key` (the answer's turn), each token carries `data-tf="turn:segment"`, which the page's
    script sends to the inspector when the token is clicked."""
    out = []
    for i, seg in enumerate(segments):
        data = f' data-tf="{key}:{i}"' if key is not None else ""
        if seg.kind == "token":
            label = LEVEL_STYLE[seg.level][0]
            title = html.escape(f"{label} · {seg.note}" if seg.note else label)
            out.append(f'<span class="{token_class} tf-{seg.level}" title="{title}"{data}>{html.escape(seg.text)}</span>')
        elif not teaching:
            continue
        elif seg.kind == "rejected":
            out.append(f'<s class="tf-rej tf-{seg.level}" title="{html.escape(seg.note)}"{data}>'
                       f"{html.escape(seg.text)}</s>")
        elif seg.kind == "round":
            out.append(f'<span class="tf-round" title="{html.escape(seg.note)}"></span>')
    return "".join(out)


def legend_block(teaching: bool = False) -> str:
    items = [
        f'<span class="tf-tok tf-{lvl}">{label}</span>' for lvl, (label, _colour) in LEVEL_STYLE.items()
    ]
    if teaching:
        items.append('<s class="tf-rej tf-draft">rejected draft</s>')
        items.append('<span class="tf-round"></span> round start')
        # the hover's short form ("u 0.31 < p/q 0.74/0.58"), in words where it appears
        items.append('<span class="tf-legend-note">· hover a token: p is the verifier\'s probability of it, q the '
                     "proposer's, u the uniform random draw (kept when u &lt; p/q)</span>")
    return '<div class="tf-legend">Proposed by: ' + " ".join(items) + "</div>"


def sources_html(sections_read: Sequence[dict] | None, passages: Sequence[dict]) -> str:
    """An answer's citations: the book's sections its question read and the passages its
    retrieval selections read most, or else those it quotes (`Turn.sections_read`,
    `Turn.passages`); "" when neither."""
    if not sections_read and not passages:
        return ""
    summary = []
    if sections_read:
        summary.append(f"{len(sections_read)} section{'s' if len(sections_read) != 1 else ''} read")
    quoted = bool(passages) and all(p.get("kind") == "quoted" for p in passages)
    if passages:
        what = "quoted" if quoted else "most-read"
        summary.append(f"{len(passages)} {what} passage{'s' if len(passages) != 1 else ''}")
    body = []
    if sections_read:
        names = "".join(f"<li>{html.escape(read_name(s))}</li>" for s in sections_read)
        body.append(f"<b>Read</b><ul>{names}</ul>")
    if passages:
        items = "".join(
            f"<li>{'<span class=tf-where>' + html.escape(p['section']) + '</span> · ' if p.get('section') else ''}"
            f"{100 * float(p.get('share', 0)):.0f}% of {'the answer' if quoted else 'heads'}: "
            f"«{html.escape(str(p.get('text', '')))}»</li>"
            for p in passages)
        body.append(f"<b>{'Quoted in the answer' if quoted else 'Most read while answering'}</b><ol>{items}</ol>")
    return (f'<details class="tf-sources"><summary>Sources: {" · ".join(summary)}</summary>'
            f'{"".join(body)}</details>')


def read_name(section: dict) -> str:
    """One entry of `BookReader.describe`, named as the book names it: its "name" ('4.1. What is
    Ownership?', 'Ownership, from «The stack…»', 'Text from «It was…»'). An entry written before
    parts had names (a saved conversation) reads '16. What is Ownership? (part 2 of 3)'."""
    if section.get("name"):
        return str(section["name"])
    if section.get("number") is None:
        return str(section.get("title", ""))
    part = f" (part {section['part']})" if section.get("part") else ""
    return f"{section['number']}. {section.get('title', '')}{part}"


def transcript_html(turns: Sequence[tuple], empty: str = "") -> str:
    """The conversation: (question, answer_html, footer[, sources_html[, actions]]) per turn;
    answer_html, sources_html and actions (buttons under the answer: copy, Continue) are trusted
    markup; actions go right after the footer, in a `<div class="tf-actions">`."""
    if not turns:
        return f'<div class="tf-transcript tf-empty">{html.escape(empty)}</div>'
    parts = ['<div class="tf-transcript">']
    for question, answer, footer, *rest in turns:
        parts.append(f'<div class="tf-msg tf-user">{html.escape(question)}</div>')
        parts.append(f'<div class="tf-msg tf-assistant">{answer or "<span class=tf-wait>…</span>"}')
        if footer:
            parts.append(f'<div class="tf-foot">{html.escape(footer)}</div>')
        if len(rest) > 1 and rest[1]:
            parts.append(f'<div class="tf-actions">{rest[1]}</div>')
        if rest and rest[0]:
            parts.append(rest[0])
        parts.append("</div>")
    parts.append("</div>")
    return "".join(parts)


def context_gauge_html(
    document_tokens: int, conversation_tokens: int, window: int, budget: int | None, cache_bytes: int = 0,
    *, book_tokens: int = 0,
) -> str:
    """A bar: document and conversation tokens against the context window, with the retrieval
    budget (None: the mode has no retrieval level), and the memory this conversation's caches
    hold. `book_tokens`: the whole document, when it is over the window and each question reads
    a part of it (`document_tokens`)."""
    window = max(window, 1)
    used = document_tokens + conversation_tokens
    doc_pct = min(100.0, 100.0 * document_tokens / window)
    conv_pct = min(100.0 - doc_pct, 100.0 * conversation_tokens / window)
    over = used > window
    if document_tokens == 0 and book_tokens:
        reads = " · each question reads the parts of the document most relevant to it"
    elif document_tokens == 0:
        reads = " · no document yet"
    elif budget is None:
        reads = ""
    elif budget >= used:
        reads = " · the whole context fits the retrieval budget (retrieval is exact here: no speedup from it)"
    else:
        reads = f" · the retrieval level reads {100.0 * budget / used:.0f}% of the context per step"
    if budget is None:  # lookup, the small draft alone, autoregressive: every step reads the whole context
        retrieval, marker = "no retrieval level in this mode (every step reads the whole context)", ""
    else:
        retrieval = f"retrieval budget <b>{budget:,}</b>"
        marker = (f'<div class="tf-gauge-budget" style="left:{min(100.0, 100.0 * budget / window):.2f}%" '
                  'title="retrieval budget"></div>')
    document = f"document <b>{document_tokens:,}</b>" + (f" read of its <b>{book_tokens:,}</b>" if book_tokens else "")
    return (
        f'<div class="tf-gauge{" tf-over" if over else ""}">'
        f'<div class="tf-gauge-bar">'
        f'<div class="tf-gauge-doc" style="width:{doc_pct:.2f}%"></div>'
        f'<div class="tf-gauge-conv" style="width:{conv_pct:.2f}%"></div>'
        f"{marker}</div>"
        f'<div class="tf-gauge-text">{document} + conversation <b>{conversation_tokens:,}</b> '
        f"of <b>{window:,}</b> tokens · {retrieval}{reads}"
        + (f" · caches in memory <b>{cache_bytes / 1e6:,.0f} MB</b>" if cache_bytes else "")
        + (" · <b>does not fit the context window</b>" if over else "")
        + "</div></div>"
    )


def status_html(message: str, kind: str = "info", progress: float | None = None) -> str:
    """A status line (kind: info | busy | error | ok), with an optional progress bar (0..1)."""
    if progress is None:  # an invisible bar: the line keeps one height with or without progress
        bar = '<div class="tf-progress tf-idle"><div style="width:0%"></div></div>'
    else:
        bar = f'<div class="tf-progress"><div style="width:{100.0 * max(0.0, min(1.0, progress)):.1f}%"></div></div>'
    return f'<div class="tf-status tf-{kind}" role="status">{html.escape(message)}{bar}</div>'


def stats_html(rows: Sequence[tuple[str, str]]) -> str:
    """A two-column table of figures."""
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="tf-stats">{body}</table>'


def passages_html(passages: Sequence[tuple[str, str, float]]) -> str:
    """The passages the retrieval level read most: (where, text, share of heads)."""
    if not passages:
        return '<div class="tf-passages tf-empty">The passages the retrieval level reads most appear here.</div>'
    items = "".join(
        f'<li><span class="tf-where">{html.escape(where)}</span> · {100 * share:.0f}% of heads: '
        f"«{html.escape(text)}»</li>"
        for where, text, share in passages
    )
    return f'<div class="tf-passages"><b>Most-read passages of the document</b><ol>{items}</ol></div>'


def answer_label(number: int, text: str, words: int = 6) -> str:
    """Which answer a panel shows: 'answer 2: «A class is a blueprint…»' (its first `words`
    words; `number` counts from 1)."""
    first = text.split()
    quoted = " ".join(first[:words]) + ("…" if len(first) > words else "")
    return f"answer {number}: «{quoted}»" if quoted else f"answer {number}"
