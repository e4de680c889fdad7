"""Switching the model: the settings' model picker and its path field.

A switch is the user's own (`triforce_core.serving.registry`): it loads (or finds loaded) another
engine and changes nothing another user holds, so their answers run on undisturbed. The
document stays: it is read again with the new model's tokenizer, and the context gauge and
the table of contents follow the new window. The conversation starts afresh, since its caches
belong to the old model. A model that cannot be loaded (a corrupt or unsupported file, a path
outside the model folders) leaves the user on the model they had, with one line saying why.
One switch runs per page at a time: a second pick of the model being loaded (Gradio's dropdown
sends `input` twice for one pick) changes nothing, a pick of another one is refused until it is
loaded.

Outputs: `ui.views.DOCUMENT_OUTPUTS`, then `MODEL_OUTPUTS`.
"""

from __future__ import annotations

import html
import threading
import time

import gradio as gr

from triforce_core.config import DEFAULT_MODE, DRAFTLESS_MODES, MODES, default_sampling
from triforce_core.models.loading import ModelLoadError
from triforce_core.models.folders import PathRefused
from triforce_core.prompting import PLAIN_LAYOUT_NOTE, has_chat_template
from triforce_core.serving.registry import ServedModel, UnknownModel
from triforce_core.serving.book import BookSession
from triforce_core.serving.session import ChatSession

from ..figures import retrieval_map_figure
from ..render import status_html
from ..settings import retrieval_budget
from ..state import AppContext, UserState
from ..views import DOCUMENT_OUTPUTS, PANELS, cleared_panels, doc_info, gauge, toc_update, transcript
from .documents import DocumentHandlers

# "repetition_penalty": the new model's default; "message": the chat box, whose placeholder fits the model
MODEL_OUTPUTS = ("mode", "model", "model_info", "repetition_penalty", "message")
PROGRESS_EVERY_S = 0.5  # how often the loading line refreshes


def modes_for(engine) -> list[str]:
    """The decoding modes a model can run: those needing a small draft only with one."""
    return [m for m in MODES if engine.draft is not None or m in DRAFTLESS_MODES]


def model_info(served_id: str | None, note: str | None, engine) -> str:
    """One line on the user's model: its name, what it is, its context window, its draft, and for a
    model without a chat template how a chat is laid out for it (PLAIN_LAYOUT_NOTE)."""
    draft = "with its small draft" if engine.draft is not None else "no small draft (modes without one)"
    name = f"<b>{html.escape(served_id)}</b>" if served_id else "<b>the model</b>"
    what = f" ({html.escape(note)})" if note else ""
    url = getattr(engine, "url", None)  # a remote engine's server
    where = f" · served by {html.escape(url)}" if url else ""
    tokenizer = getattr(engine, "tokenizer", None)
    plain = ("" if tokenizer is None or has_chat_template(tokenizer)
             else f' · <span class="tf-plain-layout">{html.escape(PLAIN_LAYOUT_NOTE)}</span>')
    return (f'<div class="tf-model-info">Model: {name}{what} · context window '
            f"<b>{engine.context_window:,}</b> tokens · {draft}{where}{plain}</div>")


def message_placeholder(engine) -> str:
    """The chat box's placeholder for `engine`'s model: an instruct model gets a real question; a
    model that is no instruct model (the demo pair copies from its document) a phrase to go on.
    A served engine's model (`--engine URL`) is known by its card's default sampling: an instruct
    model's has the repetition control (`config.INSTRUCT_SAMPLING`)."""
    instruct = getattr(engine, "instruct", None)
    if instruct is None:
        instruct = engine.default_sampling().repetition_penalty == default_sampling(True).repetition_penalty
    if instruct:
        return "Ask about the document, e.g. What is a class?"
    return "Ask about the document, e.g. What follows «a phrase from it»?"


def page_key(request: gr.Request | None, user: UserState | None) -> object:
    """The page an event comes from: its Gradio session (whose user state may still be None),
    else the user state itself (a handler called directly)."""
    if request is not None and request.session_hash:
        return request.session_hash
    return user if user is not None else object()


