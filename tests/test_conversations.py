"""Conversations kept, for real: `python app.py --target demo --data-dir DIR` in headless Chromium
(Debian's), restarted on the same data folder; and the sidebar's handlers refusing the ids of
conversations another browser owns (a real store).

Targets (issue 64): "the app restarted: every conversation listed and reopened with its turns,
levels and citations"; "export: a Markdown file with every turn and its citations"."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import types
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.page import CHROMIUM, SAMPLE, wait_status
from tests.helpers.servers import free_port, running_server
from ui.handlers.conversations import BROWSER_KEY

pytestmark = pytest.mark.xdist_group("conversations")

MAX_NEW = 24
QUESTIONS = ("What follows «Objects have individuality»?", "What follows «In C++ terminology, normally class members»?")
OTHER = "What follows «A Word About Names»?"  # the question of a second conversation


@contextlib.contextmanager
def app_on(data: Path, port: int, log: Path):
    """The demo pair's app on `port` keeping its conversations in `data`; stopped after the block."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    url = f"http://127.0.0.1:{port}/"
    # triforce: its retrieval level reads passages, so each answer has citations to keep
    cmd = [sys.executable, str(ROOT / "app.py"), "--target", "demo", "--port", str(port), "--max-new-tokens",
           str(MAX_NEW), "--mode", "triforce", "--data-dir", str(data)]
    with running_server(cmd, log, lambda: urllib.request.urlopen(url, timeout=2), env, "the app"):
        yield url


def new_page(context, url: str):
    page = context.new_page()
    page.set_default_timeout(240_000)
    page.goto(url)
    page.wait_for_selector("#tf-send")
    return page


def open_sidebar(page) -> None:
    """Open the sidebar (Gradio's: closed, it lies left of the page) and wait until it is in view."""
    if "open" not in (page.get_attribute("#tf-sidebar", "class") or "").split():
        page.click("#tf-sidebar button.toggle-button")
    page.wait_for_function("() => document.querySelector('#tf-sidebar').getBoundingClientRect().x >= 0")
    page.wait_for_selector("#tf-conversations", state="visible")


def listed(page) -> list[str]:
    """The sidebar's conversations, as labelled."""
    return page.locator("#tf-conversations label").evaluate_all("els => els.map(e => e.innerText.trim())")


def wait_listed(page, count: int) -> list[str]:
    page.wait_for_function(f"() => document.querySelectorAll('#tf-conversations label').length === {count}")
    return listed(page)


def shown_turns(page) -> list[dict]:
    """Each answer of the transcript: its question, its tokens (text and level class) and its citations."""
    return page.evaluate("""() => [...document.querySelectorAll('#tf-chat .tf-assistant')].map(a => ({
        tokens: [...a.querySelectorAll('.tf-tok')].map(t => [t.textContent,
                 [...t.classList].filter(c => c !== 'tf-tok').sort().join(' ')]),
        sources: (a.querySelector('.tf-sources') || {textContent: ''}).textContent,
        footer: (a.querySelector('.tf-foot') || {innerText: ''}).innerText.trim(),
    }))""")


def plain(text: str) -> str:
    """Text without Markdown's emphasis and code marks, its spaces collapsed (the page renders
    an answer's Markdown: its marks are not in the page's text)."""
    return " ".join(re.sub(r"[*_`]", "", text).split())


def questions_shown(page) -> list[str]:
    return page.locator("#tf-chat .tf-user").evaluate_all("els => els.map(e => e.innerText.trim())")


