"""The app's handlers driven in-process, without a server: the one streaming loop (`follow`),
and a conversation through the answer and document handlers (ask, compare, clear, errors)."""

from __future__ import annotations

import threading
import time

import gradio as gr
import pytest

from tests.helpers.models import words
from triforce_core.documents import Document, Section
from triforce_core.engine import TriForceEngine
from triforce_core.serving.worker import EngineWorker
from triforce_core.serving.slots import SlotPool
from ui.handlers.answers import AnswerHandlers, follow
from triforce_core.serving.book import BookSession
from ui.handlers.documents import DocumentHandlers
from ui.handlers.teaching import LESSON_END_OUTPUTS, LESSON_SETUP_OUTPUTS, PICK_OUTPUTS, TeachingHandlers
from ui.narration import round_sentence
from ui.settings import SETTING_NAMES, Settings
from ui.state import AppContext, SessionPool
from ui.views import DOCUMENT_OUTPUTS, STREAMED, doc_info


@pytest.fixture
def worker():
    w = EngineWorker()
    yield w
    w.close()


def test_follow_hands_over_every_event_in_order_and_refreshes_at_most_as_asked(worker):
    seen = []
    ticks = list(follow(worker.submit(lambda: iter(range(5))), seen.append, lambda: 1e9))
    assert seen == [0, 1, 2, 3, 4] and len(ticks) <= 1  # at most the first refresh, then never


def test_follow_takes_every_queued_event_before_a_refresh(worker):
    """A refresh that costs more than a round must not leave the page further behind each time:
    what queued up during it is taken as a whole before the next refresh."""
    release = threading.Event()

    def rounds():
        yield 0
        release.wait(10)
        yield from range(1, 50)

    job = worker.submit(rounds)
    seen, seen_at_tick = [], []
    for _ in follow(job, seen.append, lambda: 0.0):
        seen_at_tick.append(len(seen))
        if len(seen_at_tick) == 1:  # a slow refresh, during which the generation runs to its end
            release.set()
            assert job.finished.wait(10)
    assert seen == list(range(50))
    assert seen_at_tick == [1]  # the backlog was taken in one go, not one event per refresh


def test_follow_raises_the_generations_error(worker):
    def failing():
        yield "first"
        raise ValueError("the context is too long")

    seen = []
    with pytest.raises(ValueError, match="too long"):
        list(follow(worker.submit(failing), seen.append, lambda: 0.0))
    assert seen == ["first"]


def _values(**changes) -> list:
    s = Settings(**{"mode": "triforce", "temperature": 0.0, "max_new_tokens": 12, "budget": 32, "chunk_size": 4,
                    "draft_window": 16, **changes})
    return [getattr(s, name) for name in SETTING_NAMES]


def named(names: tuple[str, ...], outputs) -> dict:
    """A handler's outputs by name: `names` are those ui/ wires its outputs to, in its order
    (`STREAMED` for answers, `DOCUMENT_OUTPUTS` for documents, ...)."""
    return dict(zip(names, outputs, strict=True))


def streamed(updates):
    """An answer handler's updates (`STREAMED`), each by name."""
    return (named(STREAMED, out) for out in updates)


def test_a_conversation_through_the_handlers(chat_engine: TriForceEngine, worker):
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    assert user.session.document_tokens > 0

    updates = [named(STREAMED, out) for out in answers.on_ask("w9 w10", user, False, False, "", *_values())]
    final = updates[-1]
    assert final["user"] is user and len(user.answers) == len(user.session.turns) == 1
    assert "tok/s" in final["status"] and "tf-ok" in final["status"]  # the footer as the status line
    answer = user.answers[0]
    assert answer.trace.new_tokens > 0 and answer.trace.stats is not None
    # the autoregressive re-run of the same turn gives the same tokens (greedy)
    compared = list(answers.on_compare(user, False, *_values()))
    assert "identical output: yes" in named(STREAMED, compared[-1])["status"]
    assert answer.baseline is not None and answer.baseline["identical"] == "yes"
    assert len(user.session.turns) == 1  # the comparison re-ran the turn, it did not add one

    with pytest.raises(gr.Error, match="Type a question first"):
        list(answers.on_ask("  ", user, False, False, "", *_values()))
    with pytest.raises(gr.Error, match="Invalid setting"):
        list(answers.on_ask("w9", user, False, False, "", *_values(mode="fastest")))

    cleared = named(STREAMED, answers.on_clear(user, 32))
    assert cleared["user"] is user and not user.session.turns and not user.answers
    assert user.session.document_tokens > 0  # the document stays loaded