class ModelHandlers:
    def __init__(self, ctx: AppContext, documents: DocumentHandlers):
        if ctx.models is None:
            raise ValueError("the model picker needs the server's ServedModels")
        self.ctx, self.documents = ctx, documents
        self._loading: dict[object, str] = {}  # page (`page_key`) -> the model its switch under way loads
        self._claims = threading.Lock()

    def choices(self) -> list[tuple[str, str]]:
        """The picker's entries (label, id): the models list is scanned again each time."""
        return [(c.label, c.id) for c in self.ctx.models.choices()]

    def on_page_load(self):
        return gr.update(choices=self.choices())

    def on_pick(self, model_id, user, budget, mode, request: gr.Request | None = None):
        # Gradio's dropdown sends `input` on a pick and again on the blur that follows it (and on a
        # blur with no pick): the model in use, or the one being loaded, picked again is no
        # switch, and gets no update at all (a "… is the model in use" line would overwrite the
        # first event's "Switched to …").
        yield from self._switch(lambda: self.ctx.models.find(model_id), user, budget, mode,
                                page_key(request, user), quiet=True)

    def on_path(self, text, user, budget, mode, request: gr.Request | None = None):
        yield from self._switch(lambda: self.ctx.models.open_path(text), user, budget, mode, page_key(request, user))

    def _kept(self, user: UserState | None, message: str, shown: str | None = None) -> tuple:
        """A refused or failed switch: one line, and the picker back on the model the user has
        (`shown`: the one a switch under way loads). The user state is left as it is: on a
        fresh page another event may have stored one since this one began."""
        gr.Warning(message)
        skip = (gr.skip(),) * len(DOCUMENT_OUTPUTS)
        return (*skip[:3], status_html(message, "error"), *skip[4:],
                gr.skip(), gr.update(value=shown or self.ctx.model_id_of(user)), gr.skip(), gr.skip(), gr.skip())

    def _switch(self, choose, user: UserState | None, budget, mode, page, quiet: bool = False):
        """`page`: the page the event comes from (`page_key`), whose switches run one at a time.
        `quiet`: a pick of the model in use is answered with no update (the picker's)."""
        ctx = self.ctx
        try:
            choice = choose()
        except (UnknownModel, PathRefused) as e:
            yield self._kept(user, str(e))
            return
        # Events run concurrently, the two of one pick a millisecond apart: whether a switch is
        # under way, and claiming it, is one step.
        with self._claims:
            loading = self._loading.get(page)
            in_use = loading is None and choice.id == ctx.model_id_of(user)
            busy = user is not None and user.busy
            if loading is None and not in_use and not busy:
                self._loading[page] = choice.id
        if loading == choice.id or (in_use and quiet):
            yield (gr.skip(),) * (len(DOCUMENT_OUTPUTS) + len(MODEL_OUTPUTS))
            return
        if loading is not None:
            yield self._kept(user, f"{loading} is being loaded; pick another model once it is.", shown=loading)
            return
        if in_use:
            yield self._kept(user, f"{choice.id} is the model in use.")
            return
        if busy:
            yield self._kept(user, "An answer is being generated; stop it before switching the model.")
            return
        try:
            # created now, not once loaded: the loading lines store it, so a document uploaded
            # meanwhile on a fresh page goes to this user, not to one the switch then replaces
            yield from self._load(choice, user or ctx.new_user(), budget, mode)
        finally:
            with self._claims:
                del self._loading[page]

    def _load(self, choice, user: UserState, budget, mode):
        """Load `choice` (a loading line every PROGRESS_EVERY_S), then switch `user` to it."""
        ctx = self.ctx
        # Loading runs beside the page's updates (a large file takes a while); the worker, and
        # with it every other user's answer, is not held up by it.
        box: dict = {}

        def load():
            try:
                box["served"] = ctx.models.get(choice.id)
            except (ModelLoadError, UnknownModel, OSError, ValueError) as e:
                box["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__

        t0 = time.perf_counter()
        thread = threading.Thread(target=load, name=f"load {choice.id}", daemon=True)
        thread.start()
        skip = (gr.skip(),) * (len(DOCUMENT_OUTPUTS) + len(MODEL_OUTPUTS))
        while thread.is_alive():
            line = status_html(f"Loading {choice.id} … {time.perf_counter() - t0:.0f} s", "busy")
            yield (user, *skip[1:3], line, *skip[4:])
            thread.join(PROGRESS_EVERY_S)
        if "error" in box:
            yield self._kept(user, f"Could not load {choice.id}: {box['error']}. Still on {ctx.model_id_of(user)}.")
            return
        served: ServedModel = box["served"]
        seconds = time.perf_counter() - t0
        if user.busy:  # an answer was started while the model loaded
            yield self._kept(user, "An answer is being generated; stop it before switching the model.")
            return
        old = user.session
        user.model = served
        user.session = ChatSession(served.engine, system_prompt=old.system_prompt)
        user.answers, user.spans = [], []
        ctx.worker.call(old.release)  # its caches belong to the old model
        window = served.engine.context_window
        head = f"Switched to {served.id} in {seconds:.1f} s (window {window:,} tokens)"
        doc = user.book or (old.book if isinstance(old, BookSession) else user.document)
        modes = modes_for(served.engine)
        return_mode = mode if mode in modes else DEFAULT_MODE
        if return_mode != mode:  # e.g. triforce, whose lowest level is the small draft this model lacks
            head += f"; it has no small draft, so mode {return_mode} instead of {mode}"
        if doc is not None:
            # re-tokenized: the gauge and the contents follow; the panels of the old model's answers are cleared
            out = self.documents.set_document(user, doc, budget, return_mode)
            if isinstance(user.session, BookSession):  # a book over the new window: read by relevance
                line = status_html(f"{head}: {doc.name} is over its window; each question reads the sections "
                                   "most relevant to it.", "info")
            else:
                line = status_html(f"{head}: {user.document.name} read again, {user.session.document_tokens:,} "
                                   "tokens; the conversation starts afresh.", "ok")
            out = (*out[:3], line, *out[4:])
        else:
            panels = cleared_panels()
            out = (user, doc_info(user), gauge(user, retrieval_budget(budget, return_mode), window),
                   status_html(head + ".", "ok"), transcript(user, False), retrieval_map_figure(None),
                   *(panels[name] for name in PANELS), *toc_update(user, window), gr.skip(), gr.skip())
        yield (*out, gr.update(choices=modes, value=return_mode), gr.update(value=served.id),
               model_info(served.id, served.choice.note, served.engine),
               gr.update(value=served.engine.default_sampling().repetition_penalty),  # an instruct model's own
               gr.update(placeholder=message_placeholder(served.engine)))
