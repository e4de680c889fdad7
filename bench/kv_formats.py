"""What an integer K/V cache would cost in fidelity, before the engine holds one.

    python -m bench.kv_formats --target smollm2 --tokens 4096 --json bench/results/kv-formats-smollm2.json

Why. Seven rows of attention over a float16 cache cost seven rows of float32 arithmetic: the
verification's attention is bound by the FMA units, not by memory. Integer products over 8-bit
keys (exact int32 scores, the same bits on VNNI for a step and on AMX's tiles for a
verification) would make extra rows nearly free, but only if integer keys read the document about
as faithfully as float16 does. This measures that first. A 16-bit integer is two int8 planes
(high and low bytes) to the tiles: four exact int8 products in place of one.

How. The held-out document is read teacher-forced one token at a time (`bench.fidelity`'s
sequence, Hugging Face float32 as the reference, the same figures) over a float16
`FullCache`; after each step the new token's keys and values are rounded to the format's
integer grid and written back (as float16, or float32 for the 16-bit and 12-bit formats, whose
grids float16 cannot hold), so every later token reads them as such a cache would hold them
(the token's own step read them unrounded). Products and attention are the engine's
defaults, so only the cache's rounding differs between rows of the table. The formats:

    float16             the default cache, untouched (the baseline)
    float32             the `--exact` cache, untouched
    bfloat16            a bfloat16 cache (8-bit significands), as `--kv-dtype bfloat16` holds it
    keys-token          keys as int8, one absmax scale per token and KV head
    keys-32             keys as int8 in blocks of 32 along the head, a float16 scale each (llama.cpp's q8_0)
    keys-channel-32     keys as int8 per channel over groups of 32 tokens (KIVI's keys), a group
                        once it is complete; the tokens of the group not yet complete stay float16
    keys-channel-128    the same over groups of 128 tokens
    keys-values-32      keys and values as q8_0 blocks
    keys-channel-32+values-32
                        keys per channel over 32 tokens, values as q8_0 blocks
    int16-token         keys and values as int16, one absmax scale (float32) per token and KV head
    int12-token         the same on a 12-bit grid (+-2047)
    int16-attention     int16-token's cache read by the integer attention kernel
                        (`Kernel.integer_attention`, csrc/integer_attention.c): each query row on
                        a 14-bit grid, exact integer scores; each row's exponentials times the
                        values' scales on a 14-bit grid per block of 256 keys, exact integer
                        weighted sums

Nothing here changes the engine; the figures decide whether such a cache is worth building.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from bench.chat import DOCUMENT
from bench.fidelity import Tally, figures, hf_logits, hf_model, logits_of_rows, sequence, target_and_document
from bench.reports import write_json
from triforce_core.cli.bench_report import load_average, machine_info
from triforce_core.engine import TriForceEngine
from triforce_core.kv import FullCache
from triforce_core.models import int16_kv, native_attention, transformer

# name: (cache dtype, keys' rounding, values' rounding); a rounding is ("block", n[, bits]) along
# the head, ("channel", n) along n tokens (8 bits), or None
FORMATS = {
    "float16": (torch.float16, None, None),
    "float32": (torch.float32, None, None),
    "bfloat16": (torch.bfloat16, None, None),
    "keys-token": (torch.float16, ("block", 0), None),
    "keys-32": (torch.float16, ("block", 32), None),
    "keys-channel-32": (torch.float16, ("channel", 32), None),
    "keys-channel-128": (torch.float16, ("channel", 128), None),
    "keys-values-32": (torch.float16, ("block", 32), ("block", 32)),
    "keys-channel-32+values-32": (torch.float16, ("channel", 32), ("block", 32)),
    "int16-token": (torch.float32, ("block", 0, 16), ("block", 0, 16)),
    "int12-token": (torch.float32, ("block", 0, 12), ("block", 0, 12)),
    "int16-attention": (torch.float32, ("block", 0, 16), ("block", 0, 16)),
}
INTEGER_ATTENTION = {"int16-attention"}  # formats read through the integer kernel (`KernelAttention`)
SHOWN = {"top1_agreement": "top-1", "top1_agreement_excluding_near_ties": "top-1 no ties", "mean_kl": "mean KL",
         "p99_kl": "p99 KL", "max_kl": "max KL", "mean_nll": "mean NLL"}


def int_blocks(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """`x` [..., n] rounded to int8 in blocks of `block` along its last dimension (0: all of it),
    one absmax scale per block kept as float16, as llama.cpp's q8_0 keeps it; returns the values
    the cache would read back (float32). With `bits` above 8, a grid of that many bits (signed)
    and the scale kept as float32."""
    n = x.shape[-1]
    block = block or n
    if n % block:
        raise ValueError(f"a last dimension of {n} is not a whole number of blocks of {block}")
    y = x.float().reshape(*x.shape[:-1], n // block, block)
    top = 2 ** (bits - 1) - 1
    scale = y.abs().amax(-1, keepdim=True) / top
    if bits == 8:
        scale = scale.half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block stays zero
    return (torch.round(y / scale).clamp(-top, top) * scale).reshape(x.shape)


def int8_channels(k: torch.Tensor) -> torch.Tensor:
    """Keys `k` [..., tokens, D] of one complete group rounded per channel: one absmax scale per
    channel (of D) over the group's tokens."""
    return int_blocks(k.transpose(-1, -2), 0).transpose(-1, -2)


