"""Measure the embedded demo pair on held-out text (the figures of assets/models/README.md).

* per-token loss of the same held-out tokens (the last 512 of each 16K-token stream) seen with
  1K, 4K and 16K tokens of context;
* copy accuracy: a held-out ~16K-token document (and, with ``--copy-contexts``, shorter ones:
  4K and 8K by default) in the chat template, then "What follows «quote»?" for quotes
  spread evenly over the document; the answer repeats the phrase and goes on, and a trial
  passes when the repeat and the next 20 generated tokens (greedy) equal the phrase and the
  20 tokens that follow it in the document. The
  target sees everything; the draft alone sees what its StreamingLLM cache keeps (16 sink
  tokens and the last 240);
* the draft's top-1 agreement with the target on held-out 512-token windows;
* sizes: parameters, weight bytes, KV bytes per token.

    python -m scripts.eval_demo_models [--models assets/models] [--json OUT]
    python -m scripts.eval_demo_models --context 65536 --copy-contexts 32768   # the 64K window
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import demo_corpus

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load(models: Path):
    """The pair through our own engine (the code path the app uses), float32 on the CPU."""
    from triforce_core.engine import TriForceEngine

    return TriForceEngine.from_pretrained(str(models / "target"), str(models / "draft"), device="cpu", dtype="float32")


def forward_logits(model, ids: list[int], rows: int, chunk: int = 1024) -> torch.Tensor:
    """Logits [rows, V] predicting after each of the last `rows` tokens (chunked prefill)."""
    from triforce_core.kv import FullCache

    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids), model.dtype, model.device)
    n = len(ids)
    out = []
    for i in range(0, n, chunk):
        part = ids[i:i + chunk]
        first_scored = max(0, (n - rows) - i)
        want = first_scored < len(part)
        r = model.forward(torch.tensor(part), torch.arange(i, i + len(part)), cache,
                          logits_rows=slice(first_scored, None) if want else None)
        if want:
            out.append(r.logits)
    return torch.cat(out)


def greedy(model, ids: list[int], steps: int) -> list[int]:
    from triforce_core.kv import FullCache

    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids) + steps, model.dtype, model.device)
    r = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))
    out = [int(r.logits[-1].argmax())]
    for k in range(steps - 1):
        r = model.forward(torch.tensor(out[-1:]), torch.tensor([len(ids) + k]), cache)
        out.append(int(r.logits[-1].argmax()))
    return out


def held_out_stream(tok) -> list[int]:
    _, held = demo_corpus.doc_documents(demo_corpus.ensure_docs())
    ids: list[int] = []
    for d in held:
        ids.append(tok.bos_token_id)
        ids.extend(tok(d.text, add_special_tokens=False)["input_ids"])
    return ids


@torch.no_grad()
def context_losses(model, stream: list[int], lengths=(1024, 4096, 16384), scored=512) -> dict:
    longest = max(lengths)
    scored = min(scored, min(lengths) - 1)
    n = len(stream) // longest
    out = {}
    for L in lengths:
        total, count = 0.0, 0
        for k in range(n):
            window = stream[(k + 1) * longest - L:(k + 1) * longest]
            logits = forward_logits(model, window, scored + 1)[:-1]
            target = torch.tensor(window[-scored:])
            total += F.cross_entropy(logits, target, reduction="sum").item()
            count += scored
        out[L] = total / count
        log(f"loss at context {L}: {out[L]:.4f} over {count} tokens ({n} streams)")
    return {"streams": n, "scored_tokens_per_stream": scored,
            "loss": {str(k): round(v, 4) for k, v in out.items()},
            "perplexity": {str(k): round(float(np.exp(v)), 2) for k, v in out.items()},
            "ratio_longest_over_shortest": round(out[max(lengths)] / out[min(lengths)], 4)}


def copy_documents(tok, budget_tokens: int, count: int, seed: int) -> list[str]:
    _, held = demo_corpus.doc_documents(demo_corpus.ensure_docs())
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        order = held[:]
        rng.shuffle(order)
        parts, used = [], 0
        for d in order:
            n = len(tok(d.text, add_special_tokens=False)["input_ids"])
            if used + n > budget_tokens:
                # take the part of this document that still fits, cut at a paragraph
                keep = d.text[: int(len(d.text) * (budget_tokens - used) / n)]
                keep = keep[: keep.rfind("\n\n")] if "\n\n" in keep else ""
                if keep:
                    parts.append(keep)
                break
            parts.append(d.text)
            used += n
        text = "\n".join(parts)
        # the parts were counted one by one; joined, a few more tokens can come out
        while len(tok(text, add_special_tokens=False)["input_ids"]) > budget_tokens and "\n\n" in text:
            text = text[: text.rfind("\n\n")]
        docs.append(text)
    return docs


def copy_accuracy(engine, docs: list[str], per_doc: int, seed: int, n_tokens=20, sinks=16, window=240) -> dict:
    """Ask "What follows «quote»?" in a chat session per document (the document is prefilled
    once and reused); the target answers greedily. The answer repeats the phrase and goes on
    (``demo_corpus.copy_answer``); a trial passes when the repeat and the `n_tokens` tokens
    that follow the phrase in the document all come out exactly. The draft alone sees sinks
    plus the recent window."""
    from triforce_core.config import GenerationConfig, SpeculationConfig
    from triforce_core.serving.session import ChatSession

    tok = engine.tokenizer
    rng = random.Random(seed)
    results = {"target": [], "draft": []}
    trials, first_s, later_s = [], [], []
    skipped = 0
    for di, doc in enumerate(docs):
        session = ChatSession(engine, doc)
        asked = 0
        for j in range(per_doc):
            lo, hi = int(len(doc) * j / per_doc), int(len(doc) * (j + 1) / per_doc)
            picked = demo_corpus.pick_passage(doc, rng, lo=lo, hi=hi, answer_chars=(200, 300))
            if picked is None:
                continue
            quote, cont = picked
            echo = len(tok(quote, add_special_tokens=False)["input_ids"])
            want = tok(demo_corpus.copy_answer(quote, cont), add_special_tokens=False)["input_ids"][:echo + n_tokens]
            if len(want) < echo + n_tokens:
                continue
            config = GenerationConfig(speculation=SpeculationConfig(
                mode="autoregressive", max_new_tokens=echo + n_tokens, ignore_eos=True))
            question = demo_corpus.QUESTIONS[0].format(q=quote)
            session.clear()
            prompt = session.prompt_ids(question)
            if len(prompt) + echo + n_tokens > engine.context_window:
                skipped += 1  # a phrase of many symbol tokens: question and answer would not fit
                continue
            for _ in session.ask(question, config=config):
                pass
            turn = session.turns[-1]
            (first_s if asked == 0 else later_s).append(turn.stats.first_token_s)
            asked += 1
            got = turn.token_ids[:echo + n_tokens]
            seen = prompt[:sinks] + prompt[-(window - echo - n_tokens):]
            dgot = greedy(engine.draft, seen, echo + n_tokens)
            results["target"].append(got == want)
            results["draft"].append(dgot == want)
            trials.append({"doc": di, "where": round(doc.index(quote) / len(doc), 3), "prompt_tokens": len(prompt),
                           "target_ok": got == want, "draft_ok": dgot == want,
                           "target_repeat_ok": got[:echo] == want[:echo],
                           "target_tokens_ok": sum(1 for a, b in zip(got[echo:], want[echo:]) if a == b)})
        log(f"document {di}: target {sum(results['target'])}/{len(results['target'])}, "
            f"draft {sum(results['draft'])}/{len(results['draft'])}")
    return {
        "documents": len(docs), "trials": len(results["target"]), "tokens_compared": n_tokens,
        "skipped_too_long": skipped,
        "prompt_tokens": [min(t["prompt_tokens"] for t in trials), max(t["prompt_tokens"] for t in trials)],
        "target_exact": round(sum(results["target"]) / max(1, len(results["target"])), 4),
        "draft_alone_exact": round(sum(results["draft"]) / max(1, len(results["draft"])), 4),
        "target_mean_tokens_ok": round(float(np.mean([t["target_tokens_ok"] for t in trials])), 2),
        "first_question_ttft_s": round(float(np.median(first_s)), 3) if first_s else None,
        "later_question_ttft_s": round(float(np.median(later_s)), 3) if later_s else None,
        "trials_detail": trials,
    }


@torch.no_grad()
def draft_agreement(target, draft, stream: list[int], window=512, windows=24) -> dict:
    agree = total = 0
    t_loss = d_loss = 0.0
    step = max(window, (len(stream) - window) // windows)
    for k in range(windows):
        x = stream[k * step:k * step + window]
        if len(x) < window:
            break
        tl = forward_logits(target, x, window)[:-1]
        dl = forward_logits(draft, x, window)[:-1]
        y = torch.tensor(x[1:])
        agree += int((tl.argmax(-1) == dl.argmax(-1)).sum())
        total += window - 1
        t_loss += F.cross_entropy(tl, y, reduction="sum").item()
        d_loss += F.cross_entropy(dl, y, reduction="sum").item()
    return {"windows": windows, "window": window, "top1_agreement": round(agree / total, 4),
            "target_loss": round(t_loss / total, 4), "draft_loss": round(d_loss / total, 4)}


def sizes(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    from transformers import AutoConfig

    from triforce_core.models.spec import ModelSpec

    kv = ModelSpec.from_config(AutoConfig.from_pretrained(str(folder))).kv_bytes()
    return {"parameters": n, "weight_bytes_fp32": 4 * n, "file_bytes": (folder / "model.safetensors").stat().st_size,
            "kv_bytes_per_token_fp32": kv, "kv_bytes_at_16k_fp32": kv * 16384,
            "kv_at_16k_over_weights_fp32": round(kv * 16384 / (4 * n), 2),
            "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"], "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"], "intermediate": cfg["intermediate_size"],
            "max_position_embeddings": cfg["max_position_embeddings"],
            "rope_theta": cfg.get("rope_parameters", {}).get("rope_theta")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "assets" / "models")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--copy-documents", type=int, default=4)
    p.add_argument("--copy-per-document", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--context", type=int, default=16384, help="longest context measured (default 16384)")
    p.add_argument("--copy-contexts", default="4096,8192",
                   help="shorter document lengths at which copy accuracy is measured too (comma-separated; '' for none)")
    p.add_argument("--copy-only", action="store_true",
                   help="measure copy accuracy only (no context loss, no draft agreement): e.g. tuning questions "
                        "with another --seed")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    engine = load(a.models)
    tok = engine.tokenizer
    stream = held_out_stream(tok)
    log(f"held-out stream: {len(stream)} tokens")
    res = {"target": sizes(a.models / "target"), "draft": sizes(a.models / "draft")}
    if not a.copy_only:
        lengths = sorted({min(1024, a.context // 4), min(4096, a.context // 2), a.context})
        res["context_loss"] = context_losses(engine.target, stream, lengths=tuple(lengths))
        res["draft_agreement"] = draft_agreement(engine.target, engine.draft, stream)
        log(f"draft agreement: {res['draft_agreement']}")
    docs = copy_documents(tok, a.context - 120, a.copy_documents, a.seed)
    res["copy"] = copy_accuracy(engine, docs, a.copy_per_document, a.seed)
    def summary(copy: dict) -> dict:
        return {k: v for k, v in copy.items() if k != "trials_detail"}

    res["copy_by_context"] = {str(a.context): summary(res["copy"])}
    for ctx in sorted({int(x) for x in a.copy_contexts.split(",") if x.strip()} - {a.context}):
        shorter = copy_accuracy(engine, copy_documents(tok, ctx - 120, a.copy_documents, a.seed), a.copy_per_document,
                                a.seed)
        res["copy_by_context"][str(ctx)] = summary(shorter)
        log(f"copy at {ctx}: target {shorter['target_exact']}, draft alone {shorter['draft_alone_exact']}")
    res["eval_minutes"] = round((time.time() - t0) / 60, 1)
    text = json.dumps(res, indent=2)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
