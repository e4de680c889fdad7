"""The page's polish, without a browser: the chat box's cap on a question and a long paste read as
the document (`ui.pasting`, the documents handler), the settings in words (`ui.settings`), the
chat box's placeholder by model (`ui.handlers.models`), through a real model switch, and charts
drawn on transparent backgrounds that the dark theme shows through (`ui.figures`).

The browser's side (the paste refused in the page, the note, the dark theme, nothing cut off at
1280×800) is in tests/test_app.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import gradio as gr
import pytest
import torch

from tests.helpers.models import CHAT_TEMPLATE, make_hf, make_tokenizer, to_ours, words


def test_a_question_over_the_cap_is_refused_in_one_sentence_with_its_numbers():
    from ui.pasting import MAX_QUESTION_CHARS, question_refused

    assert question_refused("What is a class?") is None
    assert question_refused("x" * MAX_QUESTION_CHARS) is None
    refused = question_refused("x" * 300_000)
    assert refused is not None and "\n" not in refused
    assert "300,000 characters" in refused and f"the limit is {MAX_QUESTION_CHARS:,}" in refused, refused
    assert "Use this text as the document" in refused  # the option the page really has
    assert "truncation" not in refused


def test_sending_empties_the_box_but_an_over_long_question_stays_in_it():
    from ui.pasting import MAX_QUESTION_CHARS, take_question

    assert take_question("What is a class?") == ("", "What is a class?")
    assert take_question(None) == ("", "")
    long = "y" * (MAX_QUESTION_CHARS + 1)
    box, asked = take_question(long)
    assert isinstance(box, type(gr.skip())) and asked == long  # kept in the box, asked to be refused


def test_a_paste_is_read_as_an_uploaded_text_is():
    from triforce_core.documents import DocumentError, extract_bytes
    from ui.pasting import PASTED_NAME, pasted_document

    plain = pasted_document("one line\r\nanother\rthird\x00", 1_000)
    assert (plain.text, plain.format, plain.name, plain.sections) == ("one line\nanother\nthird", "txt", PASTED_NAME, ())
    text = "# Classes\n\nA class.\n\n## Scopes\n\nA scope.\n"
    md = pasted_document(text, 1_000)
    assert md.format == "md" and [(s.title, s.level) for s in md.sections] == [("Classes", 1), ("Scopes", 2)]
    uploaded = extract_bytes(text.encode("utf-8"), "book.md", timeout_s=None)  # the same text as a file
    assert (md.text, md.sections) == (uploaded.text, uploaded.sections)
    with pytest.raises(DocumentError, match="the pasted text is empty"):
        pasted_document(" \n\t", 1_000)
    with pytest.raises(DocumentError, match=r"over the upload limit of 0 MB"):
        pasted_document("é" * 300, 500)  # bytes, not characters, against the limit


@pytest.fixture(scope="module")
def engines():
    """Two real tiny engines with a chat template: one an instruct model, one not (as the demo pair)."""
    from triforce_core.engine import TriForceEngine

    torch.set_num_threads(1)
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    hf = make_hf("llama_gqa_llama3", seed=0)
    return {"instruct": TriForceEngine(to_ours(hf), None, tok, eos_token_ids=[2], instruct=True),
            "copier": TriForceEngine(to_ours(hf), None, tok, eos_token_ids=[2])}


def test_the_chat_box_placeholder_fits_the_model(engines):
    from ui.handlers.models import message_placeholder

    assert message_placeholder(engines["instruct"]) == "Ask about the document, e.g. What is a class?"
    assert message_placeholder(engines["copier"]) == "Ask about the document, e.g. What follows «a phrase from it»?"


def test_a_model_switch_gives_the_chat_box_the_new_models_placeholder(engines, tmp_path):
    """A real `ServedModels` (its loader makes the tiny engines) and the real switch handler: the
    switch's last update holds the placeholder of the model switched to, and a refused switch
    leaves the box alone."""
    from triforce_core.documents import Document
    from triforce_core.models.folders import ModelFolders
    from triforce_core.serving.registry import DEMO_ID, ServedModels
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.documents import DocumentHandlers
    from ui.handlers.models import MODEL_OUTPUTS, ModelHandlers, message_placeholder
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS

    def load(choice):
        return engines["copier"] if choice.id == DEMO_ID else engines["instruct"]

    models = ServedModels(load, ModelFolders([]), started=(str(tmp_path / "chat-instruct"), None))
    started = models.get(models.started.id).engine
    assert started is engines["instruct"]
    worker = EngineWorker()
    try:
        ctx = AppContext(engine=started, worker=worker, sessions=SessionPool(worker, 2),
                         slots=SlotPool(started, capacity=1), defaults=Settings(), max_bytes=1_000_000, models=models)
        documents = DocumentHandlers(ctx)
        user, *_ = documents.set_document(None, Document(words(40, 3), "txt", "d.txt"), 32)
        switcher = ModelHandlers(ctx, documents)
        box = len(DOCUMENT_OUTPUTS) + MODEL_OUTPUTS.index("message")
        done = list(switcher.on_pick(DEMO_ID, user, 32, "lookup", SimpleNamespace(session_hash="page-1")))[-1]
        assert len(done) == len(DOCUMENT_OUTPUTS) + len(MODEL_OUTPUTS)
        assert done[box] == gr.update(placeholder=message_placeholder(engines["copier"]))
        assert "What follows" in done[box]["placeholder"]
        back = list(switcher.on_pick(models.started.id, user, 32, "lookup", SimpleNamespace(session_hash="page-1")))[-1]
        assert back[box]["placeholder"] == "Ask about the document, e.g. What is a class?"
        refused = list(switcher.on_path(str(tmp_path / "elsewhere.gguf"), user, 32, "lookup",
                                        SimpleNamespace(session_hash="page-1")))[-1]
        assert len(refused) == len(DOCUMENT_OUTPUTS) + len(MODEL_OUTPUTS)
        assert isinstance(refused[box], type(gr.skip()))  # the box keeps its placeholder and what it holds
    finally:
        worker.close()


def test_a_long_paste_used_as_the_document_is_read_like_an_upload(engines):
    """The note's button: the pasted text becomes the document (its sections, its tokens), the
    hidden box that carried it is emptied and so is the note; an empty paste is one line and
    leaves the document loaded before."""
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.documents import DocumentHandlers
    from ui.pasting import paste_note
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS

    engine = engines["copier"]
    worker = EngineWorker()
    try:
        ctx = AppContext(engine=engine, worker=worker, sessions=SessionPool(worker, 2),
                         slots=SlotPool(engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
        documents = DocumentHandlers(ctx)
        text = f"# First\n\n{words(30, 1)}\n\n# Second\n\n{words(30, 2)}\n"
        out = documents.on_paste(text, None, 32)
        assert len(out) == len(DOCUMENT_OUTPUTS) + 2 and out[-2] == ""  # the hidden box lets go of the text
        assert re.fullmatch(r'<div class="tf-paste-note" data-max="20000" data-nonce="\d+" [^>]*></div>', out[-1])
        assert out[-1] != paste_note()  # a value of its own, so the page redraws the note the script wrote into
        named = dict(zip(DOCUMENT_OUTPUTS, out))
        user = named["user"]
        assert user.document.name == "pasted text" and user.document.text == text
        assert [s.title for s in user.book.sections] == ["First", "Second"]  # its table of contents
        tokens = user.session.document_tokens
        assert tokens > 0 and f"pasted text</b> · md · {len(text):,} characters · {tokens:,} tokens" in named["docinfo"]
        empty = documents.on_paste("   ", user, 32)
        named = dict(zip(DOCUMENT_OUTPUTS, empty))
        assert "Could not use the paste as the document: the pasted text is empty" in named["status"]
        assert "the pasted text is empty" in empty[-1] and empty[-2] == ""
        assert user.document.text == text and isinstance(named["user"], type(gr.skip()))  # the document before stays
    finally:
        worker.close()


def test_every_setting_is_labelled_in_words_and_its_symbols_explained():
    from ui.settings import SETTING_INFO, SETTING_NAMES, Settings, setting_control

    defaults = Settings()
    with gr.Blocks():
        controls = {name: setting_control(name, getattr(defaults, name), ["triforce", "lookup"]) for name in SETTING_NAMES}
    for name, control in controls.items():
        label = control.label
        assert len(re.findall(r"[A-Za-z]{2,}", label)) >= 3, (name, label)  # a phrase, not a symbol or one word
        for symbol in re.findall(r"γ\d", label):  # a symbol in a label is explained in its info line
            assert control.info and control.info.startswith(f"{symbol}:"), (name, control.info)
    assert controls["gamma1"].label == "Tokens the small draft proposes per check (γ1)"
    assert controls["gamma2"].label == "Tokens per target check (γ2)"
    assert controls["budget"].label == "Retrieval budget: tokens of cache the retrieval level reads"
    assert controls["chunk_size"].label == "Chunk size: tokens per retrieval chunk"
    assert controls["draft_window"].label == "Draft window: recent tokens the small draft sees"
    assert set(SETTING_INFO) <= set(SETTING_NAMES)
    assert all(controls[name].info == SETTING_INFO[name] for name in SETTING_INFO)


def test_the_charts_are_drawn_on_transparent_backgrounds():
    """So the page's background, light or dark, is the chart's (assets/app.css gives the dark
    theme's chart text the page's colour)."""
    from triforce_core.decoding.events import ChunksSelected
    from ui.figures import acceptance_figure, retrieval_map_figure, speed_figure
    from ui.trace import RoundStats

    selection = ChunksSelected(step=0, chunk_size=8, budget=64, context_tokens=256, dense=False, heads_total=4,
                               chunk_token_spans=[(0, 8), (64, 72)], scores_or_counts=[4, 2])
    rounds = [RoundStats(index=1, committed=3, proposed={"target": 4}, accepted={"target": 2})]
    figures = [retrieval_map_figure(None), retrieval_map_figure(selection), acceptance_figure([]),
               acceptance_figure(rounds), speed_figure([]), speed_figure([("this answer", 12.5)])]
    for fig in figures:
        assert (fig.layout.paper_bgcolor, fig.layout.plot_bgcolor) == ("rgba(0,0,0,0)", "rgba(0,0,0,0)"), fig.layout.title
