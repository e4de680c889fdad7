"""Citations: the passages of the prompt an answer read most, or else the passages it quotes.

    passages = answer_passages(selections, prompt_ids, answer_ids, engine.detokenize, question_tokens=12,
                               within=(5, 8200), document=session.document)
    # [{"tokens": [812, 820], "share": 0.75, "section": "4.1. What is Ownership?", "text": "…",
    #   "kind": "read"}]

The retrieval level attends, per layer and KV head, to the chunks whose keys score highest
against the target's current query (or, with `select_by="attention"`, to the chunks the
target's own attention weighs most); `ChunksSelected` says how many (layer, head) pairs chose
each chunk. Summed over every selection of one answer, that is where the model read while
writing it: the same measure as the app's most-read-passages panel, per answer. The chunks
every pair keeps anyway (the first, the attention sink, and the recent tokens) and those past
the prompt (the answer itself) are left out. Modes without a retrieval level (lookup, draft,
autoregressive) select nothing: there an answer cites the passages it quotes instead.

Quoted passages (`quoted_passages`, "kind": "quoted"): the stretches of the prompt the answer
repeats verbatim, at least `min_tokens` tokens long (found left to right, the longest earlier
occurrence first, as context lookup finds what to copy); "share" is the part of the answer's
tokens quoted from that passage. The question and what follows it in the prompt are not
searched: an answer that repeats the question quotes nothing.

A passage is the document's or nothing: with `within` (the prompt tokens that hold the
document) only those tokens are searched or counted, never the system prompt, the template,
the conversation's earlier answers or the question; with `document` (its text) a passage
whose text, folded (case and whitespace aside, the lines naming the parts a book's reading
adds left out), is not found in the document's folded text is dropped. An earlier answer
that the model repeats is therefore never shown as the book's.

A passage's section is the last "[Section: title]" line before it (or "[Text from «…»]" for
text without headings): the line `picking` and `reading` write before each part of a book they
read, the title as the book writes it, its own number included (None when there is none).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..config import CacheConfig
from ..decoding.events import ChunksSelected
from .sections import part_names, split_at_part_lines, without_part_lines

QUESTION_MARGIN = 16  # the chat template's tokens after the question, and a little more


def _fold(text: str) -> str:
    """Text compared as the document's: the part lines out, case folded, no whitespace, and no
    replacement characters (a token that ends inside a character decodes to one)."""
    return "".join(without_part_lines(text).casefold().replace("\ufffd", "").split())


class DocumentText:
    """A document's folded text, to ask whether a passage's text is the document's."""

    def __init__(self, text: str):
        self._folded = _fold(text)

    def holds(self, text: str) -> bool:
        """Whether every stretch of `text` between part lines is in the document (folded)."""
        pieces = [p if p in self._folded else self._trim(p) for p in map(_fold, split_at_part_lines(text))]
        pieces = [p for p in pieces if p]
        return bool(pieces) and all(p in self._folded for p in pieces)

    @staticmethod
    def _trim(piece: str) -> str:
        """A stretch of tokens cut through a part line: that line's end ('beta]…') and start ('…[sect') out."""
        close = piece.find("]")
        if close >= 0 and "[" not in piece[:close]:
            piece = piece[close + 1 :]
        start = piece.rfind("[")
        if start >= 0 and "]" not in piece[start:]:
            piece = piece[:start]
        return piece


def _bounds(prompt_ids: Sequence[int], within: tuple[int, int] | None) -> tuple[int, int]:
    n = len(prompt_ids)
    return (0, n) if within is None else (max(0, within[0]), min(n, within[1]))


def _checker(decode: Callable[[list[int]], str], prompt: list[int], document: str | None):
    """(a, b) -> whether prompt tokens [a, b) decode to text of `document` (always, without one)."""
    if document is None:
        return lambda a, b: True
    text = DocumentText(document)
    return lambda a, b: text.holds(decode(prompt[a:b]))


def cited_passages(selections: Sequence[ChunksSelected], prompt_ids: Sequence[int],
                   decode: Callable[[list[int]], str], *, k: int = 3, pad_chunks: int = 2,
                   max_chars: int = 240, within: tuple[int, int] | None = None,
                   document: str | None = None) -> list[dict]:
    """The k prompt chunks chosen by the largest share of (layer, head) pairs over `selections`.

    Each: "tokens" [start, end) in the prompt, "share" (of the pairs, averaged over the
    selections), "section" (the book's part it lies in, see the module docstring) and "text"
    (the chunk with `pad_chunks` chunks of context each side, decoded, whitespace folded).
    `within` and `document`: only chunks of the document (see the module docstring).
    """
    real = [s for s in selections if not s.dense and s.heads_total]
    if not real or k <= 0:
        return []
    lo, hi = _bounds(prompt_ids, within)
    totals: dict[tuple[int, int], float] = {}
    for s in real:
        recent_from = s.context_tokens - CacheConfig(budget=s.budget, chunk_size=s.chunk_size).recent
        for (a, b), count in zip(s.chunk_token_spans, s.scores_or_counts):
            if a > 0 and a >= lo and b <= min(hi, recent_from):
                totals[(a, b)] = totals.get((a, b), 0.0) + count / s.heads_total
    prompt = list(prompt_ids)
    ours = _checker(decode, prompt, document)
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0][0]))
    best = [(span, total) for span, total in ranked if ours(*span)][:k]
    return [_passage(prompt, a, b, pad_chunks * (b - a), total / len(real), "read", decode, max_chars, (lo, hi))
            for (a, b), total in best]


