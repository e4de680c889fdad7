"""Reading documents nobody here wrote: for questions a reader would ask, is the passage that
answers them among what a question reads, under each reading rule; and, with `--answer`,
what the model answers from that reading.

    python -m bench.reading_study --root "$(rustc --print sysroot)/share/doc/rust/html" \\
        [--questions bench/questions/rust-docs.json] [--target smollm2] [--answer RULE ...] [--json OUT]

The questions file names documents (paths under ROOT) and, for each question, a phrase of
the passage that answers it (it must occur once in the document's text). A question's
passage is *read* when the part holding the phrase is among the parts picked for it
(`BookReader.pick`, a fresh conversation per question). Reported per rule: the share of
questions whose passage is read, whose part ranks first, and the tokens read.

The rules differ in the reading budget, the size of the parts (the budget divided by
`parts`: a section longer than that is cut at paragraph breaks) and at most how many parts a
question reads (`most`, 0: as many as fit). The default rule is the app's
(`serving.book.DEFAULT_READING_BUDGET`, parts of a quarter of it).

`--answer RULE`: each question asked through `BookSession` with that rule, the target's
default sampling made greedy (so a run repeats), up to `--max-new-tokens`; the answers go to
the report, to be judged by reading them. The window limits the budget as in the app.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    name: str
    budget: int
    parts: int = 4  # parts of budget // parts tokens at most
    most: int = 0  # at most this many parts (0: as many as fit the budget)

    def pick(self, reader, question: str, budget: int | None = None) -> list[int]:
        budget = self.budget if budget is None else budget
        picked = reader.pick(question, budget)
        if self.most and len(picked) > self.most:
            place = {i: r for r, i in enumerate(reader.rank(question))}
            picked = sorted(sorted(picked, key=lambda i: place[i])[: self.most])
        return picked


def rules(default_budget: int) -> list[Rule]:
    b = default_budget
    return [
        Rule("default", b),
        Rule("half budget", b // 2),
        Rule("1.5x budget", b * 3 // 2),
        Rule("finer parts (budget/8)", b, parts=8),
        Rule("coarser parts (budget/2)", b, parts=2),
        Rule("best 2 parts", b, most=2),
        Rule("best part only", b, most=1),
        Rule("finer parts, best 4", b, parts=8, most=4),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="folder the questions file's document paths are under")
    ap.add_argument("--questions", default=str(Path(__file__).parent / "questions" / "rust-docs.json"))
    ap.add_argument("--target", default="smollm2", help="its tokenizer counts tokens; its window limits the budget")
    ap.add_argument("--answer", nargs="*", default=[], metavar="RULE",
                    help="rules whose reading the target answers from (names as printed, e.g. default)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--companion-toc", action="store_true",
                    help="sections from the page's companion table of contents, as `chat` reads a file beside its "
                         "book (default: from the page alone, as the app reads an upload)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    from triforce_core.config import GenerationConfig, SpeculationConfig
    from triforce_core.documents import load_document
    from triforce_core.documents.reading import BookReader, token_starts
    from triforce_core.engine import TriForceEngine
    from triforce_core.models.loading import default_model_names
    from triforce_core.serving.book import DEFAULT_READING_BUDGET, BookSession

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    spec = json.loads(Path(args.questions).read_text())
    all_rules = rules(DEFAULT_READING_BUDGET)
    by_name = {r.name: r for r in all_rules}
    unknown = [n for n in args.answer if n not in by_name]
    if unknown:
        ap.error(f"unknown rule(s) {unknown}; rules: {', '.join(by_name)}")
    engine = TriForceEngine.from_pretrained(*default_model_names(args.target, None))
    log(f"target {args.target}: window {engine.context_window:,}")

    report = {"questions_file": Path(args.questions).name, "target": args.target, "window": engine.context_window,
              "companion_toc": args.companion_toc,
              "rules": [r.__dict__ for r in all_rules], "documents": []}
    totals = {r.name: {"read": 0, "first": 0, "tokens": [], "n": 0} for r in all_rules}
    for d in spec["documents"]:
        doc = load_document(str(Path(args.root) / d["path"]), companion_toc=args.companion_toc)
        starts = token_starts(engine.tokenizer, doc.text)
        readers = {}
        for r in all_rules:
            size = max(16, r.budget // r.parts)
            if size not in readers:
                readers[size] = BookReader(doc, starts, max_part_tokens=size)
        log(f"{d['name']}: {doc.chars:,} characters, {len(starts):,} tokens, {len(doc.sections)} sections")
        rows = []
        for q in d["questions"]:
            phrase = q["holding"]
            if doc.text.count(phrase) != 1:
                raise SystemExit(f"{d['name']}: the phrase {phrase!r} occurs {doc.text.count(phrase)} times, not once")
            at = doc.text.index(phrase)
            row = {"question": q["question"], "holding": phrase, "rules": {}}
            for r in all_rules:
                reader = readers[max(16, r.budget // r.parts)]
                holder = next(i for i, p in enumerate(reader.parts) if p.start <= at < p.end)
                ranked = reader.rank(q["question"])
                picked = r.pick(reader, q["question"])
                read, first = holder in picked, bool(ranked) and ranked[0] == holder
                t = totals[r.name]
                t["read"] += read
                t["first"] += first
                t["tokens"].append(reader.tokens(picked))
                t["n"] += 1
                row["rules"][r.name] = {"read": read, "rank": ranked.index(holder) + 1 if holder in ranked else None,
                                        "parts": len(picked), "tokens": reader.tokens(picked),
                                        "holding_part": reader.parts[holder].name}
            for name in args.answer:
                row["rules"][name]["answer"] = answer(engine, doc, readers[max(16, by_name[name].budget // by_name[name].parts)],
                                                      by_name[name], q["question"], args.max_new_tokens, at,
                                                      BookSession, GenerationConfig, SpeculationConfig)
                a = row["rules"][name]["answer"]
                log(f"  [{name}] {q['question']}\n    read {a['passage_read']}, {a['prompt_tokens']:,} prompt tokens, "
                    f"{a['seconds']:.1f} s: {a['text'][:200]!r}")
            rows.append(row)
        report["documents"].append({"name": d["name"], "path": d["path"], "chars": doc.chars, "tokens": len(starts),
                                    "sections": len(doc.sections), "questions": rows})
        for r in all_rules:
            read = sum(x["rules"][r.name]["read"] for x in rows)
            log(f"  {r.name:26} passage read {read}/{len(rows)}")
    report["summary"] = {}
    log(f"{'rule':26} {'passage read':>13} {'ranked first':>13} {'tokens read (median)':>21}")
    for r in all_rules:
        t = totals[r.name]
        report["summary"][r.name] = {"read": t["read"], "first": t["first"], "questions": t["n"],
                                     "tokens_median": statistics.median(t["tokens"])}
        log(f"{r.name:26} {t['read']:>6}/{t['n']:<6} {t['first']:>6}/{t['n']:<6} {statistics.median(t['tokens']):>21,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def answer(engine, doc, reader, rule: Rule, question: str, max_new_tokens: int, at: int,
           BookSession, GenerationConfig, SpeculationConfig) -> dict:
    """The target's answer from what `rule` reads, greedy with the model's repetition penalty."""
    sampling = engine.default_sampling()
    config = GenerationConfig(sampling=replace(sampling, temperature=0.0),
                              speculation=SpeculationConfig(max_new_tokens=max_new_tokens))
    session = BookSession(engine, doc, reading_budget=rule.budget, reader=reader)
    if rule.most:  # the rule's cap on parts, inside the session's own picking
        session.reader = _Capped(reader, rule)
    t0 = time.perf_counter()
    for _event in session.ask(question, config=config):
        pass
    turn = session.turns[-1]
    return {"text": turn.answer, "passage_read": any(s["start"] <= at < s["end"] for s in turn.sections_read),
            "sections_read": [s["title"] for s in turn.sections_read], "prompt_tokens": turn.stats.prefill_tokens,
            "seconds": round(time.perf_counter() - t0, 2)}


class _Capped:
    """A reader whose `pick` keeps at most `rule.most` parts, the rest of it the reader's own."""

    def __init__(self, reader, rule: Rule):
        self._reader, self._rule = reader, rule

    def pick(self, question: str, budget: int, previous=()) -> list[int]:
        return self._rule.pick(self._reader, question, budget)

    def __getattr__(self, name):
        return getattr(self._reader, name)


if __name__ == "__main__":
    sys.exit(main())