def test_conversations_outlive_a_restart_and_stay_in_their_browser(tmp_path, playwright_api):
    data, port = tmp_path / "data", free_port()
    doc = tmp_path / "classes.txt"
    doc.write_text(SAMPLE.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    browser = playwright_api.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
    context = browser.new_context(viewport={"width": 1500, "height": 1100}, accept_downloads=True)
    with app_on(data, port, tmp_path / "first.log") as url:
        page = new_page(context, url)
        page.set_input_files("#tf-upload input[type=file]", str(doc))
        page.wait_for_selector("#tf-docinfo:has-text('classes.txt')")
        for question in QUESTIONS:
            page.fill("#tf-message textarea", question)
            page.click("#tf-send")
            done = wait_status(page, "tok/s", "rror")
            assert "tok/s" in done, done
        open_sidebar(page)
        assert wait_listed(page, 1) == [f"classes.txt · {QUESTIONS[0]}"]
        before, asked = shown_turns(page), questions_shown(page)
        assert len(before) == 2 and all(t["tokens"] and t["sources"] for t in before), before
        levels = {cls for t in before for _text, cls in t["tokens"]}
        assert len(levels) > 1, levels  # coloured by more than one level: the colours must come back
        # Clear conversation: the next answer starts a second one; the first stays listed
        page.click("#tf-clear")
        page.wait_for_function("() => !document.querySelector('#tf-chat .tf-assistant')")
        page.fill("#tf-message textarea", OTHER)
        page.click("#tf-send")
        assert "tok/s" in wait_status(page, "tok/s", "rror")
        both = [f"classes.txt · {OTHER}", f"classes.txt · {QUESTIONS[0]}"]  # the newest first
        assert wait_listed(page, 2) == both
    # -- the app restarted on the same data folder; the same browser (its localStorage) --
    with app_on(data, port, tmp_path / "second.log") as url:
        page = new_page(context, url)
        open_sidebar(page)
        assert wait_listed(page, 2) == both  # every conversation listed
        assert shown_turns(page) == []
        page.locator("#tf-conversations label").nth(1).click()
        wait_status(page, "Opened")
        page.wait_for_selector("#tf-docinfo:has-text('classes.txt')")  # its document, loaded again
        assert questions_shown(page) == asked
        assert shown_turns(page) == before  # tokens, their levels, citations and footers
        assert page.locator("#tf-stats").inner_text() != ""
        # rename
        page.fill("#tf-conv-title textarea, #tf-conv-title input", "Classes, twice")
        page.click("#tf-conv-rename")
        page.wait_for_function("() => document.querySelector('#tf-conversations').innerText.includes('Classes, twice')")
        assert listed(page) == [both[0], "Classes, twice"]
        # export: every question, answer and citation
        with page.expect_download() as download:
            page.click("#tf-conv-export")
        markdown = Path(download.value.path()).read_text(encoding="utf-8")
        assert markdown.startswith("# Classes, twice\n")
        for question, turn in zip(QUESTIONS, before):
            assert question in markdown
            answer = "".join(text for text, _cls in turn["tokens"])  # as rendered: Markdown's marks aside
            assert plain(answer) in plain(markdown)
        assert markdown.count("**Sources**") == 2 and ("- Quoted: " in markdown or "- Most read: " in markdown)
        # a follow-up after reopening joins the same conversation
        page.fill("#tf-message textarea", "What follows «multiple names»?")
        page.click("#tf-send")
        assert "tok/s" in wait_status(page, "tok/s", "rror")
        page.wait_for_function("() => document.querySelectorAll('#tf-chat .tf-assistant').length === 3")
        page.wait_for_function("() => document.querySelector('#tf-conversations label').innerText.includes("
                               "'Classes, twice')")  # answered last: the newest
        assert listed(page) == ["Classes, twice", both[0]]
        # another browser sees nothing of them
        other = browser.new_context(viewport={"width": 1500, "height": 1100})
        stranger = new_page(other, url)
        open_sidebar(stranger)
        # its page has loaded its list: the load event gave it its own token (in its localStorage)
        stranger.wait_for_function(f"() => localStorage.getItem({BROWSER_KEY!r}) !== null")
        assert listed(stranger) == []
        other.close()
        # delete (the open one, ticked in the list), undo, delete
        page.click("#tf-conv-delete")
        assert wait_listed(page, 1) == [both[0]]
        page.click("#tf-conv-undo")
        assert wait_listed(page, 2) == ["Classes, twice", both[0]]
        page.locator("#tf-conversations label").first.click()
        wait_status(page, "Opened")
        page.click("#tf-conv-delete")
        assert wait_listed(page, 1) == [both[0]]
        page.reload()
        page.wait_for_selector("#tf-send")
        open_sidebar(page)
        assert wait_listed(page, 1) == [both[0]]
    browser.close()


def test_the_sidebar_refuses_ids_of_another_browser(tmp_path):
    """The handlers ask the store as the page's owner: another browser's conversation cannot be
    opened, renamed, deleted or exported (a real store; ids from the page are hostile)."""
    import gradio as gr

    from triforce_core.documents import Document
    from triforce_core.serving.history import ConversationStore, new_token, owner_id
    from ui.handlers.conversations import ConversationHandlers

    store = ConversationStore.open(tmp_path)
    mine, theirs = new_token(), new_token()
    cid, _ = store.save(owner_id(mine), None, document=Document("text", "txt", "a.txt"), model="demo",
                        turns=[{"question": "q?", "answer": "a"}])
    ctx = types.SimpleNamespace(history=store, history_note="")
    handlers = ConversationHandlers(ctx, documents=None)
    with pytest.raises(gr.Error, match="not in your list"):
        handlers.on_rename(cid, "taken", theirs, None, None)
    with pytest.raises(gr.Error, match="not in your list"):
        handlers.on_delete(cid, theirs, None, None)
    with pytest.raises(gr.Error, match="nothing to undo"):
        handlers.on_undo(cid, theirs, None, None)
    assert handlers._export(owner_id(theirs), cid)["value"] is None
    assert handlers._sidebar(owner_id(theirs), None)[0]["choices"] == []
    assert store.load(owner_id(mine), cid).title == "" and [c.id for c in store.listing(owner_id(mine))] == [cid]
    # a token that is not one (too short, or anything else a page sends) owns nothing
    assert handlers.owner_of("short", None) is None and handlers.owner_of(mine, None) == owner_id(mine)


def test_with_an_api_key_the_key_is_part_of_the_owner():
    """The key's token as the Guard let it through: the browser's cookie, or a Bearer key (the
    same token as the cookie that key gives); another key, another owner."""
    import gradio as gr
    from starlette.requests import Request

    from triforce_core.serving.guard import AccessPolicy
    from triforce_core.serving.history import new_token
    from ui.handlers.conversations import ConversationHandlers, key_token

    def request(*headers):
        return gr.Request(Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                                   "headers": [(k.encode(), v.encode()) for k, v in headers]}))

    token = AccessPolicy(api_key="s3cret").cookie_token
    assert key_token(request(("cookie", f"triforce_key_7860={token}; theme=dark"))) == token
    assert key_token(request(("authorization", "Bearer s3cret"))) == token
    assert key_token(request()) is None
    handlers, browser = ConversationHandlers(types.SimpleNamespace(history=None, history_note=""), None), new_token()
    with_key = handlers.owner_of(browser, request(("authorization", "Bearer s3cret")))
    assert with_key == handlers.owner_of(browser, request(("cookie", f"triforce_key_7860={token}")))
    assert with_key not in (handlers.owner_of(browser, request()),
                            handlers.owner_of(browser, request(("authorization", "Bearer other"))))


