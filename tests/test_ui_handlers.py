"""The app's handlers driven in-process, without a server: the one streaming loop (`follow`),
and a conversation through the answer and document handlers (ask, compare, clear, errors)."""

from __future__ import annotations

import gradio as gr
import pytest

from conftest import words
from triforce_core.documents import Document, Section
from triforce_core.engine import TriForceEngine
from triforce_core.serving.worker import EngineWorker
from triforce_core.slots import SlotPool
from ui.handlers.answers import AnswerHandlers, follow
from ui.handlers.documents import DocumentHandlers
from ui.settings import SETTING_NAMES, Settings
from ui.state import AppContext, SessionPool


@pytest.fixture
def worker():
    w = EngineWorker()
    yield w
    w.close()


def test_follow_hands_over_every_event_in_order_and_refreshes_at_most_as_asked(worker):
    seen = []
    ticks = list(follow(worker.submit(lambda: iter(range(5))), seen.append, lambda: 0.0))
    assert seen == [0, 1, 2, 3, 4] and len(ticks) >= 5
    seen.clear()
    ticks = list(follow(worker.submit(lambda: iter(range(5))), seen.append, lambda: 1e9))
    assert seen == [0, 1, 2, 3, 4] and len(ticks) == 1  # the first event refreshes at once, then never


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


def test_a_conversation_through_the_handlers(chat_engine: TriForceEngine, worker):
    ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                     slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(words(200, 3), "txt", "d.txt", (Section(0, "page 1"),))
    user, *_ = documents.set_document(None, doc, 32)
    assert user.session.document_tokens > 0

    updates = list(answers.on_ask("w9 w10", user, False, "", *_values()))
    final = updates[-1]
    assert final[0] is user and len(user.answers) == len(user.session.turns) == 1
    assert "tok/s" in final[2] and "tf-ok" in final[2]  # the footer as the status line
    answer = user.answers[0]
    assert answer.trace.new_tokens > 0 and answer.trace.stats is not None
    # the autoregressive re-run of the same turn gives the same tokens (greedy)
    compared = list(answers.on_compare(user, False, *_values()))
    assert "identical output: yes" in compared[-1][2]
    assert answer.baseline is not None and answer.baseline["identical"] == "yes"
    assert len(user.session.turns) == 1  # the comparison re-ran the turn, it did not add one

    with pytest.raises(gr.Error, match="Type a question first"):
        list(answers.on_ask("  ", user, False, "", *_values()))
    with pytest.raises(gr.Error, match="Invalid setting"):
        list(answers.on_ask("w9", user, False, "", *_values(mode="fastest")))

    cleared = answers.on_clear(user, 32)
    assert cleared[0] is user and not user.session.turns and not user.answers
    assert user.session.document_tokens > 0  # the document stays loaded
