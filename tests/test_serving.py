"""Serving many callers: the one scheduler (`EngineWorker`), prefill chunks interleaved with
other callers' rounds, cache slots matched by token prefix (`Slot`, `SlotPool`)."""

from __future__ import annotations

import threading

import pytest

from tests.helpers.models import words
from triforce_core.config import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.decoding.events import Committed, Prefilled, PrefillProgress
from triforce_core.serving.worker import EngineWorker
from triforce_core.serving.slots import Slot, SlotPool, common_prefix


def config(mode: str = "triforce", max_new: int = 16, chunk: int = 1024, **sampling) -> GenerationConfig:
    return GenerationConfig(
        sampling=SamplingConfig(**sampling),
        speculation=SpeculationConfig(mode=mode, max_new_tokens=max_new, ignore_eos=True, gamma1=2, gamma2=4),
        cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, refresh_every=16,
                          prefill_chunk=chunk),
    )


def ids_of(events) -> list[int]:
    return [t for ev in events if isinstance(ev, Committed) for t in ev.token_ids]


def alone(engine, prompt, cfg) -> list[int]:
    return engine.run(prompt, cfg).token_ids


# -- the worker ------------------------------------------------------------------------------------

def counting(name, n, log, closed):
    def start():
        def gen():
            try:
                for i in range(n):
                    log.append((name, i))
                    yield i
            finally:
                closed.append(name)

        return gen()

    return start


def test_worker_interleaves_jobs_and_delivers_everything_in_order():
    worker = EngineWorker()
    log, closed = [], []
    gate = threading.Event()
    worker.submit(lambda: iter([gate.wait(5)]))  # hold the worker until both jobs are queued
    a = worker.submit(counting("a", 20, log, closed))
    b = worker.submit(counting("b", 20, log, closed))
    gate.set()
    assert list(a) == list(range(20)) and list(b) == list(range(20))
    firsts = [name for name, _ in log[:6]]
    assert "a" in firsts and "b" in firsts  # round-robin, not one job after the other
    assert sorted(closed) == ["a", "b"] and worker.jobs() == 0
    worker.close()


def test_cancel_closes_the_generation_and_errors_reach_the_consumer():
    worker = EngineWorker()
    log, closed = [], []
    job = worker.submit(counting("long", 10**9, log, closed))
    assert [job.get(timeout=5) for _ in range(3)] == [0, 1, 2]
    job.cancel()
    assert job.finished.wait(5) and job.stopped and closed == ["long"]

    def failing():
        raise ValueError("the question is empty")

    with pytest.raises(ValueError, match="question is empty"):
        list(worker.submit(failing))
    assert worker.call(lambda: 42) == 42  # the worker lives on
    worker.close()


def test_a_stepping_job_waits_between_steps_without_holding_up_others():
    worker = EngineWorker()
    log, closed = [], []
    # pause after every multiple of 3 (a "round" is three items)
    job = worker.submit(counting("stepped", 12, log, closed), pause_after=lambda i: i % 3 == 2, stepping=True)
    assert [job.get(timeout=5) for _ in range(3)] == [0, 1, 2]
    assert job.get(timeout=0.3) is None  # waits for a step
    assert job.waiting and len(log) == 3
    other = worker.submit(counting("other", 5, log, closed))  # others run meanwhile
    assert list(other) == list(range(5))
    job.step()
    assert [job.get(timeout=5) for _ in range(3)] == [3, 4, 5]
    assert job.get(timeout=0.3) is None and job.steps_taken == 1
    job.set_stepping(False)  # run on to the end
    assert list(job) == list(range(6, 12)) and not job.waiting
    # a waiting job still stops at once
    held = worker.submit(counting("held", 10**9, log, closed), pause_after=lambda i: True, stepping=True)
    assert held.get(timeout=5) == 0 and held.get(timeout=0.3) is None
    held.cancel()
    assert held.finished.wait(5) and held.stopped and "held" in closed
    worker.close()


