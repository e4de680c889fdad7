"""The app's model picker, for real: `python app.py --target demo --models-dir SHELF` in headless Chromium.

The shelf holds a tiny GGUF model (window 1,024 tokens, a tokenizer of single letters, so a
short book is over its window), a corrupt GGUF file and a mixture of experts (listed with
why it is not run; a pick of it loads nothing). Switching from the demo pair to the
tiny model and back keeps the document (read again with each tokenizer: the table of
contents and the context gauge follow the window); a corrupt file or a path outside the
model folders is refused in one line and the app keeps the model it had.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import urllib.request
from types import SimpleNamespace

import gradio as gr
import pytest

from tests.helpers.models import make_hf, words
from tests.helpers.servers import free_port, running_server
from tests.helpers.gguf_files import write_gguf
from tests.helpers import ROOT
from tests.helpers.page import (SAMPLE, assert_answer_figures, document_text, number, open_page, shown_gauge,
                                wait_status, watch_status)

WINDOW = json.loads((ROOT / "assets" / "models" / "target" / "config.json").read_text())["max_position_embeddings"]
MAX_NEW = 12
pytestmark = pytest.mark.xdist_group("model-picker")


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    root = tmp_path_factory.mktemp("picker")
    shelf = root / "shelf"
    shelf.mkdir()
    write_gguf(make_hf("llama_mha", seed=4), shelf / "tiny.gguf", {})
    (shelf / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    # a Mixtral-style file: arch llama, experts in its header (`families.refusal`)
    write_gguf(make_hf("llama_mha", seed=5), shelf / "mixtral-like.gguf", {}, settings={"expert_count": 8})
    text = SAMPLE.read_text(encoding="utf-8")
    book = root / "book.md"  # about 700 demo tokens; about 1,900 of the tiny model's
    book.write_text("".join(f"# Part {i + 1}\n\n{text[i * 600:(i + 1) * 600]}\n\n" for i in range(3)), encoding="utf-8")
    return {"shelf": shelf, "home": root / "home", "book": book, "root": root}


@pytest.fixture(scope="module")
def page(shelf, playwright_api):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               HOME=str(shelf["home"]))  # no LM Studio, Ollama or Hugging Face models of this machine's
    cmd = [sys.executable, str(ROOT / "app.py"), "--target", "demo", "--port", str(port), "--max-new-tokens", str(MAX_NEW),
           "--models-dir", str(shelf["shelf"]), "--data-dir", str(shelf["root"] / "data")]
    with running_server(cmd, shelf["root"] / "app.log", lambda: urllib.request.urlopen(url, timeout=2), env, "the app"):
        browser, pg = open_page(playwright_api, url, 120_000)
        pg.click("#tf-settings button")  # open the settings accordion
        pg.wait_for_selector("#tf-model input")
        yield _Page(pg, url)
        browser.close()


class _Page:
    """The page, and the app's own HTTP API beside it (`api`)."""

    def __init__(self, page, url: str):
        self._page, self.url = page, url

    def __getattr__(self, name):
        return getattr(self._page, name)

    def api(self, model: str, document: str, question: str) -> dict:
        """The engine's answer through the app's HTTP API to a first question over `document`
        with `model`, as the page asks it (greedy, the page's token limit)."""
        body = {"model": model, "temperature": 0, "max_tokens": MAX_NEW,
                "messages": [{"role": "user", "content": f"{document.strip()}\n\n{question}"}]}
        request = urllib.request.Request(self.url + "v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())


def pick(page, model_id: str) -> None:
    page.click("#tf-model input")
    page.locator("ul[role='listbox'] li", has_text=f"{model_id} (").first.click()


def ask_and_finish(page, question: str) -> str:
    page.fill("#tf-message textarea", question)
    page.click("#tf-send")
    return wait_status(page, "tok/s", "rror")


def test_switching_both_ways_keeps_the_document_and_follows_the_window(page, shelf):
    page.set_input_files("#tf-upload input[type=file]", str(shelf["book"]))
    wait_status(page, "Loaded book.md")
    assert "a 64K-window copier for demonstrations" in page.inner_text("#tf-model-info")
    # the default mode, lookup, has no retrieval level: the gauge says so, and follows the mode
    assert "no retrieval level in this mode" in page.inner_text("#tf-gauge")
    assert "retrieval level reads" not in page.inner_text("#tf-gauge")
    for mode, shown in (("retrieval", "retrieval budget"), ("lookup", "no retrieval level")):
        page.click("#tf-mode input")
        page.locator("ul[role='listbox'] li", has_text=re.compile(rf"\b{mode}\s*$")).first.click()  # after a "✓"
        page.wait_for_selector(f"#tf-gauge:has-text('{shown}')")

    watch_status(page)
    pick(page, "tiny")
    switched = wait_status(page, "Switched to", "Could not")
    assert "Switched to tiny" in switched and "over its window" in switched, switched
    assert "of 1,024 tokens" in page.inner_text("#tf-gauge")
    assert "window 1,024 tokens" in page.inner_text("#tf-model-info")
    labels = page.locator("#tf-toc-list label").all_inner_texts()  # the contents, in the tiny model's tokens
    assert len(labels) == 3 and all(label.endswith(" tokens") for label in labels)
    page.locator("#tf-toc-list label", has_text="Part 1 ·").click()
    page.click("#tf-read-sections")
    wait_status(page, "Reading sections Part 1 of book.md")
    done = ask_and_finish(page, "abc")
    assert "tok/s" in done, done
    # the figures shown after the switch are the new model's: those of its own answer through the API
    from triforce_core.documents import load_document
    from triforce_core.documents.picking import selected_text

    reply = page.api("tiny", selected_text(load_document(shelf["book"]), [0]), "abc")
    assert_answer_figures(page, reply)
    assert number(shown_gauge(page)["window"]) == 1024

    pick(page, "triforce-demo")
    back = wait_status(page, "Switched to triforce-demo", "Could not")
    assert "book.md read again" in back and "starts afresh" in back, back
    assert f"of {WINDOW:,} tokens" in page.inner_text("#tf-gauge") and "book.md" in page.inner_text("#tf-docinfo")
    assert "tf-tok" not in page.inner_html("#tf-chat")  # the conversation started afresh
    assert "no answer yet" in page.inner_text("#tf-stats")  # and the tiny model's answer's figures are gone
    done = ask_and_finish(page, "What follows «Part 2»?")
    assert "tok/s" in done, done
    assert_answer_figures(page, page.api("triforce-demo", document_text(shelf["book"]), "What follows «Part 2»?"))
    assert number(shown_gauge(page)["window"]) == WINDOW
    # Each pick sends the picker's `input` twice (on the pick and on the blur after it): one
    # switch each way, and no refusal from the second event
    shown = page.evaluate("window.tfStatuses")
    assert not any("model in use" in s or "being loaded" in s for s in shown), shown
    for model in ("tiny", "triforce-demo"):
        assert len({m.group() for s in shown if (m := re.search(rf"Switched to {model} in [\d.]+ s", s))}) == 1, shown


def test_a_corrupt_file_or_a_path_outside_is_one_line_and_the_model_stays(page, shelf):
    before = page.inner_text("#tf-model-info")
    pick(page, "corrupt")
    wait_status(page, "Could not load")
    failed = page.inner_text("#tf-status .tf-status")  # the line itself (not Gradio's timer beside it)
    assert "Could not load corrupt" in failed and "Still on triforce-demo" in failed and "\n" not in failed.strip()
    # the picker's value and the model card come back in the same update as the status line, but
    # the browser may render them a moment later: wait for them (up to Playwright's timeout)
    expect = pytest.importorskip("playwright.sync_api").expect
    expect(page.locator("#tf-model input")).to_have_value(re.compile(r"^triforce-demo"))
    expect(page.locator("#tf-model-info")).to_have_text(before, use_inner_text=True)

    for path in ("/etc/passwd", f"{shelf['shelf']}/../book.md"):
        page.fill("#tf-model-path textarea", path)
        page.click("#tf-model-open")
        wait_status(page, "refused:")
        refused = page.inner_text("#tf-status .tf-status")
        assert refused.strip().startswith("refused: only GGUF files under the model folders"), refused
        page.fill("#tf-model-path textarea", "")
    done = ask_and_finish(page, "What follows «Part 1»?")
    assert "tok/s" in done, done


def test_the_app_doc_names_every_mode_and_smollm2s_draft():
    """docs/app.md says what the app offers: the settings' modes (`triforce_core.config.MODES`,
    every one with a small draft, as `modes_for` gives) and SmolLM2 with its own draft."""
    from triforce_core.config import MODES
    from triforce_core.models.loading import SMOLLM2_DRAFT
    from ui.handlers.models import modes_for

    class WithDraft:
        draft = object()

    text = " ".join((ROOT / "docs" / "app.md").read_text(encoding="utf-8").split())
    assert "no small draft yet" not in text
    settings = text[text.index("a settings accordion: mode (") :]
    settings = settings[: settings.index("), temperature")]
    assert modes_for(WithDraft()) == list(MODES) and all(f"`{m}`" in settings for m in MODES), settings
    if SMOLLM2_DRAFT.is_dir():  # the built-in choice takes it (registry.builtin_choices)
        assert f"`assets/models/{SMOLLM2_DRAFT.name}`" in text and "offers every mode" in text


class _Shelf:
    """`ServedModels` for the handlers: the started model, "second" (its load waits for
    `loaded`) and "third", all over one engine."""

    def __init__(self, engine):
        from triforce_core.serving.registry import ModelChoice, ServedModel

        self.started = ModelChoice("first", "started", "first")
        self.loaded = threading.Event()
        self._served = {c.id: ServedModel(c, engine, None) for c in
                        (self.started, ModelChoice("second", "on demand", "second"), ModelChoice("third", "", "third"))}
        self.loads = 0

    def choices(self):
        return [m.choice for m in self._served.values()]

    def find(self, model_id: str):
        return self._served[model_id].choice

    open_path = find

    def get(self, model_id: str):
        self.loads += 1
        assert self.loaded.wait(60)
        return self._served[model_id]


def test_a_pick_sent_twice_switches_once_and_a_pick_meanwhile_is_refused(chat_engine):
    """Gradio's dropdown sends `input` on a pick and on the blur after it, a millisecond apart:
    the second event, during the load or after it, changes nothing (no line that would overwrite
    the first's); a pick of another model during the load is refused, the picker on the one
    loading; on a fresh page (no user state yet) the same, per page."""
    from triforce_core.documents import Document
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.documents import DocumentHandlers
    from ui.handlers.models import MODEL_OUTPUTS, ModelHandlers
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS

    nothing = [(gr.skip(),) * (len(DOCUMENT_OUTPUTS) + len(MODEL_OUTPUTS))]
    status, picker = DOCUMENT_OUTPUTS.index("status"), len(DOCUMENT_OUTPUTS) + MODEL_OUTPUTS.index("model")
    worker = EngineWorker()
    try:
        shelf = _Shelf(chat_engine)
        ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                         slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000,
                         models=shelf)
        documents = DocumentHandlers(ctx)
        switcher = ModelHandlers(ctx, documents)
        user, *_ = documents.set_document(None, Document(words(60, 5), "txt", "d.txt"), 32)
        page = SimpleNamespace(session_hash="page-1")

        first = switcher.on_pick("second", user, 32, "lookup", page)
        assert "Loading second" in next(first)[status]  # its load waits for `loaded`
        assert list(switcher.on_pick("second", user, 32, "lookup", page)) == nothing
        refused = list(switcher.on_pick("third", user, 32, "lookup", page))
        assert "second is being loaded" in refused[0][status] and refused[0][picker]["value"] == "second"
        assert refused[0][0] == gr.skip()  # the user state is left as it is
        shelf.loaded.set()
        done = list(first)[-1]
        assert done[0] is user and user.model.id == "second" and "Switched to second" in done[status]
        assert "d.txt read again" in done[status]
        assert list(switcher.on_pick("second", user, 32, "lookup", page)) == nothing  # the blur's, after the load
        assert shelf.loads == 1
        # the path field is asked on purpose: it says so
        said = list(switcher.on_path("second", user, 32, "lookup", page))
        assert "second is the model in use" in said[0][status]

        # a fresh page: both events find no user state; one switch, on a user the loading lines store
        shelf.loaded.clear()
        fresh = SimpleNamespace(session_hash="page-2")
        first = switcher.on_pick("second", None, 32, "lookup", fresh)
        new_user = next(first)[0]
        assert new_user is not None and new_user.model is None
        assert list(switcher.on_pick("second", None, 32, "lookup", fresh)) == nothing
        shelf.loaded.set()
        assert list(first)[-1][0] is new_user and new_user.model.id == "second"
    finally:
        worker.close()


