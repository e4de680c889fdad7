"""The conversations kept: the sidebar's list of a browser's conversations, reopening one (its
document, its turns with their levels, citations and statistics), renaming, deleting (with
Undo) and exporting one as Markdown; and `keep_answer`, which saves a conversation whole when
one of its answers ends (`ui.handlers.answers`).

Who owns what: each browser keeps a random token in its localStorage (`gr.BrowserState`, under
the store's own secret, so it survives a restart of the app); with `--api-key` the key's token,
from the request the `Guard` let through, is part of it too (`owner_of`). Every handler asks
the store with that owner: a conversation id sent by a page that is not its owner's finds
nothing. The store itself is `triforce_core.serving.history`.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
import tempfile
from pathlib import Path

import gradio as gr

from triforce_core.decoding.events import Committed, Finished, GenerationStats, Prefilled
from triforce_core.serving.book import BookSession
from triforce_core.serving.guard import AccessPolicy
from triforce_core.serving.history import HistoryError, Stored, new_token, owner_id
from triforce_core.serving.turns import Truncation, Turn, TurnStats

from ..render import read_name, stats_html, status_html
from ..state import Answer, AppContext, UserState, chat_session
from ..trace import AnswerTrace, RoundStats
from ..views import DOCUMENT_OUTPUTS, stats_rows, transcript, with_outputs

BROWSER_KEY = "triforce-studio-browser"  # the localStorage entry of the browser's token
TOKEN = re.compile(r"[A-Za-z0-9_-]{32}")  # `history.new_token`'s form: anything else is made anew
# The sidebar's outputs, in this order, after every handler here but `on_open` (which adds the
# document's outputs before them).
SIDEBAR = ("conversations", "conversation_title", "export", "conversation_note", "undo")


def _fields(cls, values: dict | None) -> dict:
    """`values` limited to the fields `cls` has (a record written by another version of the app)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in (values or {}).items() if k in names}


def _plain(value):
    """`value` as JSON holds it (tuples as lists, anything else as its text)."""
    return json.loads(json.dumps(value, default=str))


def key_token(request: gr.Request | None) -> str | None:
    """The API key's token of a request (the key cookie's value, or that of a Bearer key), None
    without one. The `Guard` has checked it already: a request without the right key never gets here."""
    if request is None:
        return None
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return AccessPolicy(api_key=token.strip()).cookie_token
    cookies = getattr(request, "cookies", None) or {}
    found = sorted(v for k, v in cookies.items() if k.startswith("triforce_key_"))
    return found[0] if found else None


# -- what is kept of a turn, and what comes back ---------------------------------------------
def turn_record(turn: Turn, answer: Answer) -> dict:
    """One turn as the store keeps it: the question, the answer's text, token ids and levels,
    its citations, statistics, footer, and the trace's rounds (the page's colours and figures)."""
    t = answer.trace
    return _plain({
        "question": turn.question, "answer": turn.answer, "token_ids": list(turn.token_ids),
        "levels": list(turn.levels), "stats": dataclasses.asdict(turn.stats) if turn.stats else None,
        "truncation": dataclasses.asdict(turn.truncation) if turn.truncation else None,
        "sections_read": turn.sections_read, "passages": turn.passages, "footer": answer.footer,
        "baseline": answer.baseline, "settings": answer.settings,
        "trace": {"text": t.text, "token_ids": list(t.token_ids), "levels": list(t.levels),
                  "pieces": [s.text for s in t.segments if s.kind == "token"],
                  "rounds": [dataclasses.asdict(r) for r in t.rounds], "waited_s": t.waited_s,
                  "prefill": dataclasses.asdict(t.prefill) if t.prefill else None,
                  "stats": dataclasses.asdict(t.stats) if t.stats else None},
    })


def kept_turn(record: dict) -> Turn:
    """The session's `Turn` of a stored record (what the next question's prompt holds)."""
    stats = record.get("stats")
    truncation = record.get("truncation")
    return Turn(record.get("question", ""), record.get("answer", ""), list(record.get("token_ids", [])),
                list(record.get("levels", [])), TurnStats(**_fields(TurnStats, stats)) if stats else None,
                Truncation(**_fields(Truncation, truncation)) if truncation else None,
                record.get("sections_read"), list(record.get("passages") or []))