def _book() -> Document:
    """Three top-level sections, one with a subsection: 1,270 tokens, over the 1,024 window."""
    parts, sections, at = [], [], 0
    for title, level, n in (("Alpha", 1, 250), ("Beta", 1, 300), ("Beta detail", 2, 320), ("Gamma", 1, 400)):
        body = f"{words(n, len(parts) + 7)}\n"
        sections.append(Section(at, f"section: {title}", title, level))
        parts.append(body)
        at += len(body)
    text = "".join(parts)
    ends = [sections[1].start, sections[3].start, sections[3].start, len(text)]
    return Document(text, "md", "book.md", tuple(Section(s.start, s.label, s.title, s.level, e)
                                                  for s, e in zip(sections, ends)))


def test_a_book_over_the_window_is_read_by_the_sections_picked(chat_engine: TriForceEngine, worker):
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    loaded = named(DOCUMENT_OUTPUTS, documents.set_document(None, _book(), 32))
    user, status, box, toc = loaded["user"], loaded["status"], loaded["toc"], loaded["toc_list"]
    # Not refused, not cut: each question reads the sections most relevant to it ...
    assert "over the context window of 1,024" in status and "each question reads the sections" in status
    assert isinstance(user.session, BookSession) and user.session.document_tokens == 0
    assert box["visible"] is True
    gamma = _book().text[_book().sections[3].start : _book().sections[3].end].split()
    updates = [named(STREAMED, out) for out in answers.on_ask(" ".join(gamma[:3]), user, False, False, "", *_values())]
    assert "tf-ok" in updates[-1]["status"]
    read = user.session.turns[-1].sections_read
    assert 4 in [s["number"] for s in read] and user.document.text.startswith("[Section: ")
    assert documents.on_answered(user)["value"] == sorted({s["number"] - 1 for s in read})  # ticked
    # ... until the user ticks sections and reads those: a plain conversation over them
    labels = [label for label, _ in toc["choices"]]
    assert labels[0] == "Alpha · 250 tokens" and labels[2] == "\u2003└ Beta detail · 320 tokens"
    assert labels[1] == "Beta · 620 tokens"  # a section includes its subsection
    assert "4 sections, about 1,270 tokens" in toc["label"] and "window of 1,024" in toc["label"]

    # Beta (with its detail) and Gamma: 1,020 tokens + the template + 12 for the answer, too many.
    with pytest.warns(UserWarning, match="selection"):  # gr.Warning: a toast on the page
        refused = named(DOCUMENT_OUTPUTS, documents.on_sections([1, 3], user, 32, 12))["status"]
    assert "The selection (Beta; Gamma) is 1,0" in refused and "window of 1,024" in refused
    assert "tf-error" in refused
    assert isinstance(user.session, BookSession)  # nothing changed
    out = named(DOCUMENT_OUTPUTS, documents.on_sections([0, 2, 3], user, 32, 12))  # Alpha, Beta detail, Gamma
    assert not isinstance(user.session, BookSession)
    assert "Reading sections Alpha; Beta detail; Gamma of book.md" in out["status"] and out["toc_list"]["value"] == [0, 2, 3]
    assert user.session.document.startswith("[Section: Alpha]") and "[Section: Beta detail]" in user.session.document
    assert 970 < user.session.document_tokens < 1000
    updates = [named(STREAMED, out) for out in answers.on_ask("w9 w10", user, False, False, "", *_values())]
    assert "tf-ok" in updates[-1]["status"] and user.answers[0].trace.new_tokens > 0
    with pytest.raises(gr.Error, match="Tick at least one"):
        documents.on_sections([], user, 32, 12)
    # A document that fits loads as before, its table of contents offered too.
    small = Document(words(50, 1), "md", "s.md", (Section(0, "section: S", "S", 1, 10),))
    loaded = named(DOCUMENT_OUTPUTS, documents.set_document(user, small, 32))
    user, box, toc = loaded["user"], loaded["toc"], loaded["toc_list"]
    assert user.document is small and box["visible"] is True and len(toc["choices"]) == 1


def test_a_book_over_the_window_shows_its_size_not_zero(chat_engine: TriForceEngine, worker):
    """The document line and the gauge of a book read by relevance give its real size in tokens
    (the status line's figure), before any question and after one."""
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    loaded = named(DOCUMENT_OUTPUTS, documents.set_document(None, _book(), 32))
    user, info, gauge, status = loaded["user"], loaded["docinfo"], loaded["gauge"], loaded["status"]
    size = user.session.book_tokens
    assert size > ctx.window and len(chat_engine.encode(_book().text)) - size in (0, 1)  # at most a BOS apart
    assert f"is {size:,} tokens" in status
    assert f"{size:,} tokens, over the context window" in info and " 0 tokens" not in info
    assert "no document yet" not in gauge and f"read of its <b>{size:,}</b>" in gauge
    assert "each question reads the parts of the document most relevant to it" in gauge
    gamma = _book().text[_book().sections[3].start : _book().sections[3].end].split()
    updates = [named(STREAMED, out) for out in answers.on_ask(" ".join(gamma[:3]), user, False, False, "", *_values())]
    read = user.session.document_tokens  # what this question read
    assert 0 < read < ctx.window
    assert f"document <b>{read:,}</b> read of its <b>{size:,}</b>" in updates[-1]["gauge"]
    assert f"{size:,} tokens, over the context window" in doc_info(user)  # the book, not the part read