# -- the handlers in-process, on a real engine and a real store ----------------------------------
def _settings(**changes) -> list:
    from ui.settings import SETTING_NAMES, Settings

    s = Settings(**{"mode": "triforce", "temperature": 0.0, "max_new_tokens": 12, "budget": 32, "chunk_size": 4,
                    "draft_window": 16, **changes})
    return [getattr(s, name) for name in SETTING_NAMES]


@pytest.fixture
def handlers(chat_engine, tmp_path):
    """A page's handlers around `chat_engine` keeping conversations in a store in `tmp_path`."""
    from triforce_core.serving.history import ConversationStore
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.answers import AnswerHandlers
    from ui.handlers.conversations import ConversationHandlers
    from ui.handlers.documents import DocumentHandlers
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool

    worker = EngineWorker()
    store = ConversationStore.open(tmp_path / "data", max_document_bytes=1_500)
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000,
                     history=store, model_name="chat-test")
    documents = DocumentHandlers(ctx)
    yield types.SimpleNamespace(ctx=ctx, store=store, documents=documents, answers=AnswerHandlers(ctx),
                                conversations=ConversationHandlers(ctx, documents))
    worker.close()


def _ask(h, user, question: str):
    *_, last = h.answers.on_ask(question, user, False, False, "", *_settings())
    return last


