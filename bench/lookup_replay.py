"""Lookup's proposal rules replayed offline on recorded document chats.

Greedy decoding is deterministic, with or without a repetition penalty: whatever proposes, the
answer is the autoregressive one, and a lookup proposal is accepted up to its first token that
differs from it (each verification row is penalized by its own prefix, `decoding.penalties`, so
while a proposal equals the answer every row's law is the one autoregressive decoding had
there). So one autoregressive pass over a workload (`bench.chat`'s questions, one `ChatSession` a
document) records everything a lookup setting would see, and the forward's cost by its number
of rows (measured once per document, on the target over a cache as long as its first prompt)
prices every round. Each setting then replays in milliseconds with the real index
(`triforce_core.decoding.lookup.ContextIndex`) and the decoding loop's length rule: the price
of a row (`schedule.LookupLength`, at the c these forwards give, `row_cost.row_cost_of`); no
rows past the token limit.

This ranks settings over many workloads where a live run compares a few, with noise. It is a
model: a live `bench.chat` run checks what it finds (docs: Results, Benchmarks).

    python -m bench.lookup_replay --target smollm2 --document D [--document D2 ...] [--seeds 5,6] \\
        [--repetition-penalty 1.2,1] [--max-new-tokens 64] [--recording TURNS.json] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from triforce_core.config import GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.decoding.lanes import Lane
from triforce_core.decoding.lookup import ContextIndex
from triforce_core.decoding.proposers import RIVAL_SLACK
from triforce_core.decoding.row_cost import ROWS, row_cost_of
from triforce_core.decoding.schedule import LookupLength
from triforce_core.engine import TriForceEngine
from triforce_core.kv import FullCache
from triforce_core.models.loading import default_model_names
from triforce_core.serving.session import ChatSession

from .chat import ChatBenchError, _answer, workload
from .level_steps import step_seconds

# name -> ContextIndex settings and the proposal length's rule, the price of a row
# (`schedule.LookupLength` at the row cost these forwards give, times `scale`; `learn`: its
# acceptance counted in the generation, else its prior alone; `cost_rows`: the wider forward c is
# measured with). Unnamed fields are the decoder's defaults.
SETTINGS = {
    "cost": dict(),  # the default
    "cost, prior only": dict(learn=False),
    "cost, longest 16": dict(lookup_max=16),
    "cost, c x 0.75": dict(scale=0.75),
    "cost, c x 1.5": dict(scale=1.5),
    "cost, c from 2 rows": dict(cost_rows=2),
    "cost, c from 9 rows": dict(cost_rows=9),
    "cost, no rival cut": dict(rival_slack=None),
    "cost, no backoff": dict(backoff=False),
}
MAX_ROWS = 17
_SPEC = SpeculationConfig()


def record(engine: TriForceEngine, text: str, seed: int, max_new_tokens: int,
           repetition_penalty: float = 1.0) -> list[dict]:
    """Each turn's prompt (the whole conversation so far) and greedy answer (with the penalty).

    A penalty keeps greedy decoding deterministic and the replay's acceptance right: each row of
    a verification is penalized by its own prefix (`decoding.penalties`), so while a proposal
    equals the recorded answer, every row's law is the one autoregressive decoding had there, and
    a proposed token is accepted exactly when it is the recorded one."""
    cfg = GenerationConfig(sampling=SamplingConfig(repetition_penalty=repetition_penalty),
                           speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=max_new_tokens))
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


def replay(turns: list[dict], cost: dict[int, float], rival_slack: int | None = RIVAL_SLACK,
           backoff: bool = _SPEC.lookup_backoff, lookup_max: int = _SPEC.lookup_max, min_match: int = _SPEC.lookup_min_match, max_new_tokens: int = 64,
           scale: float = 1.0, learn: bool = True, cost_rows: int = ROWS) -> dict:
    """Decode every turn's answer again as the loop would with these lookup settings (`SETTINGS`)."""
    price = scale * row_cost_of(cost[1], cost[cost_rows], cost_rows)
    ms = 0.0
    tokens = rounds = proposed = accepted = 0
    for turn in turns:
        prompt, answer = turn["prompt"], turn["answer"]
        index = ContextIndex(min_match=min_match, rival_slack=rival_slack, backoff=backoff)
        index.reset(prompt)
        length = LookupLength(price, learn=learn)
        seq, done = list(prompt), 0
        while done < len(answer):
            longest = min(lookup_max, max_new_tokens - done - 1)  # no rows past the token limit
            prop, match = index.propose(seq, longest) if longest > 0 else ([], 0)
            prop = prop[: length.take(match, len(prop))]
            ok = 0
            while ok < len(prop) and done + ok < len(answer) and prop[ok] == answer[done + ok]:
                ok += 1
            length.update(match, len(prop), ok)
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
            "proposed": proposed, "accepted": accepted, "row_cost": price}


