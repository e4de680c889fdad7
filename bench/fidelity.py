"""Fidelity to Hugging Face float32, teacher-forced over a document: our arithmetic paths and K/V dtypes.

    python -m bench.fidelity --target smollm2 --tokens 4096 --json bench/results/fidelity-smollm2.json

What it measures. The held-out document (`bench.chat.DOCUMENT`, or `--document`) is rendered as
the chat session renders it (`--prefix chat`, the default: the chat template's opening, with its
default system prompt where the template has one, then the document as the user's message; with
`--prefix none` the document's own tokens, no special tokens), and its first `--tokens` tokens
(4096 by default; all of them when it has fewer) are the sequence. Hugging Face's model, loaded in
float32 from the same GGUF file (transformers dequantizes to the very values ours keeps
quantized, see `triforce_core.models.quantized`), reads the whole sequence in one forward: its
logits at every position are the reference. Each configuration of ours reads the same sequence
teacher-forced, in chunks of `--chunk` tokens (16; fewer for a model with more than 3 query heads
per KV head, `default_chunk`), each chunk one forward over a
`triforce_core.kv.FullCache` of the configuration's K/V dtype with every row's logits kept: every
forward is a few-row one (at most `native_layers.ROWS`), the path decoding steps and
verifications take, not the long-prefill path. The configurations:

    float/kv-float32   dequantize in registers, float32 products (float_products.c); K/V float32
    float/kv-float16   the same products; K/V float16 (today's default for GGUF files)
    int16/kv-float16   16-bit activation rows, integer products for the 256-weight types, the float
                       path for the others (`int8.WIDE`); K/V float16 (the default for GGUF files)
    int16/kv-float32   the same products; K/V float32
    step-tiles/kv-float16
                       int16/kv-float16's activations and integers, the K types' parts summed
                       in the order steps and verifications share on AMX's tiles (`int8.STEP_TILES`)
    int16/kv-bfloat16  int16/kv-float16's products; K/V bfloat16 (8-bit significands, not 11)

and two that read the sequence as a prefill does, in chunks of `--prefill-chunk` tokens (1,024,
the engine's `prefill_chunk`) through the many-row path (PyTorch's attention, `Transformer._project`),
where no step's arithmetic is kept and so no rows-vs-steps check applies:

    int16-prefill/kv-float16   the 256-weight types' products as int16/kv-float16's (no tiles)
    tiles-prefill/kv-float16   the same integers on AMX's tiles where they run (`int8.TILES`, their
                               own order of the float sums); equal to the one above where they do not

Per position, against HF: whether our top-1 token equals HF's; KL(HF || ours) of the two
softmaxes (taken in float64); the largest |logit difference|; and the negative log-likelihood
of the document's next token (HF's and ours, the perplexity view). A position is a near-tie where
HF's two best logits differ by less than `--tie-gap` (1e-3, float32 rounding on logits of order
10-30): two exact computations may legitimately pick either token there, so agreement is also
given without them. Figures are pooled over all positions and per `--depth-bin` positions.

Sanity check (asserted): for each configuration one chunk (the last whole one, the deepest) is
also run as `--chunk` one-token steps, and the chunk's logits must equal the steps' bit for bit:
rows equal steps on both paths (`tests/test_integer_products.py`, `bench.cuda_exactness`), so the
chunked figures are those of decoding. A report also says whether the integer configurations'
logits differ from the float ones at all (they must, or the switch did not take).

llama.cpp: its logits are not compared here. `bench.llama_cpp`'s cached build (TOOLS: bench,
lookup, tokenize) has no tool that dumps logits, and this benchmark never builds it; the report
says whether that build is present.

The report (`--json`): the settings, the machine, per configuration the pooled figures, per depth
bin, the sanity check and seconds; HF's own mean NLL.

Measured (`bench/results/fidelity-smollm2.json`, SmolLM2-135M-Instruct Q4_1, 4096 positions, the
chat prefix, chunks of 16): float/kv-float32 agrees with HF at every position (mean KL 1e-11);
K/V float16 at 99.93 % (3 positions, mean KL 9e-7); the integer path at 97.9 % (K/V float16) and
97.7 % (float32), mean KL 2.4e-3, mean NLL of the next token +0.003 nats. Rerun, the figures are
the same bit for bit. The integer path's cost is that of 8-bit activations themselves: HF's model
with every linear layer's input rounded the same way (32-blocks, d = max|x| / 127) scores KL 2.8e-3
and 97.1 % over the first 1024 positions, where ours scores 2.8e-3 and 97.4 %.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.chat import DOCUMENT
from bench.reports import write_json
from triforce_core.cli.bench_report import load_average, machine_info
from triforce_core.engine import TriForceEngine
from triforce_core.kv import FullCache
from triforce_core.models import int8, native_layers
from triforce_core.models.arithmetic import EXACT
from triforce_core.models.attention import NATIVE_QUERY_ROWS
from triforce_core.models.gguf_file import GGUFError, is_gguf, resolve
from triforce_core.prompting import render_prompt

# name: (the products' mode, `int8`'s: 0 the float path; K/V dtype)
CONFIGS = {
    "float/kv-float32": (0, torch.float32),
    "float/kv-float16": (0, torch.float16),
    "int16/kv-float16": (int8.WIDE, torch.float16),
    "int16/kv-float32": (int8.WIDE, torch.float32),
    "int16-prefill/kv-float16": (int8.WIDE, torch.float16),
    "tiles-prefill/kv-float16": (int8.WIDE, torch.float16),
    "step-tiles/kv-float16": (int8.STEP_TILES, torch.float16),
    "int16/kv-bfloat16": (int8.WIDE, torch.bfloat16),
}
# The configurations read in a prefill's chunks, and whether each takes AMX's tiles where they run
# (`Arithmetic.prefill_tiles`).
PREFILL = {"int16-prefill/kv-float16": False, "tiles-prefill/kv-float16": True}


# The figures each depth bin of the report keeps.
BY_DEPTH = ("top1_agreement", "top1_agreement_excluding_near_ties", "mean_kl", "max_kl", "near_tie_share", "mean_nll")


def say(message: str) -> None:
    print(f"[fidelity] {message}", file=sys.stderr, flush=True)


def default_chunk(model, largest: int = 16) -> int:
    """Tokens per forward: `largest`, or fewer so that a chunk's query rows (query heads per KV
    head x tokens) stay within `attention.NATIVE_QUERY_ROWS`. Beyond that a forward leaves the
    one-call native path for PyTorch's attention, and its rows no longer equal one-token steps bit
    for bit (e.g. 16 tokens of a model with 4 query heads per KV head: 64 rows > 51)."""
    G = model.spec.num_heads // model.spec.num_kv_heads
    return max(1, min(largest, NATIVE_QUERY_ROWS // G))


def sequence(tokenizer, text: str, prefix: str, tokens: int) -> list[int]:
    """The first `tokens` ids of the document, after the chat template's opening (`chat`) or bare (`none`)."""
    if prefix == "chat":
        ids = render_prompt(tokenizer, [{"role": "user", "content": text}])[1]
    else:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[:tokens]


