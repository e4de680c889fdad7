"""How long SmolLM2's chat answers are, to pick the app's default answer limit.

Asks varied questions over the bundled sample (over SmolLM2's window, so each question reads
the sections most relevant to it, as the page does: a `BookSession`) with the app's default
settings (its default mode, the model's default sampling) and a large limit, each question in
a conversation of its own. Prints one JSON line per answer (its length in tokens, whether it
ended by EOS) and, at the end, one with the sorted lengths and their 90th percentile.

    python -m scripts.measure_answer_lengths [--target smollm2] [--limit 1024] [--questions N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

QUESTIONS = (
    "What is a class in Python?",
    "How do I define a method that belongs to a class?",
    "What does the __init__ method do?",
    "Explain the difference between class variables and instance variables.",
    "How does inheritance work in Python?",
    "What is multiple inheritance and how are methods resolved?",
    "What are private variables in Python classes?",
    "What is a namespace and what is a scope?",
    "How do iterators and generators relate to classes?",
    "Give an example of a class with a method that uses self.",
    "What does the nonlocal statement do?",
    "Summarize the main ideas of this tutorial in a few sentences.",
)


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile: the smallest value with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--limit", type=int, default=1024)
    p.add_argument("--questions", type=int, default=10)
    args = p.parse_args(argv)

    import torch

    from triforce_core import TriForceEngine
    from triforce_core.documents import load_document
    from triforce_core.resources import SAMPLE_DOCUMENT
    from triforce_core.serving.book import BookSession
    from triforce_core.serving.registry import app_model_names
    from ui.settings import Settings

    torch.set_num_threads(1)  # a shared machine: one core
    target, draft = app_model_names(args.target, None)
    engine = TriForceEngine.from_pretrained(target, draft, device="cpu")
    settings = replace(Settings().for_model(engine), max_new_tokens=args.limit)
    config = settings.config()
    doc = load_document(SAMPLE_DOCUMENT)
    lengths, ended = [], []
    for question in QUESTIONS[: args.questions]:
        session = BookSession(engine, doc, config=config)
        t0 = time.perf_counter()
        for _ in session.ask(question):
            pass
        turn = session.turns[-1]
        n, eos = turn.stats.new_tokens, turn.stats.stop_reason == "eos"
        lengths.append(n)
        ended.append(eos)
        print(json.dumps({"question": question, "tokens": n, "eos": eos, "seconds": round(time.perf_counter() - t0, 1),
                          "answer_start": turn.answer[:120]}), flush=True)
        session.release()
    print(json.dumps({"mode": settings.mode, "repetition_penalty": settings.repetition_penalty,
                      "temperature": settings.temperature, "limit": args.limit, "lengths": sorted(lengths),
                      "ended_by_eos": sum(ended), "of": len(ended), "p90": percentile(lengths, 0.9)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
