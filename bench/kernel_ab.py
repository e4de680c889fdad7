"""The native libraries of two source trees, timed against each other in one process.

    python -m bench.kernel_ab --base REV [--target FILE.gguf] [--rows 1,7,256] [--steps 1,7]
                              [--context 4096] [--kv-dtype int16] [--prefill 2048] [--repeats 8] [--json OUT]
    python -m bench.kernel_ab --base-arithmetic FIELD=VALUE ...   (the working tree's library both
                              sides, the base's models with that field of their `Arithmetic`:
                              prefill_tiles=0, a prefill without tiles)

Builds the decoder layers' library (`layers.c`) and the attention's (`attention.c`) from git
revision REV's `triforce_core/models/csrc` (extracted with `git archive` into a temporary
folder) and from the working tree, with the flags the engine builds them with, loads both
pairs, and alternates them call by call (the order reversed every other repetition, medians of
the repetitions):

- products: each projection of one layer of --target (with --from-memory: of every layer in
  turn, so that the weights come from memory) in the products mode the engine takes here
  (`arithmetic.measured_default`: the steps' order on AMX's tiles where they run; or
  --products-mode, on --path), at each of --rows: milliseconds, GMAC/s, new/base, and whether
  both gave the same bits (a change of speed must not be a change of arithmetic);
- random products: --matrices random [--shape] matrices of each of --random-types in turn (as
  `bench.int8_rows --matrices`), at each of --rows;
- attention: --attention-rows query rows over 16 random caches of --attention-keys tokens in
  turn (--heads KV heads of --head-dim; --kv-dtype int16: the integer kernel, float16: the
  float one), all rows seeing every key, as a step's or a verification's attention;
- steps: a forward of each of --steps rows over a random cache of --context tokens in
  --kv-dtype (`bench.level_steps.random_cache_decoder`; default the engine's), the process's
  two libraries swapped between runs;
- prefill: --prefill random tokens through the model into an empty cache, in chunks of the
  default `prefill_chunk`, as a document's prefill runs (tokens a second).

A library is a few seconds to build; a desktop-size file (`bench.desktop_models`) is what it
is for. Never in `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from io import BytesIO
from pathlib import Path
from typing import NamedTuple

import torch

from bench.int8_rows import TYPES as RANDOM_TYPES
from bench.int8_rows import random_matrix
from bench.reports import write_json
from triforce_core.cli.bench_report import cpu_model
from triforce_core.config import KV_DTYPES
from triforce_core.kv.store import kv_dtype_name
from triforce_core.models import int8, native_attention, native_build, native_layers
from triforce_core.models.arithmetic import measured_default

ROOT = Path(__file__).resolve().parent.parent
CSRC = "triforce_core/models/csrc"


def sources_at(rev: str, folder: Path) -> Path:
    """REV's csrc folder written under `folder`; the path of its layers.c."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(folder, filter="data")
    return folder / CSRC / "layers.c"


class Libraries(NamedTuple):
    """One source tree's two libraries: the decoder layers' and the attention's (which the
    layers call by address)."""

    layers: native_layers.Layers
    attention: native_attention.Kernel


def load(layers_c: Path, folder: Path) -> Libraries:
    """The libraries built from the csrc folder holding `layers_c`."""
    layers = native_layers.Layers(ctypes.CDLL(str(native_build.build(layers_c, native_layers.LAYER_FLAGS, folder))))
    source = layers_c.with_name(native_attention.SOURCE.name)
    if not source.exists():  # a revision from before the attention's source was named attention.c
        source = layers_c.with_name("few_rows.c")
    attention = native_attention.Kernel(native_build.build(source, native_attention.FLAGS, folder))
    return Libraries(layers, attention)


def use(libs: Libraries) -> None:
    """Every forward of this process takes `libs` from now on."""
    native_layers._loader._loaded = libs.layers
    native_attention._loader._loaded = libs.attention


# Fields of `Arithmetic` per side (`--base-arithmetic`), given to the timed forwards' models
# (`MODELS`) around each of that side's runs.
ARITHMETIC: dict[str, dict] = {}
MODELS: list = []


def alternate(libs: dict, repeats: int, run) -> dict[str, float]:
    """Median seconds of `run(lib)` per library, the libraries alternated, order reversed every other time."""
    names, times = list(libs), {n: [] for n in libs}
    for r in range(repeats + 1):
        for n in (names if r % 2 == 0 else names[::-1]):
            with arithmetic_of(ARITHMETIC.get(n, {})):
                t = run(libs[n])
            if r:  # the first round warms both
                times[n].append(t)
    return {n: statistics.median(v) for n, v in times.items()}