def test_the_gauge_follows_the_mode(chat_engine: TriForceEngine, worker):
    """Loading a document, clearing, answering and changing the budget or the mode: the gauge
    speaks of the retrieval level only in a mode that has one."""
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(mode="lookup"), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    reads = "the retrieval level reads"
    loaded = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32, "lookup"))
    user, gauge = loaded["user"], loaded["gauge"]
    assert reads not in gauge and "no retrieval level in this mode" in gauge
    assert reads in named(DOCUMENT_OUTPUTS, documents.set_document(user, doc, 32, "triforce"))["gauge"]
    # no mode given: the app's default, lookup
    assert reads not in named(DOCUMENT_OUTPUTS, documents.set_document(user, doc, 32))["gauge"]
    assert reads in answers.on_budget(user, 32, "retrieval") and reads not in answers.on_budget(user, 32, "draft")
    last = named(STREAMED, list(answers.on_ask("w9 w10", user, False, False, "", *_values(mode="lookup")))[-1])
    assert "tf-ok" in last["status"] and reads not in last["gauge"]
    last = named(STREAMED, list(answers.on_ask("w9 w10", user, False, False, "", *_values(mode="triforce")))[-1])
    assert reads in last["gauge"]
    assert reads not in named(STREAMED, answers.on_clear(user, 32, "autoregressive"))["gauge"]


def test_a_new_document_clears_the_panels_of_the_answers_before(chat_engine: TriForceEngine, worker):
    """The charts, the figures, the round narration and the inspector describe an answer; once
    the document (or, through the same handler, the model) changes, that answer is gone, and so
    are they."""
    from ui.views import DOCUMENT_OUTPUTS, STREAMED, cleared_panels

    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    answered = dict(zip(STREAMED, list(answers.on_ask("w9 w10", user, True, False, "", *_values()))[-1]))
    cleared = cleared_panels()
    assert "mean accepted length" in answered["stats"] and "Round " in answered["narration"]  # the answer's panels, shown
    assert answered["stats"] != cleared["stats"] and answered["narration"] != cleared["narration"]
    assert "<th>mode</th><td>triforce</td>" in answered["stats"]  # after a change of the mode: which one they show
    out = dict(zip(DOCUMENT_OUTPUTS, documents.set_document(user, doc, 32)))
    for name in ("passages", "stats", "narration", "inspector"):
        assert out[name] == cleared[name], name
    for name in ("acceptance", "speed", "inspector_plot"):
        assert out[name].to_json() == cleared[name].to_json(), name
    assert "no answer yet" in out["stats"]


def test_a_refused_file_is_said_under_the_upload_box_which_lets_go_of_it(chat_engine: TriForceEngine, worker,
                                                                          tmp_path):
    """A renamed file (a web page saved as report.pdf): the reason shows on the line under the
    upload box and in the status line, the box is emptied, the document loaded before stays.
    The next document loaded empties that line; the sample also empties the box."""
    from ui.views import DOCUMENT_OUTPUTS

    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents = DocumentHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    renamed = tmp_path / "report.pdf"
    renamed.write_text("<!DOCTYPE html><html><body><h1>Report</h1><p>w1 w2 w3</p></body></html>", encoding="utf-8")
    with pytest.warns(UserWarning, match="report.pdf"):  # gr.Warning: a toast as well
        out = dict(zip(DOCUMENT_OUTPUTS, documents.on_upload(str(renamed), user, 32)))
    assert 'class="tf-upload-note tf-error"' in out["upload_note"] and "Could not read report.pdf" in out["upload_note"]
    assert "not a PDF file" in out["upload_note"] and "renamed?" in out["upload_note"]  # the reader's own words
    assert "Could not read report.pdf" in out["status"] and "tf-error" in out["status"]
    assert out["upload"]["value"] is None and "__type__" in out["upload"]  # the box lets go of the refused file
    assert out["user"] is user and user.document.name == "d.txt"  # the document before stays
    assert all(isinstance(out[name], type(gr.skip())) for name in ("docinfo", "gauge", "chat", "toc", "toc_list"))
    good = tmp_path / "notes.md"
    good.write_text("# Notes\n\n" + words(100, 5), encoding="utf-8")
    out = dict(zip(DOCUMENT_OUTPUTS, documents.on_upload(str(good), user, 32)))
    assert "tf-error" not in out["upload_note"] and isinstance(out["upload"], type(gr.skip()))  # it shows notes.md
    out = dict(zip(DOCUMENT_OUTPUTS, documents.on_sample(user, 32)))
    assert out["upload"]["value"] is None and user.document.name == "python-tutorial-classes.txt"


