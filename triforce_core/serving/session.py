"""Multi-turn chat over one long document, prefilling the document once.

    session = ChatSession(engine, document=load_document("book.pdf"))
    for event in session.ask("Who is Ishmael?"):     # Prefilled, ChunksSelected, ..., Finished
        ...
    session.turns[-1].answer, session.turns[-1].stats.prefill_tokens
    for event in session.regenerate(): ...           # rolls the caches back, no re-prefill
    for event in session.edit_last("Who is Ahab?"): ...
    for event in session.continue_last(): ...        # an answer cut by its token limit goes on

How the reuse works: every turn renders the whole conversation with the target's chat
template and tokenizes it. The speculation loop's full target cache remembers which token ids it
holds; only the part after their longest common prefix is run through the target. The
document (first in the conversation) is therefore prefilled once, each new question costs
only its own tokens, the previous answer's KV stays cached, regenerate and edit roll the
cache back to the end of the previous turn, and the result is exactly what a fresh prefill
of the whole conversation gives (the prefix *is* that conversation's tokens). The
retrieval selection is redone for every question, since the query changed.

Context limits are checked before any prefill: a conversation that does not fit is refused
with the numbers, unless the session was created with ``allow_truncation=True``, in which
case the document's end is cut, explicitly, and the turn reports what was cut. An
out-of-memory error frees the caches and leaves the session usable.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterator

from ..config import GenerationConfig
from ..engine import ContextLengthError, TriForceEngine
from ..documents.citations import answer_passages, question_tokens
from ..decoding.events import ChunksSelected, Committed, Event, Finished, Prefilled
from ..decoding.stop_text import cut_text
from ..prompting import answer_stops, render_prompt
from .slots import Slot
from .turns import Truncation, Turn, TurnStats


class SessionError(RuntimeError):
    """A turn failed in a way the session survives (e.g. out of memory); one-line message."""


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class ChatSession:
    """One document and one conversation over a shared engine; not thread-safe (one user)."""

    # How the caller can allow truncation (the command line: "--truncate"), named in a refusal
    # as one of its options; None where no such option exists (the app's page, the HTTP API).
    truncation_hint: str | None = None

    def __init__(
        self,
        engine: TriForceEngine,
        document: str | object | None = None,
        *,
        system_prompt: str | None = None,
        config: GenerationConfig | None = None,
        allow_truncation: bool = False,
    ):
        if engine.tokenizer is None:
            raise ValueError("a chat session needs a model with a tokenizer")
        self.engine = engine
        self.system_prompt = (system_prompt or "").strip() or None
        # Without a config, the model's own default sampling (an instruct model's repetition control).
        self.config = config or GenerationConfig(sampling=engine.default_sampling())
        self.allow_truncation = allow_truncation
        self.turns: list[Turn] = []
        self._slot = Slot(engine)  # the conversation's caches, kept between turns
        self._document = ""
        self._prefix: tuple | None = None  # ((document, system prompt, first question), the document's tokens)
        self._document_tokens: int | None = None
        self.sections_read: list[dict] | None = None  # what the document holds of a book, if a part of one
        self.set_document(document)

    # -- document and conversation ---------------------------------------------------------
    @property
    def document(self) -> str:
        return self._document

    def set_document(self, document: str | object | None) -> None:
        """Replace the document (a str or a `documents.Document`); the conversation restarts.

        The cached KV is kept: whatever prefix the new conversation shares with it (the
        system prompt, say) is reused.
        """
        text = getattr(document, "text", document) or ""
        if not isinstance(text, str):
            raise TypeError("document must be text or a documents.Document")
        self._document = text.strip()
        self._document_tokens = None
        self.sections_read = None
        self.turns = []

    def read(self, text: str, sections_read: list[dict] | None = None) -> None:
        """Replace the document's text, keeping the conversation: the earlier turns are rendered
        after the new text, and whatever prefix it shares with the old one stays cached (a book
        read by parts: a follow-up that reads the same parts re-prefills only its question)."""
        self._document = (text or "").strip()
        self._document_tokens = None
        self.sections_read = sections_read

    @property
    def document_tokens(self) -> int:
        """Tokens of the document text alone."""
        if self._document_tokens is None:
            self._document_tokens = len(self._encode(self._document)) if self._document else 0
        return self._document_tokens

    def clear(self) -> None:
        """Forget the conversation, keep the document (and its cached KV)."""
        self.turns = []

    def messages(self, question: str | None = None) -> list[dict]:
        """The conversation as chat messages, the document leading the first user message."""
        out: list[dict] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        questions = [t.question for t in self.turns] + ([question] if question is not None else [])
        for i, q in enumerate(questions):
            content = f"{self._document}\n\n{q}" if i == 0 and self._document else q
            out.append({"role": "user", "content": content})
            if i < len(self.turns):
                out.append({"role": "assistant", "content": self.turns[i].answer})
        return out

    def document_end(self, prompt: list[int]) -> int | None:
        """Where the document ends in `prompt` (this conversation's): the tokens its first
        question's prompt shares with that of an empty question, compared once per document,
        system prompt and first question. The prefill keeps the K/V on disk up to there, so the
        same document asked anything later runs only the question. None without a document or
        a conversation, or where `prompt` does not begin with those tokens."""
        first = self.turns[0].question if self.turns else None
        if not self._document or first is None:
            return None
        key = (self._document, self.system_prompt, first)
        if self._prefix is None or self._prefix[0] != key:
            head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

            def render(question: str) -> list[int]:
                return render_prompt(self.engine.tokenizer, head + [{"role": "user", "content": f"{self._document}\n\n{question}"}])[1]

            a = prompt if len(self.turns) == 1 else render(first)  # a first turn's prompt is that rendering
            b = render("")
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            self._prefix = (key, a[:n])
        prefix = self._prefix[1]
        return len(prefix) if prefix and prompt[: len(prefix)] == prefix else None

    def document_span(self, prompt: list[int]) -> tuple[int, int] | None:
        """The tokens [start, end) of `prompt` (this conversation's) that hold the document: from
        where the first user message's content begins (what `prompt` shares with the same head
        and an empty message ends there) to `document_end`. None where that is not known."""
        end = self.document_end(prompt)
        if end is None:
            return None
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        empty = render_prompt(self.engine.tokenizer, head + [{"role": "user", "content": ""}])[1]
        start = 0
        while start < min(len(empty), end) and empty[start] == prompt[start]:
            start += 1
        return start, end

    def passages(self, selections: list[ChunksSelected], prompt: list[int], answer_ids: list[int],
                 question: str) -> list[dict]:
        """An answer's citations (`documents.citations.answer_passages`), the document's only:
        searched in the prompt tokens that hold it and checked against its text, so an earlier
        answer the model repeats, the question or the template is never cited as the book's."""
        return answer_passages(selections, prompt, answer_ids, self.engine.detokenize,
                               question_tokens=question_tokens(self.engine.tokenizer, question),
                               within=self.document_span(prompt), document=self.document)

    def prompt_ids(self, question: str) -> list[int]:
        """Token ids of the whole conversation plus `question`, ready for the answer."""
        return render_prompt(self.engine.tokenizer, self.messages(question))[1]

    def prompt_text(self, question: str) -> str:
        """The text `prompt_ids` tokenizes: the chat template's rendering, or a plain transcript."""
        return render_prompt(self.engine.tokenizer, self.messages(question))[0]

    def token_char_spans(self, question: str) -> tuple[list[tuple[int, int]], int]:
        """For the prompt of `question`: each token's (start, end) characters in the document
        (-1, -1 outside it), and the token position where the document begins.

        Lets a viewer map KV positions (e.g. retrieval chunks) back to the document's text.
        """
        tok = self.engine.tokenizer
        text = self.prompt_text(question)
        special = not getattr(tok, "chat_template", None)
        enc = tok(text, add_special_tokens=special, return_offsets_mapping=True)
        doc_at = text.find(self._document) if self._document else -1
        doc_end = doc_at + len(self._document)
        spans, first = [], -1
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if doc_at >= 0 and b > doc_at and a < doc_end:
                spans.append((max(a, doc_at) - doc_at, min(b, doc_end) - doc_at))
                if first < 0:
                    first = i
            else:
                spans.append((-1, -1))
        return spans, first

    def _encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- the turns -------------------------------------------------------------------------
    def ask(
        self,
        question: str,
        config: GenerationConfig | None = None,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        progress_events: bool = False,
        inspect: bool = False,
    ) -> Iterator[Event]:
        """Answer `question` after the conversation so far; a generator of events (close it to stop).

        Checks (empty question, context window) raise here, before anything runs. With
        `progress_events`, `PrefillProgress` events come between the prefill's chunks; with
        `inspect`, each `Verified` event carries its `TokenCheck`s.
        """
        t0 = time.perf_counter()
        question = (question or "").strip()
        if not question:
            raise ValueError("the question is empty")
        config = config or self.config
        prompt, truncation = self._fit(question, config)
        return self._turn(question, prompt, config, truncation, on_prefill_progress, progress_events, t0, inspect)

    def prompt_for(self, question: str, config: GenerationConfig | None = None) -> list[int]:
        """The prompt ids `ask(question)` would run, checked against the context window (a
        ContextLengthError gives the numbers); nothing runs and the conversation is unchanged."""
        question = (question or "").strip()
        if not question:
            raise ValueError("the question is empty")
        return self._fit(question, config or self.config)[0]

    def regenerate(self, config: GenerationConfig | None = None, on_prefill_progress=None,
                   progress_events: bool = False, inspect: bool = False) -> Iterator[Event]:
        """Answer the last question again; the caches roll back to the end of the previous turn."""
        if not self.turns:
            raise ValueError("there is no answer to regenerate")
        last = self.turns.pop()
        try:
            return self.ask(last.question, config, on_prefill_progress, progress_events, inspect)
        except Exception:
            self.turns.append(last)
            raise

    def edit_last(self, question: str, config: GenerationConfig | None = None, on_prefill_progress=None,
                  progress_events: bool = False, inspect: bool = False) -> Iterator[Event]:
        """Replace the last question (and its answer) by `question` and answer it."""
        if not self.turns:
            raise ValueError("there is no question to edit")
        last = self.turns.pop()
        try:
            return self.ask(question, config, on_prefill_progress, progress_events, inspect)
        except Exception:
            self.turns.append(last)
            raise

    def rerun_last(self, config: GenerationConfig, on_prefill_progress=None,
                   progress_events: bool = False, inspect: bool = False) -> Iterator[Event]:
        """Answer the last question again with `config` (e.g. autoregressively, to compare),
        leaving the conversation as it was: the original answer stays the last turn.

        The caches roll back as for `regenerate`; the rerun's answer is in the events.
        """
        if not self.turns:
            raise ValueError("there is no question to answer again")
        last = self.turns.pop()
        try:
            events = self.ask(last.question, config, on_prefill_progress, progress_events, inspect)
        finally:
            self.turns.append(last)

        def run():
            try:
                yield from events  # appends its own turn after `last` while it runs
            finally:
                if self.turns and self.turns[-1] is not last:
                    self.turns.pop()

        return run()

    # -- Continue: the last answer, cut by its token limit, goes on ----------------------------
    def can_continue(self) -> bool:
        """The last answer stopped at its token limit (`continue_last` goes on with it)."""
        last = self.turns[-1] if self.turns else None
        return last is not None and last.stats is not None and last.stats.stop_reason == "max_new_tokens"

    def continue_last(self, config: GenerationConfig | None = None, on_prefill_progress=None,
                      progress_events: bool = False, inspect: bool = False) -> Iterator[Event]:
        """Go on with the last answer where its token limit stopped it, up to `config`'s
        max_new_tokens more (fewer where the window has less room), exactly as one generation
        with the larger limit would have gone on: greedy, the same tokens.

        The prompt is the turn's prompt followed by the answer's token ids as ids (rendered as
        text, the chat template would close the assistant's turn), the penalties count the whole
        answer (they cover the answer, not the prompt: `decoding.penalties`), and the cache
        already holds it all, so nothing but a token or two is prefilled. The new tokens join
        the same `Turn` (its ids, levels and text); its stats then cover the whole answer
        (`TurnStats.continued`), or are None if the continuation is stopped (a stopped answer's).
        Checks raise here: ValueError when the last answer did not stop at its limit,
        ContextLengthError when the window has no room left."""
        if not self.turns:
            raise ValueError("there is no answer to continue")
        if not self.can_continue():
            raise ValueError("only an answer stopped by its token limit can be continued; "
                             "the last one ended on its own or was stopped")
        config = config or self.config
        turn = self.turns[-1]
        prompt = self._prompt_of_last()
        if len(prompt) != turn.stats.prompt_tokens:
            raise ValueError("the conversation changed since this answer (another document or system prompt); "
                             "ask the question again")
        answer = [int(t) for t in turn.token_ids]
        window, held = self.engine.context_window, len(prompt) + len(answer)
        room = window - held
        if room <= 0:
            raise ContextLengthError(
                f"no room left to continue: the conversation and this answer fill the context window "
                f"({held:,} of {window:,} tokens); clear the conversation, or ask a shorter question")
        if room < config.speculation.max_new_tokens:  # what is left of the window
            config = replace(config, speculation=replace(config.speculation, max_new_tokens=room))
        self.engine.check_prompt(prompt + answer, config)
        return self._continued(turn, prompt, answer, config, on_prefill_progress, progress_events, inspect)

    def _prompt_of_last(self) -> list[int]:
        """The prompt the last turn's answer followed (the conversation before it, its question)."""
        turns, self.turns = self.turns, self.turns[:-1]
        try:
            return self.prompt_ids(turns[-1].question)
        finally:
            self.turns = turns

    def _continued(self, turn: Turn, prompt: list[int], answer: list[int], config: GenerationConfig,
                   on_prefill_progress, progress_events: bool, inspect: bool) -> Iterator[Event]:
        before, turn.stats = turn.stats, None  # None until the continuation finishes
        prefilled: Prefilled | None = None
        selections: list[ChunksSelected] = []
        try:
            for ev in self._slot.generate(prompt + answer, config, on_prefill_progress, progress_events, inspect,
                                          boundary=self.document_end(prompt), answer_start=len(prompt),
                                          stops=answer_stops(self.engine.tokenizer)):
                if isinstance(ev, Prefilled):
                    prefilled = ev
                elif isinstance(ev, ChunksSelected):
                    selections.append(ev)
                elif isinstance(ev, Committed):
                    turn.token_ids += ev.token_ids
                    turn.levels += ev.levels
                elif isinstance(ev, Finished):
                    turn.stats = before.continued(ev.stats, prefilled.tokens, prefilled.seconds)
                    if selections or not any(p.get("kind") == "read" for p in turn.passages):
                        # what the continuation's selections read, or what the whole answer quotes
                        turn.passages = self.passages(selections, prompt, list(turn.token_ids), turn.question)
                yield ev
        except Exception as e:  # the slot has freed its caches (they may be half-written)
            if _is_oom(e):
                raise SessionError("out of memory while continuing the answer; the caches were freed. "
                                   "Try a smaller retrieval budget or a lower-precision dtype") from None
            raise
        finally:  # what was generated is kept, as in `_turn`
            ids = [t for t in turn.token_ids if t not in self.engine.eos_token_ids]
            turn.answer = self._answer_text(ids, turn.stats)

    def cache_lengths(self) -> dict[str, int]:
        """Tokens held by each cache (0 when there is none yet)."""
        return self._slot.cache_lengths()

    def cached_tokens(self) -> list[int]:
        """The token ids whose keys/values the target's cache holds."""
        return self._slot.cached_tokens()

    def cache_bytes(self) -> int:
        """Memory held by the caches (every level)."""
        return self._slot.cache_bytes()

    def release(self) -> None:
        """Free the caches (the next turn prefills from scratch)."""
        self._slot.release()

    # -- internals -------------------------------------------------------------------------
    def _fit(self, question: str, config: GenerationConfig) -> tuple[list[int], Truncation | None]:
        window = self.engine.context_window
        max_new = config.speculation.max_new_tokens
        prompt = self.prompt_ids(question)
        if len(prompt) + max_new <= window:
            self.engine.check_prompt(prompt, config)
            return prompt, None
        question_tokens = len(self._encode(question))
        doc = self.document_tokens
        rest = len(prompt) - doc - question_tokens
        if not self.allow_truncation or not self._document:
            raise ContextLengthError(self._too_long(question, question_tokens, doc, rest, max_new, len(prompt), window))
        before_chars, before_tokens = len(self._document), doc
        ids = self._encode(self._document)
        for _ in range(4):
            excess = len(prompt) + max_new - window
            if excess <= 0:
                break
            keep = len(ids) - excess - 8
            if keep <= 0:
                raise ContextLengthError(
                    f"Even with none of the document, this question ({question_tokens:,} tokens), the "
                    f"{'conversation so far and the ' if self.turns else ''}chat template ({rest:,} tokens) and "
                    f"{max_new:,} tokens for the answer are over the model's context window of {window:,} tokens."
                )
            ids = ids[:keep]
            self._document = self.engine.tokenizer.decode(ids).strip()
            self._document_tokens = None
            ids = self._encode(self._document)
            prompt = self.prompt_ids(question)
        if len(prompt) + max_new > window:
            raise ContextLengthError(f"could not cut the document to fit the context window of {window} tokens")
        self.engine.check_prompt(prompt, config)
        return prompt, Truncation(before_tokens, self.document_tokens, before_chars, len(self._document))

    def _document_words(self, tokens: int) -> str:
        """The document's part in a refusal: 'the document (8,235 tokens)'."""
        return f"the document ({tokens:,} tokens)"

    def _document_option(self) -> str | None:
        """What a refusal may offer about the document itself (None where there is nothing to offer)."""
        return "use a shorter document" if self._document else None

    def _too_long(self, text: str, question: int, document: int, rest: int, max_new: int, prompt: int,
                  window: int) -> str:
        """A refusal in a sentence: what the turn needs, every number true, then the options that
        exist here, those that would make it fit alone if any would (else every one of them)."""
        around = "the conversation so far and the chat template" if self.turns else "the chat template"
        over = prompt + max_new - window
        conversation = 0
        if self.turns:  # the earlier turns' tokens: the prompt's length without them
            turns, self.turns = self.turns, []
            try:
                conversation = prompt - len(self.prompt_ids(text))
            finally:
                self.turns = turns
        options = [("shorten the question", question > over),  # a question is left
                   ("clear the conversation", conversation >= over),
                   (f"lower the answer's token limit (now {max_new:,})", max_new > over)]
        if self._document_option():
            options.append((self._document_option(), document >= over))
        if self.truncation_hint and self._document and not self.allow_truncation:
            options.append((f"allow truncation ({self.truncation_hint})", document > over))
        alone = [what for what, enough in options if enough]
        said = alone or [what for what, _enough in options if what != "clear the conversation" or self.turns]
        said = ", ".join(said[:-1]) + (" or " if len(said) > 1 else "") + said[-1]
        return (f"This question is {question:,} tokens: with {self._document_words(document)}, {around} "
                f"({rest:,} tokens) and {max_new:,} tokens for the answer, it needs {prompt + max_new:,} tokens, "
                f"{over:,} over the model's context window of {window:,}. {said[0].upper()}{said[1:]}.")

    def _turn(self, question, prompt, config, truncation, on_prefill_progress, progress_events, t0,
              inspect: bool = False) -> Iterator[Event]:
        first_token_s = None
        turn = Turn(question, truncation=truncation, sections_read=self.sections_read)
        self.turns.append(turn)
        answer_ids: list[int] = []
        prefilled: Prefilled | None = None
        selections: list[ChunksSelected] = []
        try:
            for ev in self._slot.generate(prompt, config, on_prefill_progress, progress_events, inspect,
                                          boundary=self.document_end(prompt), stops=answer_stops(self.engine.tokenizer)):
                if isinstance(ev, Prefilled):
                    prefilled = ev
                elif isinstance(ev, ChunksSelected):
                    selections.append(ev)
                elif isinstance(ev, Committed):
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - t0
                    answer_ids += ev.token_ids
                    turn.token_ids += ev.token_ids
                    turn.levels += ev.levels
                elif isinstance(ev, Finished):
                    s = ev.stats
                    turn.stats = TurnStats(
                        prompt_tokens=len(prompt), prefill_tokens=prefilled.tokens,
                        reused_tokens=prefilled.reused_tokens, disk_tokens=prefilled.disk_tokens,
                        prefill_s=prefilled.seconds,
                        first_token_s=first_token_s if first_token_s is not None else time.perf_counter() - t0,
                        decode_s=s.decode_s, tokens_per_s=s.tokens_per_s, new_tokens=s.new_tokens,
                        acceptance=dict(s.acceptance), mean_accepted=s.mean_accepted,
                        stop_reason=s.stop_reason, mode=s.mode, proposed=dict(s.proposed),
                    )
                    turn.passages = self.passages(selections, prompt, answer_ids, question)
                yield ev
        except Exception as e:  # the slot has freed its caches (they may be half-written)
            if _is_oom(e):
                during = "while decoding" if prefilled is not None else f"while prefilling {len(prompt)} tokens"
                raise SessionError(
                    f"out of memory {during}; the caches were freed. "
                    "Try a shorter document, a smaller retrieval budget or a lower-precision dtype"
                ) from None
            raise
        finally:
            # Whatever happened (finished, stopped, failed), what was generated is kept. The text
            # is not stripped: re-tokenized next turn, it then matches the cached ids.
            ids = [t for t in answer_ids if t not in self.engine.eos_token_ids]
            turn.answer = self._answer_text(ids, turn.stats)

    def _answer_text(self, ids: list[int], stats: TurnStats | None) -> str:
        """The answer's text: its tokens' (not stripped: re-tokenized next turn, it then matches
        the cached ids), cut where a stop text begins (`prompting.answer_stops`: the plain
        layout's next "Question:", `stop_text.cut_text`), and then without the whitespace before
        it, so the next turn lays the conversation out as the model wrote it."""
        stops = answer_stops(self.engine.tokenizer)
        text = self.engine.detokenize(ids)
        return cut_text(text, stops, stats is not None and stats.stop_reason == "stop_text") if stops else text
