"""Asking a whole book: quote questions spread over a book beyond the window,
each read with `--sections auto`'s picking, and follow-ups that should reuse the cached read.

    python -m bench.book BOOK.html [--questions 6] [--budget 16384] [--json OUT]

For each of N passages at evenly spread places of the book (prose paragraphs whose first
words occur once in it), a fresh conversation asks "What follows «first words»?" and the
target answers greedily. Reported per question: whether the answer goes on with the
passage's next words (its first 7 words, then the next 8 words, whitespace folded),
whether `sections_read` holds the passage, the ranking time, prefill time and the turn's time.
Then a follow-up in the same conversation quotes another passage of the same part: the share
of the window it re-prefills.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path


def passages(text: str, n: int, words: int = 7) -> list[tuple[int, str, str]]:
    """(offset, quote, what follows) for `n` prose paragraphs at evenly spread places: the
    first paragraph at or after each place whose first `words` words occur once in the book."""
    out = []
    for k in range(n):
        at = int(len(text) * (k + 0.5) / n)
        for m in re.finditer(r"\n\n([^\n]{200,})", text[at:]):
            para = m.group(1)
            tokens = para.split()
            if sum(c.isalpha() for c in para) < 0.75 * len(para) or len(tokens) < 2 * words + 8:
                continue
            quote = " ".join(tokens[:words])
            if text.count(quote) != 1:
                continue
            out.append((at + m.start(1), quote, " ".join(tokens[words:words + 8])))
            break
    return out


def second_passage(text: str, part, quote: str) -> tuple[str, str] | None:
    """Another quotable passage inside the same part (for a follow-up), or None."""
    body = text[part.start:part.end]
    for m in re.finditer(r"\n\n([^\n]{200,})", body):
        tokens = m.group(1).split()
        q = " ".join(tokens[:7])
        if q != quote and text.count(q) == 1 and len(tokens) > 22:
            return q, " ".join(tokens[7:15])
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("book")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--follow-ups", type=int, default=3, help="how many of the questions get a follow-up")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    from triforce_core.documents.reading import token_starts
    from triforce_core.serving.book import DEFAULT_READING_BUDGET, BookSession
    from triforce_core.config import DEFAULT_MODE, GenerationConfig, SpeculationConfig
    from triforce_core.documents import load_document
    from triforce_core.engine import TriForceEngine
    from triforce_core.models.loading import default_model_names
    from triforce_core.documents.reading import BookReader

    engine = TriForceEngine.from_pretrained(*default_model_names(None, None))
    budget = args.budget or DEFAULT_READING_BUDGET
    t0 = time.perf_counter()
    doc = load_document(args.book, companion_toc=True)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    starts = token_starts(engine.tokenizer, doc.text)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader = BookReader(doc, starts, max_part_tokens=max(16, budget // 4))
    t_index = time.perf_counter() - t0
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(f"{Path(args.book).name}: {doc.chars:,} characters, {len(starts):,} tokens, {len(doc.sections)} sections, "
        f"{len(reader.parts)} parts; load {t_load:.2f}s, tokenize {t_tok:.2f}s, index {t_index:.2f}s; budget {budget:,}")

    def part_of(offset: int) -> int:
        return next(i for i, p in enumerate(reader.parts) if p.start <= offset < p.end)

    def ask(session, quote: str, follows: str) -> dict:
        question = f"What follows «{quote}»?"
        echo = len(engine.encode(quote))
        config = GenerationConfig(speculation=SpeculationConfig(mode=DEFAULT_MODE, max_new_tokens=echo + 24,
                                                                ignore_eos=True))
        t = time.perf_counter()
        ranked_t = time.perf_counter()
        reader.rank(question)
        rank_s = time.perf_counter() - ranked_t
        for _ev in session.ask(question, config=config):
            pass
        turn = session.turns[-1]
        answer = " ".join(turn.answer.split())
        want = f"{quote} {follows}"
        offset = doc.text.index(quote)
        return {
            "question": question, "where": round(offset / len(doc.text), 3),
            "next_words_ok": answer.startswith(want),
            "answer": turn.answer[:160],
            "passage_read": any(s["start"] <= offset < s["end"] for s in turn.sections_read),
            "sections_read": [(s["number"], s["title"], s["part"]) for s in turn.sections_read],
            "rank_s": round(rank_s, 4), "prefill_tokens": turn.stats.prefill_tokens,
            "reused_tokens": turn.stats.reused_tokens, "prefill_s": round(turn.stats.prefill_s, 2),
            "turn_s": round(time.perf_counter() - t, 2),
        }

    rows, follow = [], []
    for k, (offset, quote, follows) in enumerate(passages(doc.text, args.questions)):
        session = BookSession(engine, doc, reading_budget=budget, reader=reader)
        row = ask(session, quote, follows)
        rows.append(row)
        log(f"Q{k + 1} at {row['where']:.0%}: next words {'ok' if row['next_words_ok'] else 'MISS'}, "
            f"passage read {row['passage_read']}, rank {row['rank_s'] * 1000:.1f} ms, "
            f"prefill {row['prefill_tokens']:,} in {row['prefill_s']}s, turn {row['turn_s']}s | {row['answer'][:90]!r}")
        if k < args.follow_ups:
            other = second_passage(doc.text, reader.parts[part_of(offset)], quote)
            if other is not None:
                f = ask(session, *other)
                f["window_share"] = round(f["prefill_tokens"] / engine.context_window, 4)
                follow.append(f)
                log(f"  follow-up: prefilled {f['prefill_tokens']:,} ({f['window_share']:.2%} of the window), "
                    f"reused {f['reused_tokens']:,}, next words {'ok' if f['next_words_ok'] else 'MISS'}, "
                    f"prefill {f['prefill_s']}s, turn {f['turn_s']}s")
    report = {
        "book": Path(args.book).name, "chars": doc.chars, "tokens": len(starts), "sections": len(doc.sections),
        "parts": len(reader.parts), "budget": budget, "window": engine.context_window,
        "load_s": round(t_load, 2), "tokenize_s": round(t_tok, 2), "index_s": round(t_index, 2),
        "next_words_ok": sum(r["next_words_ok"] for r in rows),
        "passage_read": sum(r["passage_read"] for r in rows), "questions": rows, "follow_ups": follow,
    }
    log(f"next words {report['next_words_ok']}/{len(rows)}, "
        f"passage read {report['passage_read']}/{len(rows)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