def test_a_change_of_mode_clears_the_panels_of_the_answers_before(chat_engine: TriForceEngine, worker):
    """The user picks another mode: the map, charts, figures, narration and inspector of the
    answers before are cleared (they describe the mode those answers ran in); the conversation
    stays. With no answer, or during one, nothing is touched."""
    from ui.figures import retrieval_map_figure
    from ui.views import PANELS, STREAMED, cleared_panels

    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    assert all(isinstance(u, type(gr.skip())) for u in answers.on_mode(user, 32, "lookup"))  # no answer yet
    answered = dict(zip(STREAMED, list(answers.on_ask("w9 w10", user, True, False, "", *_values()))[-1]))
    assert "mean accepted length" in answered["stats"] and "Round " in answered["narration"]
    ran = user.answers[-1].trace.stats.mode
    assert ran != "lookup"
    # the dropdown closed without a pick sends the mode the answer ran in: nothing changes
    assert all(isinstance(u, type(gr.skip())) for u in answers.on_mode(user, 32, ran))
    out = dict(zip(("status", "map", *PANELS), answers.on_mode(user, 32, "lookup")))
    cleared = cleared_panels()
    assert "Mode lookup" in out["status"] and "cleared" in out["status"]
    for name in ("passages", "stats", "narration", "inspector"):
        assert out[name] == cleared[name], name
    for name in ("acceptance", "speed", "inspector_plot"):
        assert out[name].to_json() == cleared[name].to_json(), name
    assert out["map"].to_json() == retrieval_map_figure(None).to_json()
    assert len(user.answers) == len(user.session.turns) == 1  # the conversation stays
    assert all(isinstance(u, type(gr.skip())) for u in answers.on_mode(user, 32, "lookup"))  # closed again
    assert "Mode " + ran in answers.on_mode(user, 32, ran)[0]  # a real change back is one

    class Busy:
        finished = threading.Event()  # never set: an answer is running

    user.job = Busy()
    assert all(isinstance(u, type(gr.skip())) for u in answers.on_mode(user, 32, "draft"))


def test_a_stepped_answers_speed_leaves_out_the_waits_for_step(chat_engine: TriForceEngine, worker):
    """The engine's decode clock runs on while a stepped generation waits for Step; the speeds
    shown (footer, figures, speed chart) are its tokens over its decoding time less those waits,
    and say so. The wait after the prefill is no decoding time and is not subtracted."""
    from ui.views import answer_footer, stats_rows

    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers, teaching = DocumentHandlers(ctx), AnswerHandlers(ctx), TeachingHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    pause, waits = 0.4, 0
    for out in streamed(answers.on_ask("w9 w10", user, False, True, "", *_values(max_new_tokens=20))):
        if "Step mode" in out["status"]:
            time.sleep(pause)  # the user reads the round before pressing Step
            waits += 1
            if waits < 4:
                teaching.on_step(user)
            else:
                teaching.on_step_mode(user, False)
    trace = user.answers[0].trace
    s = trace.stats
    assert waits == 4 and s is not None
    assert len(user.job.waits) == 4 and user.job.waited_s >= 4 * pause
    assert 3 * pause <= trace.waited_s < user.job.waited_s  # the three waits after a round, not the prefill's
    assert s.decode_s - trace.waited_s == pytest.approx(trace.decode_s()) and trace.decode_s() > 0
    shown = s.new_tokens / (s.decode_s - trace.waited_s)
    assert trace.tokens_per_s() == pytest.approx(shown) and shown > s.tokens_per_s
    footer = answer_footer(trace, False)
    assert f"{s.new_tokens} tokens at {shown:.1f} tok/s (not counting {trace.waited_s:.1f} s waiting for Step)" \
        in footer
    assert footer in out["status"]
    assert dict(stats_rows(user.answers[0]))["tokens/s"].startswith(f"{shown:.1f} (not counting")
    speed = out["speed"]
    assert speed.data[0].x[0] == pytest.approx(shown) and "waits for Step left out" in speed.layout.title.text
    # the round clock leaves the waits out too: the last round ends within the decoding time less them
    assert trace.rounds[-1].at_s <= trace.decode_s() + 0.05
    # an answer not stepped: the engine's own figure, nothing subtracted
    list(answers.on_ask("w11", user, False, False, "", *_values(max_new_tokens=20)))
    plain = user.answers[1].trace
    assert plain.waited_s == 0 and plain.tokens_per_s() == plain.stats.tokens_per_s
    assert "waiting for Step" not in answer_footer(plain, False)