def test_a_long_prefill_is_interleaved_with_another_callers_rounds(chat_engine):
    """Caller B decodes while caller A prefills 600 tokens in 32-token chunks: B's rounds run
    between A's chunks (not after A's whole prefill), and both answers equal their runs alone."""
    worker = EngineWorker()
    order: list[str] = []
    long_prompt = chat_engine.encode(words(600, 5))
    short_prompt = chat_engine.encode(words(40, 6))
    cfg_a, cfg_b = config("triforce", 8, chunk=32), config("lookup", 24)

    def logged(name, events):
        for ev in events:
            order.append(f"{name}:{type(ev).__name__}")
            yield ev

    gate = threading.Event()
    worker.submit(lambda: iter([gate.wait(5)]))
    b = worker.submit(lambda: logged("b", Slot(chat_engine).generate(short_prompt, cfg_b, progress_events=True)))
    a = worker.submit(lambda: logged("a", Slot(chat_engine).generate(long_prompt, cfg_a, progress_events=True)))
    gate.set()
    events_a, events_b = list(a), list(b)
    chunks = [i for i, e in enumerate(order) if e == "a:PrefillProgress"]
    assert len(chunks) == -(-(len(long_prompt) - 1) // 32)  # one event per chunk
    assert sum(1 for e in order[chunks[0] : chunks[-1]] if e == "b:Committed") >= 5
    assert [e.done for e in events_a if isinstance(e, PrefillProgress)][-1] == len(long_prompt) - 1
    assert ids_of(events_a) == alone(chat_engine, long_prompt, cfg_a)
    assert ids_of(events_b) == alone(chat_engine, short_prompt, cfg_b)
    worker.close()


def test_progress_events_only_when_asked(chat_engine):
    prompt = chat_engine.encode(words(100, 7))
    quiet = list(chat_engine.generate(prompt, config(chunk=16)))
    assert not any(isinstance(e, PrefillProgress) for e in quiet) and isinstance(quiet[0], Prefilled)
    loud = list(chat_engine.generate(prompt, config(chunk=16), progress_events=True))
    assert [type(e) for e in loud[:7]] == [PrefillProgress] * 7 and isinstance(loud[7], Prefilled)
    assert ids_of(loud) == ids_of(quiet)


# -- slots -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["triforce", "retrieval", "draft", "lookup", "autoregressive"])
def test_a_prefill_stopped_between_chunks_leaves_a_cache_the_next_prompt_reuses_exactly(chat_engine, mode):
    """Close a generation in the middle of its prefill: the slot keeps the chunks done, the next
    prompt reuses them, and its greedy answer equals a fresh run's."""
    slot = Slot(chat_engine)
    first = chat_engine.encode(words(300, 8))
    cfg = config(mode, 12, chunk=32)
    events = slot.generate(first, cfg, progress_events=True)
    for _ in range(3):
        assert isinstance(next(events), PrefillProgress)
    events.close()
    assert slot.cached_tokens() == first[:96]
    second = first[:200] + chat_engine.encode(words(20, 9))
    out = list(slot.generate(second, cfg))
    prefilled = next(e for e in out if isinstance(e, Prefilled))
    assert prefilled.reused_tokens == 96
    assert ids_of(out) == alone(chat_engine, second, cfg)


def test_a_slot_reuses_the_conversation_and_a_stopped_answer(chat_engine):
    slot = Slot(chat_engine)
    turn1 = chat_engine.encode(words(200, 10))
    cfg = config("triforce", 20)
    out1 = list(slot.generate(turn1, cfg))
    turn2 = turn1 + ids_of(out1) + chat_engine.encode(words(8, 11))
    out2 = list(slot.generate(turn2, cfg))
    assert next(e for e in out2 if isinstance(e, Prefilled)).tokens <= 9  # only the new question
    assert ids_of(out2) == alone(chat_engine, turn2, cfg)
    events = slot.generate(turn2, cfg)  # stopped after its first round
    next(e for e in events if isinstance(e, Committed))
    events.close()
    assert ids_of(list(slot.generate(turn2, cfg))) == ids_of(out2)  # the stop left a usable cache


def test_a_failed_generation_frees_the_slot(chat_engine):
    slot = Slot(chat_engine)
    prompt = chat_engine.encode(words(50, 12))
    list(slot.generate(prompt, config()))
    assert slot.cache_lengths()["target"] > 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        slot.generate([10**6], config())  # checked before anything runs: the cache stays
    assert slot.cache_lengths()["target"] > 0
    bad = slot.generate(prompt, config())
    with pytest.raises(RuntimeError, match="boom"):
        next(bad)
        bad.throw(RuntimeError("boom"))
    assert slot.cache_lengths()["target"] == 0  # may be half-written: freed


def test_the_pool_lends_the_slot_sharing_most_and_keeps_at_most_capacity(chat_engine):
    pool = SlotPool(chat_engine, capacity=2)
    doc_a, doc_b = chat_engine.encode(words(120, 13)), chat_engine.encode(words(120, 14))
    cfg = config("lookup", 4)

    def run(prompt):
        slot, held = pool.take(prompt)
        list(slot.generate(prompt, cfg))
        pool.give_back(slot)
        return slot, held

    sa, held = run(doc_a)
    assert held == 0
    sb, _ = run(doc_b)
    again, held = run(doc_a + chat_engine.encode("w5 w6"))
    assert again is sa and held == len(doc_a)  # the conversation's slot, its document cached
    lent, _ = pool.take(doc_a)
    other, held = pool.take(doc_a)  # the matching slot is lent: a new one
    assert other is not lent and held == 0
    pool.give_back(lent)
    pool.discard(other)  # an abandoned request: dropped, not kept
    assert pool.stats() == {"lent": 0, "idle": 2, "idle_tokens": sum(len(s.cached_tokens()) for s in (sa, sb))}
    # A prompt sharing only a short preamble with a cached document does not take its slot.
    preamble = doc_a[:10] + chat_engine.encode(words(100, 15))
    fresh, held = run(preamble)
    assert fresh not in (sa, sb) and held == 0
    assert pool.stats()["idle"] == 2 and sb.loop is None  # least recently used evicted
    assert sa.loop is not None


def test_an_idle_slot_is_lent_to_one_of_many_concurrent_takers(chat_engine):
    pool = SlotPool(chat_engine, capacity=8)
    prompt = chat_engine.encode(words(30, 16))
    slot, _ = pool.take(prompt)
    list(slot.generate(prompt, config("lookup", 2)))
    pool.give_back(slot)
    taken: list[tuple[Slot, int]] = []
    lock = threading.Lock()

    def take():
        got = pool.take(prompt)
        with lock:
            taken.append(got)

    threads = [threading.Thread(target=take) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s, _ in taken}) == 16 and pool.stats() == {"lent": 16, "idle": 0, "idle_tokens": 0}
    assert [s for s, held in taken if held] == [slot]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0 and common_prefix([1], [1]) == 1
