"""Loading a document: an upload (a clear error for a file that cannot be read) or the sample;
a book with sections also gets its table of contents, from which the user picks what to read.
A book over the context window is never cut: each question reads the sections most relevant
to it (`triforce_core.serving.book.BookSession`), ticked in the table of contents after the answer,
until the user ticks sections and reads those instead."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

import re
import time

from triforce_core.serving.book import BookSession
from triforce_core.documents import Document, DocumentError, Section, load_document
from triforce_core.resources import SAMPLE_DOCUMENT
from triforce_core.documents.picking import over_window, picked_titles, section_tokens, selected_text

from ..figures import retrieval_map_figure
from ..pasting import paste_note, pasted_document
from ..render import status_html
from ..settings import retrieval_budget
from ..state import AppContext, UserState, book_session, chat_session, reads_by_relevance
from ..views import (DOCUMENT_OUTPUTS, PANELS, cleared_panels, doc_info, gauge, toc_update, transcript, upload_note,
                     with_outputs)


def _skipped() -> tuple:
    """Every output left as it is (a fresh update each call: Gradio may change what it is handed)."""
    return (gr.skip(),) * len(DOCUMENT_OUTPUTS)


class DocumentHandlers:
    """Outputs in `ui.views.DOCUMENT_OUTPUTS` order."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def _read(self, user: UserState, doc: Document) -> None:
        if isinstance(user.session, BookSession):  # the user's own pick from now on: a plain conversation
            old = user.session
            user.session = chat_session(old.engine, system_prompt=old.system_prompt, config=old.config)
            self.ctx.worker.call(old.release)
        self.ctx.worker.call(lambda: (user.session.set_document(doc), user.session.document_tokens))
        user.document, user.answers, user.spans = doc, [], []
        user.new_conversation()  # kept as a new conversation from its first answer

    def _read_book(self, user: UserState, doc: Document) -> None:
        """Each question reads the book's parts most relevant to it."""
        old, engine = user.session, self.ctx.engine_of(user)
        user.session = self.ctx.worker.call(
            lambda: book_session(engine, doc, system_prompt=old.system_prompt, config=old.config))
        self.ctx.worker.call(old.release)
        user.document, user.answers, user.spans = doc, [], []
        user.new_conversation()  # kept as a new conversation from its first answer

    def _outputs(self, user: UserState, budget, mode: str | None, status: str) -> tuple:
        """`mode`: the settings' (None: the app's default), for the gauge's retrieval budget. The
        upload box is left as it is, the line under it emptied (a handler that loads something
        else than the box's file empties the box)."""
        w = self.ctx.window_of(user)  # the user's model's
        budget = retrieval_budget(budget, mode or self.ctx.defaults.mode)
        panels = cleared_panels()  # the answers they showed belong to the document (or model) before
        return (user, doc_info(user), gauge(user, budget, w), status, transcript(user, False),
                retrieval_map_figure(None), *(panels[name] for name in PANELS), *toc_update(user, w),
                gr.skip(), upload_note())

    def set_document(self, user: UserState | None, doc: Document, budget, mode: str | None = None) -> tuple:
        user = user or self.ctx.new_user()
        if user.busy:
            raise gr.Error("An answer is being generated; stop it before changing the document.")
        engine, window = self.ctx.engine_of(user), self.ctx.window_of(user)
        count = engine.encode
        by_relevance, sizes = self.ctx.worker.call(
            lambda: (reads_by_relevance(engine, doc),
                     section_tokens(doc, lambda t: len(count(t))) if doc.sections else []))
        user.book, user.book_sizes = (doc, sizes) if doc.sections else (None, [])
        if by_relevance:  # a book: each question reads what is most relevant to it
            self._read_book(user, doc)
            what = "sections" if doc.sections else "parts"
            size = user.session.book_tokens  # the count the document line and the gauge show
            message = (f"{doc.name} is {size:,} tokens, over the context window of {window:,}: each question reads "
                       f"the {what} most relevant to it, up to {user.session.reading_budget:,} tokens"
                       + (" (ticked in the table of contents after each answer; or tick sections yourself and "
                          "read those)." if doc.sections else "."))
            return self._outputs(user, budget, mode, status_html(message, "info"))
        self._read(user, doc)
        return self._outputs(user, budget, mode, status_html(
            f"Loaded {doc.name}: {user.session.document_tokens:,} tokens. Ask a question.", "ok"))

    def on_sections(self, picked, user: UserState | None, budget, max_new_tokens, mode=None):
        """Read only the ticked sections of the book (indices into its sections)."""
        if user is None or user.book is None:
            raise gr.Error("Load a document with sections first.")
        if user.busy:
            raise gr.Error("An answer is being generated; stop it before changing the document.")
        if not picked:
            raise gr.Error("Tick at least one section.")
        book, picked = user.book, sorted(int(i) for i in picked)
        text = selected_text(book, picked)
        # The conversation's prompt without a question: the document, the template, the system prompt.
        system = user.session.system_prompt
        engine, window = self.ctx.engine_of(user), self.ctx.window_of(user)
        tokens = self.ctx.worker.call(lambda: len(chat_session(engine, text, system_prompt=system).prompt_ids("")))
        room = int(max_new_tokens or 0)
        if tokens + room > window:
            message = over_window(f"The selection ({picked_titles(book, picked)})", tokens, window, room)
            gr.Warning(message)
            skip = _skipped()
            return (user, *skip[1:3], status_html(message + ". Pick fewer.", "error"), *skip[4:])
        names = picked_titles(book, picked)  # the book's own titles and numbers, not the list's positions
        self._read(user, Document(text, book.format, f"{book.name}: {names}"))
        out = self._outputs(user, budget, mode, status_html(
            f"Reading sections {names} of {book.name}: {user.session.document_tokens:,} tokens. Ask a question.", "ok"))
        return with_outputs(out, toc_list=gr.update(value=picked))

    def on_answered(self, user: UserState | None):
        """After an answer of a book read by relevance: tick the sections the question read."""
        if user is None or not isinstance(user.session, BookSession) or not user.session.turns:
            return gr.skip()
        read = user.session.turns[-1].sections_read or []
        return gr.update(value=sorted({s["number"] - 1 for s in read if s["number"] is not None}))

    def on_upload(self, file, user, budget, mode=None):
        if file is None:
            return _skipped()
        path = Path(file if isinstance(file, str) else file.name)
        try:
            doc = load_document(path, max_bytes=self.ctx.max_bytes, name=path.name)
        except DocumentError as e:
            # said under the upload box, where the eye is, and in the status line; the box lets go
            # of the refused file (the document loaded before stays)
            message = f"Could not read {path.name}: {e}"
            gr.Warning(message)
            return with_outputs(_skipped(), user=user, status=status_html(message, "error"),
                                upload=gr.update(value=None), upload_note=upload_note(message))
        return self.set_document(user, doc, budget, mode)

    def on_sample(self, user, budget, mode=None):
        doc = load_document(SAMPLE_DOCUMENT, max_bytes=self.ctx.max_bytes)
        # the upload box would show a file that is no longer the document
        return with_outputs(self.set_document(user, doc, budget, mode), upload=gr.update(value=None))

    def on_paste(self, text, user, budget, mode=None):
        """A paste too long for a question, used as the document (the note's button, `ui.pasting`),
        read as an upload is. Outputs: `DOCUMENT_OUTPUTS`, then the hidden box that carried the
        text (emptied) and the note beside the chat box (emptied once the text is read)."""
        nonce = time.monotonic_ns()  # the page's script wrote into the note: this update must redraw it
        try:
            doc = pasted_document(text, self.ctx.max_bytes)
        except DocumentError as e:
            message = f"Could not use the paste as the document: {e}"
        else:
            if user is None or not user.busy:
                out = with_outputs(self.set_document(user, doc, budget, mode), upload=gr.update(value=None))
                return (*out, "", paste_note(nonce=nonce))
            message = "An answer is being generated; stop it, then paste the text again to use it as the document."
        gr.Warning(message)
        return (*with_outputs(_skipped(), status=status_html(message, "error")), "", paste_note(message, nonce))


def read_document(session: BookSession) -> Document:
    """What a book session's last question read, as a document whose sections are the lines
    naming each part (so the retrieval map's hover says which section a chunk lies in)."""
    book, text = session.book, session.document
    sections = tuple(Section(m.start(), m.group(1), m.group(1), 1) for m in re.finditer(r"(?m)^\[(.+)\]$", text))
    return Document(text, book.format, f"{book.name}, the sections read for the last question", sections)
