"""What one forward of each level costs, against the bytes it reads: the native layers on and off.

For each context length: the target over its full cache (1 row: a decoding step; gamma2 + 1
rows: a verification), the target's weights over the retrieval cache (1 row; gamma1 + 1 rows:
the middle level checking the small draft) and the small draft over its StreamingLLM window
(1 row). Each forward runs with the native decoder layers (`native_layers`) on and off,
alternated, medians; the native attention kernel stays as the model uses it. Beside each time:
the bytes the forward must read (weights, one embedding row, the K/V it attends to) and the
time those bytes take at the memory's bandwidth, measured just before each level's timings (the
floor; on a shared machine the bandwidth moves between minutes).

The full cache holds random keys and values, not a prefilled document: a step's cost does not
depend on what the keys say, and a 64K-token prefill would take minutes. The retrieval level
selects its chunks for the last token's real queries, as after a prefill.

With `--kv-dtypes`, every cache is kept in each K/V dtype in turn (the same random K/V,
rounded), a row per dtype, every dtype's forwards alternated with the others' (and with
`--no-pytorch-layers`, the native layers only: half the forwards). With `--products 0,fast`, the native layers' products
over GGUF blocks in each mode (`triforce_core.models.int8`: the float path, two levels of 8-bit
activations for the K types, ...), alternated likewise. With `--pages huge,small`,
likewise every cache on 2 MB pages (`triforce_core.models.huge_pages`, the default) and on ordinary
4 KB ones. With `--attention float,integer`, few-row attention on its float32 path (the default)
and otherwise, alternated likewise: `integer` reads each forward's
cache through the integer attention kernel instead (`bench.kv_formats.KernelAttention`: the
cache packed into int16 planes once, then each forward's own tokens), a layer at a time (the
one-call forward calls the float kernel from C), what the kernel would make a forward cost before
a cache holds its planes; `float-layers`, the float32 path a layer at a time, its control.

    python -m bench.level_steps [--context 16000,32000,64000] [--repeats 15] [--kv-dtypes float32,float16]
                                [--pages huge,small] [--products 0,int16] [--attention float,integer]
                                [--no-pytorch-layers] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from bench.kv_formats import KernelAttention
from bench.reports import write_json
from triforce_core.models import huge_pages, int8, native_attention, native_layers, transformer
from bench.loading import load_bench
from triforce_core.cli.bench_report import cpu_model
from triforce_core.cli.harness import Bench
from triforce_core.config import KV_DTYPES, PAPER_METHOD, CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.kv import kv_dtype_name, new_full_cache
from triforce_core.models.loading import sync_device
from triforce_core.models.roofline import decode_weight_bytes, kv_bytes, measure_bandwidth


def random_cache_decoder(engine: TriForceEngine, tokens: int, seed: int, kv_dtype: str | None = None):
    """A decoder of the paper's three levels whose target cache holds `tokens` random K/V (drawn
    in float32 a layer at a time, rounded into `kv_dtype`; None: the engine's default), as after
    a prefill. Returns the decoder and its config."""
    # Without a small draft (a GGUF target has none yet) the retrieval level drafts on its own.
    mode = "triforce" if engine.draft is not None else "retrieval"
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=16, **PAPER_METHOD),
                           cache=CacheConfig(kv_dtype=kv_dtype))
    target = engine.target
    s, dev = target.spec, target.device
    history = torch.randint(16, target.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    full = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, engine.capacity_for(tokens + 1, cfg),
                          engine.kv_dtype_for(cfg), dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    shape = (s.num_kv_heads, tokens, s.head_dim)
    for layer in range(s.num_layers):  # a layer at a time: no float32 copy of a whole long cache
        full.write(layer, 0, torch.randn(shape, generator=g, device=dev), torch.randn(shape, generator=g, device=dev))
    full.length = tokens
    dec = engine.make_loop(cfg, full.capacity, None, full_cache=full, history=history)
    dec.prefill(history + [history[-1]])  # feeds the last token: the retrieval selection needs its queries
    return dec, cfg


def step_seconds(lane, rows: int) -> float:
    """One forward of `rows` new tokens, rolled back afterwards (on a GPU, until its work is done)."""
    return forward_times(lane, rows)[0]


def forward_times(lane, rows: int) -> tuple[float, float]:
    """`step_seconds`, and the time until the forward returned, before waiting for the device
    (on a GPU, the host's part: Python and kernel launches; on the CPU, all of it)."""
    length, fed, pending = lane.cache.length, list(lane.fed), list(lane.pending)
    sync_device(lane.model.device)
    t0 = time.perf_counter()
    lane.advance([7] * (rows - len(pending)))
    t1 = time.perf_counter()
    sync_device(lane.model.device)
    t2 = time.perf_counter()
    lane.cache.truncate(length)
    lane.fed, lane.pending = fed, pending
    return t2 - t0, t1 - t0


def measure(bench: Bench, contexts: list[int], repeats: int, say=print, kv_dtypes: tuple[str | None, ...] = (None,),
            pytorch_layers: bool = True, pages: tuple[str, ...] = ("huge",), products: tuple[str | None, ...] = (None,),
            attention: tuple[str | None, ...] = (None,)) -> dict:
    if native_layers.kernel() is None:
        raise SystemExit("error: the native layers are unavailable here (no C compiler)")
    results, bandwidths = [], []
    paths = ("native", "pytorch") if pytorch_layers else ("native",)
    for T in contexts:
        decs = {}
        for dt in kv_dtypes:
            for pg in pages:
                with mock.patch.object(huge_pages, "available", lambda: False) if pg == "small" else contextlib.nullcontext():
                    decs[dt, pg] = random_cache_decoder(bench.engine, T, seed=T, kv_dtype=dt)  # the same K/V in each dtype
        spec = next(iter(decs.values()))[1].speculation
        levels = [("target", "full", 1), ("target", "full", spec.gamma2 + 1), ("retrieval", "retrieval", 1),
                  ("retrieval", "retrieval", spec.gamma1 + 1), ("draft", "small", 1)]
        if bench.engine.draft is None:
            levels = levels[:3]
        for level, attr, rows in levels:
            lanes = {v: getattr(dec, attr) for v, (dec, _) in decs.items()}
            # measured beside each timing: on a shared machine it moves by half between minutes
            bandwidth = measure_bandwidth(torch.device("cpu"))
            bandwidths.append(bandwidth)
            own = {v: lane.model.arithmetic for v, lane in lanes.items()}
            times = {(v, (pr, at), path): [] for v in decs for pr in products for at in attention for path in paths}
            readers: dict = {}  # the integer kernel's reader of each lane's cache
            for i in range(repeats + 2):
                for v, (pr, at), path in (list(times) if i % 2 == 0 else list(times)[::-1]):
                    lanes[v].model.arithmetic = replace(own[v], products=own[v].products if pr is None else int8.MODE_WORDS[pr],
                                                        native_layers=path == "native")
                    with attention_switched(at, lanes[v], readers):
                        t = step_seconds(lanes[v], rows)
                    if i >= 2:
                        times[v, (pr, at), path].append(t)
            for v, lane in lanes.items():
                lane.model.arithmetic = own[v]
            for v, (pr, at) in dict.fromkeys((v, x) for v, x, _ in times):
                lane, pg = lanes[v], v[1]
                model = lane.model
                keys = lane.cache.length + rows
                read = decode_weight_bytes(model) + kv_bytes(model, keys, lane.cache.dtype)
                med = {path: sorted(times[v, (pr, at), path])[len(times[v, (pr, at), path]) // 2] * 1e3 for path in paths}
                floor = read / (bandwidth * 1e9) * 1e3
                kv = kv_dtype_name(lane.cache.dtype)
                mode = own[v].products if pr is None else int8.MODE_WORDS[pr]
                kind = "integer" if kv == "int16" else at if at in ("integer", "float-layers") else "float"
                # the retrieval level keeps an int16 configuration's tokens as float16: its rows
                # say which configuration they belong to
                asked = v[0] if v[0] is not None and v[0] != kv else None
                row = {"context": T, "level": level, "rows": rows, "keys": keys, "kv_dtype": kv, "pages": pg, "bytes": read,
                       "products": int8.LEVEL_NAMES[mode], "attention": kind,
                       "ms": med, "bandwidth_gbs": bandwidth, "floor_ms": floor}
                if asked is not None:
                    row["configured_kv_dtype"] = asked
                if pytorch_layers:
                    row["speedup"] = med["pytorch"] / med["native"]
                results.append(row)
                torch_part = f", pytorch {med['pytorch']:.2f} ms ({row['speedup']:.2f}x)" if pytorch_layers else ""
                kv_said = f"{kv} K/V" + (f" (of the {asked} configuration)" if asked is not None else "")
                say(f"[steps] {T} tokens, {level}, {rows} rows over {keys} keys, {kv_said} on {pg} pages, "
                    f"{int8.LEVEL_NAMES[mode]} products, {row['attention']} attention ({read / 1e6:.1f} MB): "
                    f"native {med['native']:.2f} ms{torch_part}; "
                    f"floor {floor:.2f} ms at {bandwidth:.1f} GB/s ({med['native'] / floor:.2f}x it)")
        del decs
    return {"bandwidth_gbs": sorted(bandwidths)[len(bandwidths) // 2], "results": results}


ATTENTION_PATHS = ("float", "float-layers", "integer")


def attention_switched(path: str | None, lane=None, readers: dict | None = None):
    """Few-row attention inside the block: its float32 path ("float", or None: the model's
    own); "float-layers": the same a layer at a time; "integer": `lane`'s forwards a layer at
    a time, reading its cache through the integer kernel (a reader kept in `readers` per lane)."""
    if path is None or path == "float":
        return contextlib.nullcontext()
    if path == "float-layers":
        return mock.patch.object(lane.model, "one_call", False)
    if path == "integer":
        model = lane.model
        if id(lane) not in readers:
            s = model.spec
            readers[id(lane)] = KernelAttention(native_attention.kernel(), lane.cache.capacity,
                                                s.num_heads // s.num_kv_heads)
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(model, "one_call", False))
        stack.enter_context(mock.patch.object(transformer, "attend", readers[id(lane)]))
        return stack
    raise ValueError(f"no attention path {path!r}")


def parse_contexts(text: str, repeats: int) -> list[int]:
    """`--context`'s comma-separated lengths; ValueError (the message for the user) if they or
    `--repeats` are not positive."""
    try:
        contexts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--context must be comma-separated integers, got {text!r}") from None
    if not contexts or min(contexts) < 1 or repeats < 1:
        raise ValueError("--context needs positive lengths and --repeats must be >= 1")
    return contexts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the embedded demo target)")
    p.add_argument("--draft", help="draft model (default: the embedded demo draft)")
    p.add_argument("--context", default="16000,32000,64000", help="comma-separated cache lengths in tokens (each at most the target's window less 64)")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per configuration (default 15)")
    p.add_argument("--kv-dtypes", default=None,
                   help=f"comma-separated K/V dtypes, of {', '.join(KV_DTYPES)}, measured alternately "
                   "(default: the engine's default alone)")
    p.add_argument("--pages", default="huge",
                   help="comma-separated page sizes for the caches, of huge (2 MB, the default) and small (4 KB), "
                   "measured alternately")
    p.add_argument("--products", default=None,
                   help="comma-separated modes of the native layers' products over GGUF blocks, measured alternately: "
                   "0 (the float path), int16, step-tiles (default: the engine's own alone; see triforce_core.models.int8)")
    p.add_argument("--attention", default=None,
                   help="comma-separated few-row attention paths, measured alternately: float (the float32 path, "
                   "the default), float-layers (the same a layer at a time), integer (the integer kernel over the "
                   "cache packed as int16, a layer at a time) (default: the model's own, alone)")
    p.add_argument("--no-pytorch-layers", action="store_true",
                   help="time the native layers only (not PyTorch's beside them)")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    try:
        contexts = parse_contexts(a.context, a.repeats)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kv_dtypes: tuple[str | None, ...] = (None,)
    if a.kv_dtypes is not None:
        kv_dtypes = tuple(x.strip() for x in a.kv_dtypes.split(",") if x.strip())
        if not kv_dtypes or any(d not in KV_DTYPES for d in kv_dtypes) or len(set(kv_dtypes)) != len(kv_dtypes):
            print(f"error: --kv-dtypes takes distinct names of {', '.join(KV_DTYPES)}", file=sys.stderr)
            return 2
    pages = tuple(x.strip() for x in a.pages.split(",") if x.strip())
    if not pages or any(pg not in ("huge", "small") for pg in pages) or len(set(pages)) != len(pages):
        print("error: --pages takes distinct names of huge, small", file=sys.stderr)
        return 2
    products: tuple[str | None, ...] = (None,)
    if a.products is not None:
        products = tuple(x.strip().lower() for x in a.products.split(",") if x.strip())
        if not products or any(x not in int8.MODE_WORDS for x in products) or len(set(products)) != len(products):
            print(f"error: --products takes distinct names of {', '.join(int8.MODE_WORDS)}", file=sys.stderr)
            return 2
    attention: tuple[str | None, ...] = (None,)
    if a.attention is not None:
        attention = tuple(x.strip().lower() for x in a.attention.split(",") if x.strip())
        if (not attention or any(x not in ATTENTION_PATHS for x in attention) or len(set(attention)) != len(attention)):
            print(f"error: --attention takes distinct names of {', '.join(ATTENTION_PATHS)}", file=sys.stderr)
            return 2
    bench = load_bench(a.target, a.draft)
    limit = bench.engine.target.spec.max_position_embeddings
    if max(contexts) + 64 > limit:
        print(f"error: the target reads at most {limit} tokens; --context {max(contexts)} leaves no room", file=sys.stderr)
        return 2
    if "integer" in attention and any(w is not None for w in bench.engine.target.spec.sliding_windows):
        print("error: --attention integer reads every key of the int16 planes: a model with sliding-window layers "
              "takes float", file=sys.stderr)
        return 2
    report = measure(bench, contexts, a.repeats, kv_dtypes=kv_dtypes, pytorch_layers=not a.no_pytorch_layers,
                     pages=pages, products=products, attention=attention)
    report.update(machine={"cpu": cpu_model(), "threads": torch.get_num_threads(),
                           "cores": os.cpu_count()}, repeats=a.repeats)
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
