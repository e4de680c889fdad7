"""Repetition control: a logits processor that is a function of each position's own prefix.

Three penalties, all over the tokens of the *answer so far* (what this generation produced
before the position, never the prompt: in document chat the prompt is the document, and an
answer that quotes it, which context lookup makes cheap, must not be pushed away from it):

    repetition_penalty  r   Hugging Face's RepetitionPenaltyLogitsProcessor (Keskar et al. 2019):
                            a token already in the answer has its logit divided by r when
                            positive, multiplied by r when negative (1 = off)
    frequency_penalty   f   OpenAI's: minus f times the token's count in the answer (0 = off)
    presence_penalty    a   OpenAI's: minus a once the token is in the answer (0 = off)

applied in that order to raw logits, before temperature, top-k and top-p (as Hugging Face runs
processors before warpers).

Why decoding stays exact: the processed law of a position depends only on that position's
prefix, so it is just another target law, and every level computes it for each of its rows
from that row's own prefix -- the committed answer plus the tokens drafted before it inside
the round. The target's verification then checks each drafted token against exactly the law
autoregressive decoding with the same penalty would have used there; greedy speculation equals
greedy autoregressive decoding, and speculative sampling samples exactly from the processed
target law. (Stochastic exactness needs only the target's rows to be right, since the rule is
exact for whatever law the proposer really drew from; the lower levels apply the same penalty
so that they propose what the target will accept.)

Worked example: answer so far [7, 9, 7], a round drafting [9, 4], presence 1: row 0 (after
[7, 9, 7]) lowers 7 and 9; row 1 (after [.., 9]) the same; row 2 (after [.., 9, 4]) also 4.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import SamplingConfig


class Penalties:
    """The penalties of a `SamplingConfig` for one generation, applied row by row.

    `start`: where the answer begins in a path (the prompt's length); the decoder sets it at the
    start of each generation, and every level shares this one object.
    """

    def __init__(self, sampling: SamplingConfig):
        self.repetition = sampling.repetition_penalty
        self.frequency = sampling.frequency_penalty
        self.presence = sampling.presence_penalty
        self.start = 0

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    def __call__(self, logits: torch.Tensor, committed: Sequence[int], speculated: Sequence[int] = (),
                 extra: Sequence[int] = ()) -> torch.Tensor:
        """logits [R, V]: row r predicts the token after committed + speculated + extra[:r] -> processed [R, V].

        (The parts come apart so that nothing is copied when no penalty is on.)"""
        if not self.active:
            return logits
        answer = list(committed[self.start :]) + list(speculated)
        return penalize(logits, answer, list(extra), self.repetition, self.frequency, self.presence)


NO_PENALTIES = Penalties(SamplingConfig())  # for proposers built without the loop's processor


def penalize(logits: torch.Tensor, answer: list[int], extra: list[int], repetition: float = 1.0,
             frequency: float = 0.0, presence: float = 0.0) -> torch.Tensor:
    """The pure function: logits [R, V], row r following the answer tokens answer + extra[:r].

    Only the columns of tokens seen in the answer change; those are gathered, so a row costs
    O(tokens seen), not O(V). Float32 whatever the logits' dtype (a bf16 logit is exact in it).
    """
    rows = logits.shape[0]
    seen = answer + extra[: rows - 1]  # the last row's prefix; row r sees its first len(answer) + r
    out = logits.float()
    if not seen:
        return out
    ids = torch.tensor(seen, device=logits.device)
    cols, which = torch.unique(ids, return_inverse=True)  # [U], [N]
    counts = torch.zeros(rows, cols.numel(), device=logits.device)  # [R, U]
    n0 = len(answer)
    if n0:
        counts += torch.bincount(which[:n0], minlength=cols.numel()).float()
    if rows > 1 and len(seen) > n0:
        step = torch.zeros(rows, cols.numel(), device=logits.device)
        step[torch.arange(1, 1 + len(seen) - n0, device=logits.device), which[n0:]] = 1.0
        counts += step.cumsum(0)  # row r adds extra[:r]
    present = counts > 0
    x = out[:, cols]  # [R, U] (a copy)
    if repetition != 1.0:
        x = torch.where(present, torch.where(x < 0, x * repetition, x / repetition), x)
    if frequency != 0.0:
        x = x - frequency * counts
    if presence != 0.0:
        x = x - presence * present.float()
    out = out.clone() if out is logits else out
    out[:, cols] = x
    return out