def kept_answer(record: dict, decode) -> Answer:
    """The page's `Answer` of a stored record: its trace rebuilt by pushing a `Committed` per
    stored round and a `Finished` with the stored statistics, so its colours (levels), footer,
    figures and statistics come back. The teaching view's rejected drafts are not kept."""
    kept = record.get("trace") or {}
    trace = AnswerTrace(decode)
    if kept.get("prefill"):
        trace.push(Prefilled(**_fields(Prefilled, kept["prefill"])))
    ids, levels = list(kept.get("token_ids", [])), list(kept.get("levels", []))
    rounds = [RoundStats(**_fields(RoundStats, r)) for r in kept.get("rounds", [])]
    at = 0
    for r in rounds or [RoundStats(1, len(ids))]:
        trace.push(Committed(tuple(ids[at:at + r.committed]), tuple(levels[at:at + r.committed]), ""), 0.0)
        at += r.committed
    if at < len(ids):  # tokens after the last round kept (a record cut short): one more round
        trace.push(Committed(tuple(ids[at:]), tuple(levels[at:]), ""), 0.0)
    pieces = kept.get("pieces")
    tokens = [i for i, s in enumerate(trace.segments) if s.kind == "token"]
    if pieces and len(pieces) == len(tokens):  # the text the page showed, whatever decodes it now
        for i, piece in zip(tokens, pieces):
            trace.segments[i] = dataclasses.replace(trace.segments[i], text=piece)
    trace.text = kept.get("text", trace.text)
    if rounds:
        trace.rounds = rounds
        trace._last_t = rounds[-1].at_s
    trace.waited_s = float(kept.get("waited_s") or 0.0)
    if kept.get("stats"):
        trace.push(Finished(GenerationStats(**_fields(GenerationStats, kept["stats"]))))
    return Answer(trace, footer=record.get("footer", ""), baseline=record.get("baseline"),
                  settings=record.get("settings"))


def conversation_markdown(stored: Stored) -> str:
    """The conversation as a Markdown file: every question and answer, and under each answer its
    citations (the sections its question read, the passages it quoted or read most)."""
    out = [f"# {stored.label}", ""]
    out.append(f"- Document: {stored.document_name or 'none'}"
               + ("" if stored.document is not None else " (no longer kept)"))
    if stored.model:
        out.append(f"- Model: {stored.model}")
    out.append("")
    for n, t in enumerate(stored.turns, 1):
        out += [f"## {n}. {' '.join(str(t.get('question', '')).split())}", "", str(t.get("answer", "")).strip(), ""]
        if t.get("footer"):
            out += [f"*{t['footer']}*", ""]
        read, passages = t.get("sections_read") or [], t.get("passages") or []
        if read or passages:
            out += ["**Sources**", ""]
            for s in read:  # named as the page names them: the book's own titles and numbers
                out.append(f"- Read: {read_name(s)}")
            quoted = bool(passages) and all(p.get("kind") == "quoted" for p in passages)
            for p in passages:
                where = f"{p['section']}: " if p.get("section") else ""
                what = "Quoted" if quoted else "Most read"
                text = " ".join(str(p.get("text", "")).split())
                out.append(f"- {what}: {where}«{text}»")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


# -- saving --------------------------------------------------------------------------------
def conversation_document(user: UserState):
    """What a conversation is kept with: the whole book when its questions read parts of it, else the document."""
    return user.session.book if isinstance(user.session, BookSession) else user.document


def keep_answer(ctx: AppContext, user: UserState | None, config=None) -> None:
    """An answer of `user` ended (finished, stopped or failed): save their conversation whole,
    with `config` (its generation settings) on that answer. Nothing is saved for a session that is
    not kept (`UserState.keep`, the lesson's), whose owner is not known yet (the sidebar's handler
    saves it once it is), or without a store. Never raises: a failure is said in the sidebar."""
    if ctx.history is None or user is None or not user.keep or user.owner is None or user.document_gone:
        return
    turns = user.session.turns
    if not turns or len(user.answers) < len(turns):
        return
    if config is not None and user.answers:
        user.answers[len(turns) - 1].settings = _plain(dataclasses.asdict(config))
    records = [turn_record(t, a) for t, a in zip(turns, user.answers)]
    model = ctx.model_id_of(user) or ctx.model_name or ""
    last = user.answers[len(turns) - 1].settings or {}
    try:
        user.conversation_id, let_go = ctx.history.save(
            user.owner, user.conversation_id, document=conversation_document(user), model=model, turns=records,
            settings={"system_prompt": user.session.system_prompt, **last})
    except (HistoryError, TypeError, ValueError) as e:
        user.history_note = f"This conversation was not saved: {e}"
        return
    user.history_note = (f"Let go of the stored {', '.join(let_go)} to keep the stored documents under "
                         f"{ctx.history.max_document_bytes / 1e6:,.0f} MB; the conversations with "
                         f"{'it' if len(let_go) == 1 else 'them'} stay listed." if let_go else "")


