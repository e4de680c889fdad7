"""Citations: the passages of the prompt the answer's retrieval selections read most.

    passages = cited_passages(selections, prompt_ids, engine.decode, k=3)
    # [{"tokens": [812, 820], "share": 0.75, "section": "Section 16: What is Ownership?", "text": "…"}]

The retrieval level attends, per layer and KV head, to the chunks whose keys score highest
against the target's current query (or, with `select_by="attention"`, to the chunks the
target's own attention weighs most); `ChunksSelected` says how many (layer, head) pairs chose
each chunk. Summed over every selection of one answer, that is where the model read while
writing it: the same measure as the app's most-read-passages panel, per answer. The chunks
every pair keeps anyway (the first, the attention sink, and the recent tokens) and those past
the prompt (the answer itself) are left out. Modes without a retrieval level (lookup, draft,
autoregressive) select nothing, so they cite no passage.

A passage's section is the last "[Section N: title]" line before it: the line `sections`
and `reading` write before each part of a book they read (None when there is none).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from .config import CacheConfig
from .events import ChunksSelected

_HEADER = re.compile(r"\[((?:Section \d+|Part \d+ of \d+|Opening)[^\]\n]*)\](?:\s|$)")


def cited_passages(selections: Sequence[ChunksSelected], prompt_ids: Sequence[int],
                   decode: Callable[[list[int]], str], *, k: int = 3, pad_chunks: int = 2,
                   max_chars: int = 240) -> list[dict]:
    """The k prompt chunks chosen by the largest share of (layer, head) pairs over `selections`.

    Each: "tokens" [start, end) in the prompt, "share" (of the pairs, averaged over the
    selections), "section" (the book's part it lies in, see the module docstring) and "text"
    (the chunk with `pad_chunks` chunks of context each side, decoded, whitespace folded).
    """
    real = [s for s in selections if not s.dense and s.heads_total]
    if not real or k <= 0:
        return []
    n = len(prompt_ids)
    totals: dict[tuple[int, int], float] = {}
    for s in real:
        recent_from = s.context_tokens - CacheConfig(budget=s.budget, chunk_size=s.chunk_size).recent
        for (a, b), count in zip(s.chunk_token_spans, s.scores_or_counts):
            if a > 0 and b <= min(n, recent_from):
                totals[(a, b)] = totals.get((a, b), 0.0) + count / s.heads_total
    best = sorted(totals.items(), key=lambda kv: (-kv[1], kv[0][0]))[:k]
    out = []
    for (a, b), total in sorted(best, key=lambda kv: -kv[1]):
        pad = pad_chunks * (b - a)
        text = " ".join(decode(list(prompt_ids[max(0, a - pad) : min(n, b + pad)])).split())
        headers = _HEADER.findall(decode(list(prompt_ids[:a])))
        out.append({"tokens": [a, b], "share": round(total / len(real), 4), "section": headers[-1] if headers else None,
                    "text": text[:max_chars] + ("…" if len(text) > max_chars else "")})
    return out
