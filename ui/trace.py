"""One answer's events, accumulated into what the app shows. Pure: no model, no server.

`AnswerTrace.push(event, now)` folds the engine's events (see `triforce_core.decoding.events`) into

- `segments`: the answer as coloured pieces, with the teaching view's extras (rejected draft
  tokens and round boundaries) marked so a renderer can show or hide them;
- `rounds`: per target forward, how many tokens were proposed and accepted at each level;
- `selections`: every retrieval selection (`ChunksSelected`), the latest last;
- `prefill` and `stats` (the `Prefilled` and `Finished` payloads);
- `waited_s`: seconds of decoding spent waiting for Step (set by the app from its job; the
  engine's decode clock runs on while a stepped generation waits), left out of `tokens_per_s`.

How rejected tokens are placed. In one round the retrieval level builds a speculation
out of the lower levels' proposals (`Drafted("lookup")` or `Drafted("draft")`, then
`Verified("retrieval")`) and its own tokens (`Drafted("retrieval")`); a lower-level token it rejects belonged at a known offset of that speculation. The target then verifies
the speculation (`Verified("target")`): its rejected tail starts at offset `accepted`. The
round's `Committed` tokens are speculation[:accepted] plus the target's own token, so both
kinds of rejection can be drawn where they happened, struck through, before the token that
replaced them. Nothing is re-derived from text: only the events are read.

With `inspect=True` generations, each segment also keeps the `TokenCheck`s that concern it
(its own verifications, lowest level first) and, for a token a verifier drew itself after a
rejection, the check of the token it replaced (`drawn_from`): what the inspector shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from triforce_core.detokenize import IncrementalDetokenizer
from triforce_core.decoding.events import (
    ChunksSelected, Committed, Drafted, Finished, GenerationStats, Prefilled, TokenCheck, Verified,
)


@dataclass(frozen=True)
class Segment:
    kind: str  # "token" (committed), "rejected" (a discarded proposal) or "round" (a round begins)
    text: str = ""
    level: str = ""  # who proposed it: lookup | draft | retrieval | target
    note: str = ""  # hover text
    token_id: int = -1
    checks: tuple[TokenCheck, ...] = ()  # this token's verifications, lowest level first (inspect)
    drawn_from: TokenCheck | None = None  # the rejection this token replaced (inspect)
    round: int = 0  # 1-based round the segment belongs to
    rejected_by: str = ""  # for a rejected proposal: the level that discarded it
    replaced_by: int = -1  # for the first proposal a verifier rejected: the token it drew in its place


def check_summary(c: TokenCheck) -> str:
    """The short form of one decision, e.g. 'retrieval proposed, target accepted: u 0.31 < p/q 0.74/0.58'."""
    verdict = "accepted" if c.accepted else "rejected"
    head = f"{c.proposer} proposed, {c.verifier} {verdict}"
    if c.u is None:  # greedy
        best, p_best = c.p_top[0] if c.p_top else (c.token_id, c.p)
        why = "it is the argmax" if c.accepted else f"its argmax is another token (p {p_best:.2f})"
        return f"{head}: {why}; p {c.p:.2f}"
    sign = "<" if c.accepted else "≥"
    return f"{head}: u {c.u:.2f} {sign} p/q {c.p:.2f}/{c.q:.2f}"


# (token, proposing level, its checks so far, the rejection it replaced)
_Spec = tuple[int, str, tuple[TokenCheck, ...], TokenCheck | None]


@dataclass
class RoundStats:
    index: int  # 1-based target forward
    committed: int  # tokens committed in this round
    proposed: dict[str, int] = field(default_factory=dict)  # by verifying level
    accepted: dict[str, int] = field(default_factory=dict)
    at_s: float = 0.0  # seconds since decoding began


class AnswerTrace:
    """Accumulates one generation's events (see the module docstring)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._detok = IncrementalDetokenizer(decode)  # each token's own text, for colouring
        self.segments: list[Segment] = []
        self.rounds: list[RoundStats] = []
        self.selections: list[ChunksSelected] = []
        self.prefill: Prefilled | None = None
        self.stats: GenerationStats | None = None
        self.token_ids: list[int] = []
        self.levels: list[str] = []
        self.text = ""
        self._t0: float | None = None
        self._last_t: float = 0.0
        self.waited_s = 0.0  # decoding's waits for Step (the caller's clock for `push` leaves them out too)
        self.waited_before = 0.0  # of those, the waits of the answer's parts before a Continue
        self._first: tuple[Prefilled | None, GenerationStats | None] | None = None  # (`continuing`)
        self._reset_round()

    def continuing(self) -> None:
        """The answer goes on (Continue after its token limit): the next generation's events
        join this trace. Its prefill stays the answer's first; its statistics, when it finishes,
        are merged into the answer's (`GenerationStats.then`), so every figure covers the whole
        answer; its round clock goes on from the last round's (the wait before Continue left out)."""
        self._first = (self.prefill, self.stats)
        self.stats = None
        self.waited_before = self.waited_s
        self._t0 = None

    # -- folding events --------------------------------------------------------------------
    def _reset_round(self) -> None:
        self._spec: list[_Spec] = []  # the speculation the target will verify
        self._inline: dict[int, list[_Spec]] = {}  # offset -> small-draft tokens rejected there
        self._drafted: Drafted | None = None
        self._target: Verified | None = None
        self._proposed: dict[str, int] = {}
        self._accepted: dict[str, int] = {}
        self._replacements: dict[tuple[int, int], int] = {}  # (offset, rejected token) -> the retrieval level's draw

    def push(self, ev, now: float = 0.0) -> None:
        if isinstance(ev, Prefilled):
            self.prefill = ev if self._first is None else self._first[0]
        elif isinstance(ev, ChunksSelected):
            self.selections.append(ev)
        elif isinstance(ev, Drafted):
            self._drafted = ev
            if ev.level == "retrieval":  # the retrieval level's own tokens join the speculation
                self._spec += [(t, "retrieval", (), None) for t in ev.token_ids]
        elif isinstance(ev, Verified):
            self._count(ev)
            if ev.level == "retrieval":
                self._verified_by_retrieval(ev)
            else:
                if not self._spec and self._drafted is not None:
                    self._spec = [(t, self._drafted.level, (), None) for t in self._drafted.token_ids]
                self._spec = self._spec[: ev.proposed]
                for i, c in enumerate(ev.checks[: len(self._spec)]):
                    t, lvl, checks, drawn = self._spec[i]
                    self._spec[i] = (t, lvl, checks + (c,), drawn)
                self._target = ev
        elif isinstance(ev, Committed):
            if self._t0 is None:
                self._t0 = now - self._last_t  # a continued answer's clock goes on from its last round
            self._committed(ev, now - self._t0)
        elif isinstance(ev, Finished):
            before = self._first[1] if self._first is not None else None
            self.stats = before.then(ev.stats) if before is not None else ev.stats

    def _count(self, ev: Verified) -> None:
        self._proposed[ev.level] = self._proposed.get(ev.level, 0) + ev.proposed
        self._accepted[ev.level] = self._accepted.get(ev.level, 0) + ev.accepted

    def _verified_by_retrieval(self, ev: Verified) -> None:
        drafted = self._drafted.token_ids if self._drafted is not None else ev.rejected_ids
        lower = self._drafted.level if self._drafted is not None else "draft"  # lookup or small draft
        base = len(self._spec)
        checks = ev.checks
        rejection = checks[ev.accepted] if len(checks) > ev.accepted else None
        if ev.rejected_ids:
            self._inline.setdefault(base + ev.accepted, []).extend(
                (t, lower, (rejection,) if k == 0 and rejection else (), None) for k, t in enumerate(ev.rejected_ids))
            if ev.resampled_id is not None:
                self._replacements[(base + ev.accepted, ev.rejected_ids[0])] = ev.resampled_id
        self._spec += [(t, lower, checks[j:j + 1], None) for j, t in enumerate(drafted[: ev.accepted])]
        extra = ev.resampled_id if ev.resampled_id is not None else ev.bonus_id
        if extra is not None:
            self._spec.append((extra, "retrieval", (), rejection if ev.resampled_id is not None else None))

    def _committed(self, ev: Committed, at_s: float) -> None:
        target = self._target
        accepted = target.accepted if target is not None else 0
        rejected_tail = self._spec[accepted:] if target is not None and target.rejected_ids else []
        n = len(self.rounds) + 1
        title = f"round {n}"
        if target is not None:
            title += f": the target accepted {target.accepted} of {target.proposed} proposed tokens"
        self.segments.append(Segment("round", note=title, round=n))
        target_rejection = (target.checks[accepted] if target is not None and target.rejected_ids
                            and len(target.checks) > accepted else None)
        for i, (text, level) in enumerate(zip(self._detok.push(ev.token_ids), ev.levels)):
            for k, (tok, lvl, checks, _) in enumerate(self._inline.get(i, []) if i <= accepted else []):
                note = check_summary(checks[-1]) if checks else f"{lvl} token discarded after the rejection before it"
                drawn = self._replacements.get((i, tok), -1) if k == 0 else -1
                self.segments.append(Segment("rejected", self._piece(tok), lvl, note, tok, checks, round=n,
                                             rejected_by="retrieval", replaced_by=drawn))
            if i == accepted:
                for k, (tok, lvl, checks, _) in enumerate(rejected_tail):
                    note = check_summary(checks[-1]) if k == 0 and checks else "proposal rejected by the full target"
                    # the target's own token, committed here, replaced the first proposal it rejected
                    drawn = ev.token_ids[i] if k == 0 else -1
                    self.segments.append(Segment("rejected", self._piece(tok), lvl, note, tok, checks, round=n,
                                                 rejected_by="target", replaced_by=drawn))
            tok = ev.token_ids[i]
            if i < accepted and i < len(self._spec):
                _, _, checks, drawn = self._spec[i]
            else:  # the target's own token: drawn after its rejection, or a bonus
                checks, drawn = (), target_rejection
            note = self._note(level, checks, drawn)
            self.segments.append(Segment("token", text, level, note, tok, checks, drawn, round=n))
        self.token_ids += ev.token_ids
        self.levels += ev.levels
        self.text += ev.text
        self.rounds.append(RoundStats(len(self.rounds) + 1, len(ev.token_ids), dict(self._proposed), dict(self._accepted), at_s))
        self._last_t = at_s
        self._reset_round()

    def _note(self, level: str, checks: tuple[TokenCheck, ...], drawn: TokenCheck | None) -> str:
        if checks:
            return check_summary(checks[-1])
        if drawn is not None:
            return (f"{level} drew it after rejecting «{self._piece(drawn.token_id)}»"
                    + (" (from the residual)" if drawn.u is not None else " (its argmax)"))
        return ""

    def _piece(self, token: int) -> str:
        return self._decode([token]).replace("\ufffd", "\u00b7")

    # -- summaries -------------------------------------------------------------------------
    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def decode_s(self) -> float | None:
        """The engine's decoding time less the waits for Step (None before the end)."""
        if self.stats is None:
            return None
        return self.stats.decode_s - self.waited_s

    def tokens_per_s(self) -> float:
        """Final decode speed when finished (the engine's, or with waits for Step its tokens over
        its decoding time less those waits), else a running estimate."""
        if self.stats is not None:
            decode = self.decode_s()
            if self.waited_s <= 0:
                return self.stats.tokens_per_s
            return self.stats.new_tokens / decode if decode > 0 else 0.0
        if len(self.rounds) < 2 or self._last_t <= 0:
            return 0.0
        return (self.new_tokens - self.rounds[0].committed) / self._last_t

    def mean_accepted(self) -> float:
        return self.new_tokens / len(self.rounds) if self.rounds else 0.0

    def acceptance(self) -> dict[str, float]:
        """Accepted / proposed so far, by verifying level."""
        proposed: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for r in self.rounds:
            for k, v in r.proposed.items():
                proposed[k] = proposed.get(k, 0) + v
                accepted[k] = accepted.get(k, 0) + r.accepted.get(k, 0)
        return {k: accepted[k] / v for k, v in proposed.items() if v}
