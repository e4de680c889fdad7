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
"""

from __future__ import annotations

from collections import defaultdict


class ContextIndex:
    """An n-gram index over a token sequence, grown as tokens are committed.

    min_match       tokens of suffix that must match for a proposal (the n-gram length)
    max_match       backward match counted up to this many tokens (ranks the candidates)
    max_candidates  most recent occurrences of the n-gram examined per query
    """

    def __init__(self, min_match: int = 2, max_match: int = 32, max_candidates: int = 64):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.min_match = min_match
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

    def match(self, seq: list[int]) -> tuple[int, int]:
        """(continuation start, match length) of the best earlier occurrence of seq's suffix,
        or (-1, 0). `seq` must extend the indexed tokens (committed + speculative)."""
        n = self.min_match
        if len(seq) < n:
            return -1, 0
        starts = self._starts.get(tuple(seq[-n:]))
        if not starts:
            return -1, 0
        best, best_len = -1, 0
        end = len(seq)
        for i in reversed(starts[-self.max_candidates :]):
            if i >= end:  # cannot happen for committed-only entries; kept for safety
                continue
            m = n
            while m < self.max_match and m < i and seq[i - m - 1] == seq[end - m - 1]:
                m += 1
            if m > best_len:
                best, best_len = i, m
                if m >= self.max_match:
                    break
        return best, best_len

    def propose(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `seq` by lookup, and the match length (0: no proposal)."""
        start, length = self.match(seq)
        if start < 0 or k <= 0:
            return [], 0
        out: list[int] = []
        base = len(seq)
        for j in range(k):
            src = start + j
            out.append(seq[src] if src < base else out[src - base])
        return out, length