def test_a_conversation_reopened_in_another_session_is_the_same(handlers):
    from tests.helpers.models import words
    from triforce_core.documents import Document, Section
    from triforce_core.serving.history import new_token, owner_id
    from ui.views import DOCUMENT_OUTPUTS, transcript

    h, browser = handlers, new_token()
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = dict(zip(DOCUMENT_OUTPUTS, h.documents.set_document(None, doc, 32)))["user"]
    _ask(h, user, "w9 w10")
    assert h.store.listing(owner_id(browser)) == []  # its owner is not known until the page says
    h.conversations.on_answered(browser, user, None)  # the handler chained after each answer
    _ask(h, user, "w20 w21")  # from now on saved as each answer ends
    [kept] = h.store.listing(owner_id(browser))
    assert kept.turns == 2 and kept.label == "d.txt · w9 w10"
    stored = h.store.load(owner_id(browser), kept.id)
    assert stored.model == "chat-test" and stored.settings["speculation"]["mode"] == "triforce"

    # another session of the same browser (a reload, a restart) opens it
    out = h.conversations.on_open(kept.id, browser, None, False, 32, "triforce", None)
    page = dict(zip(DOCUMENT_OUTPUTS, out[:len(DOCUMENT_OUTPUTS)]))
    again = page["user"]
    assert again is not user and again.conversation_id == kept.id and again.document.text == doc.text
    assert "Opened" in page["status"] and again.session.document_tokens == user.session.document_tokens
    for a, b in zip(user.session.turns, again.session.turns, strict=True):
        assert (a.question, a.answer, a.token_ids, a.levels, a.passages, a.stats) == \
            (b.question, b.answer, b.token_ids, b.levels, b.passages, b.stats)
    for a, b in zip(user.answers, again.answers, strict=True):
        tokens = lambda t: [(s.text, s.level, s.round) for s in t.segments if s.kind == "token"]  # noqa: E731
        assert tokens(a.trace) == tokens(b.trace) and a.footer == b.footer
        assert (a.trace.text, a.trace.acceptance(), a.trace.tokens_per_s()) == \
            (b.trace.text, b.trace.acceptance(), b.trace.tokens_per_s())
    # the same page, but for the indices of the tokens' segments (the rejected drafts are not kept)
    unindexed = lambda html: re.sub(r' data-tf="[^"]*"', "", html)  # noqa: E731
    assert unindexed(transcript(again, False)) == unindexed(transcript(user, False))
    # a follow-up joins the stored conversation
    _ask(h, again, "w30 w31")
    assert [c.turns for c in h.store.listing(owner_id(browser))] == [3]

    # a page with another token cannot open it (a warning, nothing changes)
    out = h.conversations.on_open(kept.id, new_token(), None, False, 32, "triforce", None)
    assert all(isinstance(o, dict) and o.get("__type__") == "update" for o in out[:len(DOCUMENT_OUTPUTS)])


def test_a_conversation_whose_document_was_let_go_opens_without_it(handlers):
    import gradio as gr

    from tests.helpers.models import words
    from triforce_core.documents import Document
    from triforce_core.serving.history import new_token, owner_id
    from ui.views import DOCUMENT_OUTPUTS

    h, browser = handlers, new_token()
    first = Document(words(200, 3), "txt", "first.txt")
    user = dict(zip(DOCUMENT_OUTPUTS, h.documents.set_document(None, first, 32)))["user"]
    _ask(h, user, "w9 w10")
    h.conversations.on_answered(browser, user, None)
    gone = user.conversation_id
    # documents over the store's cap (1,500 bytes): the first one is let go
    h.documents.set_document(user, Document(words(300, 5), "txt", "second.txt"), 32)
    _ask(h, user, "w40 w41")
    assert "Let go of the stored first.txt" in user.history_note
    assert "first.txt" in h.conversations._sidebar(owner_id(browser), user)[3]
    out = h.conversations.on_open(gone, browser, user, False, 32, "triforce", None)
    page = dict(zip(DOCUMENT_OUTPUTS, out[:len(DOCUMENT_OUTPUTS)]))
    assert "no longer kept" in page["status"] and user.document is None and len(user.session.turns) == 1
    with pytest.raises(gr.Error, match="first.txt, is no longer kept: load it again"):
        _ask(h, user, "w11 w12")
    # the lesson's session (keep False) is never saved
    lesson = dict(zip(DOCUMENT_OUTPUTS, h.documents.set_document(None, first, 32)))["user"]
    lesson.keep = False
    h.conversations.on_answered(browser, lesson, None)
    _ask(h, lesson, "w9 w10")
    assert len(h.store.listing(owner_id(browser))) == 2


def test_a_refused_store_lets_the_app_serve_without_saving(tmp_path, capsys):
    import html

    import app
    from triforce_core.serving.history import FILE_NAME

    (tmp_path / FILE_NAME).write_text("these are my notes, not a database\n" * 50)
    store, note = app.open_history(app.parse_args(["--data-dir", str(tmp_path)]))
    assert store is None and note.startswith("Conversations are not saved: ") and "\n" not in note
    assert capsys.readouterr().err.strip() == f"warning: {note}"
    assert (tmp_path / FILE_NAME).read_text().startswith("these are my notes")
    from ui.handlers.conversations import ConversationHandlers

    assert html.escape(note) in ConversationHandlers(types.SimpleNamespace(history=None, history_note=note), None).note(None)