def test_the_last_update_of_an_answer_opens_the_inspector_on_its_first_rejection(chat_engine, worker, monkeypatch):
    """The lesson opens the inspector on an answer's first checked rejection. When the answer
    ends before the page refreshes again (here: refreshes held off after the first), only the
    final update sees that rejection, and it must open the inspector, with the model's decode."""
    import ui.handlers.answers as answers_module
    from ui.views import STREAMED

    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    monkeypatch.setattr(answers_module, "UPDATE_EVERY_S", 1e9)  # no refresh after the first until the end
    user.auto_inspect = True
    values = _values(temperature=0.8, seed=2, max_new_tokens=30, lookup=False)
    updates = [dict(zip(STREAMED, out)) for out in answers.on_ask("w9 w10", user, True, False, "", *values)]
    trace = user.answers[0].trace
    first = next(seg for seg in trace.segments if seg.kind == "rejected" and seg.checks)
    skip = type(gr.skip())
    assert "Click a token" in updates[0]["inspector"]  # a new answer: the inspector starts cleared
    assert all(isinstance(u["inspector"], skip) for u in updates[1:-1])  # the refreshes before saw no rejection
    final = updates[-1]["inspector"]
    assert not isinstance(final, skip) and "rejected</b>" in final and "u = " in final
    assert f"«{chat_engine.detokenize([first.token_id])}»" in final  # decoded by the model's tokenizer
    assert user.auto_inspect is False  # opened once


