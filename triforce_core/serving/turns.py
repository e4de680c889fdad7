"""The records of a chat session's turns: the question, the answer and what it cost.

`Turn` is what `ChatSession.turns` holds; its `stats` (`TurnStats`) arrive when the answer
finishes, and its `truncation` (`Truncation`) says what `allow_truncation` cut from the document.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int  # tokens of the whole conversation prompt of this turn
    prefill_tokens: int  # of which run through the target in this turn
    reused_tokens: int  # of which already cached from earlier turns
    prefill_s: float
    first_token_s: float  # from `ask` (tokenization included) to the first committed token
    decode_s: float
    tokens_per_s: float
    new_tokens: int
    acceptance: dict[str, float]
    mean_accepted: float
    stop_reason: str
    mode: str
    disk_tokens: int = 0  # of the reused tokens, those whose K/V was read from the disk cache
    # proposed tokens by verifying level (what `acceptance` is a share of; {} where not known)
    proposed: dict[str, int] = field(default_factory=dict)

    def continued(self, later, prefill_tokens: int, prefill_s: float) -> "TurnStats":
        """These figures with those of `later` (the `GenerationStats` of a continuation of the
        same answer, Continue after its token limit, which ran `prefill_tokens` through the
        target in `prefill_s`), as one answer's: tokens, rounds, prefill and decoding times add
        up, the speed, mean accepted length and acceptance are recomputed from the sums (a
        level's acceptance weighted by its proposals; without this part's counts, by its
        tokens); the prompt, its reuse and the first token's time stay this part's, the stop
        reason is the later part's; the mode is one name, or 'first, then later'."""
        rounds = self.new_tokens / self.mean_accepted if self.mean_accepted else 0.0
        new, decode = self.new_tokens + later.new_tokens, self.decode_s + later.decode_s
        rounds += later.rounds
        proposed, acceptance = {}, {}
        for level in {**self.acceptance, **later.acceptance}:
            mine = self.proposed.get(level, self.new_tokens if level in self.acceptance else 0)
            theirs = later.proposed.get(level, 0)
            proposed[level] = mine + theirs
            accepted = self.acceptance.get(level, 0.0) * mine + later.accepted.get(level, 0)
            acceptance[level] = accepted / proposed[level] if proposed[level] else 0.0
        return replace(
            self, prefill_tokens=self.prefill_tokens + prefill_tokens, prefill_s=self.prefill_s + prefill_s,
            decode_s=decode, tokens_per_s=new / decode if decode > 0 else 0.0, new_tokens=new,
            acceptance=acceptance, mean_accepted=new / rounds if rounds else 0.0, stop_reason=later.stop_reason,
            mode=self.mode if self.mode == later.mode else f"{self.mode}, then {later.mode}",
            proposed={k: int(v) for k, v in proposed.items()},
        )

    def as_dict(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
            "disk_tokens": self.disk_tokens,
            "prefill_s": self.prefill_s,
            "first_token_s": self.first_token_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
            "acceptance": self.acceptance,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "mean_accepted": self.mean_accepted,
            "stop_reason": self.stop_reason,
            "mode": self.mode,
        }


@dataclass(frozen=True)
class Truncation:
    """What `allow_truncation` cut from the document to make a turn fit the context window."""

    tokens_before: int
    tokens_after: int
    chars_before: int
    chars_after: int

    def message(self) -> str:
        return (
            f"the document was cut from {self.tokens_before} to {self.tokens_after} tokens "
            f"(characters {self.chars_after}-{self.chars_before} dropped) to fit the context window"
        )


@dataclass
class Turn:
    question: str
    answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    levels: list[str] = field(default_factory=list)
    stats: TurnStats | None = None  # None until the answer finished (a stopped answer keeps None)
    truncation: Truncation | None = None
    # the book's parts this turn read (`book.BookSession`; number, title, part, start, end, tokens); None: whole document
    sections_read: list[dict] | None = None
    # the prompt's passages this answer's retrieval selections read most (`citations`); [] without retrieval
    passages: list[dict] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.stats is not None
