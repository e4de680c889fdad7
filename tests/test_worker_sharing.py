"""What an answer shares the one worker with, said on the page: before its prefill the status
line names the requests it waits behind (never a silent "waiting for the model"), and the
comparison with autoregressive decoding says when other users' answers ran by turns with the
two runs it compares (their ratio is then no clean measurement).

The worker's own reports (`ahead_of`, `sharing`, `Job.ran_with`) are checked on plain jobs;
the page's lines through the handlers, with the real worker, two users' sessions and the demo pair."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from triforce_core.documents import Document
from triforce_core.resources import SAMPLE_DOCUMENT
from triforce_core.serving.slots import SlotPool
from triforce_core.serving.worker import EngineWorker
from ui.handlers.answers import AnswerHandlers, before_prefill
from ui.handlers.documents import DocumentHandlers
from ui.settings import SETTING_NAMES, Settings
from ui.state import AppContext, SessionPool
from ui.views import DOCUMENT_OUTPUTS, STREAMED, stats_rows

NOT_CLEAN = "the ratio is not a clean measurement"


@pytest.fixture
def worker():
    w = EngineWorker()
    yield w
    w.close()


@contextlib.contextmanager
def held(worker: EngineWorker):
    """The worker busy with a call (another user's request) until the block ends."""
    holding, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=worker.call, args=(lambda: (holding.set(), release.wait(60)),))
    thread.start()
    assert holding.wait(60)
    try:
        yield
    finally:
        release.set()
        thread.join(60)


def test_a_job_behind_a_request_is_told_so_and_once_started_reads_its_prompt_beside_the_others(worker):
    with held(worker):
        job = worker.submit(lambda: iter([1]))
        assert worker.ahead_of(job) == 1 and worker.sharing(job) == 0  # a call is a request, not an answer
        assert before_prefill(worker, job) == "waiting for 1 request ahead of yours"
    assert list(job) == [1] and worker.ahead_of(job) == 0

    # another answer runs while this one has started but has no event yet
    other_go, reading, go = threading.Event(), threading.Event(), threading.Event()

    def other():  # an answer's rounds, one per pass, until told to end
        while not other_go.is_set():
            yield 0

    def start():
        reading.set()
        go.wait(60)
        return iter([2])

    a = worker.submit(other)
    assert next(iter(a)) == 0
    b = worker.submit(start)
    assert reading.wait(60)
    assert worker.ahead_of(b) == 0 and worker.sharing(b) == 1
    assert before_prefill(worker, b) == "reading the prompt (the model runs 1 other answer by turns with it)"
    go.set()
    other_go.set()
    assert list(b) == [2] and set(a) == {0}


def test_the_worker_records_the_generations_run_between_a_jobs_events(worker):
    with held(worker):  # both start in the same pass, then advance by turns
        a = worker.submit(lambda: iter(range(5)))
        b = worker.submit(lambda: iter(range(5)))
    assert list(a) == list(range(5)) and list(b) == list(range(5))
    assert a.ran_with == {b.number} and b.ran_with == {a.number}
    alone = worker.submit(lambda: iter(range(5)))
    assert list(alone) == list(range(5))
    for _ in range(3):
        worker.call(lambda: None)  # calls (a document read, a release) are no generations
    assert alone.ran_with == set()


@pytest.fixture(scope="module")
def demo_engine():
    from triforce_core.engine import TriForceEngine
    from triforce_core.models.loading import DEMO_DRAFT, DEMO_TARGET

    return TriForceEngine.from_pretrained(str(DEMO_TARGET), str(DEMO_DRAFT), device="cpu")


def values(**changes) -> list:
    s = Settings(**{"mode": "lookup", "temperature": 0.0, "max_new_tokens": 24, **changes})
    return [getattr(s, name) for name in SETTING_NAMES]


def named(updates):
    return [dict(zip(STREAMED, out, strict=True)) for out in updates]


def test_the_status_names_the_queue_and_a_comparison_under_load_says_so(demo_engine, worker):
    ctx = AppContext(engine=demo_engine, worker=worker, sessions=SessionPool(worker, 4),
                     slots=SlotPool(demo_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    doc = Document(SAMPLE_DOCUMENT.read_text(encoding="utf-8")[:3000], "txt", "classes.txt")
    one = dict(zip(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 64)))["user"]
    two = dict(zip(DOCUMENT_OUTPUTS, documents.set_document(None, doc, 64)))["user"]

    # 1. Before its prefill, an answer behind another user's request says so.
    with held(worker):
        asking = answers.on_ask("What follows «A namespace is»?", one, False, False, "", *values())
        first = dict(zip(STREAMED, next(asking)))
        assert "Answering: waiting for 1 request ahead of yours" in first["status"], first["status"]
    final = named(asking)[-1]
    assert "tok/s" in final["status"] and one.answers[-1].ran_with == set()  # it ran alone

    # 2. Compared alone: a clean measurement, nothing said.
    alone = named(answers.on_compare(one, False, *values()))[-1]
    assert "identical output: yes" in alone["status"] and NOT_CLEAN not in alone["status"], alone["status"]
    assert "measured" not in dict(stats_rows(one.answers[-1]))

    # 3. Compared while the second user's answer runs: said in the status line and the table.
    stepped = answers.on_ask("What follows «Python classes provide»?", two, False, True, "",
                             *values(max_new_tokens=200))
    updates: list = []
    other = threading.Thread(target=lambda: updates.extend(stepped))
    other.start()
    try:
        while not (two.job is not None and two.job.waiting):  # paused after its prefill (step mode)
            assert other.is_alive(), updates[-1:]
            time.sleep(0.05)
        with held(worker):  # the comparison and the other answer begin in one pass
            for _ in range(500):
                two.job.step()  # rounds to run, one per pass, beside the comparison's
            comparing = answers.on_compare(one, False, *values())
            first = dict(zip(STREAMED, next(comparing)))
            assert "Autoregressive baseline: waiting for 2 requests ahead of yours" in first["status"], first["status"]
        loaded = named(comparing)[-1]
    finally:
        if two.job is not None:
            two.job.cancel()
        other.join(120)
    assert "identical output: yes" in loaded["status"], loaded["status"]
    assert f"Measured while 1 other answer ran: {NOT_CLEAN}." in loaded["status"], loaded["status"]
    assert dict(stats_rows(one.answers[-1]))["measured"] == f"while 1 other answer ran: {NOT_CLEAN}"
