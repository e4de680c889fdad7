"""What the page shows, computed from a user's state: the document line, the context gauge,
the transcript, the statistics table, and the tuples of updates the handlers yield.

Handlers return their updates in the order of `STREAMED` (answers, clearing) or
`DOCUMENT_OUTPUTS` (loading a document, switching the model); the layout binds those names to
its components. A new document or model clears the `PANELS` of the answers before it.
"""

from __future__ import annotations

import html
from typing import Callable

import gradio as gr

from triforce_core.documents.picking import top_level
from triforce_core.serving.book import BookSession

from .figures import acceptance_figure, retrieval_map_figure, speed_figure, top_passages
from .inspector import inspector_figure, inspector_html
from .narration import narration_html
from .answer_html import answer_body_html, copy_buttons, rounds_html
from .render import answer_label, context_gauge_html, passages_html, sources_html, stats_html, transcript_html
from .state import Answer, UserState
from .trace import AnswerTrace

STREAMED = ("user", "chat", "status", "map", "passages", "acceptance", "speed", "stats", "gauge", "narration",
            "inspector", "inspector_plot")
PANELS = ("passages", "acceptance", "speed", "stats", "narration", "inspector", "inspector_plot")
# "upload": the upload box (emptied when it would show a file that is not the document loaded);
# "upload_note": the line under it that says why a file was refused.
DOCUMENT_OUTPUTS = ("user", "docinfo", "gauge", "status", "chat", "map", *PANELS, "toc", "toc_list", "upload",
                    "upload_note")


def upload_note(message: str = "") -> str:
    """The line under the upload box: why the last file was refused ('' when none was)."""
    if not message:
        return '<div class="tf-upload-note"></div>'
    return f'<div class="tf-upload-note tf-error" role="alert">{html.escape(message)}</div>'


def with_outputs(outputs: tuple, **changes) -> tuple:
    """`DOCUMENT_OUTPUTS` updates with some replaced by name."""
    named = dict(zip(DOCUMENT_OUTPUTS, outputs))
    named.update(changes)
    return tuple(named[name] for name in DOCUMENT_OUTPUTS)


TOC_INDENT = "\u2003\u2003"  # per level below the top (an em space is kept by HTML, unlike a space)


def toc_label(number: int, title: str, level: int, tokens: int) -> str:
    """One line of the table of contents, as a tree: a subsection indented by its depth under
    its parent, with a branch mark ('7. Reference · 2,048 tokens', then '  └ 7.1 Hash functions ·
    512 tokens'). The title is the book's, its own number included where it has one; the index
    `number` (what `chat --sections` picks by) is not shown, so the book is never renumbered."""
    branch = TOC_INDENT * (level - 2) + "\u2003└ " if level > 1 else ""
    return f"{branch}{title[:70]} · {tokens:,} tokens"


def toc_update(user: UserState | None, window: int) -> tuple:
    """The table of contents (its box, its list): one choice per section of the book, one per
    line (app.css), a subsection indented under its parent, with its size in tokens; hidden
    when the document has no sections."""
    book = user.book if user is not None else None
    if book is None or not book.sections:
        return gr.update(visible=False), gr.update(choices=[], value=[])
    sized = zip(book.sections, user.book_sizes)
    choices = [(toc_label(i + 1, s.title, s.level, n), i) for i, (s, n) in enumerate(sized)]
    total = sum(user.book_sizes[i] for i in top_level(book.sections))
    label = (f"Table of contents: {len(choices)} sections, about {total:,} tokens against a window of {window:,}. "
             "Tick the sections to read (a section includes its subsections), then Read the selected sections.")
    return gr.update(visible=True), gr.update(choices=choices, value=[], label=label)


def doc_info(user: UserState | None) -> str:
    if user is None or user.document is None:
        return '<div class="tf-docinfo">No document loaded.</div>'
    d, tokens, over = user.document, user.session.document_tokens, ""
    if isinstance(user.session, BookSession):  # over the window: each question reads a part of it
        d, tokens, over = user.session.book, user.session.book_tokens, ", over the context window"
    pages = f" · {d.pages} pages" if d.pages else ""
    return (
        f'<div class="tf-docinfo"><b>{html.escape(d.name or "document")}</b> · {d.format}{pages} · '
        f"{d.chars:,} characters · {tokens:,} tokens{over}</div>"
    )