def _passage(prompt: list[int], a: int, b: int, pad: int, share: float, kind: str,
             decode: Callable[[list[int]], str], max_chars: int, bounds: tuple[int, int]) -> dict:
    """One citation: prompt tokens [a, b) with `pad` tokens of context each side (inside
    `bounds`, the document's tokens), decoded, the part lines out and whitespace folded, under the
    last part line before it."""
    lo, hi = bounds
    text = " ".join(without_part_lines(decode(prompt[max(lo, a - pad) : min(hi, b + pad)])).split())
    headers = part_names(decode(prompt[:a]))
    return {"tokens": [a, b], "share": round(share, 4), "section": headers[-1] if headers else None,
            "text": text[:max_chars] + ("…" if len(text) > max_chars else ""), "kind": kind}


def quoted_passages(answer_ids: Sequence[int], prompt_ids: Sequence[int], decode: Callable[[list[int]], str], *,
                    end: int | None = None, k: int = 3, min_tokens: int = 8, pad_tokens: int = 16,
                    max_chars: int = 240, within: tuple[int, int] | None = None,
                    document: str | None = None) -> list[dict]:
    """The k passages of `prompt_ids[:end]` the answer repeats most tokens of, verbatim runs of at
    least `min_tokens` tokens; quotes closer than `pad_tokens` in the prompt make one passage.
    `within` and `document`: only passages of the document (see the module docstring)."""
    lo, hi = _bounds(prompt_ids, within)
    hi = min(hi, len(prompt_ids) if end is None else max(0, end))
    prompt = list(prompt_ids[:hi])
    answer = list(answer_ids)
    if k <= 0 or len(answer) < min_tokens or hi - lo < min_tokens:
        return []
    starts: dict[tuple[int, ...], list[int]] = {}
    for i in range(lo, len(prompt) - min_tokens + 1):
        starts.setdefault(tuple(prompt[i : i + min_tokens]), []).append(i)
    quotes: list[tuple[int, int]] = []  # [start, end) in the prompt
    i = 0
    while i + min_tokens <= len(answer):
        best_at, best_len = -1, 0
        for at in starts.get(tuple(answer[i : i + min_tokens]), ()):
            m = min_tokens
            while i + m < len(answer) and at + m < len(prompt) and answer[i + m] == prompt[at + m]:
                m += 1
            if m > best_len:
                best_at, best_len = at, m
        if best_len:
            quotes.append((best_at, best_at + best_len))
            i += best_len
        else:
            i += 1
    if not quotes:
        return []
    ours = _checker(decode, prompt, document)
    quotes = [q for q in quotes if ours(*q)]
    merged: list[list[int]] = []  # [start, end, quoted tokens]
    for a, b in sorted(quotes):
        if merged and a <= merged[-1][1] + pad_tokens:
            merged[-1][1] = max(merged[-1][1], b)
            merged[-1][2] += b - a
        else:
            merged.append([a, b, b - a])
    best = sorted(merged, key=lambda m: (-m[2], m[0]))[:k]
    return [_passage(prompt, a, b, pad_tokens, quoted / len(answer), "quoted", decode, max_chars, (lo, hi))
            for a, b, quoted in best]


def question_tokens(tokenizer, question: str) -> int:
    """Prompt tokens, counted from its end, that hold `question` and the template after it."""
    if tokenizer is None:
        return QUESTION_MARGIN
    return len(tokenizer(question, add_special_tokens=False)["input_ids"]) + QUESTION_MARGIN


def answer_passages(selections: Sequence[ChunksSelected], prompt_ids: Sequence[int], answer_ids: Sequence[int],
                    decode: Callable[[list[int]], str], *, question_tokens: int, k: int = 3,
                    within: tuple[int, int] | None = None, document: str | None = None) -> list[dict]:
    """An answer's citations: what its retrieval selections read most, else what it quotes
    from the prompt before the question (`question_tokens`: the question and the template
    tokens after it, counted from the prompt's end); with `within` (the document's tokens in
    the prompt) and `document` (its text), only passages of the document."""
    return (cited_passages(selections, prompt_ids, decode, k=k, within=within, document=document)
            or quoted_passages(answer_ids, prompt_ids, decode, end=len(prompt_ids) - question_tokens, k=k,
                               within=within, document=document))