def target_and_document(target: str, document: Path) -> tuple[Path, str] | None:
    """The GGUF file `target` names and `document`'s text; None, with a one-line error printed,
    where either cannot be had."""
    if not is_gguf(target):
        print("error: --target must be a GGUF file (or smollm2): the integer path runs on a GGUF file's blocks",
              file=sys.stderr)
        return None
    try:
        return resolve(target), document.read_text(encoding="utf-8")
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:
        print(f"error: cannot read {document}: {e.strerror}", file=sys.stderr)
    return None


def hf_model(path: Path):
    """Hugging Face's float32 model from the GGUF file (transformers dequantizes it)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[N, V] float32: HF's logits at every position, one forward over the whole sequence."""
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def logits_of_rows(model, ids: list[int], start: int, cache: FullCache) -> torch.Tensor:
    """Every row's logits [len(ids), V] of one forward of `ids` from position `start` over `cache`."""
    return model.forward(torch.tensor(ids), cache.positions(start, len(ids)), cache, logits_rows=slice(None)).logits


def teacher_forced(model, ids: list[int], kv_dtype: torch.dtype, chunk: int, check_at: int | None):
    """Yield (start, logits [rows, V]) over `ids` in chunks of `chunk` tokens on a fresh FullCache;
    the chunk starting at `check_at` (None: none) is first run as one-token steps, and must equal
    them bit for bit."""
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids), kv_dtype, model.device)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        if start == check_at:
            steps = torch.cat([logits_of_rows(model, [t], start + i, cache) for i, t in enumerate(part)])
            cache.truncate(start)
            rows = logits_of_rows(model, part, start, cache)
            if not torch.equal(rows, steps):
                diff = (rows - steps).abs().max().item()
                raise AssertionError(
                    f"a {len(part)}-row forward at {start} differs from {len(part)} one-token steps by up to {diff:.3g}: "
                    "rows must equal steps bit for bit (a chunk whose query rows exceed attention.NATIVE_QUERY_ROWS, "
                    "or a model with a sliding window, leaves the one-call native path: see `default_chunk`)")
            yield start, rows
        else:
            yield start, logits_of_rows(model, part, start, cache)