def gauge(user: UserState | None, budget, window: int) -> str:
    """The context gauge: the user's document and conversation against `window` and the
    retrieval budget (None in a mode without a retrieval level: `settings.retrieval_budget`)."""
    budget = None if budget is None else int(budget)
    if user is None:
        return context_gauge_html(0, 0, window, budget)
    doc = user.session.document_tokens if user.document is not None else 0
    book = user.session.book_tokens if isinstance(user.session, BookSession) else 0
    # Until the first question the cache may still hold an earlier document's prompt. After it,
    # the conversation is the last answer's prompt and its tokens so far: the cache lags one
    # token behind (the newest token's keys and values come with the next forward).
    total = (len(user.session.cached_tokens()) or doc) if user.session.turns else doc
    last = user.answers[-1].trace if user.session.turns and user.answers else None
    if last is not None and last.prefill is not None:
        total = last.prefill.tokens + last.prefill.reused_tokens + last.new_tokens
    return context_gauge_html(doc, max(0, total - doc), window, budget, user.session.cache_bytes(),
                              book_tokens=book)


def chunk_labeler(user: UserState) -> Callable[[int, int], tuple[str, str]]:
    """token span -> (where in the document, its text), for the retrieval map's hover."""
    spans, doc = user.spans, user.document
    text = user.session.document
    lead = 0
    if doc is not None:
        lead = len(doc.text) - len(doc.text.lstrip())

    def label(start: int, end: int) -> tuple[str, str]:
        inside = [spans[i] for i in range(max(0, start), min(end, len(spans))) if spans[i][0] >= 0]
        if inside:
            a, b = inside[0][0], inside[-1][1]
            where = doc.locate(a + lead) if doc is not None else ""
            return where, text[a:b]
        if start >= len(spans):
            return "the answer so far", ""
        return "chat template / question", ""

    return label


def document_span(user: UserState) -> tuple[int, int] | None:
    inside = [i for i, (a, _b) in enumerate(user.spans) if a >= 0]
    return (inside[0], inside[-1] + 1) if inside else None


def prefill_progress_text(progress, elapsed_s: float, spec) -> str:
    """'prefilling 12,288 / 65,536 tokens · 410 tokens/s · about 2 min left'.

    Time left scales the time so far by the arithmetic left over the arithmetic done: later
    tokens attend to more keys, so a token rate alone would promise too early an end.
    """
    from triforce_core.models.roofline import prefill_flops

    text = f"prefilling {progress.done:,} / {progress.total:,} tokens"
    if progress.done <= 0 or elapsed_s <= 0:
        return text
    rate = f"{text} · {progress.done / elapsed_s:,.0f} tokens/s"
    if spec is None:  # a remote engine's model: no arithmetic to scale by, its token rate only
        return f"{rate} · {_duration(elapsed_s * (progress.total - progress.done) / progress.done)} left"
    a = progress.start
    done = prefill_flops(spec, a, a + progress.done)
    left = prefill_flops(spec, a + progress.done, a + progress.total)
    return f"{text} · {progress.done / elapsed_s:,.0f} tokens/s · {_duration(elapsed_s * left / done)} left"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"about {seconds:.0f} s"
    return f"about {seconds / 60:.0f} min" if seconds < 5400 else f"about {seconds / 3600:.1f} h"


def waits_note(trace: AnswerTrace) -> str:
    """' (not counting 12.3 s waiting for Step)' for a stepped answer, else ''."""
    return f" (not counting {trace.waited_s:.1f} s waiting for Step)" if trace.waited_s > 0 else ""


def answer_footer(trace: AnswerTrace, stopped: bool) -> str:
    s = trace.stats
    if s is None:
        return f"stopped after {trace.new_tokens} tokens" if stopped else ""
    acc = ", ".join(f"{k} {v:.2f}" for k, v in s.acceptance.items())
    disk = f" ({s.disk_tokens:,} from disk)" if s.disk_tokens else ""
    reused = f", {s.reused_tokens:,} reused{disk}" if s.reused_tokens else ""
    prefill = trace.prefill
    pre = f"prefill {prefill.tokens:,} tokens in {prefill.seconds:.1f}s{reused} · " if prefill is not None else ""
    return (
        f"{s.mode} · {s.new_tokens} tokens at {trace.tokens_per_s():.1f} tok/s{waits_note(trace)} · {pre}"
        f"mean accepted {s.mean_accepted:.2f}" + (f" · acceptance {acc}" if acc else "") + limit_note(s)
    )


