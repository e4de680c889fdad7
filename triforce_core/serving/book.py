"""Asking a whole book: each question reads the parts of it most relevant to it.

    session = BookSession(engine, load_document("book.html"))      # the book may exceed the window
    for event in session.ask("What follows «the stack and the heap»?"): ...
    session.turns[-1].sections_read      # [{"number": 16, "title": "What is Ownership?", ...}, ...]

A `ChatSession` whose document is, for each turn, what `reading.BookReader` picks for the
question within the reading budget (at most what the window leaves after the conversation,
the question and the answer). The earlier turns stay in the conversation; a follow-up keeps
the parts read before that still rank, so its prompt starts as the last one did and the
cached prefix is reused (only the question, and any part added, is prefilled). Greedy output
is still exactly the target's: each turn is a plain prompt, prefilled or reused exactly.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ..config import GenerationConfig
from ..documents import Document
from ..engine import ContextLengthError, TriForceEngine
from ..decoding.events import Event
from ..documents.reading import BookReader, token_starts
from .session import ChatSession

# The budget that answered most quote questions on a whole book with the demo pair: a larger read
# held the passage as often but answered fewer, and prefills later (docs/results.md, "Asking a
# whole book"; `python -m bench.book`).
DEFAULT_READING_BUDGET = 4_096
# Tokens kept free beside the estimate: a part counted alone and the same part inside the
# prompt can tokenize a few tokens apart.
SLACK = 32


class BookSession(ChatSession):
    """A conversation over a book read part by part; `turns[i].sections_read` says what each turn read."""

    def __init__(self, engine: TriForceEngine, document: Document, *, reading_budget: int = DEFAULT_READING_BUDGET,
                 system_prompt: str | None = None, config: GenerationConfig | None = None,
                 reader: BookReader | None = None):
        if reading_budget < 64:
            raise ValueError(f"the reading budget must be at least 64 tokens, got {reading_budget}")
        super().__init__(engine, None, system_prompt=system_prompt, config=config)
        self.book = document
        self.reading_budget = min(reading_budget, engine.context_window)
        # parts of at most a quarter of the budget: several can be read, and a long page is
        # ranked by where in it the question's words are
        self.reader = reader or BookReader(document, token_starts(engine.tokenizer, document.text),
                                           max_part_tokens=max(16, self.reading_budget // 4))
        self.picked: list[int] = []  # the parts the document holds now

    @property
    def book_tokens(self) -> int:
        """Tokens of the whole book (what `--sections all` would read)."""
        return self.reader.total_tokens

    def ask(self, question: str, config: GenerationConfig | None = None, on_prefill_progress=None,
            progress_events: bool = False, inspect: bool = False) -> Iterator[Event]:
        """Pick the parts for `question` (keeping those read before that still rank), then answer it."""
        q = (question or "").strip()
        if not q:
            raise ValueError("the question is empty")
        config = config or self.config
        before = (self._document, self.sections_read, list(self.picked))
        picked = self.reader.pick(q, self._room(q, config), previous=self.picked)
        while True:
            self._use(picked)
            try:
                return super().ask(question, config, on_prefill_progress, progress_events, inspect)
            except ContextLengthError:
                if picked:  # the estimate was a few tokens short: drop the part ranked lowest
                    place = {i: r for r, i in enumerate(self.reader.rank(q))}
                    picked = sorted(sorted(picked, key=lambda i: place.get(i, len(place)))[:-1])
                    continue
                self._restore(before)
                raise
            except Exception:  # refused before anything ran: the session reads what it read before
                self._restore(before)
                raise

    def _restore(self, before: tuple) -> None:
        self._document, self.sections_read, self.picked = before
        self._document_tokens = None

    def _room(self, question: str, config: GenerationConfig) -> int:
        """Tokens left for the book: the budget, or less when the conversation, the question and
        the answer leave less of the window."""
        saved = self._document
        self._document = ""
        try:
            rest = len(self.prompt_ids(question))
        finally:
            self._document = saved
        room = self.engine.context_window - rest - config.speculation.max_new_tokens - SLACK
        return max(0, min(self.reading_budget, room))

    def _document_words(self, tokens: int) -> str:
        """The book's part in a refusal: how much of it this question could read, of how much."""
        if not tokens:
            return f"none of the book ({self.book_tokens:,} tokens) read"
        return f"the {tokens:,} tokens read of the book ({self.book_tokens:,} tokens)"

    def _document_option(self) -> str | None:
        return None  # what is read of the book is already what fits beside the question

    def _use(self, picked: Sequence[int]) -> None:
        self.picked = list(picked)
        self.read(self.reader.text(self.picked) if self.picked else "", self.reader.describe(self.picked))
