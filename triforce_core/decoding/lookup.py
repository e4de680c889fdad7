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

Every proposed token costs the target a verification row, whether or not it is accepted, so a
cut where the text is unsure pays (replayed on recorded document chats, `bench.lookup_replay`,
and live, `bench.chat`: docs/benchmarks.md). Considering every occurrence as a rival, however
short its match, was worse than no cut.

With `backoff`, where the last `min_match` tokens never occurred before, their last
`min_match - 1` are looked up instead, and when every earlier occurrence of those (the most
recent `max_candidates`) continues with the same token, that one token is proposed: where the
earlier occurrences agree, the target takes such a token often enough to pay for its row
(docs/benchmarks.md).
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
    backoff         with no match, one token where every occurrence of the last min_match - 1
                    tokens continues alike (the match length returned is then min_match - 1)
    """

    def __init__(self, min_match: int = 2, max_match: int = 32, max_candidates: int = 64,
                 rival_slack: int | None = 2, backoff: bool = False):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if rival_slack is not None and rival_slack < 0:
            raise ValueError(f"rival_slack must be >= 0 or None, got {rival_slack}")
        self.min_match = min_match
        self.rival_slack = rival_slack
        self.backoff = backoff and min_match >= 2
        self.max_match = max(max_match, min_match)
        self.max_candidates = max_candidates
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._short: dict[tuple[int, ...], list[int]] = defaultdict(list)  # (min_match - 1)-grams, for backoff
        self._indexed = 0  # continuation starts below this are in the index

    def reset(self, tokens: list[int]) -> None:
        """Index `tokens` from scratch (a new prompt)."""
        self.tokens = []
        self._starts.clear()
        self._short.clear()
        self._indexed = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens and index every n-gram that now has a continuation."""
        self.tokens += tokens
        n, seq = self.min_match, self.tokens
        for i in range(max(n, self._indexed), len(seq)):
            self._starts[tuple(seq[i - n : i])].append(i)
        if self.backoff:
            for i in range(max(n - 1, self._indexed), len(seq)):
                self._short[tuple(seq[i - n + 1 : i])].append(i)
        self._indexed = max(self._indexed, len(seq))

    def candidates(self, seq: list[int], short: bool = False) -> list[tuple[int, int]]:
        """(continuation start, backward match length) of the most recent `max_candidates`
        earlier occurrences of seq's suffix of min_match tokens (`short`: min_match - 1, with
        backoff), most recent first. `seq` must extend the indexed tokens (committed +
        speculative)."""
        n = self.min_match - short
        if len(seq) < n or (short and not self.backoff):
            return []
        starts = (self._short if short else self._starts).get(tuple(seq[-n:]))
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
        or (-1, 0)."""
        return _best(self.candidates(seq))

    def propose(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `seq` by lookup, and the match length (0: no proposal)."""
        found = self.candidates(seq) if k > 0 else []
        if not found:
            return self._backoff(seq) if k > 0 else ([], 0)
        start, length = _best(found)
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

    def _backoff(self, seq: list[int]) -> tuple[list[int], int]:
        """One token where every occurrence of seq's last min_match - 1 tokens continues alike."""
        found = self.candidates(seq, short=True)
        firsts = {seq[i] if i < len(seq) else None for i, _ in found}
        if len(firsts) != 1 or None in firsts:
            return [], 0
        return [firsts.pop()], self.min_match - 1


def _best(found: list[tuple[int, int]]) -> tuple[int, int]:
    """The longest backward match, the most recent among equals (`found` is most recent first)."""
    return max(found, key=lambda c: c[1]) if found else (-1, 0)