def test_the_lesson_reads_a_quarter_of_the_context_runs_by_itself_and_gives_the_settings_back(
        chat_engine: TriForceEngine, worker, monkeypatch):
    """The lesson's budget is about a quarter of the context, so the retrieval level drops chunks:
    each of the three levels proposes tokens and the retrieval level checks some. Its answer
    runs by itself (each pause ends after LESSON_ROUND_S, no Step pressed), and when it ends the
    settings it changed come back as the user had them."""
    import ui.handlers.answers as answers_module
    from ui.handlers.teaching import LESSON_CONTROLS, LESSON_QUESTION, LESSON_SETTINGS, RESTORED

    pace = 0.3
    monkeypatch.setattr(answers_module, "LESSON_ROUND_S", pace)
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers, teaching = DocumentHandlers(ctx), AnswerHandlers(ctx), TeachingHandlers(ctx)
    doc = Document(words(700, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    context = user.session.document_tokens
    mine = dict(teaching=False, stepmode=False, mode="lookup", temperature=0.0, seed=-1, lookup=True,
                repetition_penalty=1.0, budget=512)
    lesson = named(LESSON_SETUP_OUTPUTS, teaching.lesson_setup(user, *(mine[name] for name in LESSON_CONTROLS), 4))
    budget = lesson["budget"]["value"]
    assert lesson["teaching"]["value"] is True and lesson["stepmode"]["value"] is True
    assert lesson["mode"]["value"] == "triforce" and lesson["lookup"]["value"] is False
    assert {name: lesson[name]["value"] for name in LESSON_SETTINGS} == LESSON_SETTINGS
    assert user.keep is False  # the lesson's session is never saved
    assert budget == context // 4 // 64 * 64 and budget < context / 2, (budget, context)
    from ui.handlers.teaching import lesson_budget
    assert lesson_budget(4096, 8) == 1024 and lesson_budget(9375, 8) == 2304  # SmolLM2 reading a book, the demo pair
    assert lesson_budget(100, 64) == 192 and lesson_budget(10**6, 8) == 16384  # 3 chunks at least; the slider's top
    assert lesson["question"] == LESSON_QUESTION
    assert f"The retrieval budget is {budget:,} tokens, about a quarter of the context ({context:,} tokens)" \
        in lesson["lesson"] and "cheapest" in lesson["lesson"]
    values = _values(mode="triforce", temperature=0.8, seed=3, lookup=False, budget=budget, max_new_tokens=30)
    # (the demo pair's answer: the lesson's own temperature and seed are SmolLM2's pick, a test there)
    statuses = [out["status"] for out in streamed(answers.on_ask("w9 w10", user, True, True, "", *values))]
    trace, job = user.answers[0].trace, user.job
    s = trace.stats
    # three levels at work, the middle one over a real selection
    assert all(s.committed_by_level.get(level, 0) > 0 for level in ("draft", "retrieval", "target")), \
        s.committed_by_level
    assert s.proposed.get("retrieval", 0) > 0 and 0 <= s.acceptance["retrieval"] <= 1
    first = trace.selections[0]
    spans = list(zip(first.chunk_token_spans, first.scores_or_counts))  # each chunk, with the heads that chose it
    assert not first.dense and sum(b - a for (a, b), _n in spans) < context  # some chunks no head reads
    assert sum(n * (b - a) for (a, b), n in spans) <= first.heads_total * budget  # each head reads its budget
    # it ran by itself: every pause (after the prefill, after each round but the last) ended on its own
    assert job.steps_taken == len(job.waits) == len(trace.rounds) > 3
    assert all(seconds >= pace * 0.9 for _after, seconds in job.waits)
    assert any("Lesson: round 1 done; round 2 follows in a second" in st for st in statuses)
    assert "not counting" in statuses[-1]  # its speed leaves the pauses out
    # it ends: the settings come back, but the teaching view
    back = named(LESSON_END_OUTPUTS, teaching.lesson_end(user))
    assert {name: back[name]["value"] for name in RESTORED} == {name: mine[name] for name in RESTORED}
    assert "settings are back" in back["lesson"] and user.lesson is None
    # which level produced what: the counts of its own trace
    by = s.committed_by_level
    assert f"{by['draft']} green" in back["lesson"] and f"{by['retrieval']} blue" in back["lesson"]
    assert f"{by['target']} red" in back["lesson"] and f"Its answer: {s.new_tokens} tokens" in back["lesson"]
    struck = sum(1 for seg in trace.segments if seg.kind == "rejected")
    assert f"Struck through: {struck} rejected proposal" in back["lesson"]
    assert all(isinstance(u, type(gr.skip())) for u in teaching.lesson_end(user))  # only once
    # the next question is the user's own: it does not run by itself
    list(answers.on_ask("w11", user, False, False, "", *_values()))
    assert user.job.waits == [] and user.job.steps_taken == 0


def test_stepping_a_sampled_answer_and_inspecting_a_rejection(chat_engine: TriForceEngine, worker):
    """Step mode: the generation waits after the prefill and after each round; three Steps show
    three rounds, then it runs on. The teaching view records the rule's values: a rejected
    proposal opens in the inspector with its draw u, p/q and the residual."""
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers, teaching = DocumentHandlers(ctx), AnswerHandlers(ctx), TeachingHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    values = _values(temperature=0.8, seed=2, max_new_tokens=30, lookup=False)
    seen, narrated = [], []
    for out in streamed(answers.on_ask("w9 w10", user, True, True, "", *values)):
        if "Step mode" in out["status"]:  # the handler saw the job waiting (it waits until stepped)
            assert user.job.waiting
            rounds = len(user.answers[-1].trace.rounds) if user.answers else 0
            seen.append(rounds)
            assert f"round {rounds + 1}" in out["status"]
            narrated.append(out["narration"])
            if len(seen) <= 3:
                teaching.on_step(user)
            else:
                teaching.on_step_mode(user, False)  # run on to the end
    assert seen == [0, 1, 2, 3], seen
    assert "Round 3:" in narrated[-1] and "Press <b>Step</b>" in narrated[-1]
    trace = user.answers[0].trace
    assert len(trace.rounds) > 3 and trace.stats is not None and user.job.steps_taken == 3
    assert round_sentence(trace, 1).startswith("Round 1: the small draft")
    picked = [i for i, seg in enumerate(trace.segments) if seg.kind == "rejected" and seg.checks]
    assert picked, "a sampled answer of 30 tokens with a random pair rejects something"
    inspected = named(PICK_OUTPUTS, teaching.on_pick(f"0:{picked[0]}@123", user))
    html, fig = inspected["inspector"], inspected["inspector_plot"]
    assert "rejected</b>" in html and "u = " in html and "residual" in html
    assert [t.name for t in fig.data] == ["p (verifier)", "q (proposer)", "residual"]
    # a token without checks of an answer asked with the teaching view off says how to get them
    list(answers.on_ask("w11", user, False, False, "", *values))
    seg = next(i for i, s in enumerate(user.answers[1].trace.segments) if s.kind == "token" and s.level != "target")
    html = named(PICK_OUTPUTS, teaching.on_pick(f"1:{seg}@1", user))["inspector"]
    assert "Turn on the teaching view" in html
    assert "Click a token" in named(PICK_OUTPUTS, teaching.on_pick("nonsense", user))["inspector"]


def test_continue_after_the_limit_says_so_and_goes_on_in_the_same_answer(chat_engine: TriForceEngine, worker):
    """An answer cut by its token limit says so (footer and status line) with a Continue button
    on it; Continue goes on in the same answer, whose tokens then equal one longer answer's and
    whose footer covers the whole of it; the button is on the last answer only."""
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    with pytest.raises(gr.Error, match="no answer to continue"):
        list(answers.on_continue(user, False, False, *_values()))
    final = list(streamed(answers.on_ask("w9 w10", user, False, False, "", *_values())))[-1]
    answer = user.answers[0]
    assert answer.trace.stats.stop_reason == "max_new_tokens"
    assert answer.footer.endswith(" · Stopped at the 12-token limit.") and answer.footer in final["status"]
    assert final["chat"].count('class="tf-continue"') == 1

    updates = list(streamed(answers.on_continue(user, False, False, *_values())))
    assert all('class="tf-continue"' not in out["chat"] for out in updates[:-1])  # not while it streams
    final = updates[-1]
    assert user.answers == [answer] and len(user.session.turns) == 1  # the same answer went on
    trace, turn = answer.trace, user.session.turns[0]
    assert trace.new_tokens == 24 and trace.token_ids == turn.token_ids and trace.stats.new_tokens == 24
    assert trace.stats.rounds == len(trace.rounds)  # the figures of both parts, as one answer's
    assert " · 24 tokens at " in answer.footer and answer.footer.endswith(" · Stopped at the 24-token limit.")
    assert answer.footer in final["status"] and final["chat"].count('class="tf-continue"') == 1
    # Compare with autoregressive reruns the whole answer, its 24 tokens, not the page's limit of 12
    compared = list(answers.on_compare(user, False, *_values()))
    assert "identical output: yes" in named(STREAMED, compared[-1])["status"]

    # the same question with a limit of 24 at once: the same tokens (greedy)
    other = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))["user"]
    list(answers.on_ask("w9 w10", other, False, False, "", *_values(max_new_tokens=24)))
    assert other.answers[0].trace.token_ids == trace.token_ids
    assert other.session.turns[0].answer == turn.answer

    # a next question: its answer carries the button, the one before no longer
    final = list(streamed(answers.on_ask("w11", user, False, False, "", *_values())))[-1]
    assert final["chat"].count('class="tf-continue"') == 1
    assert final["chat"].rindex('class="tf-continue"') > final["chat"].rindex("tf-user")


