"""Greedy answers against Hugging Face's on the same checkpoint, question by question.

    python -m bench.hf_agreement --target smollm2 --document D --quotes 4 --open 2 \\
        --modes autoregressive,lookup,retrieval --kv-dtypes float32,float16

For a GGUF file transformers dequantizes the weights into its own model (bit for bit the values
ours keeps quantized, see `triforce_core.models.quantized`); it answers each document-chat question
(the prompt the chat session renders: template, document, question) with
`generate(do_sample=False)`. Every mode and K/V dtype of ours answers the same prompt. An answer
either equals HF's token for token or first differs at some token: the report gives where, and
HF's gap between its two best logits there. A gap within float32 rounding (below `--tie-gap`,
default 1e-3 on logits of order 10-30) is a near-tie, where two exact float32 computations may
legitimately pick different tokens; a larger gap is a real disagreement.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.chat import workload
from bench.reports import write_json
from triforce_core.config import KV_DTYPES, CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.models.gguf_file import is_gguf, resolve
from triforce_core.prompting import render_prompt
from triforce_core.serving.session import ChatSession


def _hf_model(target: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if is_gguf(target):
        path = resolve(target)
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _hf_answer(hf, ids: list[int], new: int, eos: set[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                          max_new_tokens=new, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0], output_logits=True,
                          return_dict_in_generate=True)
    gaps = []
    for lg in out.logits:
        top = lg[0].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    return out.sequences[0, len(ids):].tolist(), gaps


def compare(ours: list[int], ref: list[int], gaps: list[float], tie_gap: float) -> dict:
    """Equal, or where the first difference is and whether HF's top two nearly tied there."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return {"equal": False, "at": i, "hf_gap": gaps[i], "near_tie": gaps[i] < tie_gap}
    if len(ours) != len(ref):
        i = min(len(ours), len(ref))
        return {"equal": False, "at": i, "hf_gap": gaps[i] if i < len(gaps) else None, "near_tie": False}
    return {"equal": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2", help="hub id, folder or GGUF file (default smollm2)")
    p.add_argument("--document", type=Path, required=True, help="text file the questions are about")
    p.add_argument("--quotes", type=int, default=4, help="quote questions (default 4)")
    p.add_argument("--open", type=int, default=2, help="open questions (default 2)")
    p.add_argument("--seed", type=int, default=0, help="picks the quoted phrases")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", default="autoregressive,lookup,retrieval", help="comma-separated modes of ours")
    p.add_argument("--kv-dtypes", default="float32,float16", help=f"comma-separated, of {', '.join(KV_DTYPES)}")
    p.add_argument("--tie-gap", type=float, default=1e-3, help="HF top-2 logit gap below which a difference is a near-tie")
    p.add_argument("--exact", action="store_true",
                   help="ours in `--exact` arithmetic (float32 K/V only), as `generate --exact` runs")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    kv_dtypes = [d for d in a.kv_dtypes.split(",") if d]
    if any(d not in KV_DTYPES for d in kv_dtypes):
        print(f"error: --kv-dtypes takes {', '.join(KV_DTYPES)}", file=sys.stderr)
        return 2
    try:
        text = a.document.read_text(encoding="utf-8")
    except OSError as e:
        print(f"error: cannot read {a.document}: {e.strerror}", file=sys.stderr)
        return 2
    if a.exact and kv_dtypes != ["float32"]:
        print("error: --exact keeps K/V in float32: pass --kv-dtypes float32", file=sys.stderr)
        return 2
    engine = TriForceEngine.from_pretrained(a.target, None, device="cpu", exact=a.exact)
    hf = _hf_model(a.target)
    session = ChatSession(engine, text)
    rows = []
    for kind, question in workload(text, a.quotes, a.open, a.seed):
        ids = render_prompt(engine.tokenizer, session.messages(question))[1]
        t0 = time.perf_counter()
        ref, gaps = _hf_answer(hf, ids, a.max_new_tokens, set(engine.eos_token_ids))
        row = {"kind": kind, "question": question, "prompt_tokens": len(ids), "hf_tokens": len(ref),
               "hf_seconds": time.perf_counter() - t0, "min_hf_gap": min(gaps) if gaps else None, "ours": {}}
        for dt in kv_dtypes:
            for mode in modes:
                cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=a.max_new_tokens),
                                       cache=CacheConfig(kv_dtype=dt))
                got = engine.run(ids, cfg).token_ids
                row["ours"][f"{mode}/{dt}"] = compare(got, ref, gaps, a.tie_gap)
        rows.append(row)
        verdicts = ", ".join(f"{k}: {'=' if v['equal'] else ('tie' if v['near_tie'] else 'DIFF')}@{v.get('at', '')}"
                             for k, v in row["ours"].items())
        print(f"[agree] {kind} {len(ids)} tokens, HF min gap {row['min_hf_gap']:.3g}: {verdicts}", file=sys.stderr)
    summary = {}
    for key in rows[0]["ours"] if rows else []:
        cells = [r["ours"][key] for r in rows]
        summary[key] = {"answers": len(cells), "equal": sum(c["equal"] for c in cells),
                        "near_tie": sum(c.get("near_tie", False) for c in cells),
                        "differ": sum(not c["equal"] and not c.get("near_tie", False) for c in cells)}
    report = {"target": a.target, "exact": a.exact, "document": a.document.name,  # its name: no folder of the machine it ran on
              "max_new_tokens": a.max_new_tokens,
              "tie_gap": a.tie_gap, "summary": summary, "answers": rows}
    for key, s in summary.items():
        print(f"{key:28s} equal {s['equal']}/{s['answers']}, near-tie {s['near_tie']}, differ {s['differ']}")
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
