"""How many tokens a round proposes: the levels below the target's draft, and a lookup's."""

from __future__ import annotations

import bisect


class DraftSchedule:
    """How many tokens the levels below the target draft in a round (0: a plain target step).

    Fixed (the paper): always `longest`. Adaptive: `longest` at first; after a draft the target
    took whole, one more (up to `longest`); after a partial one, as many as were accepted;
    after a draft with nothing accepted, `pause` plain target steps and then a one-token draft,
    the pause doubling with each such miss in a row (1, 2, 4, .. 16 steps) and reset by any
    accepted token. Drafting costs a forward of the lower level per token and the target a
    verification row each, so where the lower level keeps missing (e.g. sampling from a flat
    law) rounds fall back to about the price of autoregressive decoding, and where it hits the
    draft grows back. Exact: a proposal's length may depend on anything already decided.
    """

    MAX_PAUSE = 16

    def __init__(self, longest: int, adaptive: bool):
        self.longest, self.adaptive = longest, adaptive
        self.length, self.pause, self.next_pause = longest, 0, 1

    def take(self) -> int:
        """The draft length of this round."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length

    def update(self, proposed: int, accepted: int) -> None:
        """After the target accepted `accepted` of `proposed` drafted tokens."""
        if not self.adaptive or proposed == 0:
            return
        if accepted == 0:
            self.length, self.pause = 1, self.next_pause
            self.next_pause = min(2 * self.next_pause, self.MAX_PAUSE)
            return
        self.next_pause = 1
        self.length = min(self.longest, proposed + 1) if accepted == proposed else accepted


class LookupLength:
    """How many tokens of a lookup proposal the target verifies (0: a plain target step).

    A proposed token adds a token to the round only when every token before it is accepted too,
    and it costs a verification row, `row_cost` of a step (`row_cost.py`, measured per machine).
    So the proposal keeps its j-th token while P(the first j accepted) >= row_cost::

        P(first j accepted) = a(m) * a(m + 1) * ... * a(m + j - 1)

    where m is the proposal's backward match (`lookup.ContextIndex`: how many tokens before the
    copied place equal the sequence's end) and a(n) the chance that a token copied after an
    n-token match is the target's own: once the first tokens of a copy are accepted, the match
    is that much longer. a(n) is counted in this generation, by buckets of n (BUCKETS), from a
    prior of PRIOR_WEIGHT tokens at PRIOR's rate: the acceptance of a proposal's first token by
    its match on SmolLM2's recorded document chats (`bench.lookup_replay`: 20 workloads, greedy
    with and without a repetition penalty), made non-decreasing. A first token is the least
    sure of a proposal, so the prior is cautious about the later ones until this generation's
    copies are taken. Worked example, row_cost 0.4, no outcomes yet::

        match 3:  a(3) = 0.45                     -> 1 token (then 0.45 * 0.55 = 0.25 < 0.4)
        match 5:  0.65, 0.42, 0.27                -> 2 tokens
        match 8:  0.85, 0.72, 0.61, 0.52, 0.47, 0.42, 0.38   -> 6 tokens
        match 2 (a backoff token): 0.4            -> 1 token; at row_cost 0.45, none

    The length depends only on the sequence so far and row_cost, so the proposal stays exact
    and a seeded sampled generation reproducible.
    """

    BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # a match n counts in the last bucket <= n
    PRIOR = (0.2, 0.4, 0.45, 0.55, 0.65, 0.65, 0.85, 0.9, 0.95)
    PRIOR_WEIGHT = 4.0

    def __init__(self, row_cost: float, prior: tuple[float, ...] = PRIOR, weight: float = PRIOR_WEIGHT,
                 learn: bool = True):
        if not row_cost >= 0:
            raise ValueError(f"row_cost must be >= 0, got {row_cost}")
        if len(prior) != len(self.BUCKETS) or weight <= 0:
            raise ValueError(f"a prior of {len(self.BUCKETS)} rates and a weight > 0, got {len(prior)} and {weight}")
        self.row_cost = row_cost
        self.learn = learn
        self.hits = [p * weight for p in prior]
        self.tries = [weight] * len(prior)

    def rate(self, match: int) -> float:
        """a(match): the chance that a token copied after a match this long is accepted."""
        b = max(0, bisect.bisect_right(self.BUCKETS, match) - 1)
        return self.hits[b] / self.tries[b]

    def take(self, match: int, offered: int) -> int:
        """How many of `offered` tokens, proposed after a backward match of `match`, to verify."""
        p = 1.0
        for j in range(offered):
            p *= self.rate(match + j)
            if p < self.row_cost:
                return j
        return offered

    def update(self, match: int, proposed: int, accepted: int) -> None:
        """After the target accepted `accepted` of `proposed` tokens offered after `match`: each
        token up to the first rejected one was tried (the ones after it were not)."""
        if not self.learn:
            return
        for j in range(min(accepted + 1, proposed)):
            b = max(0, bisect.bisect_right(self.BUCKETS, match + j) - 1)
            self.tries[b] += 1
            self.hits[b] += j < accepted