# -- the lesson in its own tab; panels that say which answer they show ---------------------------

def _ctx(engine, worker) -> AppContext:
    return AppContext(engine=engine, worker=worker, sessions=SessionPool(worker, 2),
                      slots=SlotPool(engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)


def _request(query: str) -> gr.Request:
    """The request of a page opened at `/?{query}`, as Gradio hands it to a load handler."""
    from starlette.requests import Request

    return gr.Request(Request({"type": "http", "method": "GET", "path": "/", "query_string": query.encode(),
                               "headers": []}))


def test_the_lesson_opens_only_at_its_own_address_in_a_session_never_saved(chat_engine: TriForceEngine, worker):
    """The Lesson button's tab (/?lesson=1) gets a session of its own, never saved, and the gate
    that starts the lesson; any other page load (the user's own tab) changes nothing."""
    teaching = TeachingHandlers(_ctx(chat_engine, worker))
    skip = type(gr.skip())
    for query in ("", "lesson=0", "other=1"):
        assert all(isinstance(out, skip) for out in teaching.lesson_open(None, _request(query))), query
    user, gate = teaching.lesson_open(None, _request("lesson=1"))
    assert gate is True and user is not None and user.keep is False and user.document is None


def test_the_lesson_s_words_go_with_the_next_action_once_it_is_over(chat_engine: TriForceEngine, worker):
    from ui.state import Lesson

    teaching = TeachingHandlers(_ctx(chat_engine, worker))
    user = _ctx(chat_engine, worker).new_user()
    user.lesson = Lesson({})  # a lesson under way: its words stay
    assert isinstance(teaching.on_action(user), type(gr.skip()))
    user.lesson = None  # over: the next question, document or clearing takes them away
    assert teaching.on_action(user) == "" and teaching.on_action(None) == ""


def test_the_fluency_check_finds_short_and_looping_answers():
    from ui.handlers.teaching import fluency_problem, repeated_run

    english = ("A class is a blueprint for objects: it bundles data and the functions that work on it. Each "
               "instance of a class has its own attributes, and methods are functions defined in the class body "
               "that receive the instance as their first argument, usually called self.")
    assert fluency_problem(english) is None and repeated_run(english) == 1
    assert fluency_problem("A class is a blueprint.") == "5 words, under 25"
    loop = "Regular classes have two fundamental attributes: the class and the object. " * 4
    assert repeated_run(loop) == 4 and "repeated 4 times" in fluency_problem(loop)
    twice = english + " " + "the class and the object of it. " * 2  # a phrase twice is not a loop
    assert fluency_problem(twice) is None
    # punctuation and case do not hide a loop
    assert repeated_run("The class, the object. the CLASS the object " * 3) >= 3


def test_an_empty_or_blank_token_is_never_shown_as_nothing():
    from ui.narration import EMPTY_PIECE, quoted

    assert quoted("") == EMPTY_PIECE and "«»" not in EMPTY_PIECE
    assert quoted(" ") == "«␣»" and quoted("\n") == "«⏎»" and quoted(" \n\t") == "«␣⏎⇥»"
    assert quoted("a b\nc") == "«a b⏎c»"  # spaces inside words read as they are


def test_a_new_answer_clears_the_inspector_and_each_panel_names_the_answer_it_shows(
        chat_engine: TriForceEngine, worker):
    """The inspector and the p/q chart keep no token of an earlier answer once a new one starts;
    the narration keeps every round of the answer it describes and names it, the inspector, the
    chart, the charts and the table name it too; the chat's empty text names the document."""
    from ui.views import transcript

    ctx = _ctx(chat_engine, worker)
    documents, answers, teaching = DocumentHandlers(ctx), AnswerHandlers(ctx), TeachingHandlers(ctx)
    assert "Load a document" in transcript(None, False)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    loaded = named(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 32))
    user = loaded["user"]
    assert "Ask a question about d.txt." in loaded["chat"] and "Load a document" not in loaded["chat"]
    values = _values(temperature=0.8, seed=2, max_new_tokens=30, lookup=False)
    first = list(streamed(answers.on_ask("w9 w10", user, True, False, "", *values)))[-1]
    trace = user.answers[0].trace
    label = f"answer 1: «{' '.join(trace.text.split()[:6])}"
    rounds = len(trace.rounds)
    assert rounds > 4  # more than the four the narration used to keep
    assert first["narration"].count("<li>") == rounds and "Round 1:" in first["narration"]
    assert f"{rounds} rounds of {label}" in first["narration"].replace("&#x27;", "'")
    assert "«»" not in first["narration"] and "p: the verifier&#x27;s probability" in first["narration"]
    assert label in first["stats"] and label in first["acceptance"].layout.title.text
    assert label in first["speed"].layout.title.text
    picked = next(i for i, s in enumerate(trace.segments) if s.kind == "rejected" and s.checks)
    shown = named(PICK_OUTPUTS, teaching.on_pick(f"0:{picked}@1", user))
    assert "In answer 1: «" in shown["inspector"] and "answer 1: «" in shown["inspector_plot"].layout.title.text
    assert "if and only if" in shown["inspector"] or "uniform random draw" in shown["inspector"]
    assert "the distribution left after removing what the proposer already covered" in shown["inspector"]
    # the next answer: its first update clears the inspector and the chart; its panels name it
    updates = list(streamed(answers.on_ask("w11", user, True, False, "", *values)))
    assert "Click a token" in updates[0]["inspector"] and not updates[0]["inspector_plot"].data
    shown_map = updates[0]["map"]  # the first answer's selection goes too (or the new one's, named)
    assert not isinstance(shown_map, type(gr.skip())) and not isinstance(updates[0]["passages"], type(gr.skip()))
    assert not shown_map.data or "answer 2" in shown_map.layout.title.text
    assert all(isinstance(u["inspector"], type(gr.skip())) for u in updates[1:])  # cleared once, then left
    assert "answer 2: «" in updates[-1]["stats"] and " rounds of answer 2: «" in updates[-1]["narration"]
    # a token of either answer can still be inspected, and says which answer it is in
    again = named(PICK_OUTPUTS, teaching.on_pick(f"0:{picked}@2", user))["inspector"]
    assert "In answer 1: «" in again
    cleared = named(STREAMED, answers.on_clear(user, 32))
    assert "Ask a question about d.txt." in cleared["chat"]


