"""The app's users' caches: bounded by count and by bytes, least recently used freed first."""

from __future__ import annotations

import pytest

from tests.helpers.models import words
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.serving.worker import EngineWorker
from triforce_core.serving.session import ChatSession
from ui.state import SessionPool, UserState

CONFIG = GenerationConfig(
    speculation=SpeculationConfig(mode="triforce", max_new_tokens=4, ignore_eos=True, gamma1=2, gamma2=4),
    cache=CacheConfig(budget=32, chunk_size=4, draft_window=16, draft_sinks=4),
)


@pytest.fixture(scope="module")
def worker():
    w = EngineWorker()
    yield w
    w.close()


def asked(engine, pool, n_words: int, seed: int) -> UserState:
    user = UserState(ChatSession(engine, words(n_words, seed), config=CONFIG))
    pool.touch(user)
    list(user.session.ask("w9 w10"))
    return user


def test_cache_bytes_count_every_level(chat_engine):
    session = ChatSession(chat_engine, words(100, 1), config=CONFIG)
    assert session.cache_bytes() == 0
    list(session.ask("w9"))
    spec = chat_engine.target.spec
    full = session._slot.loop.full.cache
    assert full.nbytes() >= spec.kv_bytes(full.capacity, full.k.element_size())  # plus the retrieval chunk means
    d = session._slot.loop
    assert d.retrieval is not None and d.small is not None  # triforce: the three levels, lookup in front
    assert session.cache_bytes() == full.nbytes() + d.retrieval.cache.nbytes() + d.small.cache.nbytes()
    assert d.retrieval.cache.nbytes() > 0 and d.small.cache.nbytes() > 0
    session.release()
    assert session.cache_bytes() == 0


def test_the_pool_frees_least_recently_used_sessions_beyond_its_bytes(chat_engine, worker):
    probe = asked(chat_engine, SessionPool(worker, 10), 200, 1)
    one = probe.session.cache_bytes()
    pool = SessionPool(worker, max_cached=10, max_bytes=int(2.5 * one))  # room for two sessions by bytes
    users = [asked(chat_engine, pool, 200, seed) for seed in (2, 3, 4)]
    pool.touch(users[0])  # users[0] becomes the most recently used: users[1] is the oldest
    held = [u.session.cache_bytes() > 0 for u in users]
    assert held == [True, False, True]
    assert pool.held_bytes() <= 2.5 * one
    by_count = SessionPool(worker, max_cached=1)
    a, b = asked(chat_engine, by_count, 50, 5), asked(chat_engine, by_count, 50, 6)
    by_count.touch(b)
    assert a.session.cache_bytes() == 0 and b.session.cache_bytes() > 0
