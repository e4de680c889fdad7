"""Context lookup: a proposer with no model.

When a long document is in the context, the target often copies from it (a quoted passage, a
name, a code line) or from the conversation and its own answer. The cheapest draft of such a
continuation is the text itself: find where the sequence's last tokens occurred before, and
propose what followed them there. Its proposal law is a point mass on the proposed token, so
it is verified exactly like any draft (`sampling.verify_stochastic` with ``q=None``).

The rule, with ``min_match = 2``::

    sequence   a b c d x y z a b c
    suffix                   . b c        the last 2 tokens, looked up in the index
    candidates     ^ (after "b c" at 1..2: continuation starts at 3)
    match          a b c = 3 tokens long (counted backwards, up to `max_match`)
    proposal   d x y z a b c d ...        copied from position 3 on; a continuation that
                                          reaches the end of the sequence runs on into its
                                          own proposal (a repeating loop is followed)

Among several earlier occurrences the longest backward match wins; ties go to the most recent
one. Only tokens `extend`-ed into the index (the committed sequence) are searched; the query
may end in speculative tokens.

The other occurrences are rivals when their backward match is nearly as long (at most
`rival_slack` tokens shorter). Where a rival's continuation parts from the winner's, the text
itself is unsure what comes next, and the proposal stops there (keeping at least one token)::

    sequence   p q r s t . . . q r s u . . . p q r s
    winner     p q r s -> t .            (match 4)
    rival            q r s -> u          (match 3, within the slack of 2: "t" and "u" differ)
    proposal   t                         (cut where the two continuations part)

Every proposed token costs the target a verification row, whether or not it is accepted. On
SmolLM2's document chat (`bench.chat`, six questions at 2K-8K, eight workloads replayed
offline with the measured cost of a forward by rows) the cut raised lookup's speed over
autoregressive decoding by 3 % on their geometric mean, and the run measured in one process
likewise (README, Benchmarks). Considering every occurrence as a rival, however short its
match, was worse than no cut.
"""

from __future__ import annotations

from collections import defaultdict


class ContextIndex:
    """An n-gram index over a token sequence, grown as tokens are committed.

    min_match       tokens of suffix that must match for a proposal (the n-gram length)
    max_match       backward match counted up to this many tokens (ranks the candidates)
    max_candidates  most recent occurrences of the n-gram examined per query
    rival_slack     a proposal stops where an occurrence matched at most this many tokens
                    shorter than the winner continues differently (None: never cut)
    """

    def __init__(self, min_match: int = 2, max_match: int = 32, max_candidates: int = 64,
                 rival_slack: int | None = 2):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if rival_slack is not None and rival_slack < 0:
            raise ValueError(f"rival_slack must be >= 0 or None, got {rival_slack}")
        self.min_match = min_match
        self.rival_slack = rival_slack
        self.max_match = max(max_match, min_match)
        self.max_candidates = max_candidates
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._indexed = 0  # continuation starts below this are in the index

    def reset(self, tokens: list[int]) -> None:
        """Index `tokens` from scratch (a new prompt)."""
        self.tokens = []
        self._starts.clear()
        self._indexed = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens and index every n-gram that now has a continuation."""
        self.tokens += tokens
        n, seq = self.min_match, self.tokens
        for i in range(max(n, self._indexed), len(seq)):
            self._starts[tuple(seq[i - n : i])].append(i)
        self._indexed = max(self._indexed, len(seq))

    def candidates(self, seq: list[int]) -> list[tuple[int, int]]:
        """(continuation start, backward match length) of the most recent `max_candidates`
        earlier occurrences of seq's suffix, most recent first. `seq` must extend the indexed
        tokens (committed + speculative)."""
        n = self.min_match
        if len(seq) < n:
            return []
        starts = self._starts.get(tuple(seq[-n:]))
        if not starts:
            return []
        end, out = len(seq), []
        for i in reversed(starts[-self.max_candidates :]):
            if i >= end:  # cannot happen for committed-only entries; kept for safety
                continue
            m = n
            while m < self.max_match and m < i and seq[i - m - 1] == seq[end - m - 1]:
                m += 1
            out.append((i, m))
        return out

    def match(self, seq: list[int]) -> tuple[int, int]:
        """(continuation start, match length) of the best earlier occurrence of seq's suffix,
        or (-1, 0): the longest backward match, the most recent among equals."""
        best, best_len = -1, 0
        for i, m in self.candidates(seq):
            if m > best_len:
                best, best_len = i, m
        return best, best_len

    def propose(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `seq` by lookup, and the match length (0: no proposal)."""
        found = self.candidates(seq) if k > 0 else []
        if not found:
            return [], 0
        start, length = max(found, key=lambda c: c[1])  # the first of the longest: the most recent
        base = len(seq)

        def at(p: int) -> int:  # seq, then the proposal: a continuation may run into its own proposal
            return seq[p] if p < base else out[p - base]

        out: list[int] = []
        for j in range(k):
            out.append(at(start + j))
        keep = k
        if self.rival_slack is not None:
            for i, m in found:
                if i == start or m < length - self.rival_slack:
                    continue
                j = 0
                while j < keep and at(i + j) == out[j]:
                    j += 1
                keep = max(j, 1)
        return out[:keep], length
        return out, length
