"""Lanes: one model running over one cache, knowing which token ids the cache holds.

After any verification a lane rolls back to the longest common prefix of what it fed and the
current path by setting the cache's length (O(1)). Three kinds: the target over its full
cache (`Lane`), the small draft over its StreamingLLM cache (`StreamingLane`: sinks + a recent
window, prefilled with only what it keeps), and the target's weights over the retrieval cache
(`RetrievalLane`: committed K/V copied from the full cache, chunks re-selected on demand).

Invariant between rounds: a lane's cache holds the committed sequence except its last token,
which is "pending" and is the first input of the lane's next forward.
"""

from __future__ import annotations

import time

import torch

from ..kv import KVStore, RetrievalCache, StreamingCache
from ..models.transformer import Transformer, KeyMass


class Lane:
    """One model over one cache.

    covered  committed tokens accounted for by the cache (for the streaming cache some of them
             were skipped or evicted on purpose)
    fed      tokens fed since the last commit, in order (their KV follows the covered part)
    pending  tokens of the current path not yet fed
    """

    def __init__(self, model: Transformer, cache: KVStore, vocab_size: int):
        self.model = model
        self.cache = cache
        self.vocab_size = vocab_size  # laws are padded/cut to the target's vocabulary
        self.covered = 0
        self.fed: list[int] = []
        self.pending: list[int] = []
        self.seconds = 0.0  # time in decoding forwards (what a round costs at this level)
        self.forwards = 0

    def sync(self, committed: list[int], speculated: list[int]) -> None:
        """Make the lane's path committed + speculated: keep the common prefix, drop the rest."""
        tail = committed[self.covered :] + speculated
        lcp = 0
        limit = min(len(self.fed), len(tail) - 1)  # at least one token stays pending
        while lcp < limit and self.fed[lcp] == tail[lcp]:
            lcp += 1
        self.cache.truncate(self.cache.length - (len(self.fed) - lcp))
        del self.fed[lcp:]
        self.pending = tail[lcp:]

    def advance(self, extra: list[int], capture_queries: bool = False, key_mass: KeyMass | None = None):
        """Feed pending + extra; return logits [len(extra) + 1, V] predicting after the last
        pending token and after each extra token (and the forward's queries if asked)."""
        ids = self.pending + extra
        if not ids:
            raise RuntimeError("lane has nothing to feed")
        t0 = time.perf_counter()
        first_row = len(self.pending) - 1 if self.pending else 0
        self.cache.reserve(len(ids))
        start = self.covered + len(self.fed)
        positions = self.cache.positions(start, len(ids))
        out = self.model.forward(
            torch.tensor(ids, device=self.model.device),
            positions,
            self.cache,
            logits_rows=slice(first_row, None),
            capture_queries=capture_queries,
            key_mass=key_mass,
        )
        self.fed += ids
        self.pending = []
        logits = _fit_vocab(out.logits, self.vocab_size)
        self.seconds += time.perf_counter() - t0  # CPU: synchronous; CUDA: launch + the logits' sync
        self.forwards += 1
        return (logits, out.queries, first_row) if capture_queries else logits

    def commit(self, committed: list[int]) -> None:
        """After a round: keep only committed tokens; the last committed token stays pending."""
        self.sync(committed, [])
        self.covered += len(self.fed)
        self.fed = []

    def prefill(self, tokens: list[int], chunk: int, capture_last: bool = False):
        """Feed committed tokens in chunks without computing logits.

        With capture_last, return the post-rope queries [L, H, D] of the last token fed.
        """
        queries = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            self.cache.reserve(len(part))
            positions = self.cache.positions(self.covered, len(part))
            last = capture_last and i + chunk >= len(tokens)
            out = self.model.forward(
                torch.tensor(part, device=self.model.device), positions, self.cache, logits_rows=None,
                capture_queries=last,
            )
            self.covered += len(part)
            if last:
                queries = out.queries[:, -1]
        return queries


class StreamingLane(Lane):
    """The small draft over its StreamingLLM cache."""

    cache: StreamingCache

    def prefill(self, tokens: list[int], chunk: int) -> None:
        c = self.cache
        skip_to = len(tokens) - c.window  # only sinks + the last `window` tokens matter
        if skip_to > c.sinks:
            self._absorb(tokens[: c.sinks], chunk)
            self.covered += skip_to - c.sinks
            c.evicted += skip_to - c.sinks
            tokens = tokens[skip_to:]
        self._absorb(tokens, chunk)

    def _absorb(self, tokens: list[int], chunk: int) -> None:
        """Feed committed tokens, compacting whenever the cache runs out of room."""
        c = self.cache
        while tokens:
            if c.room <= 0:
                c.compact(force=True)
            n = min(len(tokens), c.room, chunk)
            super().prefill(tokens[:n], n)
            tokens = tokens[n:]

    def commit(self, committed: list[int]) -> None:
        super().commit(committed)
        c = self.cache
        c.compact()
        backlog = self.pending[:-1]
        if len(backlog) > c.margin // 2:  # e.g. a new user turn: absorb it like a prefill
            self.pending = self.pending[-1:]
            skip = max(0, len(backlog) - c.window)  # older tokens would be evicted anyway
            self.covered += skip
            c.evicted += skip
            self._absorb(backlog[skip:], c.window)


class RetrievalLane(Lane):
    """The target's weights over the retrieval cache; committed KV is copied from the full cache."""

    cache: RetrievalCache

    def commit(self, committed: list[int]) -> None:
        c = self.cache
        c.truncate(c.length - len(self.fed))
        self.fed = []
        end = len(committed) - 1
        c.append_from_full(self.covered, end)
        self.covered = end
        self.pending = committed[end:]

    def reselect(self, queries: torch.Tensor, committed: list[int], mass: torch.Tensor | None = None):
        self.fed = []
        sel = self.cache.select(queries, len(committed) - 1, mass)
        self.covered = sel.upto
        self.pending = committed[sel.upto :]
        return sel


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Cut or pad (with -inf) a draft's logits to the target's vocabulary size."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