def limit_note(stats) -> str:
    """' · Stopped at the 128-token limit.' for an answer its token limit ended (Continue goes on
    with it), else ''. A continued answer's limit is its whole length: the limits added up."""
    return f" · Stopped at the {stats.new_tokens}-token limit." if stats.stop_reason == "max_new_tokens" else ""


CONTINUE_BUTTON = ('<button type="button" class="tf-continue" title="Go on with this answer: up to Max new tokens '
                   'more, as a larger limit would have written it">Continue</button>')


def continue_button(user: UserState, k: int) -> str:
    """The Continue button, on the last answer only, once it has ended at its token limit
    (assets/app.js clicks the hidden #tf-continue, `AnswerHandlers.on_continue`)."""
    last = k == len(user.session.turns) - 1 and k == len(user.answers) - 1
    return CONTINUE_BUTTON if last and not user.busy and user.session.can_continue() else ""


def stats_rows(answer: Answer | None) -> list[tuple[str, str]]:
    if answer is None:
        return [("status", "no answer yet")]
    t = answer.trace
    # the mode the figures come from: the settings may have changed since
    rows = [("mode", t.stats.mode)] if t.stats is not None else []
    rows += [("tokens", f"{t.new_tokens}"), ("tokens/s", f"{t.tokens_per_s():.1f}{waits_note(t)}"),
            ("mean accepted length", f"{t.mean_accepted():.2f} tokens per target forward")]
    for level, value in t.acceptance().items():
        name = "lookup / small draft → retrieval" if level == "retrieval" else "proposals → target"
        rows.append((f"acceptance, {name}", f"{value:.2f}"))
    if t.prefill is not None:
        p = t.prefill
        disk = f", {p.disk_tokens:,} of them from disk" if p.disk_tokens else ""
        rows.append(("prefill", f"{p.tokens:,} tokens in {p.seconds:.2f}s ({p.reused_tokens:,} reused{disk})"))
    b = answer.baseline
    if b is not None:
        rows.append(("autoregressive", f"{b['tokens_per_s']:.1f} tok/s"))
        if b["tokens_per_s"] > 0 and t.stats is not None:
            rows.append(("speed-up", f"{t.tokens_per_s() / b['tokens_per_s']:.2f}×"))
        rows.append(("outputs identical", b["identical"]))
        if b.get("load"):  # other users' answers ran by turns with the two runs
            rows.append(("measured", b["load"]))
    return rows


def answer_html(answer: Answer, key: int, teaching: bool) -> str:
    """One answer in the transcript: its text as Markdown coloured by level and, in the teaching
    view, its rounds and rejected drafts one click away. The Markdown is rendered again only
    when the answer has grown (the page redraws the conversation while the last answer streams)."""
    segments = answer.trace.segments
    drawn = (len(segments), key)  # segments are only appended to (a replaced trace is another list)
    if answer.shown is None or answer.shown[0] != drawn or answer.shown[2] is not segments:
        answer.shown = (drawn, answer_body_html(segments, key), segments)
    body = answer.shown[1]
    return body + rounds_html(segments, key) if teaching and body else body


def empty_chat(user: UserState | None) -> str:
    """The chat's words before the first question: what to do next, for the document loaded."""
    if user is None or user.document is None:
        return "Load a document (or the sample), then ask a question about it."
    doc = user.session.book if isinstance(user.session, BookSession) else user.document
    return f"Ask a question about {doc.name or 'the document'}."


def transcript(user: UserState | None, teaching: bool) -> str:
    if user is None or not user.session.turns:
        return transcript_html([], empty_chat(user))
    turns = []
    for k, (turn, answer) in enumerate(zip(user.session.turns, user.answers)):
        ended = bool(answer.footer)
        sources = sources_html(turn.sections_read, turn.passages) if ended else ""  # once it has ended
        actions = copy_buttons(answer.trace.text) if ended and answer.trace.text else ""
        actions += continue_button(user, k) if ended else ""
        turns.append((turn.question, answer_html(answer, k, teaching), answer.footer, sources, actions))
    return transcript_html(turns)


