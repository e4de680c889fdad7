"""How many tokens the levels below the target draft in a round."""

from __future__ import annotations


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
        self.length, self.pause, self.backoff = longest, 0, 1

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
            self.length, self.pause = 1, self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_PAUSE)
            return
        self.backoff = 1
        self.length = min(self.longest, proposed + 1) if accepted == proposed else accepted
