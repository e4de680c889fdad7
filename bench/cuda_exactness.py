"""Greedy exactness on a GPU, in bfloat16 and float32: every mode against our own autoregressive
output and against Hugging Face's model in the same dtype on the same device, and a
verification's rows against one-token steps.

On the CPU our few-row kernels sum in one order whatever the rows beside, so a verification's
logits equal a step's bit for bit and every mode's greedy output is the autoregressive output
(tests/helpers/exactness.py `assert_verification_rows_equal_steps`). On a GPU the libraries choose a
kernel by shape (cuBLAS for the products, PyTorch's attention kernels), so the rows of a
7-token verification may round differently from seven steps. This measures how much, and how
often a greedy answer then differs:
- `rows`: the largest |difference| between a verification's logits and the steps' (0 = bit for
  bit), and whether their argmaxes agree;
- each mode's first token that differs from our autoregressive output, and our autoregressive
  output's first token that differs from Hugging Face's, each with Hugging Face's top-2 logit gap
  there (a gap within the dtype's rounding is a tie that either answer may take).

Models are random (transformers' own classes, no download): small Llama (grouped-query heads,
llama3 rope), Qwen2 (tied embeddings, q/k/v bias) and Mistral (sliding window) with weights
drawn wide (logits far apart), and a medium Llama (width 1,024, 8 layers, vocabulary 32,000)
with narrower weights, whose logits come closer together as a real model's sometimes do.

    python -m bench.cuda_exactness [--device cuda] [--dtypes bfloat16,float32] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.reports import write_json
from triforce_core.config import PAPER_METHOD, CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.kv import new_full_cache
from triforce_core.models.transformer import Transformer

ROPE3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=64)
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2)
CASES = {
    "llama-small": ("llama", dict(SMALL, rope_parameters=ROPE3)),
    "qwen2-tied-small": ("qwen2", dict(SMALL, tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral-window-small": ("mistral", dict(SMALL, sliding_window=48)),
    "llama-medium": ("llama", dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                                   initializer_range=0.05, rope_parameters=ROPE3)),
}
DRAFT = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
CACHE = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_sinks=4, draft_window=32, refresh_every=16)
MODES = {
    "triforce-paper": dict(mode="triforce", **PAPER_METHOD),
    "triforce": dict(mode="triforce"),
    "retrieval": dict(mode="retrieval"),
    "draft": dict(mode="draft"),
    "lookup": dict(mode="lookup"),
}
NEW = 48


def _hf(family: str, overrides: dict, seed: int):
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    config = getattr(transformers, names[0])(bos_token_id=1, eos_token_id=2, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, names[1])(config).eval()


def _prompt(vocab: int, seed: int) -> list[int]:
    """320 tokens that repeat themselves in part: lookup finds matches, and the prompt is
    longer than the retrieval budget and the draft's window."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (120,), generator=g).tolist()
    return base + torch.randint(3, vocab, (80,), generator=g).tolist() + base


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def rows_against_steps(model: Transformer, ids: list[int], kv_dtype: torch.dtype | None = None, rows: int = 7) -> dict:
    """`rows` tokens after `ids` in one forward (7: a verification of six drafted tokens and the
    bonus; 17: a 16-token lookup run and its bonus) against as many one-token forwards (K/V in
    `kv_dtype`; None: the model's dtype): the largest |difference| of their logits, whether they
    are equal bit for bit, and whether their argmaxes agree."""
    s, dev = model.spec, model.device
    cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids) + rows + 16, kv_dtype or model.dtype, dev)
    model.forward(torch.tensor(ids, device=dev), cache.positions(0, len(ids)), cache, logits_rows=None)
    new = [(5, 9, 13, 2, 7, 11, 3)[i % 7] for i in range(rows)]
    together = model.forward(torch.tensor(new, device=dev), cache.positions(len(ids), rows), cache).logits
    cache.truncate(len(ids))
    steps = torch.cat([model.forward(torch.tensor([t], device=dev), cache.positions(len(ids) + i, 1), cache).logits
                       for i, t in enumerate(new)])
    diff = (together - steps).abs().max().item()
    return {"max_abs_diff": diff, "bit_equal": bool(torch.equal(together, steps)),
            "argmax_equal": bool(torch.equal(together.argmax(-1), steps.argmax(-1)))}


def check(case: str, device: torch.device, dtype: torch.dtype) -> dict:
    family, overrides = CASES[case]
    hf = _hf(family, overrides, seed=0).to(device=device, dtype=dtype)
    draft_hf = _hf(family, {**overrides, **DRAFT}, seed=11)
    ours = Transformer(hf.config, hf.state_dict(), device, dtype)
    draft = Transformer(draft_hf.config, draft_hf.state_dict(), device, dtype)
    prompt = _prompt(hf.config.vocab_size, seed=7)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt):].tolist()
    top2 = [l[0].float().topk(2).values for l in out.logits]
    gaps = [float(v[0] - v[1]) for v in top2]
    engine = TriForceEngine(ours, draft)

    def run(**spec) -> list[int]:
        cfg = GenerationConfig(speculation=SpeculationConfig(max_new_tokens=NEW, ignore_eos=True, **spec), cache=CACHE)
        return engine.run(prompt, cfg).token_ids

    auto = run(mode="autoregressive")
    at = _first_difference(auto, ref)
    result = {"case": case, "dtype": str(dtype).removeprefix("torch."), "rows": rows_against_steps(ours, prompt),
              "hf": {"first_difference": at, "hf_gap": None if at is None else gaps[at]}, "modes": {}}
    for name, spec in MODES.items():
        got = run(**spec)
        i = _first_difference(got, auto)
        # HF's gap is ours to within rounding only up to the first token where the two differ
        gap = gaps[i] if i is not None and (at is None or i <= at) else None
        result["modes"][name] = {"first_difference": i, "hf_gap": gap}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated model dtypes (default bfloat16,float32)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated models, of {', '.join(CASES)}")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    dtypes = [x.strip() for x in a.dtypes.split(",") if x.strip()]
    cases = [x.strip() for x in a.cases.split(",") if x.strip()]
    if not dtypes or any(d not in ("bfloat16", "float16", "float32") for d in dtypes):
        print("error: --dtypes takes bfloat16, float16 and float32", file=sys.stderr)
        return 2
    if not cases or any(c not in CASES for c in cases):
        print(f"error: --cases takes names of {', '.join(CASES)}", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here (--device cpu runs the same checks on the CPU)", file=sys.stderr)
        return 2
    results = []
    for dt in dtypes:
        for case in cases:
            t0 = time.perf_counter()
            r = check(case, device, getattr(torch, dt))
            results.append(r)
            modes = ", ".join(f"{m} {'same' if v['first_difference'] is None else 'differs at ' + str(v['first_difference'])}"
                              + (f" (gap {v['hf_gap']:.3g})" if v["hf_gap"] is not None else "")
                              for m, v in r["modes"].items())
            h = r["hf"]
            hf_text = "same" if h["first_difference"] is None else f"differs at {h['first_difference']} (gap {h['hf_gap']:.3g})"
            print(f"[cuda-exact] {case} {dt}: rows vs steps max |diff| {r['rows']['max_abs_diff']:.3g} "
                  f"(bit-equal {r['rows']['bit_equal']}, argmax-equal {r['rows']['argmax_equal']}); "
                  f"autoregressive vs HF {hf_text}; against autoregressive: {modes} [{time.perf_counter() - t0:.1f} s]",
                  flush=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "new_tokens": NEW, "results": results}
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