def replay_all(workloads: dict[str, list[dict]], costs: dict[str, dict[int, float]], max_new_tokens: int = 64,
               groups: dict[str, list[str]] | None = None) -> dict:
    """Every setting of SETTINGS on every workload (priced by `costs[workload]`), and the
    geometric mean of their speed-ups over all and over each of `groups` (name -> workloads)."""
    out = {}
    for name, s in SETTINGS.items():
        per = {w: replay(turns, costs[w], max_new_tokens=max_new_tokens, **s) for w, turns in workloads.items()}
        out[name] = {"workloads": per, "geomean_speedup": _geomean(per.values())}
        for g, members in (groups or {}).items():
            out[name][f"geomean_speedup, {g}"] = _geomean(per[w] for w in members)
    return out


def _geomean(results) -> float:
    logs = [math.log(r["speedup"]) for r in results]
    return math.exp(sum(logs) / len(logs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lookup_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the embedded demo target)")
    p.add_argument("--document", type=Path, action="append", required=True, help="a text file (repeatable)")
    p.add_argument("--seeds", default="5", help="comma-separated: each picks a workload's quoted phrases (default 5)")
    p.add_argument("--repetition-penalty", default="1.0",
                   help="comma-separated: each records every workload greedy with that penalty (default 1: off; "
                        "an instruct model's default is 1.2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--recording", type=Path,
                   help="the recorded answers: read from this file where it holds a workload, else recorded and "
                        "added to it (a replay of new settings then needs no model run but the forward's timing)")
    p.add_argument("--json", type=Path, help="write the recorded turns' sizes, the costs and the results here")
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        penalties = [float(x) for x in a.repetition_penalty.split(",") if x.strip()]
        if not seeds or not penalties:
            raise ValueError("--seeds or --repetition-penalty is empty")
        for r in penalties:
            SamplingConfig(repetition_penalty=r)  # a bad penalty fails here, before any loading
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
    kept = json.loads(a.recording.read_text()) if a.recording and a.recording.is_file() else {}
    workloads, document_of, groups = {}, {}, {}
    for r in penalties:
        for name, text in texts.items():
            for seed in seeds:
                w = f"{name}, seed {seed}, penalty {r:g}"
                if w not in kept:
                    kept[w] = record(engine, text, seed, a.max_new_tokens, r)
                    print(f"[replay] recorded {w}", file=sys.stderr)
                    if a.recording:
                        a.recording.write_text(json.dumps(kept))
                workloads[w], document_of[w] = kept[w], name
                groups.setdefault(f"penalty {r:g}", []).append(w)
    # Each document's forwards are timed over as long a cache as its first question's prompt.
    contexts = {name: len(workloads[next(w for w in workloads if document_of[w] == name)][0]["prompt"])
                for name in texts}
    by_document = {}
    for name, context in contexts.items():
        by_document[name] = forward_ms(engine, context)
        print(f"[replay] {name}: forward ms by rows at {context} tokens: "
              + ", ".join(f"{r}: {c:.1f}" for r, c in by_document[name].items()), file=sys.stderr)
    costs = {w: by_document[document_of[w]] for w in workloads}
    results = replay_all(workloads, costs, a.max_new_tokens, groups)
    names = list(workloads)
    print(f"{'setting':28s} {'geomean':>8s}  " + "  ".join(f"{g:>11s}" for g in groups) + "  " + "  ".join(names))
    for name, r in results.items():
        print(f"{name:28s} {r['geomean_speedup']:7.3f}x  "
              + "  ".join(f"{r[f'geomean_speedup, {g}']:10.3f}x" for g in groups) + "  "
              + "  ".join(f"{r['workloads'][w]['speedup']:.2f}x" for w in names))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "model": Path(t).name, "forward_ms_by_rows": by_document, "contexts": contexts,
            "row_cost": {name: row_cost_of(c[1], c[ROWS]) for name, c in by_document.items()},
            "threads": torch.get_num_threads(),
            "workloads": {w: [len(x["prompt"]) for x in turns] for w, turns in workloads.items()},
            "max_new_tokens": a.max_new_tokens, "results": results,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
