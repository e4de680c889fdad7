"""The prefill half of the speculation loop: make every lane hold the prompt.

`Prefill.prefill_steps` brings every lane to the loop's invariant (see `loop`): each cache
holds the prompt except its last token, which stays pending. The target's full cache keeps
the longest common prefix of what it already holds (prefix reuse for chat), reads whole
blocks from a disk cache where it can, and runs the rest in chunks; the small draft's window
is rebuilt and the retrieval chunks are selected for the prompt's last query.
"""

from __future__ import annotations

import time
from typing import Generator

import torch

from .events import ChunksSelected, Prefilled, PrefillProgress
from ..models.loading import sync_device


class Prefill:
    """The prefill half of `SpeculationLoop`: the attributes it reads are set by
    `SpeculationLoop.__init__` (and `_reset_counters` is the loop's)."""

    def prefill(self, prompt: list[int], on_progress=None, boundary: int | None = None) -> Prefilled:
        """Run `prefill_steps` to the end (for callers that decode with `run` themselves)."""
        steps = self.prefill_steps(prompt, on_progress, boundary)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def prefill_steps(self, prompt: list[int], on_progress=None,
                      boundary: int | None = None) -> Generator[PrefillProgress, None, Prefilled]:
        """Make every lane hold prompt[:-1] (the last prompt token stays pending); after each
        target chunk, calls `on_progress(done, total)` and yields `PrefillProgress(done, total)`
        (new tokens); returns the `Prefilled` event.

        The target's full cache keeps the longest common prefix of what it already holds and
        the new prompt; with a disk cache, whole blocks beyond it are read from disk; only the
        rest is run through the target (prefix reuse for chat), in chunks that end at multiples
        of `prefill_chunk` so that a fresh prefill's whole chunks can be kept on disk. The
        small draft's window is rebuilt and the retrieval chunks are re-selected for the new
        last query. Closed between chunks, the full cache keeps what was prefilled so far, and
        `history` names exactly those tokens (a later prompt reuses them).

        `boundary`: where a document ends in the prompt (prompts that differ only after it share
        everything before it). A chunk then also ends there, and with a disk cache the part
        from the last whole block to it is kept and read back as a tail block (`DiskCache.tail`).
        """
        if not prompt:
            raise ValueError("the prompt is empty")
        t0 = time.perf_counter()
        self.prompt = list(prompt)
        body = self.prompt[:-1]
        chunk = self.config.cache.prefill_chunk
        lane = self.full
        held = self.history[: lane.covered]
        reuse, limit = 0, min(len(held), len(body))
        while reuse < limit and held[reuse] == body[reuse]:
            reuse += 1
        if reuse == len(body) and reuse > 0 and self.retrieval is not None:
            reuse -= 1  # re-feed one token: the retrieval selection needs the last query
        need = len(self.prompt) + self.config.speculation.max_new_tokens + self.margin
        cache = lane.cache
        cache.make_room(need)
        stop = boundary if boundary is not None and 0 < boundary < len(body) else None  # the document's end
        blocks, tail = [], None
        if self.disk is not None:
            blocks = self.disk.blocks(body, chunk, cache.dtype, cache.device, self.target.arithmetic)
            if stop is not None:
                tail = self.disk.tail(body, stop, chunk, cache.dtype, cache.device, self.target.arithmetic)
        disk_tokens = 0
        if blocks or tail is not None:
            reuse, disk_tokens = self._read_disk(blocks, reuse, len(body), tail)
        cache.truncate(reuse)
        lane.covered, lane.fed, lane.pending = reuse, [], []
        self.history = body[:reuse]  # == what the full cache holds, after every chunk
        total = len(body) - reuse
        protect = {b.key for b in blocks} | ({tail.key} if tail is not None else set())
        queries = None
        at = reuse
        while at < len(body):
            end = min(len(body), (at // chunk + 1) * chunk)  # [at, end): up to the next multiple
            if stop is not None and at < stop < end:
                end = stop  # the document's end closes a chunk too
            part = body[at:end]
            whole = end - at == chunk and cache.canonical == at
            is_tail = tail is not None and (at, end) == (tail.start, tail.end) and cache.canonical == at
            q = lane.prefill(part, chunk, capture_last=end == len(body) and self.retrieval is not None)
            self.history += part
            queries = q if q is not None else queries
            if whole or is_tail:
                cache.canonical = end
                if whole and blocks:
                    self.disk.save(cache, blocks[at // chunk], protect)
                if is_tail:
                    self.disk.save(cache, tail, protect)
            at = end
            if on_progress is not None:
                on_progress(at - reuse, total)
            yield PrefillProgress(at - reuse, total, reuse)
        lane.pending = self.prompt[-1:]
        self.history = list(self.prompt)
        if self.small is not None:
            small = self.small
            small.cache.truncate(0)
            small.cache.evicted = 0
            small.covered, small.fed, small.pending = 0, [], []
            small.prefill(body, chunk)
            small.pending = self.prompt[-1:]
        if self.retrieval is not None:
            self._select(queries)
        if self.lookup is not None:
            self.lookup.index.reset(self.prompt)
        self._reset_counters()
        sync_device(self.target.device)
        return Prefilled(tokens=len(self.prompt) - reuse, seconds=time.perf_counter() - t0, reused_tokens=reuse,
                         disk_tokens=disk_tokens)

    def _read_disk(self, blocks: list, reuse: int, body_len: int, tail=None) -> tuple[int, int]:
        """Read the blocks beyond what the cache holds in memory; returns (reuse, tokens read).

        Blocks are read from the first one the cache does not hold canonically, up to the last
        that ends before the prompt's final body token (its query is needed: see `reuse -= 1`);
        with a `tail` (a document's end), up to the tail's start, then the tail: a whole block
        across the document's end was computed in other chunks than this prefill's.
        """
        cache = self.full.cache
        chunk = self.config.cache.prefill_chunk
        first = min(reuse, cache.canonical) // chunk
        end = first
        while (end < len(blocks) and (blocks[end].end <= tail.start if tail is not None else blocks[end].end < body_len)
               and self.disk.has(blocks[end])):
            end += 1
        with_tail = tail is not None and end * chunk == tail.start and tail.end < body_len and self.disk.has(tail)
        if (tail.end if with_tail else end * chunk) <= reuse:
            return reuse, 0
        cache.truncate(first * chunk)
        read = self.disk.load(cache, blocks, first, end)
        if with_tail and read == (end - first) * chunk:
            read += self.disk.load(cache, [tail], 0, 1)
        return first * chunk + read, read

    def _select(self, queries: torch.Tensor | None) -> None:
        if queries is None:  # a one-token prompt: nothing is cached, the selection is empty
            shape = self.target.spec
            queries = torch.zeros(shape.num_layers, shape.num_heads, shape.head_dim, device=self.target.device)
        sel = self.retrieval.reselect(queries, self.prompt)
        self.selection_event = self._selection_event(sel, 0)

    def _selection_event(self, sel, step: int) -> ChunksSelected:
        spans = sel.spans()
        shape = self.target.spec
        return ChunksSelected(
            step=step,
            chunk_size=sel.chunk_size,
            chunk_token_spans=tuple((a, b) for a, b, _ in spans),
            scores_or_counts=tuple(n for _, _, n in spans),
            context_tokens=sel.upto,
            budget=self.config.cache.budget,
            heads_total=shape.num_layers * shape.num_kv_heads,
            dense=sel.dense,
        )
