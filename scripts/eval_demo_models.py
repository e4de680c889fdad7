#!/usr/bin/env python3
"""Measure the embedded demo pair on held-out text (the figures of assets/models/README.md).

* per-token loss of the same held-out tokens (the last 512 of each 16K-token stream) seen with
  1K, 4K and 16K tokens of context;
* copy accuracy: a held-out ~16K-token document in the chat template, then "What follows
  «quote»?" for quotes spread evenly over the document; a trial passes when the first 20
  generated tokens (greedy) equal the 20 tokens that follow the quote in the document. The
  target sees everything; the draft alone sees what its StreamingLLM cache keeps (16 sink
  tokens and the last 240);
* the draft's top-1 agreement with the target on held-out 512-token windows;
* sizes: parameters, weight bytes, KV bytes per token.

    python scripts/eval_demo_models.py [--models assets/models] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


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
    n = len(stream) // longest
    out = {}
    for L in lengths:
        total, count = 0.0, 0
        for k in range(n):
            window = torch.tensor(stream[(k + 1) * longest - L:(k + 1) * longest])[None]
            logits = model(input_ids=window, logits_to_keep=scored + 1).logits[0, :-1].float()
            target = window[0, -scored:]
            total += F.cross_entropy(logits, target, reduction="sum").item()
            count += scored
        out[L] = total / count
        log(f"loss at context {L}: {out[L]:.4f} over {count} tokens ({n} streams)")
    return {"streams": n, "scored_tokens_per_stream": scored,
            "loss": {str(k): round(v, 4) for k, v in out.items()},
            "ratio_16k_over_1k": round(out[max(lengths)] / out[min(lengths)], 4)}


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
        docs.append("\n".join(parts))
    return docs


@torch.no_grad()
def greedy(model, prefix_cache, prefix_len: int, ids: list[int], steps: int, positions_from: int | None = None):
    """Greedy continuation of ``ids`` on top of a cached prefix (cropped back afterwards)."""
    cache = prefix_cache
    start = prefix_len if positions_from is None else positions_from
    x = torch.tensor(ids)[None]
    pos = torch.arange(start, start + len(ids))[None]
    out = []
    for _ in range(steps):
        r = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
        nxt = int(r.logits[0, -1].argmax())
        out.append(nxt)
        x = torch.tensor([[nxt]])
        pos = pos[:, -1:] + 1
    cache.crop(prefix_len)
    return out


@torch.no_grad()
def copy_accuracy(target, draft, tok, docs: list[str], per_doc: int, seed: int, n_tokens=20,
                  sinks=16, window=240) -> dict:
    from transformers import DynamicCache

    rng = random.Random(seed)
    results = {"target": [], "draft": []}
    trials = []
    for di, doc in enumerate(docs):
        head = tok.apply_chat_template([{"role": "user", "content": doc + "\n\n"}], tokenize=False)
        head = head[: head.rindex("<|end|>")]  # the question continues the user's message
        # drop the last token: where the question begins, "\n\n" may tokenize differently
        head_ids = tok(head, add_special_tokens=False)["input_ids"][:-1]
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.tensor(head_ids)[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for j in range(per_doc):
            lo = int(len(doc) * j / per_doc)
            hi = int(len(doc) * (j + 1) / per_doc)
            picked = demo_corpus.pick_passage(doc, rng, lo=lo, hi=hi, answer_chars=(200, 300))
            if picked is None:
                continue
            quote, cont = picked
            want = tok(cont, add_special_tokens=False)["input_ids"][:n_tokens]
            if len(want) < n_tokens:
                continue
            q = demo_corpus.QUESTIONS[0].format(q=quote) + "<|end|>\n<|assistant|>\n"
            full = tok(head + q, add_special_tokens=False)["input_ids"]
            assert full[: len(head_ids)] == head_ids, "tokenization of the document changed"
            q_ids = full[len(head_ids):]
            got = greedy(target, cache, len(head_ids), q_ids, n_tokens)
            results["target"].append(got == want)
            # the draft alone: its streaming cache keeps the sinks and the most recent tokens
            seen = full[:sinks] + full[-(window - n_tokens):] if len(full) > sinks + window else full
            dcache = DynamicCache(config=draft.config)
            dgot = greedy(draft, dcache, 0, seen, n_tokens)
            results["draft"].append(dgot == want)
            where = doc.index(quote) / len(doc)
            trials.append({"doc": di, "where": round(where, 3), "target_ok": got == want, "draft_ok": dgot == want})
        log(f"document {di} ({len(head_ids)} tokens): target {sum(results['target'])}/{len(results['target'])}, "
            f"draft {sum(results['draft'])}/{len(results['draft'])}")
    return {
        "documents": len(docs), "trials": len(results["target"]), "tokens_compared": n_tokens,
        "document_tokens": "about 16K (chat template included)",
        "target_exact": round(sum(results["target"]) / max(1, len(results["target"])), 4),
        "draft_alone_exact": round(sum(results["draft"]) / max(1, len(results["draft"])), 4),
        "trials_detail": trials,
    }


@torch.no_grad()
def draft_agreement(target, draft, stream: list[int], window=512, windows=24) -> dict:
    agree = total = 0
    t_loss = d_loss = 0.0
    step = max(window, (len(stream) - window) // windows)
    for k in range(windows):
        s = k * step
        x = torch.tensor(stream[s:s + window])[None]
        if x.shape[1] < window:
            break
        tl = target(input_ids=x).logits[0, :-1].float()
        dl = draft(input_ids=x).logits[0, :-1].float()
        agree += int((tl.argmax(-1) == dl.argmax(-1)).sum())
        total += window - 1
        t_loss += F.cross_entropy(tl, x[0, 1:], reduction="sum").item()
        d_loss += F.cross_entropy(dl, x[0, 1:], reduction="sum").item()
    return {"windows": windows, "window": window, "top1_agreement": round(agree / total, 4),
            "target_loss": round(t_loss / total, 4), "draft_loss": round(d_loss / total, 4)}


def sizes(model) -> dict:
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    return {"parameters": n, "weight_bytes_fp32": 4 * n, "weight_bytes_bf16": 2 * n,
            "kv_bytes_per_token_fp32": kv, "kv_bytes_at_16k_fp32": kv * 16384,
            "kv_at_16k_over_weights_fp32": round(kv * 16384 / (4 * n), 2),
            "layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "assets" / "models")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--copy-documents", type=int, default=4)
    p.add_argument("--copy-per-document", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    target, tok = load(a.models / "target")
    draft, dtok = load(a.models / "draft")
    if tok.get_vocab() != dtok.get_vocab():
        raise SystemExit("error: target and draft tokenizers differ")
    stream = held_out_stream(tok)
    log(f"held-out stream: {len(stream)} tokens")
    res = {"target": sizes(target), "draft": sizes(draft)}
    res["context_loss"] = context_losses(target, stream)
    res["draft_agreement"] = draft_agreement(target, draft, stream)
    log(f"draft agreement: {res['draft_agreement']}")
    docs = copy_documents(tok, 16384 - 120, a.copy_documents, a.seed)
    res["copy"] = copy_accuracy(target, draft, tok, docs, a.copy_per_document, a.seed)
    res["eval_minutes"] = round((time.time() - t0) / 60, 1)
    text = json.dumps(res, indent=2)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
