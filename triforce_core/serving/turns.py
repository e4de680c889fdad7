"""The records of a chat session's turns: the question, the answer and what it cost.

`Turn` is what `ChatSession.turns` holds; its `stats` (`TurnStats`) arrive when the answer
finishes, and its `truncation` (`Truncation`) says what `allow_truncation` cut from the document.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