class KernelAttention:
    """`attend`'s stand-in that reads each layer's cache through the integer attention kernel:
    the keys and values the cache holds are written once per token into that layer's int16
    planes (`int16_kv.write`, a layer known by its keys' address), and every call reads them."""

    def __init__(self, kernel, capacity: int, group: int = 1):
        self.kernel, self.capacity, self.group = kernel, capacity, group  # group: query heads a KV head
        self.layers: dict[int, int16_kv.Int16Heads] = {}

    def __call__(self, q, k, v, mask, scale, chunk=0, native=True, windowed=False):
        if windowed:
            raise ValueError("the int16 planes hold every key: a sliding-window layer's band is not read through them")
        H, T, D = k.shape
        heads = self.layers.get(k.data_ptr())
        if heads is None:
            heads = self.layers[k.data_ptr()] = int16_kv.empty(H, self.capacity, D)
        # the tokens past those held, and the forward's own (rewritten: the cache may have been
        # truncated and refilled since)
        start = min(heads.length, T - q.shape[1] // self.group)
        int16_kv.write(heads, k[:, start:T].float(), v[:, start:T].float(), start)
        return self.kernel.integer_attention(q, heads, None if mask is None else mask.limits, scale, chunk)


def round_step(cache: FullCache, position: int, keys, values) -> None:
    """Round what the step at `position` wrote (and, per channel, a group it completed)."""
    for tensor, rounding in ((cache.k, keys), (cache.v, values)):
        if rounding is None:
            continue
        kind, n, *bits = rounding
        if kind == "block":
            at = slice(position, position + 1)
            tensor[:, :, at] = int_blocks(tensor[:, :, at], n, *bits).to(tensor.dtype)
        elif (position + 1) % n == 0:
            group = slice(position + 1 - n, position + 1)
            tensor[:, :, group] = int8_channels(tensor[:, :, group]).to(tensor.dtype)


def measure(model, ids: list[int], ref: torch.Tensor, name: str) -> Tally:
    """`ids` read one token a step over a cache of format `name`: every position's figures against `ref`."""
    dtype, keys, values = FORMATS[name]
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids), dtype, model.device)
    next_ids = torch.tensor(ids[1:] + [-1])
    tally = Tally(len(ids))
    group = s.num_heads // s.num_kv_heads
    reader = KernelAttention(native_attention.kernel(), len(ids), group) if name in INTEGER_ATTENTION else None
    for i, token in enumerate(ids):
        if reader is not None:  # a forward a layer at a time (the same products) calls `attend`
            with mock.patch.object(model, "one_call", False), mock.patch.object(transformer, "attend", reader):
                logits = logits_of_rows(model, [token], i, cache)
        else:
            logits = logits_of_rows(model, [token], i, cache)
        round_step(cache, i, keys, values)
        tally.add(i, logits, ref[i:i + 1], next_ids[i:i + 1])
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_formats", description=__doc__.split("\n\n")[0],
                                epilog="Formats: " + ", ".join(FORMATS))
    p.add_argument("--target", default="smollm2", help="a GGUF file, or smollm2 (default: %(default)s)")
    p.add_argument("--document", type=Path, default=DOCUMENT, help="the text read (default: the held-out document)")
    p.add_argument("--tokens", type=int, default=4096, help="positions compared (default: %(default)s)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of those listed below (default: all)")
    p.add_argument("--tie-gap", type=float, default=0.05,
                   help="a position whose HF top-2 logits differ by less is a near-tie (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = p.parse_args(argv)
    names = [n for n in a.formats.split(",") if n]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        print(f"error: --formats takes {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    if a.tokens < 2:
        print("error: --tokens must be at least 2", file=sys.stderr)
        return 2
    if INTEGER_ATTENTION & set(names) and native_attention.kernel() is None:
        print("error: int16-attention needs the native attention kernel, which is unavailable here", file=sys.stderr)
        return 2
    read = target_and_document(a.target, a.document)
    if read is None:
        return 2
    path, text = read

    load_before = load_average()
    engine = TriForceEngine.from_pretrained(str(path), None, device="cpu", dtype="float32")
    model = engine.target
    ids = sequence(engine.tokenizer, text, "chat", a.tokens)
    if INTEGER_ATTENTION & set(names) and model.spec.head_dim % 64:
        print(f"error: int16-attention needs a head size that is a multiple of 64, not {model.spec.head_dim}",
              file=sys.stderr)
        return 2
    hf = hf_model(path)
    ref = hf_logits(hf, ids)
    del hf
    if ref.shape[-1] != model.vocab_size:
        print(f"error: HF's vocabulary ({ref.shape[-1]}) differs from ours ({model.vocab_size})", file=sys.stderr)
        return 1
    hf_top1 = ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]).double() < a.tie_gap
    print(f"{path.name}: {len(ids)} positions, one token a step; near-ties: {int(near_tie.sum())}", file=sys.stderr)
    print(f"{'format':28s} " + " ".join(f"{label:>14s}" for label in SHOWN.values()), file=sys.stderr)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        r = figures(measure(model, ids, ref, name), hf_top1, near_tie)
        r["seconds"] = time.perf_counter() - t0
        results[name] = r
        print(f"{name:28s} " + " ".join(f"{r[k]:14.6g}" for k in SHOWN), file=sys.stderr)
    write_json(a.json, {"model": path.name, "positions": len(ids), "document": a.document.name,
                        "machine": machine_info(engine, load_before, load_average()), "formats": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
