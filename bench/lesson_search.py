"""The lesson's question and settings, picked by what a model answers fluently over the sample.

The app's lesson (`ui.handlers.teaching`) asks one fixed question over the sample document in
mode triforce with the paper's three levels (no context lookup), sampled at a fixed temperature
and seed, with the lesson's retrieval budget. This runs each candidate (question x temperature x
seed x repetition penalty) as the lesson's page does: the sample opened as the app opens it for
the model's window (`bench.turn.open_session`), the teaching view's `inspect=True`, the app's
settings for everything the lesson leaves alone. Each answer is scored by the lesson's own check
(`fluency_problem`: at least 25 words, no 6-word run three times). The pick (`pick`, printed
last) is a question and temperature whose answers are fluent for every seed (a setting fluent by
one lucky draw alone is not picked), the lowest such temperature (a hotter one drifts off the
subject and into made-up strings that the check does not see), the first question given at it,
with its first seed. A question that holds a Markdown mark (`MARKS`) is not picked: its answers
quote it, and the page's Markdown would show «__init__()» as a bold «init()».

    python -m bench.lesson_search [--model smollm2] [--questions "What is a class?|..."]
                                  [--temperatures 0.3,0.6] [--seeds 1,2,3] [--penalties 1.2]
                                  [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from bench.reports import write_json
from bench.turn import MODELS, open_session
from triforce_core.decoding.events import Committed, Finished
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import default_model_names
from triforce_core.resources import SAMPLE_DOCUMENT
from triforce_core.serving.book import BookSession
from ui.handlers.teaching import LESSON_SETTINGS, fluency_problem, lesson_budget, repeated_run, words_of
from ui.settings import Settings

QUESTIONS = ("What is a class?", "What does the __init__() method of a class do?",
             "How does inheritance work in Python classes?", "What is the difference between class variables and "
             "instance variables?")


def lesson_config(engine: TriForceEngine, session, temperature: float, seed: int, penalty: float):
    """The lesson's generation config on `session`: its mode, no lookup, its budget, the rest the app's."""
    base = Settings().for_model(engine)
    context = session.reading_budget if isinstance(session, BookSession) else session.document_tokens
    return Settings(**{**base.__dict__, "mode": LESSON_SETTINGS["mode"], "lookup": False, "temperature": temperature,
                       "seed": seed, "repetition_penalty": penalty,
                       "budget": lesson_budget(context, base.chunk_size)}).config()


MARKS = ("_", "*", "`")  # Markdown's emphasis and code marks


def pick(results: list[dict]) -> dict | None:
    """Of the (question, temperature, repetition penalty) settings fluent for every seed, the one
    at the lowest temperature, first in the order run, its question free of `MARKS`: its first
    seed's row (None when none is)."""
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        groups.setdefault((row["question"], row["temperature"], row["repetition_penalty"]), []).append(row)
    fluent = [rows for rows in groups.values() if all(r["fluent"] for r in rows)
              and not any(mark in rows[0]["question"] for mark in MARKS)]
    return min(fluent, key=lambda rows: rows[0]["temperature"])[0] if fluent else None


def answer(session, question: str, config) -> tuple[str, int]:
    session.clear()
    text, tokens = [], 0
    for ev in session.ask(question, config, inspect=True):
        if isinstance(ev, Committed):
            text.append(ev.text)
        elif isinstance(ev, Finished):
            tokens = ev.stats.new_tokens
    return "".join(text), tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--questions", default="|".join(QUESTIONS), help="separated by |")
    p.add_argument("--temperatures", default="0.3,0.6")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--penalties", default="1.2", help="repetition penalties")
    p.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: PyTorch's)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.model not in MODELS:
        p.error(f"unknown model {a.model}: use {', '.join(MODELS)}")
    try:
        questions = [q.strip() for q in a.questions.split("|") if q.strip()]
        temperatures = [float(x) for x in a.temperatures.split(",")]
        seeds = [int(x) for x in a.seeds.split(",")]
        penalties = [float(x) for x in a.penalties.split(",")]
    except ValueError as e:
        p.error(f"a list holds something that is not a number: {e}")
    if not questions or any(t <= 0 for t in temperatures):
        p.error("give at least one question, and temperatures above 0 (the lesson samples)")
    if a.threads:
        torch.set_num_threads(a.threads)
    target, draft = default_model_names(MODELS[a.model], None)
    engine = TriForceEngine.from_pretrained(target, draft, device="cpu")
    session = open_session(engine, SAMPLE_DOCUMENT)
    results = []
    for question, temperature, seed, penalty in itertools.product(questions, temperatures, seeds, penalties):
        t0 = time.perf_counter()
        text, tokens = answer(session, question, lesson_config(engine, session, temperature, seed, penalty))
        problem = fluency_problem(text)
        row = {"question": question, "temperature": temperature, "seed": seed, "repetition_penalty": penalty,
               "new_tokens": tokens, "words": len(words_of(text)), "most_repeated_run": repeated_run(text),
               "fluent": problem is None, "problem": problem, "answer": text}
        results.append(row)
        print(f"[lesson] {question!r} t={temperature} seed={seed} penalty={penalty}: {row['words']} words, "
              f"6-word run x{row['most_repeated_run']}, {'fluent' if problem is None else problem} "
              f"({time.perf_counter() - t0:.0f}s)\n    {' '.join(text.split())}", file=sys.stderr, flush=True)
    chosen = pick(results)
    if chosen is None:
        print("no setting is fluent for every seed", file=sys.stderr)
    else:
        print(f"pick: {chosen['question']!r} temperature {chosen['temperature']} seed {chosen['seed']} "
              f"repetition penalty {chosen['repetition_penalty']}", file=sys.stderr)
    write_json(a.json, {"model": a.model, "draft": Path(draft).name if draft else None, "results": results,
                        "pick": chosen})
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
