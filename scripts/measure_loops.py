"""Count looping answers of a chat model under several sampling settings (the figures of the
SmolLM2 section of assets/models/README.md, "Default sampling").

Each question is asked alone (a fresh conversation) about the first `--chars` characters of a
document; an answer counts as looping when some 8-token sequence occurs 3 or more times in it.
Greedy settings run once per question, sampled ones once per seed.

    python -m scripts.measure_loops --target smollm2 \\
        --setting greedy --setting rp=1.2 --setting T=0.6,top_p=0.9,rp=1.1 [--json OUT]

A setting is comma-separated: T (temperature), top_p, rp (repetition_penalty), fp
(frequency_penalty), pp (presence_penalty); "greedy" is T=0 with no penalty.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.serving.session import ChatSession

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("What is a namespace?", "What is a class?", "How does inheritance work in Python?")
KEYS = {"T": "temperature", "top_p": "top_p", "rp": "repetition_penalty", "fp": "frequency_penalty",
        "pp": "presence_penalty"}


def loops(ids: list[int], n: int = 8, times: int = 3) -> bool:
    """Whether some n-token sequence occurs `times` or more times in `ids` (overlaps count)."""
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return any(c >= times for c in grams.values())


def parse_setting(text: str) -> SamplingConfig:
    if text == "greedy":
        return SamplingConfig()
    kw = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in KEYS:
            raise SystemExit(f"unknown key {key!r} in setting {text!r} (one of {', '.join(KEYS)})")
        kw[KEYS[key]] = float(value)
    return SamplingConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--document", default=str(ROOT / "assets/sample/python-tutorial-classes.txt"))
    p.add_argument("--chars", type=int, default=16000)
    p.add_argument("--setting", action="append", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mode", default="lookup")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    engine = TriForceEngine.from_pretrained(args.target)
    text = Path(args.document).read_text(encoding="utf-8")[: args.chars]
    session = ChatSession(engine, text)
    spec = SpeculationConfig(mode=args.mode, max_new_tokens=args.max_new_tokens)
    seeds = [int(s) for s in args.seeds.split(",")]
    report = []
    for setting in args.setting:
        sampling = parse_setting(setting)
        runs = []
        for q in QUESTIONS:
            for seed in ([None] if sampling.greedy else seeds):
                session.clear()  # each question alone; the document's K/V stays cached
                cfg = GenerationConfig(sampling=replace(sampling, seed=seed), speculation=spec)
                for _ in session.ask(q, cfg):
                    pass
                turn = session.turns[-1]
                runs.append({"question": q, "seed": seed, "looping": loops(turn.token_ids),
                             "tokens": len(turn.token_ids), "tokens_per_s": round(turn.stats.tokens_per_s, 1),
                             "answer": turn.answer})
                print(f"[{setting}] {q} seed={seed} looping={runs[-1]['looping']}: {turn.answer!r}",
                      file=sys.stderr, flush=True)
        looping = sum(r["looping"] for r in runs)
        report.append({"setting": setting, "sampling": {k: getattr(sampling, k) for k in KEYS.values()},
                       "looping": looping, "answers": len(runs), "runs": runs})
        print(f"{setting}: {looping}/{len(runs)} looping", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "chars": args.chars, "mode": args.mode,
                                               "max_new_tokens": args.max_new_tokens, "report": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
