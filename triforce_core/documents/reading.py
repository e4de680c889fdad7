"""Which parts of a book to read for a question: lexical ranking, whole parts, a reading budget.

    reader = BookReader(doc, token_starts)          # once per document: its parts and their BM25 index
    picked = reader.pick("What is a slice?", budget=16_384)            # part indices, document order
    picked = reader.pick("And a str?", 16_384, previous=picked)        # a follow-up keeps what still ranks
    text = reader.text(picked)                      # what the conversation reads
    reader.describe(picked)                         # [{"number", "title", "part", "name", "start", "end", "tokens"}]

The parts are the document's sections, each without its subsections (a partition of the
text: every character is in exactly one part, so reading a chapter's page never repeats its
chapter's opening). A part longer than `max_part_tokens` is cut at paragraph breaks into
pieces of at most that size; a text with no sections is cut the same way. A part is named as
the book names it: its section's title as the book writes it ("7.1 Hash functions"), a later
piece of a cut section by that heading and where it starts ("Ownership, from «The stack and…»"),
text without a heading above it by where it starts ("Text from «It was the best…»"). Parts are ranked by BM25 (`bm25s`, the measured faster of the two maintained Python
libraries, see docs/long-documents.md) over lower-cased words without English stop words
and over adjacent word pairs (so a quoted phrase counts as a phrase), the question's terms
against each part's (its title included: it is the part's first line).

What is read: the best-ranked parts, each whole, while they fit the budget, only parts
sharing a word with the question (a shorter read prefills sooner), in document order, each
after a line naming it. A follow-up keeps every part read before that still ranks (would be
read with twice the budget), so the document starts as it did and the cached prefix is
reused. When the part ranked best for the new question is among those read, the read stays
exactly as it was (a part added in the middle would re-prefill everything after it);
otherwise the parts it needs are added where room allows, its best part always, the kept
parts ranked lowest for it making room.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Sequence

from . import Document
from .sections import first_words, part_line

_WORD = re.compile(r"\w+")
# Cut a long part at a paragraph break, else at a line break, else anywhere (one huge line).
_BREAKS = ("\n\n", "\n")


def token_starts(tokenizer, text: str) -> list[int]:
    """The character offset where each token of `text` begins (one tokenization of the whole text)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [a for a, _b in enc["offset_mapping"]]
    except NotImplementedError:  # a tokenizer without offsets: tokens spread evenly over the text
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return [len(text) * i // max(1, n) for i in range(n)]


@dataclass(frozen=True)
class Part:
    start: int  # character span in Document.text
    end: int
    section: int | None  # index into Document.sections; None: text before the first section, or no sections
    piece: int = 1  # which piece of a cut section (1-based) ...
    pieces: int = 1  # ... of how many
    title: str = ""  # the section's title, as the book writes it ("" for none)
    tokens: int = 0  # of its text, its heading line included
    opening: str = ""  # where its text starts: its first words ("It was the best of times…")

    @property
    def name(self) -> str:
        """'7.1 Hash functions' (a section, or the first piece of one), 'Ownership, from «The
        stack and the heap…»' (a later piece), 'Text from «It was the best…»' (no heading above)."""
        if self.section is None:
            return f"Text from «{self.opening}»"
        return f"{self.title}, from «{self.opening}»" if self.piece > 1 else self.title


class BookReader:
    """A document cut into parts and their BM25 index, built once; ranking and picking change
    nothing, so one reader can serve several conversations over the same book."""

    def __init__(self, document: Document, token_starts: Sequence[int], *, max_part_tokens: int = 4096):
        """`token_starts`: the character offset where each token of `document.text` begins (the
        tokenizer's offsets, once for the whole text), so a span's size in tokens is a count."""
        if max_part_tokens < 16:
            raise ValueError(f"max_part_tokens must be >= 16, got {max_part_tokens}")
        self.document = document
        self._starts = list(token_starts)
        self.max_part_tokens = max_part_tokens
        self.parts: list[Part] = self._cut()
        self._index = self._build_index()

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole document text."""
        return len(self._starts)

    # -- the parts ----------------------------------------------------------------------------
    def _span_tokens(self, a: int, b: int) -> int:
        return bisect.bisect_left(self._starts, b) - bisect.bisect_left(self._starts, a)

    def _header_tokens(self, part: Part) -> int:
        # the line naming it: about one token per 3 characters of this kind of line, rounded up
        return len(self._header(part)) // 3 + 2

    @staticmethod
    def _header(part: Part) -> str:
        return part_line(part.name) + "\n"

    def _cut(self) -> list[Part]:
        doc, text = self.document, self.document.text
        starts = sorted({s.start for s in doc.sections})
        owners = {}
        for i, s in enumerate(doc.sections):  # of sections starting at one place, the outermost names the part
            owners.setdefault(s.start, i)
        bounds = ([0] if not starts or starts[0] > 0 else []) + starts + [len(text)]
        parts: list[Part] = []
        for a, b in zip(bounds, bounds[1:]):
            if not text[a:b].strip():
                continue
            section = owners.get(a)
            title = doc.sections[section].title if section is not None else ""
            pieces = self._pieces(a, b)
            for k, (pa, pb) in enumerate(pieces, 1):
                part = Part(pa, pb, section, k, len(pieces), title, opening=first_words(text[pa:pb]))
                parts.append(Part(pa, pb, section, k, len(pieces), title,
                                  self._span_tokens(pa, pb) + self._header_tokens(part), part.opening))
        return parts

    def _pieces(self, a: int, b: int) -> list[tuple[int, int]]:
        """[a, b) cut at paragraph breaks into spans of at most max_part_tokens (a paragraph larger
        than that at line breaks, a line larger than that by tokens)."""
        limit = self.max_part_tokens
        if self._span_tokens(a, b) <= limit:
            return [(a, b)]
        text, out, at = self.document.text, [], a
        while at < b:
            if self._span_tokens(at, b) <= limit:
                out.append((at, b))
                break
            # the furthest break whose span still fits
            hard = self._starts[min(bisect.bisect_left(self._starts, at) + limit, len(self._starts) - 1)]
            hard = max(at + 1, min(hard, b))
            cut = -1
            for brk in _BREAKS:
                cut = text.rfind(brk, at + 1, hard)
                if cut > at:
                    cut += len(brk)
                    break
            out.append((at, cut if cut > at else hard))
            at = out[-1][1]
        return out

    # -- ranking --------------------------------------------------------------------------------
    @staticmethod
    def _words(texts: list[str]) -> list[list[str]]:
        """Each text's terms: its words but the stop words, and every pair of adjacent words
        (stop words included), so that a quoted phrase ranks the part holding it first."""
        out = []
        for t in texts:
            words = _WORD.findall(t.lower())
            out.append([w for w in words if w not in _STOP] + [f"{a} {b}" for a, b in zip(words, words[1:])])
        return out

    def _build_index(self):
        import bm25s

        corpus = self._words([self.document.text[p.start : p.end] for p in self.parts])
        index = bm25s.BM25()
        index.index(corpus, show_progress=False)
        self._vocab = index.vocab_dict
        return index

    def scores(self, question: str) -> list[float]:
        """BM25 score of every part for `question` (0 for a part sharing no word with it)."""
        words = [w for w in self._words([question])[0] if w in self._vocab]
        if not words:
            return [0.0] * len(self.parts)
        return [float(x) for x in self._index.get_scores(words)]

    def rank(self, question: str) -> list[int]:
        """Part indices, the best first, of the parts sharing a word with the question (ties: document order)."""
        s = self.scores(question)
        return sorted((i for i in range(len(s)) if s[i] > 0), key=lambda i: (-s[i], i))

    def pick(self, question: str, budget: int, previous: Sequence[int] = ()) -> list[int]:
        """The parts to read for `question` within `budget` tokens, in document order.

        `previous`: the parts the conversation read so far; those that still rank are kept.
        """
        ranked = self.rank(question)
        place = {i: r for r, i in enumerate(ranked)}
        if ranked and ranked[0] in previous and self.tokens(previous) <= budget:
            # The best part is read already: the read stays exactly as it is, since a part added
            # anywhere but at its end would re-prefill everything after it.
            return sorted(previous)
        still = set(self._fill(ranked, 2 * budget))  # keep what still ranks (read with twice the budget)
        kept = [i for i in previous if i in still]
        while ranked and ranked[0] not in kept and kept and self.tokens(kept) + self.parts[ranked[0]].tokens > budget:
            kept.remove(max(kept, key=lambda i: place.get(i, len(place))))  # room for the best part: drop the worst
        while self.tokens(kept) > budget:  # a smaller budget than before (a longer conversation)
            kept.remove(max(kept, key=lambda i: place.get(i, len(place))))
        return sorted(self._fill(ranked, budget, kept))

    def _fill(self, ranked: Sequence[int], budget: int, start: Sequence[int] = ()) -> list[int]:
        out, used = list(start), sum(self.parts[i].tokens for i in start)
        for i in ranked:
            if i not in out and used + self.parts[i].tokens <= budget:
                out.append(i)
                used += self.parts[i].tokens
        return out

    def tokens(self, picked: Sequence[int]) -> int:
        """About how many tokens `text(picked)` is (the tokenizer's count may differ by a few per part)."""
        return sum(self.parts[i].tokens for i in picked)

    # -- what is read ---------------------------------------------------------------------------
    def text(self, picked: Sequence[int]) -> str:
        """The picked parts in document order, each after a line naming it."""
        return "\n\n".join(self._header(self.parts[i]) + self.document.text[self.parts[i].start : self.parts[i].end].strip()
                           for i in sorted(picked)) + "\n"

    def describe(self, picked: Sequence[int]) -> list[dict]:
        """What was read, for a transcript: section number (its index, 1-based, as `ingest --json`
        lists them and `--sections` picks them; None for text outside any section), title (as the
        book writes it), which piece of a cut section, the part's name (`Part.name`: what a
        reader is shown), span, tokens."""
        out = []
        for i in sorted(picked):
            p = self.parts[i]
            out.append({"number": None if p.section is None else p.section + 1, "title": p.title or p.name,
                        "part": f"{p.piece} of {p.pieces}" if p.pieces > 1 else None, "name": p.name,
                        "start": p.start, "end": p.end, "tokens": p.tokens})
        return out


# English function words: they would make every part share a word with every question.
_STOP = frozenset("""a an and are as at be but by for from has have he her his i if in into is it its me my no not
of on or our she so than that the their them then there these they this those to was we were what when where which
who whom why will with would you your do does did can could should how about after before up down out over under
again further once here all any both each few more most other some such only own same too very s t just don now""".split())