def test_a_switch_to_a_model_without_a_small_draft_says_which_mode_it_runs(chat_engine):
    """From triforce (whose lowest level is the small draft) to a model without one: the picker
    offers the modes that run without a draft, picks lookup, and the status line says why."""
    import copy

    from triforce_core.config import DRAFTLESS_MODES
    from triforce_core.documents import Document
    from triforce_core.serving.registry import ServedModel
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.documents import DocumentHandlers
    from ui.handlers.models import MODEL_OUTPUTS, ModelHandlers
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS

    alone = copy.copy(chat_engine)  # the same target, no small draft
    alone.draft = None
    worker = EngineWorker()
    try:
        shelf = _Shelf(chat_engine)
        shelf._served["second"] = ServedModel(shelf._served["second"].choice, alone, None)
        shelf.loaded.set()
        ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                         slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000,
                         models=shelf)
        documents = DocumentHandlers(ctx)
        user, *_ = documents.set_document(None, Document(words(60, 5), "txt", "d.txt"), 32)
        done = list(ModelHandlers(ctx, documents).on_pick("second", user, 32, "triforce",
                                                          SimpleNamespace(session_hash="page-1")))[-1]
        assert "it has no small draft, so mode lookup instead of triforce" in done[DOCUMENT_OUTPUTS.index("status")]
        mode = done[len(DOCUMENT_OUTPUTS) + MODEL_OUTPUTS.index("mode")]
        assert mode["value"] == "lookup" and mode["choices"] == list(DRAFTLESS_MODES)
    finally:
        worker.close()


def test_a_file_the_engine_does_not_run_is_labelled_and_a_pick_says_why(page):
    """The mixture-of-experts file is listed with its reason (a dropdown cannot grey one entry
    out); picking it loads nothing, says why in one line, and the model stays."""
    page.click("#tf-model input")
    entry = page.locator("ul[role='listbox'] li", has_text="mixtral-like (").first
    assert entry.inner_text().strip().endswith("mixtral-like (GGUF, models folder) — not supported: mixture of experts")
    entry.click()
    wait_status(page, "Could not load")
    said = page.inner_text("#tf-status .tf-status")
    assert "Could not load mixtral-like" in said and "mixture of experts (8 experts a layer)" in said, said
    assert "supported are llama" in said and "Still on triforce-demo" in said and "\n" not in said.strip()
    expect = pytest.importorskip("playwright.sync_api").expect
    expect(page.locator("#tf-model input")).to_have_value(re.compile(r"^triforce-demo"))
