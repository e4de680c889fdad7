"""The workload benchmark: chat about a long document, the way the app's users do.

    python -m bench.chat                                 # bundled held-out document, greedy
    python -m bench.chat --temperature 0.6 --json artifacts/bench/chat-t06.json
    python -m bench.chat --document book.txt --quotes 6 --open 2 --configs triforce,autoregressive

One `ChatSession` (chat template, prefix reuse) holds one conversation over the document: a
mix of quote questions ("What follows «…»?", phrases picked from the document by `--seed`)
and open questions. Every configuration answers every turn, in an order that rotates from
turn to turn, on the same cached conversation (`ChatSession.rerun_last`), so a disturbance
of the shared machine hits every configuration alike; the first one's answer stays in the
conversation. The document is prefilled once (once per K/V dtype when configurations differ in
it, `+kv_dtype-NAME`: each dtype holds the conversation in a session of its own, fed the same
answers). Figures are pooled over the turns: decode
tokens/s = new tokens / decode seconds, its ratio to our autoregressive decoding, tokens per
target forward, acceptance per level and per (proposer, verifier) pair, and the time of one
round broken down by level. Greedy: every configuration's answers are compared with the
autoregressive ones, token for token.

With `--llama-cpp` (a GGUF target: a .gguf file or `smollm2`), llama.cpp runs after ours on the
same model file and the first turn's prompt as the chat template renders it (`bench.llama_cpp`):
its prompt processing against our prefill of the document, and its generation at that depth
and llama-lookup's decoding against every configuration's decode speed.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import torch

from triforce_core.models import int8
from triforce_core.cli.bench_report import load_average, machine_info
from triforce_core.config import PAPER_METHOD, CacheConfig, ConfigError, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.decoding.events import Committed, Finished
from triforce_core.decoding.row_cost import measured_row_cost
from triforce_core.models.loading import default_model_names
from triforce_core.models.transformer import Transformer
from triforce_core.resources import SAMPLE_DIR
from triforce_core.serving.session import ChatSession

from triforce_core.models.gguf_file import GGUFError, is_gguf, resolve

from bench.llama_cpp import PeerError, find_or_build, format_table, peer_figures
from bench.reports import write_json

DOCUMENT = SAMPLE_DIR / "python-tutorial-data-structures-modules.txt"
OPEN_QUESTIONS = (
    "What is a module?",
    "How do I sort a list?",
    "Explain list comprehensions.",
    "What does the del statement do?",
)

# Named configurations: what each field differs in from the default SpeculationConfig.
CONFIGS: dict[str, dict] = {
    "triforce": {"mode": "triforce"},  # the three levels with lookup in front (the app's default is lookup)
    "triforce-paper": {**PAPER_METHOD, "mode": "triforce"},  # the paper's three levels alone
    "triforce-fixed-gamma": {"mode": "triforce", "adaptive_gamma": False},
    "triforce-match2": {"mode": "triforce", "lookup_min_match": 2},
    "triforce-gate": {"mode": "triforce", "min_confidence": 0.5},
    "retrieval": {"mode": "retrieval"},
    "retrieval-paper": {**PAPER_METHOD, "mode": "retrieval"},
    "draft": {"mode": "draft"},
    "draft-paper": {**PAPER_METHOD, "mode": "draft"},
    "lookup": {"mode": "lookup"},
    "lookup-no-agree": {"mode": "lookup", "lookup_agree": False},
    "lookup-no-backoff": {"mode": "lookup", "lookup_backoff": False},
    "lookup-plain": {"mode": "lookup", "lookup_agree": False, "lookup_backoff": False},
    "autoregressive": {"mode": "autoregressive"},
}
DEFAULT_CONFIGS = ("triforce", "triforce-paper", "retrieval", "lookup", "autoregressive")
# "NAME+inspect": the same configuration with inspect=True (the teaching view's cost);
# "NAME+pytorch-attention": with the native few-row attention kernel off (its gain);
# "NAME+pytorch-layers": with the native decoder layers off (theirs); "NAME+per-layer": the native
# layers called per layer from Python instead of one call for all (the one call's gain); "NAME+FIELD-N": an integer
# field of the cache or speculation settings set to N ("+budget-8192": the retrieval level attends
# to 8,192 tokens; a probability threshold takes
# a fraction: "+draft_confidence-0.5"); "NAME+kv_dtype-float16": the
# caches keep K/V in that dtype (default: the engine's). Any of them, in any order.
INSPECT = "+inspect"
PYTORCH_ATTENTION = "+pytorch-attention"
PYTORCH_LAYERS = "+pytorch-layers"
PER_LAYER = "+per-layer"
SUFFIXES = (INSPECT, PYTORCH_ATTENTION, PYTORCH_LAYERS, PER_LAYER)
SETTING = re.compile(r"\+([a-z][a-z0-9_]*)-(\d+(?:\.\d+)?)$")
KV_SETTING = re.compile(r"\+kv_dtype-([a-z0-9]+)$")
# "NAME+products-MODE": the models' products over GGUF blocks in that `int8` mode (0, int8, int8x2,
# fast; default: the engine's), set for that configuration's answers only.
PRODUCTS_SETTING = re.compile(r"\+products-([a-z0-9]+)$")
# (Not max_new_tokens, which --max-new-tokens sets for all, nor prefill_chunk: the configurations
# share one prefilled conversation.)
TUNABLE = {f.name: "cache" for f in fields(CacheConfig) if f.type in ("int", int) and f.name != "prefill_chunk"} | {
    f.name: "speculation" for f in fields(SpeculationConfig) if f.type in ("int", int) and f.name != "max_new_tokens"}
# and the speculation's probability thresholds: "+draft_confidence-0.5", "+min_confidence-0.3",
# and the price of a verification row: "+lookup_row_cost-0.3"
FRACTIONS = {f.name for f in fields(SpeculationConfig) if f.type in ("float", float, "float | None")}
TUNABLE |= {name: "speculation" for name in FRACTIONS}


def split_name(name: str) -> tuple[str, set[str]]:
    """"lookup+inspect" -> ("lookup", {"+inspect"}); "retrieval+budget-8192" -> ("retrieval", {"+budget-8192"})."""
    flags = set()
    while True:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None and (m := SETTING.search(name) or KV_SETTING.search(name) or PRODUCTS_SETTING.search(name)):
            suffix = m.group(0)
        if suffix is None:
            return name, flags
        flags.add(suffix)
        name = name.removesuffix(suffix)


def settings_of(flags: set[str]) -> dict[str, dict]:
    """The settings "+FIELD-N" and "+kv_dtype-NAME" flags ask for: {"cache": {...}, "speculation": {...}}."""
    out: dict[str, dict] = {"cache": {}, "speculation": {}}
    for f in flags:
        if PRODUCTS_SETTING.search(f):
            continue  # products_of
        if m := KV_SETTING.search(f):
            if "kv_dtype" in out["cache"]:
                raise ChatBenchError("a configuration sets kv_dtype twice")
            out["cache"]["kv_dtype"] = m.group(1)  # CacheConfig checks the name
            continue
        m = SETTING.search(f)
        if m is None:
            continue
        field, text = m.group(1), m.group(2)
        if field not in TUNABLE:
            raise ChatBenchError(f"+{field}-N: no integer setting {field!r} (one of {', '.join(sorted(TUNABLE))})")
        if field not in FRACTIONS and "." in text:
            raise ChatBenchError(f"+{field}-N: {field} takes an integer, not {text}")
        value = float(text) if field in FRACTIONS else int(text)
        if field in out[TUNABLE[field]]:
            raise ChatBenchError(f"a configuration sets {field} twice")
        out[TUNABLE[field]][field] = value
    return out


def products_of(flags: set[str]) -> int | None:
    """The `int8` mode a "+products-MODE" flag asks for (None: the engine's own)."""
    for f in flags:
        if m := PRODUCTS_SETTING.search(f):
            if m.group(1) not in int8.MODE_WORDS:
                raise ChatBenchError(f"+products-MODE takes one of {', '.join(int8.MODE_WORDS)}, not {m.group(1)!r}")
            return int8.MODE_WORDS[m.group(1)]
    return None


def _answer_as(name: str, start, models=()) -> tuple[list[int], object]:
    """Run `start(inspect)` to its end as configuration `name` asks (inspection, the kernel, the
    products of `models`)."""
    flags = split_name(name)[1]
    one_call = Transformer.one_call
    Transformer.one_call = PER_LAYER not in flags
    own = [m.arithmetic for m in models]
    mode = products_of(flags)
    try:
        for m in models:
            m.arithmetic = replace(m.arithmetic, products=m.arithmetic.products if mode is None else mode,
                                   native_attention=PYTORCH_ATTENTION not in flags,
                                   native_layers=PYTORCH_LAYERS not in flags)
        return _answer(start(INSPECT in flags))
    finally:
        Transformer.one_call = one_call
        for m, before in zip(models, own):
            m.arithmetic = before


class ChatBenchError(ValueError):
    """Bad input: reported as one line, exit code 2."""


def quote_questions(text: str, count: int, seed: int, words: int = 7) -> list[str]:
    """`count` questions "What follows «phrase»?" about phrases that occur once in `text`."""
    starts = [m.start() for m in re.finditer(r"(?<=\s)\S", text)]
    if len(starts) < 4 * words:
        raise ChatBenchError("the document is too short for quote questions")
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(200 * max(count, 1)):
        if len(out) == count:
            break
        i = rng.randrange(len(starts) - words - 1)
        phrase = text[starts[i] : starts[i + words]].strip()
        if "\n" in phrase or "«" in phrase or "»" in phrase or text.count(phrase) != 1:
            continue
        q = f"What follows «{phrase}»?"
        if q not in out:
            out.append(q)
    if len(out) < count:
        raise ChatBenchError(f"found only {len(out)} unique phrases for {count} quote questions")
    return out


def workload(text: str, quotes: int, open_count: int, seed: int) -> list[tuple[str, str]]:
    """(kind, question) turns: quote and open questions interleaved, quotes first."""
    qs = [("quote", q) for q in quote_questions(text, quotes, seed)]
    os_ = [("open", q) for q in OPEN_QUESTIONS[:open_count]]
    turns: list[tuple[str, str]] = []
    while qs or os_:
        if qs:
            turns.append(qs.pop(0))
        if qs:
            turns.append(qs.pop(0))
        if os_:
            turns.append(os_.pop(0))
    return turns


def make_config(name: str, sampling: SamplingConfig, max_new_tokens: int) -> GenerationConfig:
    name, flags = split_name(name)
    if name not in CONFIGS:
        raise ChatBenchError(f"unknown configuration {name!r}: use a comma-separated list of {', '.join(CONFIGS)} "
                             f"(each optionally with {' and/or '.join(SUFFIXES)} and +FIELD-N)")
    settings = settings_of(flags)
    try:
        spec = SpeculationConfig(**{"max_new_tokens": max_new_tokens, **CONFIGS[name], **settings["speculation"]})
        cache = CacheConfig(**settings["cache"])
    except ConfigError as e:
        raise ChatBenchError(f"{name}: {e}") from None
    return GenerationConfig(sampling=sampling, speculation=spec, cache=cache)


def _answer(events) -> tuple[list[int], object]:
    ids: list[int] = []
    stats = None
    for ev in events:
        if isinstance(ev, Committed):
            ids += ev.token_ids
        elif isinstance(ev, Finished):
            stats = ev.stats
    return ids, stats


def _add(total: dict, stats) -> None:
    total["new_tokens"] += stats.new_tokens
    total["decode_s"] += stats.decode_s
    total["rounds"] += stats.rounds
    for key in ("proposed", "accepted", "proposed_by_proposer", "level_seconds", "level_calls"):
        for k, v in getattr(stats, key).items():
            total[key][k] = total[key].get(k, 0) + v
    for k, n in stats.proposed_by_proposer.items():
        acc = stats.acceptance_by_proposer.get(k, 0.0) * n
        total["accepted_by_proposer"][k] = total["accepted_by_proposer"].get(k, 0) + acc


def _empty() -> dict:
    return {"new_tokens": 0, "decode_s": 0.0, "rounds": 0, "proposed": {}, "accepted": {},
            "proposed_by_proposer": {}, "accepted_by_proposer": {}, "level_seconds": {}, "level_calls": {}}


def _summary(t: dict) -> dict:
    rounds = max(t["rounds"], 1)
    return {
        "tokens_per_s": t["new_tokens"] / t["decode_s"] if t["decode_s"] else 0.0,
        "new_tokens": t["new_tokens"],
        "decode_s": t["decode_s"],
        "rounds": t["rounds"],
        "tokens_per_target_forward": t["new_tokens"] / rounds,
        "acceptance": {k: t["accepted"].get(k, 0) / v for k, v in t["proposed"].items() if v},
        "acceptance_by_proposer": {k: t["accepted_by_proposer"].get(k, 0) / v
                                   for k, v in t["proposed_by_proposer"].items() if v},
        "round_ms_by_level": {k: 1e3 * v / rounds for k, v in t["level_seconds"].items()},
        "round_ms": 1e3 * t["decode_s"] / rounds,
        "calls_per_round": {k: v / rounds for k, v in t["level_calls"].items()},
    }


def run(engine: TriForceEngine, text: str, turns: list[tuple[str, str]], names: list[str],
        sampling: SamplingConfig, max_new_tokens: int, say=print, repeats: int = 1, peer=None) -> dict:
    """Every configuration answers every turn `repeats` times, in an order that rotates from one
    pass to the next (a noisy machine then slows every configuration alike). `peer(prompt_text,
    prompt_tokens)`, if given, runs afterwards on the first turn's prompt (`bench.llama_cpp`)."""
    configs = {n: make_config(n, sampling, max_new_tokens) for n in names}
    # One session per K/V dtype (a cache of one dtype cannot stand for another's), all holding one
    # conversation: the turns the first answer of each question appends are shared.
    kv = {n: engine.kv_dtype_for(configs[n]) for n in names}
    # named explicitly: the default depends on the native kernel, which "+pytorch-attention" turns off
    configs = {n: replace(c, cache=replace(c.cache, kv_dtype=str(kv[n]).removeprefix("torch."))) for n, c in configs.items()}
    models = [m for m in (engine.target, engine.draft) if m is not None]
    for n in names:
        products_of(split_name(n)[1])  # a bad mode: one line before the prefill
    sessions = {}
    for n in names:
        sessions.setdefault(kv[n], ChatSession(engine, text))
    session = sessions[kv[names[0]]]

    def ask_first(n, question, config, inspect):
        """`question` asked anew by configuration n; every session then holds its turn."""
        def events():
            owner = sessions[kv[n]]
            yield from owner.ask(question, config, inspect=inspect)
            for other in sessions.values():
                other.turns = list(owner.turns)
        return events()

    t0 = time.perf_counter()
    # Warm-up: the document's prefill (shared by every turn after it) and each configuration once.
    prefills = {}  # each K/V dtype's session prefills the document in its first warm-up turn
    for i, n in enumerate(names):
        warm = replace(configs[n], speculation=replace(configs[n].speculation, max_new_tokens=4))
        _, stats = _answer_as(n, lambda inspect: ask_first(n, "Hello.", warm, inspect) if i == 0
                              else sessions[kv[n]].rerun_last(warm, inspect=inspect), models)
        prefills.setdefault(str(kv[n]).removeprefix("torch."), stats)
    prefill_s = time.perf_counter() - t0
    say(f"[chat] document {session.document_tokens} tokens; prefill and warm-up {prefill_s:.1f}s")
    prefilled = session.turns[0].stats  # the first warm-up turn prefilled the document
    if len(prefills) > 1:
        say("[chat] prefill of the document by K/V dtype: " + ", ".join(
            f"{d} {(p.prompt_tokens - p.reused_tokens) / p.prefill_s:.1f} tok/s" for d, p in prefills.items()))
    for s in sessions.values():
        s.clear()
    first_prompt = (session.prompt_text(turns[0][1]), len(session.prompt_ids(turns[0][1]))) if peer else None
    totals = {n: _empty() for n in names}
    kinds: dict[str, dict[str, dict]] = {}
    rows = []
    for k, (kind, question) in enumerate(turns):
        answers: dict[str, list[int]] = {}
        row = {"kind": kind, "question": question, "tokens_per_s": {}, "new_tokens": {}}
        per_turn = {n: _empty() for n in names}
        for rep in range(repeats):
            shift = (k * repeats + rep) % len(names)
            for j, n in enumerate(names[shift:] + names[:shift]):
                first = rep == 0 and j == 0
                ids, stats = _answer_as(n, lambda inspect: ask_first(n, question, configs[n], inspect) if first
                                        else sessions[kv[n]].rerun_last(configs[n], inspect=inspect), models)
                if answers.setdefault(n, ids) != ids and sampling.greedy:
                    raise RuntimeError(f"{n} answered turn {k + 1} differently on a repeat")
                for total in (totals[n], kinds.setdefault(kind, {}).setdefault(n, _empty()), per_turn[n]):
                    _add(total, stats)
                say(f"[chat] turn {k + 1}/{len(turns)} ({kind}) {n}: {stats.new_tokens} tokens, "
                    f"{stats.tokens_per_s:.1f} tok/s, {stats.mean_accepted:.2f} per target forward")
        for n in names:
            row["tokens_per_s"][n] = _summary(per_turn[n])["tokens_per_s"]
            row["new_tokens"][n] = len(answers[n])
        row["token_ids"] = answers  # each configuration's answer (its first, where repeats differ)
        if sampling.greedy and "autoregressive" in answers:
            ref = answers["autoregressive"]
            row["identical_to_autoregressive"] = {n: a == ref for n, a in answers.items()}
        row["answer"] = session.turns[-1].answer
        rows.append(row)
    results = {}
    for n in names:
        s = _summary(totals[n])
        s["by_kind"] = {kind: _summary(per[n]) for kind, per in kinds.items()}
        if sampling.greedy and "autoregressive" in names:
            s["identical_to_autoregressive"] = all(r["identical_to_autoregressive"][n] for r in rows)
        results[n] = s
    if "autoregressive" in results:
        base = results["autoregressive"]
        for n, s in results.items():
            s["speedup_vs_autoregressive"] = s["tokens_per_s"] / base["tokens_per_s"]
            for kind, ks in s["by_kind"].items():
                ks["speedup_vs_autoregressive"] = ks["tokens_per_s"] / base["by_kind"][kind]["tokens_per_s"]
    report = {
        "document_tokens": session.document_tokens,
        "turns": rows,
        "configs": {n: {"speculation": CONFIGS[split_name(n)[0]], "inspect": INSPECT in split_name(n)[1],
                        "native_attention": PYTORCH_ATTENTION not in split_name(n)[1],
                        "native_layers": PYTORCH_LAYERS not in split_name(n)[1],
                        "one_call": PER_LAYER not in split_name(n)[1],
                        "budget": make_config(n, sampling, max_new_tokens).cache.budget,
                        "kv_dtype": str(kv[n]).removeprefix("torch."),
                        "products": int8.LEVEL_NAMES[next(m for m in (products_of(split_name(n)[1]),
                                                                      engine.target.arithmetic.products) if m is not None)],
                        "settings": settings_of(split_name(n)[1]),
                        "row_cost": row_cost_of_config(engine, configs[n], kv[n])} for n in names},
        "results": results,
        "prefill_by_kv_dtype": {d: {"tokens": p.prompt_tokens - p.reused_tokens, "seconds": p.prefill_s,
                                    "tokens_per_s": (p.prompt_tokens - p.reused_tokens) / p.prefill_s}
                                for d, p in prefills.items()},
        "temperature": sampling.temperature,
        "repetition_penalty": sampling.repetition_penalty,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
    }
    if peer is not None:
        report["llama_cpp"] = compare_with_peer(peer, first_prompt, prefilled, results, rows[0]["tokens_per_s"], say)
    return report


def row_cost_of_config(engine: TriForceEngine, config: GenerationConfig, kv_dtype) -> float | None:
    """The price of a verification row lookup's proposals were sized by (None: no such rule ran)."""
    spec = config.speculation
    if not spec.uses_lookup:
        return None
    return spec.lookup_row_cost if spec.lookup_row_cost is not None else measured_row_cost(engine.target, kv_dtype)


def compare_with_peer(peer, first_prompt: tuple[str, int], prefilled, results: dict, first_turn: dict, say) -> dict:
    """llama.cpp's figures on the first turn's prompt, with our prefill rate (the document's, in the
    warm-up) against its prompt processing and each configuration's decode speed (over all turns,
    and on the first turn, the one llama-lookup answers) against its generation at that depth and
    against llama-lookup; {"error": ...} when the peer failed."""
    try:
        figures = peer(*first_prompt)
    except PeerError as e:
        say(f"[chat] llama.cpp: {e}")
        return {"error": str(e)}
    ours = prefilled.prefill_tokens / prefilled.prefill_s
    lookup = (figures["lookup"] or {}).get("tokens_per_s")
    figures["ours"] = {
        "prefill_tokens": prefilled.prefill_tokens,
        "prefill_s": prefilled.prefill_s,
        "prefill_tokens_per_s": ours,
        "prefill_vs_prompt_processing": ours / figures["prompt_processing"]["best"],
        "decode_vs_generation": {n: s["tokens_per_s"] / figures["generation"]["best"] for n, s in results.items()},
        "decode_vs_lookup": {n: s["tokens_per_s"] / lookup for n, s in results.items()} if lookup else None,
        "first_turn_decode_vs_lookup": {n: r / lookup for n, r in first_turn.items()} if lookup else None,
    }
    return figures


def print_table(report: dict, file=sys.stderr) -> None:
    print(f"document {report['document_tokens']} tokens, {len(report['turns'])} turns, "
          f"T={report['temperature']}, {report['max_new_tokens']} new tokens per answer", file=file)
    print(f"{'configuration':<20}{'tok/s':>8}{'vs AR':>8}{'quote':>8}{'open':>8}{'tok/fwd':>9}{'round ms':>10}"
          f"  identical  time per round by level (ms)", file=file)
    for n, s in report["results"].items():
        kinds = s["by_kind"]
        q = kinds.get("quote", {}).get("speedup_vs_autoregressive")
        o = kinds.get("open", {}).get("speedup_vs_autoregressive")
        f = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
        levels = ", ".join(f"{k} {v:.1f}" for k, v in s["round_ms_by_level"].items())
        print(f"{n:<20}{s['tokens_per_s']:>8.1f}{f(s.get('speedup_vs_autoregressive')):>8}{f(q):>8}{f(o):>8}"
              f"{s['tokens_per_target_forward']:>9.2f}{s['round_ms']:>10.1f}  {str(s.get('identical_to_autoregressive', '-')):<9}  {levels}",
              file=file)
    costs = {n: c["row_cost"] for n, c in report["configs"].items() if c.get("row_cost") is not None}
    if costs:
        print("a verification row's price (lookup's proposal length): "
              + ", ".join(f"{n} {c:.2f} of a step" for n, c in costs.items()), file=file)
    if "llama_cpp" in report:
        print_peer(report["llama_cpp"], file)


def print_peer(peer: dict, file) -> None:
    """llama.cpp's figures and our ratios to them, under the table."""
    if "error" in peer:
        print(f"llama.cpp: {peer['error']}", file=file)
        return
    print(format_table(peer), file=file)
    ours = peer["ours"]
    print(f"our prefill: {ours['prefill_tokens']} tokens at {ours['prefill_tokens_per_s']:.1f} tok/s = "
          f"{ours['prefill_vs_prompt_processing']:.2f}x llama.cpp's prompt processing", file=file)
    print(f"{'configuration':<20}{'vs llama.cpp generation':>25}{'vs llama-lookup':>17}{'turn 1 vs llama-lookup':>24}",
          file=file)
    lk, first = ours["decode_vs_lookup"], ours["first_turn_decode_vs_lookup"]
    for n, r in ours["decode_vs_generation"].items():
        print(f"{n:<20}{f'{r:.2f}x':>25}{(f'{lk[n]:.2f}x' if lk else '-'):>17}{(f'{first[n]:.2f}x' if first else '-'):>24}",
              file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the embedded demo target)")
    p.add_argument("--draft", help="draft model (default: the embedded demo draft)")
    p.add_argument("--document", type=Path, default=DOCUMENT, help="a text file (default: bundled held-out text)")
    p.add_argument("--chars", type=int, default=None,
                   help="only the document's first N characters (a conversation at that length; default: all)")
    p.add_argument("--quotes", type=int, default=4, help="quote questions (default 4)")
    p.add_argument("--open", type=int, default=2, help=f"open questions, at most {len(OPEN_QUESTIONS)} (default 2)")
    p.add_argument("--seed", type=int, default=5, help="picks the quoted phrases (default 5)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, of: {', '.join(CONFIGS)}, each optionally with {INSPECT} (the same with "
                        f"inspect=True: the teaching view's cost), {PYTORCH_ATTENTION} (the native few-row "
                        f"attention kernel off: its gain), {PYTORCH_LAYERS} (the native decoder layers off), {PER_LAYER} (the native layers called per layer, "
                        f"not all in one call), +FIELD-N (an integer "
                        f"setting, e.g. +budget-8192, +lookup_max-32, or a probability threshold, "
                        f"+draft_confidence-0.5), +kv_dtype-NAME (the caches' K/V "
                        f"dtype: float32, float16 or bfloat16), +products-MODE (the products over GGUF blocks: "
                        f"0, int8, int8x2 or fast) "
                        f"(default: {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--repeats", type=int, default=1,
                   help="answers per configuration and turn, order rotated each pass (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="the repetition penalty (default 1: off; an instruct model's default is 1.2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--llama-cpp", action="store_true",
                   help="then run llama.cpp on the same GGUF target (a .gguf file or smollm2) and the first turn's "
                        "prompt, and compare (bench/llama_cpp.py; builds llama.cpp once, about 13 minutes on 2 cores)")
    p.add_argument("--llama-cpp-repetitions", type=int, default=3,
                   help="llama-bench's repetitions of each measurement (default 3; 1 for a large model's long prompt)")
    p.add_argument("--llama-cpp-bin", type=Path, help="a folder with ready llama.cpp binaries (or env LLAMA_CPP_BIN)")
    a = p.parse_args(argv)
    try:
        names = [n.strip() for n in a.configs.split(",") if n.strip()]
        for n in names:
            make_config(n, SamplingConfig(), 1)  # an unknown name or a bad setting fails here, before any loading
        if not names or len(set(names)) != len(names):
            raise ChatBenchError("--configs is empty or names a configuration twice")
        if not 0 <= a.open <= len(OPEN_QUESTIONS) or a.quotes < 0 or a.quotes + a.open == 0:
            raise ChatBenchError(f"--quotes >= 0 and 0 <= --open <= {len(OPEN_QUESTIONS)}, not both 0")
        if a.repeats < 1 or a.llama_cpp_repetitions < 1:
            raise ChatBenchError("--repeats and --llama-cpp-repetitions must be >= 1")
        if not a.document.is_file():
            raise ChatBenchError(f"no such document: {a.document}")
        text = a.document.read_text(encoding="utf-8", errors="replace")
        if a.chars is not None:
            if a.chars < 1:
                raise ChatBenchError("--chars must be >= 1")
            text = text[: a.chars]
        turns = workload(text, a.quotes, a.open, a.seed)
        sampling = SamplingConfig(temperature=a.temperature, top_p=a.top_p, seed=a.sample_seed,
                                  repetition_penalty=a.repetition_penalty)
        peer_model = _peer_model(a.target) if a.llama_cpp else None
        if a.llama_cpp:
            find_or_build(a.llama_cpp_bin)  # a build, when needed, before anything is timed
    except (ChatBenchError, PeerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    peer = partial(peer_figures, peer_model, new_tokens=a.max_new_tokens, threads=torch.get_num_threads(),
                   bin_dir=a.llama_cpp_bin, repeat_penalty=a.repetition_penalty,
                   repetitions=a.llama_cpp_repetitions) if peer_model is not None else None
    t, d = default_model_names(a.target, a.draft)
    engine = TriForceEngine.from_pretrained(t, d)
    load = load_average()
    report = run(engine, text, turns, names, sampling, a.max_new_tokens, say=lambda s: print(s, file=sys.stderr),
                 repeats=a.repeats, peer=peer)
    report["machine"] = machine_info(engine, load, load_average())
    report["document"] = str(a.document.name)
    report["document_chars"] = len(text)
    # by name, not path: reports are committed
    report["models"] = {"target": Path(t).name if t else None, "draft": Path(d).name if d else None}
    print_table(report)
    write_json(a.json, report)
    return 0


def _peer_model(target: str | None) -> Path:
    """The GGUF file `--llama-cpp` runs llama.cpp on: the target's."""
    if not (target and is_gguf(target)):
        raise ChatBenchError("--llama-cpp needs a GGUF target: --target FILE.gguf or --target smollm2")
    try:
        return resolve(target)
    except GGUFError as e:
        raise ChatBenchError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
