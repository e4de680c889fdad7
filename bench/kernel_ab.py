"""The native layers library of two source trees, timed against each other in one process.

    python -m bench.kernel_ab --base REV [--target FILE.gguf] [--rows 1,7,256]
                              [--steps 1,7] [--context 4096] [--prefill 2048] [--repeats 8] [--json OUT]
    python -m bench.kernel_ab --base-env NAME=VALUE ...   (the working tree's library both sides,
                              the base with NAME=VALUE set: TRIFORCE_TILES=0, a prefill without tiles)

Builds `layers.c` from git revision REV's `triforce_core/models/csrc` (extracted with
`git archive` into a temporary folder) and from the working tree, with the flags the engine
builds it with (`native_layers.LAYER_FLAGS`), loads both, and alternates them call by call
(the order reversed every other repetition, medians of the repetitions):

- products: each projection of one layer of --target in the default products mode
  (`int8.FAST_PATH_DEFAULT`), at each of --rows: milliseconds, GMAC/s, new/base, and whether
  both gave the same bits (a change of speed must not be a change of arithmetic);
- steps: a forward of each of --steps rows over a random cache of --context tokens
  (`bench.level_steps.random_cache_decoder`), the process's library swapped between runs;
- prefill: --prefill random tokens through the model into an empty cache, in chunks of the
  default `prefill_chunk`, as a document's prefill runs (tokens a second).

A library is a few seconds to build; a desktop-size file (`bench.desktop_models`) is what it
is for. Never in `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from bench.reports import write_json
from triforce_core.cli.bench_report import cpu_model
from triforce_core.models import int8, native_build, native_layers

ROOT = Path(__file__).resolve().parent.parent
CSRC = "triforce_core/models/csrc"


def sources_at(rev: str, folder: Path) -> Path:
    """REV's csrc folder written under `folder`; the path of its layers.c."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(folder, filter="data")
    return folder / CSRC / "layers.c"


def load(source: Path, folder: Path) -> native_layers.Layers:
    return native_layers.Layers(ctypes.CDLL(str(native_build.build(source, native_layers.LAYER_FLAGS, folder))))


# Environment settings per side (`--base-env`), set around each of that side's runs.
ENVS: dict[str, dict[str, str]] = {}


def alternate(libs: dict, repeats: int, run) -> dict[str, float]:
    """Median seconds of `run(lib)` per library, the libraries alternated, order reversed every other time."""
    names, times = list(libs), {n: [] for n in libs}
    for r in range(repeats + 1):
        for n in (names if r % 2 == 0 else names[::-1]):
            with switched_env(ENVS.get(n, {})):
                t = run(libs[n])
            if r:  # the first round warms both
                times[n].append(t)
    return {n: statistics.median(v) for n, v in times.items()}


@contextlib.contextmanager
def switched_env(values: dict[str, str]):
    """The environment with `values` set inside the block, as before after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def products(model, libs: dict, rows: list[int], repeats: int, say) -> list[dict]:
    layer = model.layers[len(model.layers) // 2]
    out = []
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        w = getattr(layer, name)
        for S in rows:
            x = torch.randn(S, w.n_in, generator=torch.Generator().manual_seed(S))
            ys = {n: lib.int8.product(x, w, int8.FAST_PATH_DEFAULT) for n, lib in libs.items()}

            def run(lib):
                t0 = time.perf_counter()
                lib.int8.product(x, w, int8.FAST_PATH_DEFAULT)
                return time.perf_counter() - t0

            t = alternate(libs, repeats, run)
            macs = S * w.n_in * w.n_out
            row = {"matrix": name, "types": w.type_names(), "shape": [w.n_out, w.n_in], "rows": S,
                   "ms": {n: v * 1e3 for n, v in t.items()}, "gmacs": {n: macs / v / 1e9 for n, v in t.items()},
                   "new_over_base": t["base"] / t["new"], "same_bits": torch.equal(ys["base"], ys["new"])}
            out.append(row)
            say(f"[kernel-ab] {name} {row['types']} x {S} rows: base {row['ms']['base']:.2f} ms, new {row['ms']['new']:.2f} ms "
                f"({row['new_over_base']:.2f}x), same bits: {row['same_bits']}")
    return out


def steps(target: str, libs: dict, rows: list[int], context: int, repeats: int, say) -> list[dict]:
    from bench.level_steps import forward_times, random_cache_decoder
    from bench.loading import load_bench

    engine = load_bench(target, None).engine
    dec, _ = random_cache_decoder(engine, context, seed=1)
    lane = dec.full
    out = []
    for S in rows:
        def run(lib):
            native_layers._loader._loaded = lib  # the library every forward asks for
            forward_times(lane, S)  # one to settle the swapped library's caches
            return statistics.median(forward_times(lane, S)[0] for _ in range(9))

        t = alternate(libs, repeats, run)
        row = {"rows": S, "context": context, "ms": {n: v * 1e3 for n, v in t.items()}, "new_over_base": t["base"] / t["new"]}
        out.append(row)
        say(f"[kernel-ab] a forward of {S} rows over {context} keys: base {row['ms']['base']:.2f} ms, "
            f"new {row['ms']['new']:.2f} ms ({row['new_over_base']:.2f}x)")
    return out


def prefill(target: str, libs: dict, tokens: int, repeats: int, say) -> dict:
    from triforce_core.config import CacheConfig, GenerationConfig
    from triforce_core.kv.full import FullCache
    from bench.loading import load_bench

    engine = load_bench(target, None).engine
    model, s = engine.target, engine.target.spec
    chunk = CacheConfig().prefill_chunk
    ids = torch.randint(16, model.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, tokens + 1, engine.kv_dtype_for(GenerationConfig()), model.device)

    def run(lib):
        native_layers._loader._loaded = lib
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
    side.add_argument("--base-env", metavar="NAME=VALUE",
                      help="the baseline is the working tree's library with NAME=VALUE in the environment")
    p.add_argument("--target", default=str(Path.home() / ".cache/triforce-studio/desktop-models/llama-3.2-1b-shape.Q4_K_M.gguf"),
                   help="a GGUF file (default: the 1B shape of bench.desktop_models)")
    p.add_argument("--rows", default="1,7,256", help="row counts of the products")
    p.add_argument("--steps", default="1,7", help="row counts of the forwards ('' for none)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=0, help="tokens of a prefill to time (0: none)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not Path(args.target).is_file():
        print(f"error: no file {args.target} (python -m bench.desktop_models writes it)", file=sys.stderr)
        return 2
    say = lambda line: print(line, flush=True)  # noqa: E731
    parse = lambda text: [int(v) for v in text.split(",") if v.strip()]  # noqa: E731
    if args.base_env is not None:
        name, eq, value = args.base_env.partition("=")
        if not eq or not name.strip():
            print(f"error: --base-env takes NAME=VALUE, not {args.base_env!r}", file=sys.stderr)
            return 2
        ENVS["base"] = {name.strip(): value}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        new = load(native_layers.SOURCE, tmp / "lib-new")
        if args.base_env is not None:
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
        report = {"base": args.base or f"this tree with {args.base_env}", "target": Path(args.target).name, "cpu": cpu_model(),
                  "threads": torch.get_num_threads(), "mode": int8.LEVEL_NAMES[int8.FAST_PATH_DEFAULT],
                  "products": products(model, libs, parse(args.rows), args.repeats, say)}
        del model
        if parse(args.steps):
            report["steps"] = steps(args.target, libs, parse(args.steps), args.context, args.repeats, say)
        if args.prefill > 0:
            report["prefill"] = prefill(args.target, libs, args.prefill, max(2, args.repeats // 4), say)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