@contextlib.contextmanager
def arithmetic_of(fields: dict):
    """`MODELS` with these fields of their arithmetic inside the block, as before after it."""
    own = [m.arithmetic for m in MODELS]
    for m in MODELS:
        m.arithmetic = replace(m.arithmetic, **fields)
    try:
        yield
    finally:
        for m, a in zip(MODELS, own):
            m.arithmetic = a


def product_rows(libs: dict, label: str, ws: list, rows: list[int], repeats: int, mode: int, say) -> list[dict]:
    """Each row count's product through `ws` in turn (times per matrix), the libraries alternated."""
    w, out = ws[0], []
    for S in rows:
        x = torch.randn(S, w.n_in, generator=torch.Generator().manual_seed(S))
        ys = {n: lib.layers.int8.product(x, w, mode) for n, lib in libs.items()}

        def run(lib):
            t0 = time.perf_counter()
            for m in ws:
                lib.layers.int8.product(x, m, mode)
            return (time.perf_counter() - t0) / len(ws)

        t = alternate(libs, repeats, run)
        macs = S * w.n_in * w.n_out
        row = {"matrix": label, "types": w.type_names(), "shape": [w.n_out, w.n_in], "matrices": len(ws), "rows": S,
               "ms": {n: v * 1e3 for n, v in t.items()}, "gmacs": {n: macs / v / 1e9 for n, v in t.items()},
               "new_over_base": t["base"] / t["new"], "same_bits": torch.equal(ys["base"], ys["new"])}
        out.append(row)
        say(f"[kernel-ab] {label} {row['types']} x {S} rows: base {row['ms']['base']:.2f} ms, new {row['ms']['new']:.2f} ms "
            f"({row['new_over_base']:.2f}x), same bits: {row['same_bits']}")
    return out


