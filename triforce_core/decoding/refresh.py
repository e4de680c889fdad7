"""When the retrieval level re-selects its chunks, and what a selection ranks them by.

The retrieval cache holds a selection of the context's chunks (`kv.retrieval`). After a round
the retrieval lane either takes the newly committed tokens on or selects again: when its cache
has no room for another round, or (unless the whole context fits the budget, where a selection
chooses nothing) `refresh_every` tokens after the last selection, or when the target's
acceptance of the levels below, over the last `RECENT_ROUNDS` rounds they proposed, falls below
`refresh_acceptance`. With `select_by="attention"` a selection ranks the chunks by the attention
the full target gave them in its recent verifications (`KeyMass`, decayed per round); otherwise
by the freshest query against each chunk's mean key.
"""

from __future__ import annotations

from collections import deque

import torch

from ..config import CacheConfig
from ..models.transformer import KeyMass
from .lanes import RetrievalLane
from .proposers import Proposal


class RetrievalRefresh:
    """The refresh policy of one generation: what it has seen since the last selection."""

    RECENT_ROUNDS = 4
    # Per round, what the target attended to so far counts this much less: a refresh follows the
    # recent verifications (a half-life of about 7 rounds).
    MASS_DECAY = 0.9

    def __init__(self, lane: RetrievalLane, cache: CacheConfig, margin: int):
        self.lane, self.cache, self.margin = lane, cache, margin
        self.follow = cache.select_by == "attention"
        self.since_select = 0  # tokens committed since the last selection
        self.recent: deque[float] = deque(maxlen=self.RECENT_ROUNDS)  # the target's acceptance, by round
        self.mass: torch.Tensor | None = None  # [L, Hkv, n_chunks] decayed attention mass
        self.count = 0  # selections made during decoding

    def probe(self, proposal: Proposal) -> KeyMass | None:
        """Where the target's verification of `proposal` should report the attention each chunk
        received: not for a lookup's proposal (copying needs no retrieval, and reading its many
        rows' weights would cost the default's most common round), nor while the whole context
        fits the budget (no selection then chooses anything)."""
        if self.follow and proposal.match is None and not self.lane.cache.selection.dense:
            return KeyMass(self.cache.chunk_size)
        return None

    def verified(self, proposal: Proposal, accepted: int, probe: KeyMass | None, first_row: int) -> None:
        """After the target accepted `accepted` of `proposal`'s tokens in a forward whose
        proposal rows start after `first_row`: the levels below are watched, not lookups."""
        if proposal.tokens and proposal.match is None:
            self.recent.append(accepted / len(proposal.tokens))
        if probe is not None and probe.layers:  # rows of the committed positions only
            self._attended(probe, first_row + 1 + accepted)

    def commit(self, committed: list[int], new: int, queries: torch.Tensor, row: int):
        """Bring the retrieval lane to `committed` (`new` tokens more): take them on, or select
        again from the query of `row` (the row that produced the last committed token, the
        freshest position). Returns the selection when one was made, else None."""
        lane, cc = self.lane, self.cache
        self.since_select += new
        backlog = len(committed) - 1 - lane.covered
        full_up = lane.cache.length - len(lane.fed) + backlog + self.margin > lane.cache.capacity
        stale = cc.refresh_every > 0 and self.since_select >= cc.refresh_every
        low = (cc.refresh_acceptance > 0 and len(self.recent) == self.recent.maxlen
               and sum(self.recent) / len(self.recent) < cc.refresh_acceptance)
        if not (full_up or ((stale or low) and not lane.cache.selection.dense)):
            lane.commit(committed)
            return None
        self.count += 1
        self.since_select = 0
        self.recent.clear()
        return lane.reselect(queries[:, row], committed, self.mass)

    def _attended(self, probe: KeyMass, rows: int) -> None:
        """Add the attention mass the target's first `rows` query rows gave each chunk."""
        mass = torch.stack([m[:, :rows].sum(dim=1) for m in probe.layers])  # [L, Hkv, n_chunks]
        old = self.mass
        if old is not None:
            n = min(old.shape[2], mass.shape[2])
            mass[:, :, :n] += self.MASS_DECAY * old[:, :, :n]
        self.mass = mass
