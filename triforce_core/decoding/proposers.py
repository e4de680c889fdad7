"""Proposers: what drafts tokens for the level above to verify, with the law each was drawn from.

    lookup      Lookup (context n-gram match, no model): point masses
    draft       ModelDraft(draft lane)
    retrieval   ModelDraft(retrieval lane)
    triforce    MiddleLevel(retrieval lane, ModelDraft(draft lane), gamma1): TriForce's middle level

Each has `propose(n, committed, speculated, events) -> Proposal` and `commit(committed)`; the model
proposers also have `inspect` (set by the decoder): when on, greedy proposals carry their laws
(softmax at temperature 1) and the middle level's `Verified` events carry `TokenCheck`s. The middle
level verifies what the levels below propose exactly (residual resampling), so each token it
emits follows the retrieval level's law p_mid, the q the target's verification uses.
`RoundProposer` picks, each round, what the target verifies: the lookup or the levels below, and
how many tokens (`schedule.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingConfig
from .events import Drafted, Event, TokenCheck, Verified
from .inspection import greedy_law, token_checks
from .lanes import Lane, RetrievalLane
from .lookup import ContextIndex
from .penalties import NO_PENALTIES, Penalties
from .sampling import row_argmax, sample, verify_greedy, verify_stochastic, warp
from .schedule import DraftSchedule, LookupLength


@dataclass
class Proposal:
    tokens: list[int]
    laws: torch.Tensor | None  # [n, V] law each token was drawn from (None: greedy or point masses;
    #                            greedy with inspect: the softmax each argmax was taken of)
    levels: list[str]
    match: int | None = None  # the lookup's proposal: its backward match (`ContextIndex.propose`); else None
    # The level whose law `laws` is for every token, when one level emitted them all (the middle
    # level: what it accepted of a lookup run or the small draft follows its own law p_mid, so the
    # target's checks name it as their proposer); None: each token's proposer in `levels`.
    law_level: str | None = None


@dataclass
class Counters:
    """Proposed/accepted tokens by verifying level, and by (proposer, verifier) pair."""

    proposed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    pair_proposed: dict[str, int] = field(default_factory=dict)
    pair_accepted: dict[str, int] = field(default_factory=dict)

    def add(self, level: str, levels: list[str], accepted: int) -> None:
        """`levels`: the proposer of each proposed token; the first `accepted` were accepted."""
        self.proposed[level] = self.proposed.get(level, 0) + len(levels)
        self.accepted[level] = self.accepted.get(level, 0) + accepted
        for i, who in enumerate(levels):
            key = f"{who}:{level}"
            self.pair_proposed[key] = self.pair_proposed.get(key, 0) + 1
            self.pair_accepted[key] = self.pair_accepted.get(key, 0) + (i < accepted)


# With `lookup_agree`, a lookup run stops where an occurrence matched at most this many tokens
# shorter than the chosen one continues differently. Replayed offline on document chats
# (`bench.lookup_replay`) the slack mattered little; every occurrence (no slack limit) was
# worse than no cut (docs/benchmarks.md).
RIVAL_SLACK = 2


class Lookup:
    """Context lookup as a proposer: point masses on the continuation of an earlier match."""

    level = "lookup"

    def __init__(self, min_match: int, agree: bool = True, backoff: bool = True):
        self.index = ContextIndex(min_match=min_match, rival_slack=RIVAL_SLACK if agree else None, backoff=backoff)
        self.seconds = 0.0
        self.calls = 0

    def propose(self, n: int, committed: list[int], speculated: list[int], events: list[Event],
                length: LookupLength | None = None) -> Proposal:
        """Up to n tokens; `length` (the target's price of a row) cuts them where they stop paying."""
        t0 = time.perf_counter()
        tokens, match = self.index.propose(committed + speculated if speculated else committed, n)
        if length is not None:
            tokens = tokens[: length.take(match, len(tokens))]
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        if tokens:
            events.append(Drafted(self.level, tuple(tokens)))
        return Proposal(tokens, None, [self.level] * len(tokens), match)

    def commit(self, committed: list[int]) -> None:
        self.index.extend(committed[len(self.index.tokens) :])


class RoundProposer:
    """What the target verifies in a round, and how many tokens: the lookup's proposal where the
    sequence's end recurs in the context, cut where its tokens stop paying for their rows
    (`LookupLength` at `row_cost` of a step), else what the levels below the target (`lower`)
    propose in as many tokens as `DraftSchedule` allows; with neither, a plain target step.
    `update` tells the rule that sized a proposal what the target accepted of it."""

    def __init__(self, lookup: Lookup | None, lower: "ModelDraft | MiddleLevel | None", row_cost: float | None,
                 lookup_max: int, gamma2: int, adaptive: bool):
        self.lookup, self.lower, self.lookup_max = lookup, lower, lookup_max
        self.length = LookupLength(row_cost) if lookup is not None else None
        self.schedule = DraftSchedule(gamma2, adaptive)  # the draft length of the levels below

    def propose(self, committed: list[int], room: int, events: list[Event]) -> Proposal:
        """The round's proposal; `room`: tokens the answer may still take (no rows past its end)."""
        longest = min(self.lookup_max, room - 1)
        if self.lookup is not None and longest > 0:
            proposal = self.lookup.propose(longest, committed, [], events, self.length)
            if proposal.tokens:
                return proposal
        if self.lower is not None:
            n = self.schedule.take()
            if n > 0:
                return self.lower.propose(n, committed, [], events)
        return Proposal([], None, [])

    def update(self, proposal: Proposal, accepted: int) -> None:
        """After the target accepted `accepted` of `proposal`'s tokens."""
        if proposal.match is not None:
            self.length.update(proposal.match, len(proposal.tokens), accepted)
        elif self.lower is not None:
            self.schedule.update(len(proposal.tokens), accepted)


class ModelDraft:
    """A model lane as a draft (the small draft, or the retrieval level drafting for the target):
    up to n tokens sampled from its lane autoregressively (argmax when greedy).

    With `min_confidence`, the proposal stops before the first token whose law gives no token at
    least that probability: an unsure token would mostly be rejected, and each proposed token
    costs the level above a row. The test reads the law, never the drawn token, and a proposal's
    length may depend on anything the proposer computed, so verification stays exact.
    """

    def __init__(self, lane: Lane, level: str, sampling: SamplingConfig, generator: torch.Generator | None,
                 penalties: Penalties | None = None, min_confidence: float = 0.0):
        self.min_confidence = min_confidence
        self.lane = lane
        self.level = level
        self.sampling = sampling
        self.generator = generator
        self.penalties = penalties or NO_PENALTIES  # the loop's, shared by every level
        self.inspect = False

    def propose(self, n: int, committed: list[int], speculated: list[int], events: list[Event]) -> Proposal:
        self.lane.sync(committed, speculated)
        tokens: list[int] = []
        laws: list[torch.Tensor] = []
        logits = self.penalties(self.lane.advance([])[-1:], committed, speculated)[0]  # after both
        for i in range(n):
            if self.sampling.greedy:
                law = greedy_law(logits) if self.inspect or self.min_confidence else None
            else:
                law = warp(logits, self.sampling)
            if self.min_confidence and float(law.max()) < self.min_confidence:
                break
            if self.sampling.greedy:
                t = row_argmax(logits)[0]
            else:
                t = sample(law, self.generator)
            if law is not None and (self.inspect or not self.sampling.greedy):
                laws.append(law)
            tokens.append(t)
            if i < n - 1:
                logits = self.penalties(self.lane.advance([t])[-1:], committed, speculated + tokens)[0]
        if tokens:
            events.append(Drafted(self.level, tuple(tokens)))
        return Proposal(tokens, torch.stack(laws) if laws else None, [self.level] * len(tokens))

    def commit(self, committed: list[int]) -> None:
        self.lane.commit(committed)


class MiddleLevel:
    """TriForce's middle level: the retrieval lane verifies what the levels below it propose, and
    proposes what it emitted to the target.

    Below it: the context lookup where the sequence's end recurs (its whole remaining run), else
    the small draft (gamma1 tokens, fewer where its confidence gate stops it); where neither
    proposes, the retrieval level drafts its own token. Either way each emitted token follows
    the retrieval level's law p_mid.
    """

    level = "retrieval"
    verify = staticmethod(verify_stochastic)  # the exact rule (tests swap in broken ones)

    def __init__(
        self,
        lane: RetrievalLane,
        lower: ModelDraft,
        gamma1: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        counters: Counters,
        lookup: Lookup | None = None,
        min_confidence: float = 0.0,
        penalties: Penalties | None = None,
    ):
        self.min_confidence = min_confidence
        self.penalties = penalties or NO_PENALTIES
        self.lane = lane
        self.lower = lower
        self.lookup = lookup
        self.gamma1 = gamma1
        self.sampling = sampling
        self.generator = generator
        self.counters = counters
        self.inspect = False

    @property
    def inspect(self) -> bool:
        return self._inspect

    @inspect.setter
    def inspect(self, on: bool) -> None:
        """Checks for this level's verifications, and laws from the draft below it."""
        self._inspect = on
        self.lower.inspect = on

    def _lower_proposal(self, room: int, committed, speculated, events) -> Proposal:
        if self.lookup is not None:
            d = self.lookup.propose(room, committed, speculated, events)
            if d.tokens:
                return d
        return self.lower.propose(min(self.gamma1, room), committed, speculated, events)

    def propose(self, n: int, committed: list[int], speculated: list[int], events: list[Event]) -> Proposal:
        tokens: list[int] = []
        levels: list[str] = []
        laws: list[torch.Tensor] = []
        while len(tokens) < n:
            # 1. The lower levels propose: a lookup run, gamma1 small-draft tokens, or nothing.
            d = self._lower_proposal(n - len(tokens), committed, speculated + tokens, events)
            # 2. The retrieval level scores them in one forward: rows predict d_1..d_g and a bonus.
            self.lane.sync(committed, speculated + tokens)
            logits = self.lane.advance(d.tokens)  # [g + 1, V]
            logits = self.penalties(logits, committed, speculated + tokens, d.tokens)  # row i: its own prefix
            # 3. Exact verification against p_mid (a lookup's law is a point mass: d.laws None).
            if self.sampling.greedy:
                r = verify_greedy(d.tokens, logits)
                law = logits[0].float().softmax(-1) if not d.tokens and self.min_confidence else None
                p_mid = greedy_law(logits) if self.inspect else None
            else:
                p_mid = warp(logits, self.sampling)
                r = self.verify(d.tokens, d.laws, p_mid, self.generator)
                law = p_mid[0]
            # 4. Drafting alone, its own token joins the speculation only when its law is sure
            #    (max probability >= min_confidence): an unsure token would mostly be rejected,
            #    and each speculated token costs the target a row. The test reads the law, never
            #    the sampled token, so the kept token still follows p_mid exactly; after a lower
            #    proposal the emitted token is always kept (dropping a residual resample would
            #    bias the law of that position).
            keep = bool(d.tokens) or law is None or float(law.max()) >= self.min_confidence
            if p_mid is not None:
                laws.append(p_mid[: r.accepted + keep])  # the law each emitted token follows
            if d.tokens:
                self.counters.add(self.level, d.levels, r.accepted)
                checks = token_checks(self.level, d.tokens, d.levels, d.laws, p_mid, r) if self.inspect else ()
                events.append(verified_event(self.level, d.tokens, r, checks))
            elif keep:
                events.append(Drafted(self.level, (r.token,)))
            tokens += d.tokens[: r.accepted] + [r.token] * keep
            levels += d.levels[: r.accepted] + [self.level] * keep
            if not keep:
                break
        law = torch.cat(laws)[:n] if laws else None
        return Proposal(tokens[:n], law, levels[:n], law_level=self.level)

    def commit(self, committed: list[int]) -> None:
        self.lower.commit(committed)
        self.lane.commit(committed)


def verified_event(level: str, proposed: list[int], r, checks: tuple[TokenCheck, ...] = ()) -> Verified:
    return Verified(
        level=level,
        accepted=r.accepted,
        rejected_ids=tuple(proposed[r.accepted :]),
        resampled_id=None if r.bonus else r.token,
        proposed=len(proposed),
        bonus_id=r.token if r.bonus else None,
        checks=checks,
    )
