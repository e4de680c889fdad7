"""Conversations kept, for real: `python app.py --target demo --data-dir DIR` in headless Chromium
(Debian's), restarted on the same data folder; and the sidebar's handlers refusing the ids of
conversations another browser owns (a real store).

Targets (issue 64): "the app restarted: every conversation listed and reopened with its turns,
levels and citations"; "export: a Markdown file with every turn and its citations"."""

from __future__ import annotations

import contextlib
import os
import sys
import types
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.page import CHROMIUM, SAMPLE, wait_status
from tests.helpers.servers import free_port, running_server

pytestmark = pytest.mark.xdist_group("conversations")

MAX_NEW = 24
QUESTIONS = ("What follows «Objects have individuality»?", "What follows «In C++ terminology, normally class members»?")


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


def questions_shown(page) -> list[str]:
    return page.locator("#tf-chat .tf-user").evaluate_all("els => els.map(e => e.innerText.trim())")


def test_conversations_outlive_a_restart_and_stay_in_their_browser(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    data, port = tmp_path / "data", free_port()
    doc = tmp_path / "classes.txt"
    doc.write_text(SAMPLE.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
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
        # -- the app restarted on the same data folder; the same browser (its localStorage) --
        with app_on(data, port, tmp_path / "second.log") as url:
            page = new_page(context, url)
            open_sidebar(page)
            assert wait_listed(page, 1) == [f"classes.txt · {QUESTIONS[0]}"]
            assert shown_turns(page) == []
            page.locator("#tf-conversations label").first.click()
            wait_status(page, "Opened")
            page.wait_for_selector("#tf-docinfo:has-text('classes.txt')")  # its document, loaded again
            assert questions_shown(page) == asked
            assert shown_turns(page) == before  # tokens, their levels, citations and footers
            assert page.locator("#tf-stats").inner_text() != ""
            # rename
            page.fill("#tf-conv-title textarea, #tf-conv-title input", "Classes, twice")
            page.click("#tf-conv-rename")
            page.wait_for_function("() => document.querySelector('#tf-conversations').innerText.includes('Classes, twice')")
            assert listed(page) == ["Classes, twice"]
            # export: every question, answer and citation
            with page.expect_download() as download:
                page.click("#tf-conv-export")
            markdown = Path(download.value.path()).read_text(encoding="utf-8")
            assert markdown.startswith("# Classes, twice\n")
            for question, turn in zip(QUESTIONS, before):
                assert question in markdown
                answer = "".join(text for text, _cls in turn["tokens"]).strip()
                assert " ".join(answer.split()) in " ".join(markdown.split())
            assert markdown.count("**Sources**") == 2 and ("- Quoted: " in markdown or "- Most read: " in markdown)
            # a follow-up after reopening joins the same conversation
            page.fill("#tf-message textarea", "What follows «multiple names»?")
            page.click("#tf-send")
            assert "tok/s" in wait_status(page, "tok/s", "rror")
            page.wait_for_function("() => document.querySelectorAll('#tf-chat .tf-assistant').length === 3")
            assert wait_listed(page, 1) == ["Classes, twice"]
            # another browser sees nothing of it
            other = browser.new_context(viewport={"width": 1500, "height": 1100})
            stranger = new_page(other, url)
            open_sidebar(stranger)
            stranger.wait_for_timeout(500)  # its list has loaded (the load event fills it): still empty
            assert listed(stranger) == []
            other.close()
            # delete, undo, delete
            page.click("#tf-conv-delete")
            assert wait_listed(page, 0) == []
            page.click("#tf-conv-undo")
            assert wait_listed(page, 1) == ["Classes, twice"]
            page.locator("#tf-conversations label").first.click()
            wait_status(page, "Opened")
            page.click("#tf-conv-delete")
            assert wait_listed(page, 0) == []
            page.reload()
            page.wait_for_selector("#tf-send")
            open_sidebar(page)
            page.wait_for_timeout(500)
            assert listed(page) == []
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