class Tally:
    """Per-position figures of one configuration against HF's logits."""

    def __init__(self, n: int):
        self.top1 = torch.empty(n, dtype=torch.long)
        self.kl = torch.empty(n, dtype=torch.float64)
        self.max_diff = torch.empty(n, dtype=torch.float64)
        self.nll = torch.empty(n, dtype=torch.float64)  # of the next token; the last position has none (nan)

    def add(self, start: int, ours: torch.Tensor, ref: torch.Tensor, next_ids: torch.Tensor) -> None:
        end = start + ours.shape[0]
        lp_ref = torch.log_softmax(ref.double(), dim=-1)
        lp = torch.log_softmax(ours.double(), dim=-1)
        self.top1[start:end] = ours.argmax(-1)
        self.kl[start:end] = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
        self.max_diff[start:end] = (ours.double() - ref.double()).abs().amax(-1)
        self.nll[start:end] = nll(lp, next_ids)


def nll(logprobs: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """-log p(next token) per row; nan for rows without a next token (next id -1)."""
    out = torch.full((logprobs.shape[0],), math.nan, dtype=torch.float64)
    has = next_ids >= 0
    out[has] = -logprobs[has].gather(1, next_ids[has, None])[:, 0]
    return out


def figures(t: Tally, hf_top1: torch.Tensor, near_tie: torch.Tensor, sl: slice = slice(None)) -> dict:
    """Pooled figures over positions `sl`."""
    agree = (t.top1[sl] == hf_top1[sl])
    tie = near_tie[sl]
    clear = ~tie
    kl = t.kl[sl]
    nll_ = t.nll[sl]
    nll_ = nll_[~nll_.isnan()]
    return {
        "positions": int(agree.numel()),
        "top1_agreement": float(agree.double().mean()),
        "top1_disagreements": int((~agree).sum()),
        "near_tie_share": float(tie.double().mean()),
        "top1_agreement_excluding_near_ties": float(agree[clear].double().mean()) if clear.any() else None,
        "disagreements_not_near_ties": int((~agree & clear).sum()),
        "mean_kl": float(kl.mean()),
        "median_kl": float(kl.median()),
        "p99_kl": float(kl.quantile(0.99)),
        "max_kl": float(kl.max()),
        "mean_max_abs_logit_diff": float(t.max_diff[sl].mean()),
        "max_abs_logit_diff": float(t.max_diff[sl].max()),
        "mean_nll": float(nll_.mean()) if nll_.numel() else None,
    }


def llama_cpp_note() -> dict:
    """Whether llama.cpp's tools are at hand (never built here), and why its logits are not compared."""
    from bench.llama_cpp import LLAMA_CPP_PYTHON, tools_in
    from triforce_core.config import cache_home

    given = os.environ.get("LLAMA_CPP_BIN")
    # any cached build (one folder per set of instruction sets it was built with)
    folders = [Path(given)] if given else sorted((cache_home() / "llama.cpp").glob(f"{LLAMA_CPP_PYTHON}-*/bin"))
    found = next((f for f in map(tools_in, folders) if f is not None), None)
    where = "$LLAMA_CPP_BIN" if given else f"<cache>/llama.cpp/{LLAMA_CPP_PYTHON}-*/bin"
    if found is None:
        why = f"no llama.cpp build at {where} (this benchmark does not build one): its logits are skipped"
    else:
        why = (f"llama.cpp's tools are built at {where}, but none of them (llama-bench, llama-lookup, "
               "llama-tokenize) dumps logits: its logits are skipped")
    return {"tools_found": found is not None, "logits_compared": False, "note": why}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2", help="a GGUF file of a Llama-family model, or smollm2 (default)")
    p.add_argument("--document", type=Path, default=DOCUMENT, help="a text file (default: the bundled held-out document)")
    p.add_argument("--tokens", type=int, default=4096, help="positions compared: the sequence's first N tokens (default 4096)")
    p.add_argument("--prefix", choices=("chat", "none"), default="chat",
                   help="chat: the chat template's opening, then the document as the user's message (default); "
                        "none: the document's tokens alone")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"tokens per forward of ours, at most native_layers.ROWS = {native_layers.ROWS} (default: 16, "
                        f"or fewer where the model has more than {NATIVE_QUERY_ROWS // 16} query heads per KV head: "
                        "see `default_chunk`)")
    p.add_argument("--prefill-chunk", type=int, default=1024,
                   help=f"tokens per forward of the prefill configurations (more than {native_layers.ROWS}; default 1024)")
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in PREFILL),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default all but the prefill ones)")
    p.add_argument("--tie-gap", type=float, default=1e-3, help="HF top-2 logit gap below which a position is a near-tie")
    p.add_argument("--depth-bin", type=int, default=1024, help="positions per depth bin in the report (default 1024)")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    names = [c for c in a.configs.split(",") if c]
    if not names or any(c not in CONFIGS for c in names):
        print(f"error: --configs takes {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if a.chunk is not None and not 1 <= a.chunk <= native_layers.ROWS:
        print(f"error: --chunk must be 1..{native_layers.ROWS} (a few-row forward)", file=sys.stderr)
        return 2
    if a.prefill_chunk <= native_layers.ROWS:
        print(f"error: --prefill-chunk must be more than {native_layers.ROWS} (a prefill's many-row forward)", file=sys.stderr)
        return 2
    if a.tokens < 2 or a.depth_bin < 1:
        print("error: --tokens must be at least 2 and --depth-bin at least 1", file=sys.stderr)
        return 2
    read = target_and_document(a.target, a.document)
    if read is None:
        return 2
    path, text = read

    t_all = time.perf_counter()
    load_before = load_average()
    engine = TriForceEngine.from_pretrained(str(path), None, device="cpu", dtype="float32")
    model = engine.target
    kernel = native_layers.kernel()
    if kernel is None or not model.quantized:
        print("error: our model does not keep the GGUF weights quantized under the native layers "
              "(no C compiler, or a width the kernels do not take): the integer path cannot run", file=sys.stderr)
        return 2
    chunk = a.chunk or default_chunk(model)
    ids = sequence(engine.tokenizer, text, a.prefix, a.tokens)
    n = len(ids)
    if n < a.tokens:
        say(f"the document has {n} tokens, fewer than --tokens {a.tokens}: comparing all of them")
    check_at = (n // chunk - 1) * chunk if n >= chunk else 0
    say(f"{path.name}: {n} positions, chunks of {chunk}, rows-vs-steps check at the chunk from {check_at}")

    t0 = time.perf_counter()
    hf = hf_model(path)
    hf_load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = hf_logits(hf, ids)
    hf_forward_s = time.perf_counter() - t0
    del hf
    if ref.shape[-1] != model.vocab_size:
        print(f"error: HF's vocabulary ({ref.shape[-1]}) differs from ours ({model.vocab_size})", file=sys.stderr)
        return 1
    next_ids = torch.tensor(ids[1:] + [-1])
    top2 = ref.topk(2, dim=-1).values
    hf_gap = (top2[:, 0] - top2[:, 1]).double()
    near_tie = hf_gap < a.tie_gap
    hf_top1 = ref.argmax(-1)
    hf_nll = nll(torch.log_softmax(ref.double(), dim=-1), next_ids)
    say(f"HF float32: loaded in {hf_load_s:.1f} s, one forward over {n} tokens in {hf_forward_s:.1f} s; "
        f"near-ties (top-2 gap < {a.tie_gap:g}): {int(near_tie.sum())}")

    results, argmaxes, logits_of = {}, {}, {}
    bins = [(lo, min(lo + a.depth_bin, n)) for lo in range(0, n, a.depth_bin)]
    for name in names:
        on, kv_dtype = CONFIGS[name]
        tally = Tally(n)
        first_chunk = None
        t0 = time.perf_counter()
        # the model's own arithmetic (`Transformer.arithmetic`): the configuration's products, a
        # prefill's on the tiles where they run and the configuration asks
        model.arithmetic = replace(EXACT, products=on, prefill_tiles=PREFILL.get(name, True) and kernel.int8.tiles())
        prefill = name in PREFILL
        for start, logits in teacher_forced(model, ids, kv_dtype, a.prefill_chunk if prefill else chunk,
                                            None if prefill else check_at):
            tally.add(start, logits, ref[start:start + logits.shape[0]], next_ids[start:start + logits.shape[0]])
            if first_chunk is None:
                first_chunk = logits.clone()
        seconds = time.perf_counter() - t0
        logits_of[name] = first_chunk
        argmaxes[name] = tally.top1
        r = figures(tally, hf_top1, near_tie)
        r["by_depth"] = []
        for lo, hi in bins:
            f = figures(tally, hf_top1, near_tie, slice(lo, hi))
            r["by_depth"].append({"from": lo, "to": hi, **{k: f[k] for k in BY_DEPTH}})
        r["integer_products"] = int8.LEVEL_NAMES[on]
        r["kv_dtype"] = str(kv_dtype).removeprefix("torch.")
        if prefill:
            r["prefill_chunk"] = a.prefill_chunk
            r["tiles"] = model.arithmetic.prefill_tiles
        else:
            r["rows_equal_steps"] = {"chunk_from": check_at, "rows": len(ids[check_at:check_at + chunk]), "bit_equal": True}
        r["seconds"] = seconds
        results[name] = r
        say(f"{name:18s} top-1 {100 * r['top1_agreement']:.2f}% "
            f"(excluding near-ties {100 * (r['top1_agreement_excluding_near_ties'] or 0):.2f}%), "
            f"mean KL {r['mean_kl']:.3g}, max KL {r['max_kl']:.3g}, {seconds:.1f} s")

    # The integer path must change the numbers; the float configurations give the reference for it.
    for name in names:
        on, kv_dtype = CONFIGS[name]
        twin = next((m for m in names if CONFIGS[m] == (0, kv_dtype) and m not in PREFILL), None)
        if on and twin is not None:
            differs = not torch.equal(logits_of[name], logits_of[twin])
            results[name]["logits_differ_from_float_path"] = differs
            results[name]["top1_agreement_with_float_path"] = float((argmaxes[name] == argmaxes[twin]).double().mean())
            if not differs:
                say(f"WARNING: {name}'s logits equal {twin}'s: the integer path did not run")

    # The tiles' prefill against the same integers summed in WIDE's order: how far the order moves it.
    if set(PREFILL) <= set(names):
        a_, b_ = "tiles-prefill/kv-float16", "int16-prefill/kv-float16"
        results[a_]["against_int16_prefill"] = {
            "first_chunk_logits_differ": not torch.equal(logits_of[a_], logits_of[b_]),
            "first_chunk_max_abs_logit_difference": float((logits_of[a_] - logits_of[b_]).abs().max()),
            "top1_agreement": float((argmaxes[a_] == argmaxes[b_]).double().mean())}

    report = {
        "target": a.target if a.target == "smollm2" else path.name,  # its name: no folder of the machine it ran on
        "document": a.document.name,
        "prefix": a.prefix,
        "positions": n,
        "chunk": chunk,
        "tie_gap": a.tie_gap,
        "reference": "Hugging Face transformers, float32, weights dequantized from the same GGUF file, one forward",
        "hf": {"near_tie_share": float(near_tie.double().mean()), "mean_top2_gap": float(hf_gap.mean()),
               "mean_nll": float(hf_nll[~hf_nll.isnan()].mean()), "load_seconds": hf_load_s,
               "forward_seconds": hf_forward_s},
        "int8_vector_path": int8.PATH_NAMES.get(kernel.int8.path(), str(kernel.int8.path())),
        "configs": results,
        "llama_cpp": llama_cpp_note(),
        "machine": machine_info(engine, load_before, load_average()),
        "seconds": time.perf_counter() - t_all,
    }
    print_table(report)
    write_json(a.json, report)
    return 0


def print_table(report: dict, file=sys.stderr) -> None:
    print(f"{'configuration':18s} {'top-1 %':>8s} {'excl. ties %':>12s} {'mean KL':>10s} {'max KL':>9s} "
          f"{'near-ties %':>11s} {'mean NLL':>9s}", file=file)
    for name, r in report["configs"].items():
        excl = r["top1_agreement_excluding_near_ties"]
        print(f"{name:18s} {100 * r['top1_agreement']:8.2f} {100 * excl if excl is not None else float('nan'):12.2f} "
              f"{r['mean_kl']:10.3g} {r['max_kl']:9.3g} {100 * r['near_tie_share']:11.2f} {r['mean_nll']:9.4f}",
              file=file)
    print(f"{'HF float32':18s} {'':8s} {'':12s} {'':10s} {'':9s} {100 * report['hf']['near_tie_share']:11.2f} "
          f"{report['hf']['mean_nll']:9.4f}", file=file)
    print(f"llama.cpp: {report['llama_cpp']['note']}", file=file)


if __name__ == "__main__":
    sys.exit(main())
