"""Lookup's proposal rules replayed offline on recorded document chats.

Greedy decoding is deterministic: whatever proposes, the answer is the autoregressive one, and a
lookup run is accepted up to its first token that differs from it. So one autoregressive pass
over a workload (`bench.chat`'s questions, one `ChatSession` a document) records everything a
lookup setting would see, and the forward's cost by its number of rows (measured once, on the
target over a cache as long as the first document) prices every round. Each setting then replays
in milliseconds with the real index (`triforce_core.decoding.lookup.ContextIndex`) and the decoding
loop's run rule (`lookup_start`, doubling up to `lookup_max` while accepted whole; a backoff
token leaves the run as it was; no rows past the token limit).

This ranks settings over many workloads where a live run compares a few, with noise. It is a
model: a live `bench.chat` run checks what it finds (docs: Results, Benchmarks).

    python -m bench.lookup_replay --target smollm2 --document D [--document D2 ...] [--seeds 5,6] \\
        [--max-new-tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from triforce_core.config import GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.kv import FullCache
from triforce_core.decoding.lanes import Lane
from triforce_core.models.loading import default_model_names
from triforce_core.decoding.lookup import ContextIndex
from triforce_core.decoding.proposers import RIVAL_SLACK
from triforce_core.serving.session import ChatSession

from .chat import ChatBenchError, _answer, workload
from .level_steps import step_seconds

# name -> ContextIndex settings and run lengths
SETTINGS = {
    "plain": dict(rival_slack=None, backoff=False),
    "agree": dict(rival_slack=RIVAL_SLACK, backoff=False),
    "backoff": dict(rival_slack=None, backoff=True),
    "agree+backoff": dict(rival_slack=RIVAL_SLACK, backoff=True),  # the default
    "agree+backoff, longest 8": dict(rival_slack=RIVAL_SLACK, backoff=True, lookup_max=8),
    "agree+backoff, longest 12": dict(rival_slack=RIVAL_SLACK, backoff=True, lookup_max=12),
    "agree+backoff, start 3": dict(rival_slack=RIVAL_SLACK, backoff=True, lookup_start=3),
}
MAX_ROWS = 17


def record(engine: TriForceEngine, text: str, seed: int, max_new_tokens: int) -> list[dict]:
    """Each turn's prompt (the whole conversation so far) and greedy answer."""
    cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=max_new_tokens))
    session = ChatSession(engine, text)
    turns = []
    for _, question in workload(text, 4, 2, seed):
        prompt = session.prompt_ids(question)
        answer, _ = _answer(session.ask(question, cfg))
        turns.append({"prompt": prompt, "answer": answer})
    return turns


