"""The `chat` endpoint's session pool: one caller per session, prefills reused, bounded."""

from __future__ import annotations

from triforce_core.session import ChatSession
from ui.api_sessions import ApiSessions


def make_pool(engine, capacity: int = 2):
    made: list[ChatSession] = []
    released: list[ChatSession] = []

    def new():
        made.append(ChatSession(engine))
        return made[-1]

    return ApiSessions(new, released.append, capacity), made, released


def test_concurrent_takes_of_one_key_get_different_sessions_and_reuse_after_return(chat_engine):
    pool, made, released = make_pool(chat_engine)
    a, new_a = pool.take("doc")
    b, new_b = pool.take("doc")  # a is still lent out
    assert a is not b and new_a and new_b
    pool.give_back("doc", a)
    again, new = pool.take("doc")
    assert again is a and not new  # the prefilled session is reused
    other, new = pool.take("")
    assert new and other not in (a, b)


def test_idle_sessions_are_bounded_least_recently_returned_first(chat_engine):
    pool, made, released = make_pool(chat_engine, capacity=2)
    s = [pool.take(k)[0] for k in ("x", "y", "z")]
    for k, sess in zip(("x", "y", "z"), s):
        pool.give_back(k, sess)
    assert released == [s[0]] and pool.idle() == 2
    assert pool.take("x")[1] is True  # evicted: a new session
    assert pool.take("z")[0] is s[2]
