"""Caches kept between generations, and a bounded pool of them matched by token prefix.

    slot = Slot(engine)
    for event in slot.generate(prompt_ids, config): ...   # prefills everything
    for event in slot.generate(longer_prompt, config): ... # prefills only what is new

A `Slot` is one target cache (with its retrieval and draft lanes) that outlives a generation:
the next prompt reuses the longest common prefix of the tokens it holds, so a conversation
resent whole each turn (a chat client, the HTTP API) costs only its new tokens. A chat session
holds one slot; the HTTP API borrows slots from a `SlotPool`, which hands a prompt the idle
slot sharing most of it and keeps at most `capacity` idle slots, least recently used evicted.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from ..config import GenerationConfig
from ..engine import TriForceEngine
from ..decoding.events import Event
from ..decoding.loop import SpeculationLoop, make_generator


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Slot:
    """A speculation loop kept between generations (one at a time); not thread-safe."""

    def __init__(self, engine: TriForceEngine):
        self.engine = engine
        self.loop: SpeculationLoop | None = None
        self.last_used = time.monotonic()

    def cached_tokens(self) -> list[int]:
        """The token ids whose keys/values the target's cache holds."""
        d = self.loop
        return [] if d is None else list(d.history[: d.full.cache.length])

    def cache_lengths(self) -> dict[str, int]:
        """Tokens held by each cache (0 when there is none yet)."""
        d = self.loop
        if d is None:
            return {"target": 0, "retrieval": 0, "draft": 0}
        return {
            "target": d.full.cache.length,
            "retrieval": d.retrieval.cache.length if d.retrieval is not None else 0,
            "draft": d.small.cache.length if d.small is not None else 0,
        }

    def cache_bytes(self) -> int:
        """Memory held by this slot's caches (allocated capacity, all levels)."""
        d = self.loop
        if d is None:
            return 0
        return sum(lane.cache.nbytes() for lane in (d.full, d.retrieval, d.small) if lane is not None)

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        progress_events: bool = False,
        inspect: bool = False,
        boundary: int | None = None,
        answer_start: int | None = None,
        stops: tuple[str, ...] = (),
    ) -> Iterator[Event]:
        """The events of one generation after `prompt_ids` (checks raise here, before anything runs).
        With `inspect`, each `Verified` event carries its `TokenCheck`s; `boundary`: where a
        document ends in the prompt (its K/V kept on disk up to there: `Prefill.prefill_steps`);
        `answer_start`: where a continued answer began in the prompt (`SpeculationLoop.generate`);
        `stops`: texts that end the answer (`prompting.answer_stops`, `decoding.stop_text`).

        Stopped (the generator closed), the caches keep what was committed and stay usable;
        failed (an exception, e.g. out of memory), they are freed, since they may be half-written.
        """
        prompt = [int(i) for i in prompt_ids]
        self.engine.check_prompt(prompt, config)
        self.last_used = time.monotonic()
        return self._generate(prompt, config, on_prefill_progress, progress_events, inspect, boundary, answer_start,
                              stops)

    def _generate(self, prompt, config, on_prefill_progress, progress_events, inspect, boundary,
                  answer_start=None, stops=()) -> Iterator[Event]:
        try:
            loop = self._loop_for(config, len(prompt))
            yield from loop.generate(prompt, on_prefill_progress, progress_events, inspect, boundary, answer_start,
                                     stops)
        except Exception:
            self.release()
            raise
        finally:
            self.last_used = time.monotonic()

    def _loop_for(self, config: GenerationConfig, prompt_len: int) -> SpeculationLoop:
        d = self.loop
        if d is not None and d.config == config:
            if config.sampling.seed is not None:
                d.generator.manual_seed(config.sampling.seed)
            return d
        # New settings: fresh lanes, but the target's cache (the expensive part) carries over.
        generator = make_generator(config.sampling.seed, self.engine.target.device)
        capacity = self.engine.capacity_for(prompt_len, config)
        handover = {} if d is None else {"full_cache": d.full.cache, "history": d.history}
        self.loop = None
        self.loop = self.engine.make_loop(config, capacity, generator, **handover)
        return self.loop

    def release(self) -> None:
        """Free the caches (the next generation prefills from scratch)."""
        self.loop = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class SlotPool:
    """Slots lent to one generation at a time, matched to a prompt by their longest common prefix.

    `take(prompt)` lends the idle slot whose cached tokens share the most with `prompt` when
    they share at least half of what it holds (a new conversation does not wipe a cached
    document for the few tokens of a chat template's preamble); otherwise a new slot. `give_back`
    returns it; beyond `capacity` idle slots, the least recently used are freed. Thread-safe.
    """

    def __init__(self, engine: TriForceEngine, capacity: int = 4):
        if capacity < 0:
            raise ValueError(f"the slot pool's capacity must be >= 0, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self._idle: list[Slot] = []  # least recently used first
        self._lent = 0
        self._lock = threading.Lock()

    def take(self, prompt_ids: Sequence[int]) -> tuple[Slot, int]:
        """A slot for `prompt_ids` and how many of its tokens it already holds."""
        with self._lock:
            best, best_n = None, 0
            for slot in self._idle:
                held = slot.cached_tokens()
                n = common_prefix(held, prompt_ids)
                if n > 0 and 2 * n >= len(held) and n >= best_n:  # ties: the most recently used
                    best, best_n = slot, n
            if best is not None:
                self._idle.remove(best)
            self._lent += 1
        return (best, best_n) if best is not None else (Slot(self.engine), 0)

    def give_back(self, slot: Slot) -> None:
        """Return a lent slot; a slot whose caches were freed (failed) is dropped."""
        with self._lock:
            self._lent -= 1
            if slot.loop is not None:
                self._idle.append(slot)
            evicted = self._idle[: max(0, len(self._idle) - self.capacity)]
            del self._idle[: len(evicted)]
            for old in evicted:
                old.loop = None  # freed when the last reference goes (no collection pause here)

    def discard(self, slot: Slot) -> None:
        """Return a lent slot not worth keeping (an abandoned request): its caches are dropped.

        Safe while its generation is still being closed on the worker: that generator holds
        its own reference until it ends.
        """
        slot.loop = None
        self.give_back(slot)

    def stats(self) -> dict[str, int]:
        """Slots lent now, idle slots and the tokens the idle ones hold."""
        with self._lock:
            return {"lent": self._lent, "idle": len(self._idle),
                    "idle_tokens": sum(s.cache_lengths()["target"] for s in self._idle)}

    def clear(self) -> None:
        """Drop every idle slot's caches."""
        with self._lock:
            for slot in self._idle:
                slot.loop = None
            self._idle = []