# -- the sidebar -----------------------------------------------------------------------------
class ConversationHandlers:
    """The sidebar's events. `documents`: the page's `DocumentHandlers` (reopening loads a
    conversation's document as an upload would)."""

    def __init__(self, ctx: AppContext, documents):
        self.ctx, self.documents = ctx, documents
        self.exports = Path(tempfile.mkdtemp(prefix="triforce-exports-"))

    @property
    def store(self):
        return self.ctx.history

    def note(self, user: UserState | None, message: str = "") -> str:
        """The sidebar's line: saving off (and why), the last save's trouble, or `message`."""
        if self.store is None:
            text, kind = self.ctx.history_note or "Conversations are not saved.", "error"
        else:
            text = message or (user.history_note if user is not None else "")
            kind = "info"
        if not text:
            return '<div class="tf-conv-note"></div>'
        return f'<div class="tf-conv-note tf-{kind}" role="status">{html.escape(text)}</div>'

    def owner_of(self, browser: str | None, request: gr.Request | None) -> str | None:
        if not browser or not TOKEN.fullmatch(str(browser)):
            return None
        return owner_id(str(browser), key_token(request))

    def _export(self, owner: str, conversation_id: str | None):
        """The export button's file for a conversation (None without one)."""
        stored = self.store.load(owner, conversation_id) if conversation_id else None
        if stored is None:
            return gr.update(value=None, interactive=False)
        name = re.sub(r"[^\w.-]+", "-", stored.label).strip("-")[:60] or "conversation"
        folder = self.exports / re.sub(r"\W", "", stored.id)
        folder.mkdir(exist_ok=True)
        for old in folder.glob("*.md"):
            old.unlink()
        path = folder / f"{name}.md"
        path.write_text(conversation_markdown(stored), encoding="utf-8")
        return gr.update(value=str(path), interactive=True)

    def _sidebar(self, owner: str | None, user: UserState | None, message: str = "", title=None, undo=None) -> tuple:
        if self.store is None or owner is None:
            return (gr.update(choices=[], value=None), gr.skip(), gr.update(value=None, interactive=False),
                    self.note(user, message), gr.update(visible=False))
        listed = self.store.listing(owner)
        current = user.conversation_id if user is not None and user.owner == owner else None
        if current not in {c.id for c in listed}:
            current = None
        if title is None:
            title = next((c.label for c in listed if c.id == current), "")
        return (gr.update(choices=[(c.label + ("" if c.document_kept else " (document let go)"), c.id)
                                   for c in listed], value=current),
                title, self._export(owner, current), self.note(user, message), gr.update(visible=bool(undo)))

    def _adopt(self, user: UserState | None, owner: str | None) -> None:
        """The session is this browser's: its answers are saved under `owner` from now on."""
        if user is not None and owner is not None and user.owner != owner:
            user.owner, user.conversation_id = owner, None

    def on_load(self, browser, user, request: gr.Request):
        """A page opened: its browser's token (a new one on a first visit, or for a token that
        is not one), and its list. Outputs: the token, then `SIDEBAR`."""
        if self.store is None:
            return (gr.skip(), *self._sidebar(None, user))
        if not browser or not TOKEN.fullmatch(str(browser)):
            browser = new_token()
        owner = self.owner_of(browser, request)
        self._adopt(user, owner)
        return (browser, *self._sidebar(owner, user))

    def on_answered(self, browser, user, request: gr.Request):
        """After an answer: a session whose owner was not known yet is saved now; the list, the
        export and the sidebar's line follow."""
        owner = self.owner_of(browser, request)
        if user is not None and owner is not None and user.owner is None:
            self._adopt(user, owner)
            keep_answer(self.ctx, user)
        return self._sidebar(owner, user)

    def on_clear(self, browser, user, request: gr.Request):
        """Clear conversation: the next answer starts a new stored one (this one stays listed)."""
        owner = self.owner_of(browser, request)
        if user is not None and not user.busy:
            self._adopt(user, owner)
            user.new_conversation()
        return self._sidebar(owner, user)

    def on_rename(self, conversation_id, title, browser, user, request: gr.Request):
        owner = self.owner_of(browser, request)
        if self.store is None or owner is None or not conversation_id:
            raise gr.Error("Pick a conversation in the list first.")
        if not self.store.rename(owner, str(conversation_id), title or ""):
            raise gr.Error("That conversation is not in your list.")
        return self._sidebar(owner, user, "Renamed.")

    def on_delete(self, conversation_id, browser, user, request: gr.Request):
        """Take a conversation out of the list (Undo brings it back). Outputs: `SIDEBAR`, the deleted id."""
        owner = self.owner_of(browser, request)
        if self.store is None or owner is None or not conversation_id:
            raise gr.Error("Pick a conversation in the list first.")
        stored = self.store.load(owner, str(conversation_id))
        if stored is None or not self.store.delete(owner, stored.id):
            raise gr.Error("That conversation is not in your list.")
        if user is not None and user.conversation_id == stored.id:
            user.conversation_id = None  # the page keeps showing it; a next answer starts a new one
        return (*self._sidebar(owner, user, f"Deleted «{stored.label}».", undo=True), stored.id)

    def on_undo(self, deleted, browser, user, request: gr.Request):
        owner = self.owner_of(browser, request)
        if self.store is None or owner is None or not deleted or not self.store.restore(owner, str(deleted)):
            raise gr.Error("There is nothing to undo.")
        return (*self._sidebar(owner, user, "Restored.", undo=False), "")

    def on_open(self, conversation_id, browser, user, teaching, budget, mode, request: gr.Request):
        """Open a conversation of the list: its document loaded (as an upload would be; the disk
        cache of K/V makes the first question after it fast), its turns shown with their levels,
        citations and statistics, the next answer added to it. Outputs: `ui.views.DOCUMENT_OUTPUTS`,
        then `SIDEBAR`."""
        owner = self.owner_of(browser, request)
        stored = self.store.load(owner, str(conversation_id)) if self.store and owner and conversation_id else None
        if stored is None:
            gr.Warning("That conversation is not in your list.")
            return (*(gr.skip(),) * len(DOCUMENT_OUTPUTS), *self._sidebar(owner, user))
        user = user or self.ctx.new_user()
        if user.busy:
            raise gr.Error("An answer is being generated; stop it before opening another conversation.")
        self._adopt(user, owner)
        if stored.document is not None:
            out = self.documents.set_document(user, stored.document, budget, mode)
        else:  # let go to keep under the cap: the turns alone, no document to ask more of
            old, engine = user.session, self.ctx.engine_of(user)
            user.session = chat_session(engine, system_prompt=old.system_prompt, config=old.config)
            self.ctx.worker.call(old.release)
            user.document, user.book, user.book_sizes, user.answers, user.spans = None, None, [], [], []
            out = self.documents._outputs(user, budget, mode, "")
        decode = self.ctx.engine_of(user).detokenize
        user.session.turns = [kept_turn(r) for r in stored.turns]
        user.answers = [kept_answer(r, decode) for r in stored.turns]
        user.session.system_prompt = (stored.settings or {}).get("system_prompt") or user.session.system_prompt
        user.conversation_id = stored.id
        user.document_gone = None if stored.document is not None else (stored.document_name or "its document")
        model = self.ctx.model_id_of(user) or self.ctx.model_name or ""
        message = f"Opened «{stored.label}»: {len(stored.turns)} turn{'s' if len(stored.turns) != 1 else ''}."
        if user.document_gone:
            message += (f" Its document, {user.document_gone}, is no longer kept (the stored documents' cap let it "
                        "go): load it again to ask more (a new conversation starts).")
        if stored.model and model and stored.model != model:
            message += f" It was answered by {stored.model}; answers from now on come from {model}."
        last = user.answers[-1] if user.answers else None
        out = with_outputs(out, user=user, chat=transcript(user, bool(teaching)),
                           status=status_html(message, "info" if user.document_gone else "ok"),
                           stats=stats_html(stats_rows(last)))
        return (*out, *self._sidebar(owner, user, title=stored.label))


def document_gone_error(user: UserState | None) -> None:
    """A reopened conversation whose document is no longer kept cannot be asked more: a clear error."""
    if user is not None and user.document_gone:
        raise gr.Error(f"This conversation's document, {user.document_gone}, is no longer kept: load it again to "
                       "ask more (a new conversation starts).")
