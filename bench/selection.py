"""Does the retrieval level do better when its chunks follow the target's own attention?

    python -m bench.selection [--context-tokens 32768] [--questions 6] [--max-new-tokens 64] [--json OUT]

One chat session over an N-token document (the bundled sample documents, repeated; a target
whose window is shorter gets its rope stretched, as in `bench.long_prefill`; the prefill is
kept in a disk cache under the system's temporary folder and read back on later runs). Each
question ("What follows «…»?" about a random passage, and open ones) is answered once per
configuration, regenerated in place, the order rotated per question, greedy: the answers
must agree. Configurations: each mode below with the selection ranked by the queries (today)
and by the attention the target gave each chunk (`CacheConfig.select_by`). Reported per
configuration: decode tokens/s, the retrieval level's acceptance by the target, tokens per
target forward, refreshes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.long_prefill import document, stretched
from triforce_core.config import PAPER_METHOD, CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import default_model_names
from triforce_core.serving.session import ChatSession

MODES = {
    "retrieval": dict(mode="retrieval", lookup=False),
    "paper": dict(mode="triforce", **PAPER_METHOD),
    "default": dict(mode="triforce"),
}


def questions(text: str, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = text.split()
    out = ["What is this document about?", "Explain the main idea of the last section."]
    while len(out) < n:
        i = rng.randrange(0, len(words) - 8)
        out.append(f"What follows «{' '.join(words[i:i + 6])}»?")
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--context-tokens", type=int, default=32768)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--refresh-every", type=int, default=CacheConfig.refresh_every)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    target, draft = default_model_names(a.target, a.draft)
    work = Path(tempfile.gettempdir()) / "triforce-bench-selection"
    work.mkdir(exist_ok=True)
    path = stretched(str(target), a.context_tokens + 512, work)
    engine = TriForceEngine.from_pretrained(path, draft, device="cpu", dtype="float32")
    engine.use_disk_cache(work / "kv")
    configs = {}
    for name in a.modes.split(","):
        for by in ("queries", "attention"):
            configs[f"{name}/{by}"] = GenerationConfig(
                speculation=SpeculationConfig(max_new_tokens=a.max_new_tokens, ignore_eos=True, **MODES[name]),
                cache=replace(CacheConfig(), refresh_every=a.refresh_every, select_by=by),
            )
    text = document(engine, a.context_tokens)
    session = ChatSession(engine, text)
    results = {name: [] for name in configs}
    names = list(configs)
    for qi, q in enumerate(questions(text, a.questions)):
        order = names[qi % len(names):] + names[: qi % len(names)]
        answers = {}
        for i, name in enumerate(order):
            events = session.ask(q, configs[name]) if i == 0 else session.regenerate(configs[name])
            for _ in events:
                pass
            turn = session.turns[-1]
            s = turn.stats
            answers[name] = turn.token_ids
            results[name].append({
                "tokens_per_s": s.tokens_per_s, "mean_accepted": s.mean_accepted,
                "retrieval_by_target": s.acceptance.get("target", 0.0), "prefill_s": s.prefill_s,
                "disk_tokens": s.disk_tokens,
            })
            print(f"q{qi} {name:22s} {s.tokens_per_s:6.1f} tok/s  {s.mean_accepted:.2f} tok/fwd  "
                  f"target acceptance {s.acceptance.get('target', 0):.2f}  prefill {s.prefill_s:.1f}s", file=sys.stderr)
        if len({tuple(v) for v in answers.values()}) != 1:
            print(f"q{qi}: ANSWERS DIFFER between configurations", file=sys.stderr)
            return 1
        session.turns.pop()  # keep the conversation at the document: every question sees the same prefix
        # (the next ask re-uses the document's cache; the popped answer's KV is rolled back)
    summary = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    for name, s in summary.items():
        print(f"{name:22s} {s['tokens_per_s']:6.1f} tok/s  {s['mean_accepted']:.2f} tok/fwd  "
              f"target acceptance {s['retrieval_by_target']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"context_tokens": a.context_tokens, "summary": summary,
                                            "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