def test_a_chat_answers_default_limit_is_the_measured_one_everywhere_a_chat_runs():
    """The page, its `chat` endpoint and the `chat` command default to the limit measured for
    SmolLM2's chat answers (docs/results.md names it); one generation's own default stays."""
    from pathlib import Path

    import app
    from triforce_core.cli.main import build_parser
    from triforce_core.config import CHAT_MAX_NEW_TOKENS, SpeculationConfig

    parse = build_parser().parse_args
    assert Settings().max_new_tokens == app.parse_args([]).max_new_tokens == CHAT_MAX_NEW_TOKENS
    assert parse(["chat", "--question", "q"]).max_new_tokens == CHAT_MAX_NEW_TOKENS
    assert parse(["generate", "--prompt", "x"]).max_new_tokens == SpeculationConfig().max_new_tokens
    assert CHAT_MAX_NEW_TOKENS != SpeculationConfig().max_new_tokens
    results = (Path(__file__).resolve().parent.parent / "docs" / "results.md").read_text(encoding="utf-8")
    section = results.split("## How long a chat answer is", 1)[1].split("\n## ", 1)[0]
    assert f"**{CHAT_MAX_NEW_TOKENS}**" in section and "scripts.measure_answer_lengths" in section


def test_the_teaching_legend_says_what_the_hover_s_symbols_are():
    from ui.render import legend_block

    assert "p is the verifier&#x27;s probability" not in legend_block(False) and "hover" not in legend_block(False)
    shown = legend_block(True)
    assert "p is the verifier's probability" in shown and "q the proposer's" in shown and "uniform random draw" in shown