def teaching_updates(user: UserState, answer: Answer, teaching: bool, decode, waiting: bool = False,
                     auto_step: bool = False) -> tuple:
    """The round narration (teaching view) and, for the lesson, the inspector opened once on the
    answer's first checked rejection."""
    t = answer.trace
    label = answer_label(answer_number(user, answer), t.text)
    narration = narration_html(t, waiting=waiting, auto_step=auto_step, label=label) if teaching else gr.skip()
    inspector = plot = gr.skip()
    if user.panels_answer is not answer:  # a new answer: what the panels showed was an earlier one's
        user.panels_answer = answer
        inspector, plot = inspector_html(None, str), inspector_figure(None, str)
        if not teaching:
            narration = narration_html(None)
    if user.auto_inspect and decode is not None:
        seg = next((s for s in t.segments if s.kind == "rejected" and s.checks), None)
        if seg is not None:
            user.auto_inspect = False
            inspector = inspector_html(seg, decode, answer.inspected, label)
            plot = inspector_figure(seg, decode, label)
    return narration, inspector, plot


def answer_number(user: UserState, answer: Answer) -> int:
    """`answer`'s place in the conversation, from 1 (the next one while it has not taken its place)."""
    return next((k + 1 for k, a in enumerate(user.answers) if a is answer), len(user.answers) + 1)


def labelled(fig, label: str):
    """A figure of an answer, its title prefixed with the answer it shows (`answer_label`)."""
    title, label = fig.layout.title.text or "", html.escape(label, quote=False)  # a model's text: no markup
    fig.update_layout(title=dict(text=f"{label}<br>{title}" if title else label, font=dict(size=12)),
                      margin=dict(t=64))
    return fig


def answer_updates(user: UserState, answer: Answer, status: str, teaching: bool, budget, window: int,
                   new_map: bool, *, panels: bool = True, decode: Callable[[list[int]], str] | None = None,
                   waiting: bool = False, auto_step: bool = False) -> tuple:
    """The `STREAMED` updates while `answer` streams: with `panels` the figures and tables too
    (re-drawn only now and then: plots are the browser's heaviest work), with `new_map` also the
    retrieval map and its passages (after a new chunk selection). `waiting`: a stepped
    generation waits for Step (`auto_step`: or, in the lesson, for its next round)."""
    t = answer.trace
    fresh = user.panels_answer is not answer  # its first update: the map and passages showed an earlier answer
    extra = teaching_updates(user, answer, teaching, decode, waiting, auto_step)
    label = answer_label(answer_number(user, answer), t.text)  # each panel names the answer it shows
    cleared = (retrieval_map_figure(None), passages_html([])) if fresh else (gr.skip(), gr.skip())
    if not panels:  # text only: the answer so far, the status line and the narration
        return (user, transcript(user, teaching), status) + cleared + (gr.skip(),) * 4 + extra
    map_fig, passages = cleared
    if new_map:
        sel = t.selections[-1] if t.selections else None
        labeler, span = chunk_labeler(user), document_span(user)
        map_fig = retrieval_map_figure(sel, labeler, span, max(0, len(t.selections) - 1))
        map_fig = labelled(map_fig, label) if sel is not None else map_fig
        passages = passages_html(top_passages(sel, labeler, span))
    speed = [("this answer", t.tokens_per_s())]
    if answer.baseline is not None:
        speed.append(("autoregressive", answer.baseline["tokens_per_s"]))
    speed_fig = speed_figure(speed if t.new_tokens else [], "waits for Step left out" if t.waited_s > 0 else "")
    acceptance = labelled(acceptance_figure(t.rounds), label) if t.rounds else acceptance_figure(t.rounds)
    speed_fig = labelled(speed_fig, label) if t.new_tokens else speed_fig
    return (
        user, transcript(user, teaching), status, map_fig, passages, acceptance,
        speed_fig, stats_html([("answer", label)] + stats_rows(answer)), gauge(user, budget, window),
    ) + extra


def cleared_panels() -> dict:
    """The `PANELS` as they start, by name: what a page with no answer shows."""
    return {"passages": passages_html([]), "acceptance": acceptance_figure([]), "speed": speed_figure([]),
            "stats": stats_html(stats_rows(None)), "narration": narration_html(None),
            "inspector": inspector_html(None, str), "inspector_plot": inspector_figure(None, str)}


def empty_panels(user: UserState | None, status: str, budget, window: int) -> tuple:
    """The `STREAMED` updates of a page with no answer shown: the panels as they start."""
    shown = {"user": user, "chat": transcript(user, False), "status": status, "map": retrieval_map_figure(None),
             "gauge": gauge(user, budget, window), **cleared_panels()}
    return tuple(shown[name] for name in STREAMED)
