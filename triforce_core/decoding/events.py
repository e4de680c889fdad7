"""The events a generation yields (a contract: the UI and the CLI render only from these).

A generation is a Python generator of these frozen dataclasses, in this order:

    Prefilled, ChunksSelected?, then per round: Drafted/Verified (lower levels first),
    Committed, ChunksSelected? (after a refresh), ..., and finally Finished.

Levels are named after who *proposed* a token: "draft" (small model + StreamingLLM cache),
"retrieval" (target weights over the retrieved KV slice), "target" (the full verifier's own
token: a residual resample or a bonus) and, an extension of the original three, "lookup" (a
token copied from an earlier match in the context, `triforce_core.decoding.lookup`; no model). A
`Drafted` event may carry any proposing level; `Verified.level` names the *verifying* level
("retrieval" or "target").

A scheduler may ask for `PrefillProgress` events (an opt-in extension: `progress_events=True`
on `SpeculationLoop.generate`, `TriForceEngine.generate`, `Slot.generate` and `ChatSession.ask`): they
come before `Prefilled`, one after each prefill chunk, so a worker serving several callers can
run other callers' rounds between the chunks of a long prefill. Consumers that do not ask never
see one.

A caller may also ask for the numbers behind each decision (an opt-in extension: `inspect=True`
on the same four calls): each `Verified` then carries `checks`, one `TokenCheck` per proposed
token the verifier checked (the accepted ones and the first rejected one), holding the values
the rule used. Without it `checks` is empty and the hot path computes nothing extra.

To stop a generation, close the generator (`gen.close()`); the engine checks between rounds,
so a stop takes effect within one round. No `Finished` follows a close.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Union

LEVELS = ("lookup", "draft", "retrieval", "target")


@dataclass(frozen=True)
class PrefillProgress:
    """Opt-in: `done` of the `total` prompt tokens to run through the target are cached so far;
    the first of them is at sequence position `start` (the tokens before it were reused)."""

    done: int
    total: int
    start: int = 0


@dataclass(frozen=True)
class Prefilled:
    tokens: int  # prompt tokens run through the target in this prefill
    seconds: float
    reused_tokens: int = 0  # prompt tokens whose KV was already cached (prefix reuse)
    disk_tokens: int = 0  # of the reused tokens, those whose KV was read from a disk cache


@dataclass(frozen=True)
class ChunksSelected:
    """Which KV chunks the retrieval level attends to, aggregated over layers and KV heads.

    chunk_token_spans[i] = (start, end) sequence positions of a chunk chosen by at least one
    (layer, KV head) pair; scores_or_counts[i] = how many pairs chose it (out of
    `heads_total`). The sink chunk and the recent tokens are always chosen by all pairs.
    """

    step: int  # round at which the selection was made (0 = after prefill)
    chunk_size: int
    chunk_token_spans: tuple[tuple[int, int], ...]
    scores_or_counts: tuple[int, ...]
    context_tokens: int = 0  # sequence length the selection was made at
    budget: int = 0
    heads_total: int = 0  # layers x KV heads
    dense: bool = False  # the whole context fit the budget


@dataclass(frozen=True)
class Drafted:
    level: str  # "lookup", "draft" or "retrieval": who proposed the tokens
    token_ids: tuple[int, ...]


TopEntries = tuple[tuple[int, float], ...]  # (token id, probability), most likely first


@dataclass(frozen=True)
class TokenCheck:
    """One proposed token as the verification rule saw it (`inspect=True`).

    Sampling: accepted iff u * q < p, i.e. u < p(x)/q(x); after a rejection the replacement
    (`Verified.resampled_id`) was drawn from norm(max(0, p - q)), whose most likely entries are
    `residual_top`. Greedy: u is None, p and q are the softmax of the two levels' logits at
    temperature 1, and accepted iff x is the verifier's argmax (`p_top[0]`), which is also the
    replacement after a rejection.

    q is the law the rule used for x: the proposer's, except that a token which passed the
    retrieval level reaches the target with that level's law (TriForce's middle level emits
    tokens that follow it); a context lookup's point mass gives q = 1.
    """

    token_id: int
    proposer: str  # level that proposed the token (as in Committed.levels)
    verifier: str  # "retrieval" or "target"
    q: float  # q(x)
    p: float  # p(x), the verifier's probability of x
    u: float | None  # the uniform draw (None when greedy)
    accepted: bool
    p_top: TopEntries  # top entries of p at this position
    q_top: TopEntries  # top entries of q ((x, 1.0) for a point mass)
    residual_top: TopEntries = ()  # top of norm(max(0, p - q)) at a rejection (sampling only)


@dataclass(frozen=True)
class Verified:
    """Outcome of one verification by `level` ("retrieval" or "target")."""

    level: str
    accepted: int  # proposed tokens accepted (a prefix)
    rejected_ids: tuple[int, ...]  # proposed tokens discarded (the first one was rejected)
    resampled_id: int | None  # replacement drawn after a rejection (None if all accepted)
    proposed: int = 0
    bonus_id: int | None = None  # extra token drawn when everything was accepted
    checks: tuple[TokenCheck, ...] = ()  # with inspect=True: each checked token, in order


@dataclass(frozen=True)
class Committed:
    """Final tokens, in order. levels[i] labels token_ids[i]; text is their decoded text."""

    token_ids: tuple[int, ...]
    levels: tuple[str, ...]
    text: str = ""


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    rounds: int  # target forwards during decoding
    mean_accepted: float  # committed tokens per target forward
    proposed: dict[str, int] = field(default_factory=dict)  # by verifying level
    accepted: dict[str, int] = field(default_factory=dict)  # by verifying level
    acceptance: dict[str, float] = field(default_factory=dict)  # accepted / proposed
    committed_by_level: dict[str, int] = field(default_factory=dict)
    refreshes: int = 0  # retrieval re-selections after the first
    stop_reason: str = ""  # "eos" | "max_new_tokens" | "stop_text" (`stop_text.StopText`)
    mode: str = ""
    reused_tokens: int = 0
    disk_tokens: int = 0  # of the reused tokens, those whose KV was read from a disk cache
    # "proposer:verifier" -> accepted / proposed, e.g. "lookup:target", "draft:retrieval"
    acceptance_by_proposer: dict[str, float] = field(default_factory=dict)
    proposed_by_proposer: dict[str, int] = field(default_factory=dict)
    level_seconds: dict[str, float] = field(default_factory=dict)  # decoding time in each level's forwards
    level_calls: dict[str, int] = field(default_factory=dict)  # forwards (lookup: searches) per level

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def then(self, later: "GenerationStats") -> "GenerationStats":
        """These figures and those of `later`, a continuation of the same answer (Continue after
        the token limit), as one answer's: counts and times add up, rates and shares are
        recomputed from the sums; the prompt and reuse are this (the first) part's, the stop
        reason the later part's; the mode is one name, or 'first, then later' when they differ."""
        proposed, accepted = _add(self.proposed, later.proposed), _add(self.accepted, later.accepted)
        pair_proposed = _add(self.proposed_by_proposer, later.proposed_by_proposer)
        pair_accepted = _add({k: v * self.proposed_by_proposer.get(k, 0) for k, v in self.acceptance_by_proposer.items()},
                             {k: v * later.proposed_by_proposer.get(k, 0) for k, v in later.acceptance_by_proposer.items()})
        new, decode, rounds = self.new_tokens + later.new_tokens, self.decode_s + later.decode_s, self.rounds + later.rounds
        return replace(
            self, new_tokens=new, prefill_s=self.prefill_s + later.prefill_s, decode_s=decode,
            tokens_per_s=new / decode if decode > 0 else 0.0, rounds=rounds,
            mean_accepted=new / rounds if rounds else 0.0, proposed=proposed, accepted=accepted,
            acceptance={k: accepted.get(k, 0) / v if v else 0.0 for k, v in proposed.items()},
            committed_by_level=_add(self.committed_by_level, later.committed_by_level),
            refreshes=self.refreshes + later.refreshes, stop_reason=later.stop_reason,
            mode=self.mode if self.mode == later.mode else f"{self.mode}, then {later.mode}",
            acceptance_by_proposer={k: pair_accepted.get(k, 0) / v for k, v in pair_proposed.items() if v},
            proposed_by_proposer=pair_proposed,
            level_seconds=_add(self.level_seconds, later.level_seconds),
            level_calls=_add(self.level_calls, later.level_calls),
        )


def _add(a: dict, b: dict) -> dict:
    """Two dicts of counts (or seconds) summed key by key."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats


Event = Union[PrefillProgress, Prefilled, ChunksSelected, Drafted, Verified, Committed, Finished]
