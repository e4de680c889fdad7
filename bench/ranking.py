"""bm25s against rank-bm25 on one book's parts: index time, time per question, and whether the
part holding a quoted passage ranks first (the choice of ranker for `--sections auto`).

    python -m bench.ranking BOOK [--questions 30] [--budget 16384]

Both libraries get the same terms (`reading.BookReader._words`: words without stop words, and
adjacent word pairs) for the same parts, and the same "What follows «7 words»?" questions for
passages spread evenly over the book. rank-bm25 is imported here only (not a dependency).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("book")
    ap.add_argument("--questions", type=int, default=30)
    ap.add_argument("--budget", type=int, default=16_384)
    args = ap.parse_args(argv)

    import bm25s
    import numpy as np
    from rank_bm25 import BM25Okapi

    from bench.book import passages
    from triforce_core.documents.reading import token_starts
    from triforce_core.documents import load_document
    from transformers import AutoTokenizer

    from triforce_core.models.loading import default_model_names
    from triforce_core.documents.reading import BookReader

    doc = load_document(args.book, companion_toc=True)
    tok = AutoTokenizer.from_pretrained(default_model_names(None, None)[0])
    reader = BookReader(doc, token_starts(tok, doc.text), max_part_tokens=args.budget // 4)
    corpus = reader._words([doc.text[p.start : p.end] for p in reader.parts])
    qs = passages(doc.text, args.questions)
    questions = [reader._words([f"What follows «{q}»?"])[0] for _o, q, _f in qs]
    holders = [next(i for i, p in enumerate(reader.parts) if p.start <= o < p.end) for o, _q, _f in qs]

    def run(name, build, score):
        t0 = time.perf_counter()
        index = build()
        built = time.perf_counter() - t0
        times, first = [], 0
        for words, holder in zip(questions, holders):
            t0 = time.perf_counter()
            s = np.asarray(score(index, words))
            times.append(time.perf_counter() - t0)
            first += int(np.argmax(s)) == holder
        print(f"{name:10} index {built:6.2f} s   per question median {statistics.median(times) * 1000:7.2f} ms, "
              f"max {max(times) * 1000:7.2f} ms   passage's part first {first}/{len(questions)}")

    print(f"{doc.chars:,} characters, {reader.total_tokens:,} demo tokens, {len(reader.parts)} parts, "
          f"{sum(map(len, corpus)):,} terms, {len(questions)} questions", file=sys.stderr)

    def bm25s_build():
        index = bm25s.BM25()
        index.index(corpus, show_progress=False)
        return index

    def bm25s_score(index, words):
        known = [w for w in words if w in index.vocab_dict]
        return index.get_scores(known) if known else np.zeros(len(corpus))

    run("bm25s", bm25s_build, bm25s_score)
    run("rank-bm25", lambda: BM25Okapi(corpus), lambda index, words: index.get_scores(words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