def forward_ms(engine: TriForceEngine, context: int, repeats: int = 7) -> dict[int, float]:
    """Median time of one target forward of 1..MAX_ROWS rows after `context` cached tokens."""
    model = engine.target
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, context + MAX_ROWS + 1,
                      engine.kv_dtype_for(GenerationConfig()), model.device)
    g = torch.Generator().manual_seed(0)
    shape = (s.num_layers, s.num_kv_heads, context, s.head_dim)
    cache.k[:, :, :context] = torch.randn(shape, generator=g)
    cache.v[:, :, :context] = torch.randn(shape, generator=g)
    cache.length = context
    lane = Lane(model, cache, model.vocab_size)
    lane.covered = context
    times: dict[int, list[float]] = {r: [] for r in range(1, MAX_ROWS + 1)}
    order = list(times)
    for i in range(repeats + 1):
        for rows in order if i % 2 == 0 else order[::-1]:  # alternated: drift slows all alike
            dt = step_seconds(lane, rows)
            if i:
                times[rows].append(dt)
    return {r: sorted(v)[len(v) // 2] * 1e3 for r, v in times.items()}


def replay(turns: list[dict], cost: dict[int, float], rival_slack: int | None, backoff: bool,
           lookup_start: int = 4, lookup_max: int = 16, min_match: int = 3, max_new_tokens: int = 64) -> dict:
    """Decode every turn's answer again as the default loop would with these lookup settings."""
    ms = 0.0
    tokens = rounds = proposed = accepted = 0
    for turn in turns:
        prompt, answer = turn["prompt"], turn["answer"]
        index = ContextIndex(min_match=min_match, rival_slack=rival_slack, backoff=backoff)
        index.reset(prompt)
        seq, done, run = list(prompt), 0, lookup_start
        while done < len(answer):
            longest = min(run, lookup_max, max_new_tokens - done - 1)  # no rows past the token limit
            prop, length = index.propose(seq, longest) if longest > 0 else ([], 0)
            ok = 0
            while ok < len(prop) and done + ok < len(answer) and prop[ok] == answer[done + ok]:
                ok += 1
            if prop and length >= min_match:
                run = min(2 * run, lookup_max) if ok == len(prop) else lookup_start
            new = answer[done : done + ok + 1]
            ms += cost[min(len(prop) + 1, MAX_ROWS)]
            rounds += 1
            proposed += len(prop)
            accepted += ok
            seq += new
            index.extend(new)
            done += len(new)
        tokens += len(answer)
    return {"tokens_per_s": tokens / ms * 1e3, "speedup": tokens * cost[1] / ms, "rounds": rounds,
            "proposed": proposed, "accepted": accepted}


def replay_all(workloads: dict[str, list[dict]], cost: dict[int, float], max_new_tokens: int = 64) -> dict:
    """Every setting of SETTINGS on every workload, and the geometric mean of their speed-ups."""
    out = {}
    for name, s in SETTINGS.items():
        per = {w: replay(turns, cost, max_new_tokens=max_new_tokens, **s) for w, turns in workloads.items()}
        geo = math.exp(sum(math.log(r["speedup"]) for r in per.values()) / len(per))
        out[name] = {"workloads": per, "geomean_speedup": geo}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lookup_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the embedded demo target)")
    p.add_argument("--document", type=Path, action="append", required=True, help="a text file (repeatable)")
    p.add_argument("--seeds", default="5", help="comma-separated: each picks a workload's quoted phrases (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--json", type=Path, help="write the recorded turns' sizes, the costs and the results here")
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        if not seeds:
            raise ValueError("--seeds is empty")
        texts = {}
        for d in a.document:
            if not d.is_file():
                raise ChatBenchError(f"no such document: {d}")
            texts[d.name] = d.read_text(encoding="utf-8", errors="replace")
        for text in texts.values():
            workload(text, 4, 2, seeds[0])  # too short a document fails here, before any loading
    except (ChatBenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    t, d = default_model_names(a.target, None)
    engine = TriForceEngine.from_pretrained(t, d)
    workloads = {}
    for name, text in texts.items():
        for seed in seeds:
            workloads[f"{name}, seed {seed}"] = record(engine, text, seed, a.max_new_tokens)
            print(f"[replay] recorded {name}, seed {seed}", file=sys.stderr)
    context = len(next(iter(workloads.values()))[0]["prompt"])
    cost = forward_ms(engine, context)
    print(f"[replay] forward ms by rows at {context} tokens: "
          + ", ".join(f"{r}: {c:.1f}" for r, c in cost.items()), file=sys.stderr)
    results = replay_all(workloads, cost, a.max_new_tokens)
    names = list(workloads)
    print(f"{'setting':28s} {'geomean':>8s}  " + "  ".join(names))
    for name, r in results.items():
        print(f"{name:28s} {r['geomean_speedup']:7.3f}x  "
              + "  ".join(f"{r['workloads'][w]['speedup']:.2f}x" for w in names))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "model": Path(t).name, "forward_ms_by_rows": cost, "context": context,
            "workloads": {w: [len(x["prompt"]) for x in turns] for w, turns in workloads.items()},
            "max_new_tokens": a.max_new_tokens, "results": results,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
