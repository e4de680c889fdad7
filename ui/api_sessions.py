"""Chat sessions of the `chat` API endpoint, lent to one call at a time.

A call about a document reuses the prefill of an earlier call about the same bytes, but two
calls never share a session at once: a session holds one conversation's caches and decodes
one answer at a time. So a call takes an idle session for its document (or a fresh one) out
of the pool and puts it back when its answer ends; concurrent calls on the same document get
a session each. At most `capacity` idle sessions keep their caches; the least recently
returned ones beyond that are released (on the engine worker, which owns the tensors).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from triforce_core.session import ChatSession


class ApiSessions:
    def __init__(self, new_session: Callable[[], ChatSession], release: Callable[[ChatSession], None],
                 capacity: int = 2):
        self.new_session = new_session
        self.release = release
        self.capacity = capacity
        self._idle: OrderedDict[tuple[str, int], ChatSession] = OrderedDict()  # (key, serial) -> session
        self._serial = 0
        self._lock = threading.Lock()

    def take(self, key: str) -> tuple[ChatSession, bool]:
        """An idle session for `key` (most recently returned first), or a new one: (session, is_new)."""
        with self._lock:
            for k in reversed(self._idle):
                if k[0] == key:
                    return self._idle.pop(k), False
        return self.new_session(), True

    def give_back(self, key: str, session: ChatSession) -> None:
        """Return a session after its call; evict beyond the capacity."""
        with self._lock:
            self._serial += 1
            self._idle[(key, self._serial)] = session
            evicted = []
            while len(self._idle) > self.capacity:
                evicted.append(self._idle.popitem(last=False)[1])
        for old in evicted:
            self.release(old)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)
