"""The named `chat(message, document)` endpoint for `gradio_client`: streams an answer's plain
text, as the page would answer the same first question with its default settings.

A document the page would read whole is read whole here too: such calls borrow cache slots from
the same `SlotPool` as the OpenAI-compatible HTTP API, so both reuse a document either of them
prefilled. A document over the context window is read as the page reads it
(`ui.state.reads_by_relevance`): a book session that reads the sections most relevant to the
question, made for the call and let go after it. Under a remote engine each call is a
one-question conversation on the server (whose slots reuse the document's prefill).

The optional `temperature` overrides the page's default sampling for the call (0: greedy).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import gradio as gr

from triforce_core.config import ConfigError
from triforce_core.documents import DocumentError, load_document
from triforce_core.engine import ContextLengthError
from triforce_core.decoding.events import Committed
from triforce_core.prompting import answer_stops
from triforce_core.serving.remote import RemoteError
from triforce_core.serving.session import ChatSession, SessionError

from ..pasting import question_refused
from ..state import AppContext, book_session, chat_session, reads_by_relevance

ANSWER_ERRORS = (ContextLengthError, SessionError, RemoteError, ValueError)


class ChatEndpoint:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def chat(self, message: str, document, temperature: float | None = None):
        """Answer `message` about `document` (a file, or None) and stream the answer's text;
        `temperature` (None: the page's default) for this call only."""
        ctx = self.ctx
        message = (message or "").strip()
        if not message:
            raise gr.Error("the message is empty")
        refused = question_refused(message, "shorten it, or send the long text as the document")  # as the page
        if refused:
            raise gr.Error(refused)
        doc = None
        if document is not None:
            path = Path(document if isinstance(document, str) else getattr(document, "path", None) or document.name)
            try:
                doc = load_document(path, max_bytes=ctx.max_bytes, name=path.name)
            except DocumentError as e:
                raise gr.Error(f"could not read {path.name}: {e}")
        try:
            settings = ctx.defaults if temperature is None else replace(ctx.defaults, temperature=float(temperature))
            config = settings.config()
        except (ConfigError, TypeError, ValueError) as e:
            raise gr.Error(f"invalid temperature: {e}")
        engine = ctx.engine
        by_relevance = doc is not None and ctx.worker.call(lambda: reads_by_relevance(engine, doc))
        if ctx.remote or by_relevance:
            yield from self._own_session(doc, message, config, by_relevance)
            return
        # The conversation a chat session would start (the document leading the question),
        # rendered and checked against the context window on the worker, which owns the tokenizer.
        try:
            prompt = ctx.worker.call(lambda: ChatSession(engine, doc).prompt_for(message, config))
        except (ContextLengthError, ValueError) as e:
            raise gr.Error(str(e))
        slot, _ = ctx.slots.take(prompt)
        job = ctx.worker.submit(lambda: slot.generate(prompt, config, progress_events=True,
                                                      stops=answer_stops(engine.tokenizer)))
        text = ""
        ok = False
        try:
            for item in job:
                if isinstance(item, Committed):
                    text += item.text
                    yield text
            ok = True
        except ANSWER_ERRORS as e:
            raise gr.Error(str(e))
        finally:
            job.cancel()
            if ok:
                ctx.slots.give_back(slot)
            else:  # a failed or abandoned call: its caches are not worth keeping
                ctx.slots.discard(slot)
        yield text

    def _own_session(self, doc, message: str, config, by_relevance: bool):
        """One question in a session of its own (a book read by relevance, or any call under a
        remote engine), let go when the call ends."""
        ctx, engine = self.ctx, self.ctx.engine
        make = book_session if by_relevance else chat_session
        try:
            session = ctx.worker.call(lambda: make(engine, doc))
        except ANSWER_ERRORS as e:
            raise gr.Error(str(e))
        text = ""
        job = ctx.worker.submit(lambda: session.ask(message, config, progress_events=True))
        try:
            for item in job:
                if isinstance(item, Committed):
                    text += item.text
                    yield text
        except ANSWER_ERRORS as e:
            raise gr.Error(str(e))
        finally:
            job.cancel()  # a caller gone: the generation (or the server's stream) ends
            with contextlib.suppress(RuntimeError):  # a worker closed by the app's stop frees everything
                ctx.worker.call(session.release)
        yield text
