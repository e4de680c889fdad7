"""The named `chat(message, document)` endpoint for `gradio_client`: streams an answer's plain
text. Its calls borrow cache slots from the same `SlotPool` as the OpenAI-compatible HTTP API,
so both reuse a document either of them prefilled. Under a remote engine each call is a
one-question conversation on the server (whose slots reuse the document's prefill)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from triforce_core.documents import DocumentError, load_document
from triforce_core.engine import ContextLengthError
from triforce_core.decoding.events import Committed
from triforce_core.serving.remote import RemoteError
from triforce_core.serving.session import ChatSession, SessionError

from ..state import AppContext, chat_session


class ChatEndpoint:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def chat(self, message: str, document):
        """Answer `message` about `document` (a file, or None) and stream the answer's text."""
        ctx = self.ctx
        message = (message or "").strip()
        if not message:
            raise gr.Error("the message is empty")
        doc = None
        if document is not None:
            path = Path(document if isinstance(document, str) else getattr(document, "path", None) or document.name)
            try:
                doc = load_document(path, max_bytes=ctx.max_bytes, name=path.name)
            except DocumentError as e:
                raise gr.Error(f"could not read {path.name}: {e}")
        config = ctx.defaults.config()
        if ctx.remote:
            yield from self._remote(doc, message, config)
            return
        # The conversation a chat session would start (the document leading the question),
        # rendered and checked against the context window on the worker, which owns the tokenizer.
        try:
            prompt = ctx.worker.call(lambda: ChatSession(ctx.engine, doc).prompt_for(message, config))
        except (ContextLengthError, ValueError) as e:
            raise gr.Error(str(e))
        slot, _ = ctx.slots.take(prompt)
        job = ctx.worker.submit(lambda: slot.generate(prompt, config, progress_events=True))
        text = ""
        ok = False
        try:
            for item in job:
                if isinstance(item, Committed):
                    text += item.text
                    yield text
            ok = True
        except (ContextLengthError, SessionError, ValueError) as e:
            raise gr.Error(str(e))
        finally:
            job.cancel()
            if ok:
                ctx.slots.give_back(slot)
            else:  # a failed or abandoned call: its caches are not worth keeping
                ctx.slots.discard(slot)
        yield text

    def _remote(self, doc, message: str, config):
        text = ""
        job = self.ctx.worker.submit(lambda: chat_session(self.ctx.engine, doc).ask(message, config))
        try:
            for item in job:
                if isinstance(item, Committed):
                    text += item.text
                    yield text
        except (ContextLengthError, RemoteError, ValueError) as e:
            raise gr.Error(str(e))
        finally:
            job.cancel()  # a caller gone: the stream, and so the server's answer, ends
        yield text
