"""One whole turn on the sample document, per model, as the app runs it: the time to the first
token and to the end of the answer.

Each model (the embedded demo pair, SmolLM2 with its draft) opens the app's sample document as
the app does: whole where it fits the model's window, else read by relevance (a `BookSession`,
the sections most relevant to the question within the reading budget). Then it answers the
question with its default settings (the default mode for that prompt, the model's default
sampling), from an empty cache each time (no disk cache): prefill plus answer. `--modes`
adds other modes on the same turn, e.g. autoregressive decoding to compare. Models and modes
alternate within each repeat; medians are reported.

    python -m bench.turn [--models demo,smollm2] [--modes default,autoregressive] [--repeats 3]
                         [--question "What is a class?"] [--max-new-tokens 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.reports import write_json
from triforce_core.serving.book import BookSession
from triforce_core.config import DEFAULT_MODE, GenerationConfig, SpeculationConfig
from triforce_core.documents import load_document
from triforce_core.engine import TriForceEngine
from triforce_core.decoding.events import Committed, Finished, Prefilled
from triforce_core.models.gguf_file import SMOLLM2
from triforce_core.models.loading import default_model_names
from triforce_core.resources import SAMPLE_DOCUMENT
from triforce_core.serving.session import ChatSession

MODELS = {"demo": None, SMOLLM2: SMOLLM2}


def open_session(engine: TriForceEngine, path: Path):
    """The sample as the app opens it for this engine's window."""
    doc = load_document(path)
    if len(engine.encode(doc.text)) > engine.context_window:
        return BookSession(engine, doc)
    return ChatSession(engine, doc.text)


def one_turn(session, question: str, config: GenerationConfig) -> dict:
    session.release()
    session.clear()
    t0 = time.perf_counter()
    first = None
    prefill_tokens = 0
    text = []
    stats = None
    for ev in session.ask(question, config):
        if isinstance(ev, Prefilled):
            prefill_tokens += ev.tokens
        elif isinstance(ev, Committed):
            if first is None and ev.token_ids:
                first = time.perf_counter() - t0
            text.append(ev.text)
        elif isinstance(ev, Finished):
            stats = ev.stats
    whole = time.perf_counter() - t0
    return {"first_token_s": first, "turn_s": whole, "prefill_tokens": prefill_tokens,
            "new_tokens": stats.new_tokens, "prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
            "answer": "".join(text)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="demo,smollm2", help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--modes", default="default", help="comma-separated: default (what the app runs) and/or any mode")
    p.add_argument("--document", type=Path, default=SAMPLE_DOCUMENT, help="default: the app's sample document")
    p.add_argument("--question", default="What is a class?")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: PyTorch's)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        p.error(f"unknown model {unknown[0] if unknown else '(none)'}: use {', '.join(MODELS)}")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    sessions = {}
    for name in names:
        target, draft = default_model_names(MODELS[name], None)
        engine = TriForceEngine.from_pretrained(target, draft, device="cpu")
        session = open_session(engine, a.document)
        prompt = len(session.prompt_for(a.question)) if not isinstance(session, BookSession) else None
        sessions[name] = (engine, session, prompt, draft)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.repeats):
        for name, (engine, session, prompt, _) in sessions.items():
            for mode in modes:
                m = DEFAULT_MODE if mode == "default" else mode
                config = GenerationConfig(sampling=engine.default_sampling(),
                                          speculation=SpeculationConfig(mode=m, max_new_tokens=a.max_new_tokens))
                out = one_turn(session, a.question, config)
                runs.setdefault((name, mode), []).append({**out, "mode": m})
                print(f"[turn] {r + 1}/{a.repeats} {name} {mode} ({m}): first token {out['first_token_s']:.2f}s, "
                      f"turn {out['turn_s']:.2f}s, {out['prefill_tokens']} prefilled, {out['new_tokens']} new",
                      file=sys.stderr, flush=True)
    report = {"document": a.document.name, "question": a.question, "max_new_tokens": a.max_new_tokens,
              "threads": torch.get_num_threads(), "results": []}
    for (name, mode), rs in runs.items():
        engine, session, _, draft = sessions[name]
        med = lambda k: statistics.median(x[k] for x in rs)  # noqa: E731
        report["results"].append({
            "model": name, "draft": Path(draft).name if draft else None, "mode": mode, "ran": rs[0]["mode"],
            "read": "sections by relevance" if isinstance(session, BookSession) else "whole document",
            "prefill_tokens": rs[0]["prefill_tokens"], "new_tokens": rs[0]["new_tokens"],
            "first_token_s": med("first_token_s"), "turn_s": med("turn_s"),
            "decode_tokens_per_s": statistics.median(x["new_tokens"] / x["decode_s"] for x in rs if x["decode_s"]),
            "answer": rs[0]["answer"]})
    print(f"{'model':<10}{'mode':<34}{'read':<24}{'prompt':>8}{'new':>6}{'first token':>13}{'turn':>8}{'tok/s':>8}",
          file=sys.stderr)
    for x in report["results"]:
        print(f"{x['model']:<10}{x['mode'] + ' (' + x['ran'] + ')':<34}{x['read']:<24}{x['prefill_tokens']:>8}"
              f"{x['new_tokens']:>6}{x['first_token_s']:>12.2f}s{x['turn_s']:>7.2f}s{x['decode_tokens_per_s']:>8.1f}",
              file=sys.stderr)
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