def products(model, libs: dict, rows: list[int], repeats: int, say, mode: int, from_memory: bool = False) -> list[dict]:
    """Each projection at each row count, in `mode`. With `from_memory`, a call goes through that
    projection of every layer in turn (times per matrix): the weights then come from memory, as a
    forward's do, where one layer's matrix called again is read from the caches."""
    layers = model.layers if from_memory else [model.layers[len(model.layers) // 2]]
    out = []
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        out += product_rows(libs, name, [getattr(layer, name) for layer in layers], rows, repeats, mode, say)
    return out


def random_products(libs: dict, types: list[str], shape: tuple[int, int], count: int, rows: list[int], repeats: int,
                    mode: int, say) -> list[dict]:
    """`count` random [N x K] matrices of each type (`bench.int8_rows.random_matrix`) in turn."""
    out = []
    for name in types:
        ws = [random_matrix(name, *shape, seed=i) for i in range(count)]
        out += product_rows(libs, f"random {name}", ws, rows, repeats, mode, say)
    return out


def attention_calls(libs: dict, rows: list[int], keys: int, heads: int, head_dim: int, kv_dtype: str, repeats: int,
                    say, layers: int = 16) -> list[dict]:
    """Each row count's attention (all rows seeing every key) over `layers` random caches of
    `keys` tokens in turn, as a forward's layers (float16: the float kernel; int16: the integer
    kernel, on its default path), times per cache, the libraries alternated."""
    from triforce_core.models import huge_pages, int16_kv

    g = torch.Generator().manual_seed(keys)
    caches = []
    for _ in range(layers):
        k, v = torch.randn(heads, keys, head_dim, generator=g), torch.randn(heads, keys, head_dim, generator=g)
        if kv_dtype == "int16":
            caches.append(int16_kv.pack(k, v))
        else:  # on 2 MB pages, as the engine's caches are
            dt = getattr(torch, kv_dtype)
            caches.append(tuple(huge_pages.zeros(tuple(x.shape), dt).copy_(x) for x in (k, v)))
    out = []
    for R in rows:
        q = torch.randn(heads, R, head_dim, generator=g)

        def call(lib, c):
            if kv_dtype == "int16":
                return lib.attention.integer_attention(q, c, None, head_dim ** -0.5)[0]
            return lib.attention.attention(q, c[0], c[1], None, head_dim ** -0.5)[0]

        ys = {n: call(lib, caches[0]) for n, lib in libs.items()}

        def run(lib):
            t0 = time.perf_counter()
            for c in caches:
                call(lib, c)
            return (time.perf_counter() - t0) / len(caches)

        t = alternate(libs, repeats, run)
        row = {"rows": R, "keys": keys, "heads": heads, "head_dim": head_dim, "kv_dtype": kv_dtype,
               "ms": {n: v * 1e3 for n, v in t.items()}, "new_over_base": t["base"] / t["new"],
               "same_bits": torch.equal(ys["base"], ys["new"])}
        out.append(row)
        say(f"[kernel-ab] attention, {R} rows over {keys} keys, {heads} heads of {head_dim}, {kv_dtype} K/V: base "
            f"{row['ms']['base']:.3f} ms, new {row['ms']['new']:.3f} ms ({row['new_over_base']:.2f}x), same bits: {row['same_bits']}")
    return out


def steps(target: str, libs: dict, rows: list[int], context: int, repeats: int, say, kv_dtype: str | None = None) -> list[dict]:
    from bench.level_steps import forward_times, random_cache_decoder
    from bench.loading import load_bench

    engine = load_bench(target, None).engine
    dec, _ = random_cache_decoder(engine, context, seed=1, kv_dtype=kv_dtype)
    lane = dec.full
    MODELS.append(lane.model)
    out = []
    for S in rows:
        def run(lib):
            use(lib)
            forward_times(lane, S)  # one to settle the swapped library's caches
            return statistics.median(forward_times(lane, S)[0] for _ in range(9))

        t = alternate(libs, repeats, run)
        row = {"rows": S, "context": context, "kv_dtype": kv_dtype_name(lane.cache.dtype),
               "ms": {n: v * 1e3 for n, v in t.items()}, "new_over_base": t["base"] / t["new"]}
        out.append(row)
        say(f"[kernel-ab] a forward of {S} rows over {context} keys ({row['kv_dtype']} K/V): base {row['ms']['base']:.2f} ms, "
            f"new {row['ms']['new']:.2f} ms ({row['new_over_base']:.2f}x)")
    return out


def prefill(target: str, libs: dict, tokens: int, repeats: int, say) -> dict:
    from triforce_core.config import CacheConfig, GenerationConfig
    from triforce_core.kv.full import FullCache
    from bench.loading import load_bench

    engine = load_bench(target, None).engine
    model, s = engine.target, engine.target.spec
    MODELS.append(model)
    chunk = CacheConfig().prefill_chunk
    ids = torch.randint(16, model.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, tokens + 1, engine.kv_dtype_for(GenerationConfig()), model.device)

    def run(lib):
        use(lib)
        cache.truncate(0)
        t0 = time.perf_counter()
        for at in range(0, tokens, chunk):
            part = ids[at:at + chunk]
            model.forward(part, cache.positions(at, len(part)), cache, logits_rows=None)
        return time.perf_counter() - t0

    t = alternate(libs, repeats, run)
    row = {"tokens": tokens, "chunk": chunk, "seconds": t, "tokens_per_s": {n: tokens / v for n, v in t.items()},
           "new_over_base": t["base"] / t["new"]}
    say(f"[kernel-ab] a prefill of {tokens} tokens in chunks of {chunk}: base {tokens / t['base']:.1f} tok/s, "
        f"new {tokens / t['new']:.1f} tok/s ({row['new_over_base']:.2f}x)")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--base", help="git revision whose csrc is the baseline")
    side.add_argument("--base-arithmetic", metavar="FIELD=VALUE",
                      help="the baseline is the working tree's library, the forwards' models with this field of their "
                      "Arithmetic (prefill_tiles, native_layers, native_attention: 0 or 1; products: a mode word)")
    p.add_argument("--target", default=str(Path.home() / ".cache/triforce-studio/desktop-models/llama-3.2-1b-shape.Q4_K_M.gguf"),
                   help="a GGUF file (default: the 1B shape of bench.desktop_models)")
    p.add_argument("--rows", default="1,7,256", help="row counts of the products")
    p.add_argument("--products-mode", default=None,
                   help="the products' mode (int8.MODE_WORDS: int16, step-tiles; default the engine's here)")
    p.add_argument("--path", choices=list(int8.PATH_NAMES.values()), default=None,
                   help="force the products' vector instructions on both sides, for the forwards too (default: the "
                   "widest that runs)")
    p.add_argument("--from-memory", action="store_true",
                   help="each product call goes through that projection of every layer in turn (weights from memory)")
    p.add_argument("--random-types", default="",
                   help="GGML types of random matrices to time as well (Q4_K,Q6_K; '' for none), at --rows")
    p.add_argument("--shape", default="16384x2048", help="the random matrices' outputs x inputs")
    p.add_argument("--matrices", type=int, default=19,
                   help="random matrices of each type, a call going through all of them (enough to outgrow the caches)")
    p.add_argument("--attention-rows", default="",
                   help="row counts of attention calls to time ('' for none): query rows of one KV head, over "
                   "16 random caches in turn")
    p.add_argument("--attention-keys", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8, help="the attention calls' KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="the attention calls' head size")
    p.add_argument("--steps", default="1,7", help="row counts of the forwards ('' for none)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="the forwards' and the attention calls' K/V dtype (default: the engine's for the target; "
                   "int16 for the calls)")
    p.add_argument("--prefill", type=int, default=0, help="tokens of a prefill to time (0: none)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not Path(args.target).is_file():
        print(f"error: no file {args.target} (python -m bench.desktop_models writes it)", file=sys.stderr)
        return 2
    say = lambda line: print(line, flush=True)  # noqa: E731

    def parse(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    try:
        counts = [*parse(args.rows), *parse(args.steps), *parse(args.attention_rows)]
    except ValueError:
        print("error: --rows, --steps and --attention-rows take comma-separated integers", file=sys.stderr)
        return 2
    if min([*counts, args.attention_keys, args.heads, args.head_dim, args.context, args.repeats, 1]) < 1:
        print("error: row counts, --attention-keys, --heads, --head-dim, --context and --repeats must be at least 1",
              file=sys.stderr)
        return 2
    mode = None
    if args.products_mode is not None:
        if args.products_mode.strip().lower() not in int8.MODE_WORDS:
            print(f"error: --products-mode takes one of {', '.join(int8.MODE_WORDS)}", file=sys.stderr)
            return 2
        mode = int8.MODE_WORDS[args.products_mode.strip().lower()]
    path = None if args.path is None else next(k for k, v in int8.PATH_NAMES.items() if v == args.path)
    types = [t.strip().upper() for t in args.random_types.split(",") if t.strip()]
    try:
        shape = tuple(int(v) for v in args.shape.lower().split("x"))
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --shape takes OUTPUTSxINPUTS, not {args.shape!r}", file=sys.stderr)
        return 2
    quantized = [t for t in RANDOM_TYPES if t not in ("F32", "F16")]
    if any(t not in quantized for t in types) or args.matrices < 1:
        print(f"error: --random-types takes GGML types of {', '.join(quantized)} and --matrices at least 1", file=sys.stderr)
        return 2
    if parse(args.attention_rows) and (args.kv_dtype or "int16") == "int16" and args.head_dim % 64:
        print("error: the integer attention needs --head-dim a multiple of 64", file=sys.stderr)
        return 2
    if args.base_arithmetic is not None:
        name, eq, value = (x.strip().lower() for x in args.base_arithmetic.partition("="))
        flags = {"prefill_tiles", "native_layers", "native_attention"}
        ok = eq and (name in flags and value in ("0", "1") or name == "products" and value in int8.MODE_WORDS)
        if not ok:
            print(f"error: --base-arithmetic takes FIELD=VALUE ({', '.join(sorted(flags))}=0 or 1, products=MODE), "
                  f"not {args.base_arithmetic!r}", file=sys.stderr)
            return 2
        ARITHMETIC["base"] = {name: int8.MODE_WORDS[value] if name == "products" else value == "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        new = load(native_layers.SOURCE, tmp / "lib-new")
        own = Libraries(native_layers.kernel(), native_attention.kernel())  # restored at the end
        if args.base_arithmetic is not None:
            libs = {"base": new, "new": new}
        else:
            try:
                base_src = sources_at(args.base, tmp / "base")
            except subprocess.CalledProcessError as e:
                print(f"error: git archive {args.base}: {e.stderr.decode(errors='replace').strip()}", file=sys.stderr)
                return 2
            libs = {"base": load(base_src, tmp / "lib-base"), "new": new}
        from triforce_core.models.loading import load_model

        model = load_model(args.target, torch.device("cpu"), torch.float32).model
        if path is not None:
            for lib in libs.values():
                if lib.layers.int8.lib.int8_set_path(path) != path:
                    print(f"error: this processor cannot run the {args.path} path", file=sys.stderr)
                    return 2
        mode = measured_default().products if mode is None else mode
        report = {"base": args.base or f"this tree with {args.base_arithmetic}", "target": Path(args.target).name, "cpu": cpu_model(),
                  "threads": torch.get_num_threads(), "mode": int8.LEVEL_NAMES[mode],
                  "path": int8.PATH_NAMES[libs["new"].layers.int8.path()], "from_memory": args.from_memory,
                  "products": products(model, libs, parse(args.rows), args.repeats, say, mode, args.from_memory)}
        del model
        if types:
            report["random_products"] = random_products(libs, types, shape, args.matrices, parse(args.rows), args.repeats,
                                                        mode, say)
        if parse(args.attention_rows):
            report["attention"] = attention_calls(libs, parse(args.attention_rows), args.attention_keys, args.heads,
                                                  args.head_dim, args.kv_dtype or "int16", args.repeats, say)
        if parse(args.steps):
            report["steps"] = steps(args.target, libs, parse(args.steps), args.context, args.repeats, say, args.kv_dtype)
        if args.prefill > 0:
            report["prefill"] = prefill(args.target, libs, args.prefill, max(2, args.repeats // 4), say)
        for lib in libs.values():
            lib.layers.int8.lib.int8_set_path(-1)
        use(own)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
