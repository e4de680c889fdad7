"""Few-row products over quantized weights: the float path against the integer path, one process.

For each GGML type and row count (1 row: a decoding step; 7: a verification of six drafted tokens
and the bonus), y = x @ W^T for one [N x K] matrix of random blocks (or `--matrices` of them in
turn, so that the weights come from memory as a forward's do; scales of a trained model's
order) through the native layers' own product (`parts_product`): float32 arithmetic
(`csrc/float_products.c`, `exact`'s) and, for the 256-weight types, integer products over 16-bit
activations (`csrc/q_k_int16.c`, `int8.WIDE`) and, where AMX's integer tiles run, the same in
the order steps and verifications share there (`int8.STEP_TILES`), calls alternated, medians (and the ratio of the
fastest calls, which other work on a shared machine disturbs least). The header states the
machine, the threads and the integer paths' vector instructions; a ratio is float time / integer
time, and "diff" is |y_int - y_float| / |y_float| over the whole output (what the rounded
activations cost).

    python -m bench.int8_rows [--types Q4_K,Q6_K,Q8_0] [--rows 1,7] [--shape 2048x2048] [--matrices 1]
                              [--threads N] [--repeats 50] [--path avx512-vnni] [--json OUT]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.reports import write_json
from triforce_core.cli.bench_report import cpu_model
from triforce_core.models import int8, native_layers
from triforce_core.models.ggml_types import BLOCKS, TYPE_NAMES
from triforce_core.models.quantized import Matrix, StoredTensor

TYPES = {name: number for number, name in TYPE_NAMES.items()}
K_TYPES = {"Q4_K", "Q5_K", "Q6_K"}


def random_matrix(name: str, rows: int, cols: int, seed: int = 0) -> Matrix:
    """[rows, cols] of random `name` blocks whose 16-bit scales are small positive numbers
    (weights of order 0.1 to 1), as a `Matrix` the kernels read."""
    qtype = TYPES[name]
    per_block, nbytes = BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    low, high = (0.0002, 0.002) if per_block == 256 else (0.002, 0.02)

    def scale(n: int) -> np.ndarray:
        return rng.uniform(low, high, size=(blocks.shape[0], n)).astype(np.float16).view(np.uint8)

    if name in ("Q4_K", "Q5_K", "Q4_1"):
        blocks[:, 0:4] = scale(2)
    elif name == "Q6_K":
        blocks[:, 192:208] = rng.integers(-20, 21, size=(blocks.shape[0], 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = scale(1)
    else:
        blocks[:, 0:2] = scale(1)
    raw = torch.from_numpy(blocks.reshape(rows, -1))
    return Matrix(stored=(StoredTensor(qtype, raw, (rows, cols)),))


def measure(types: list[str], rows: list[int], n_out: int, n_in: int, threads: int, repeats: int, path: int | None,
            say=print, matrices: int = 1) -> dict:
    layers = native_layers.kernel()
    if layers is None:
        raise SystemExit("error: the native layers are unavailable here (no C compiler)")
    kernels = layers.int8
    if path is not None and path not in kernels.paths():
        raise SystemExit(f"error: this processor cannot run the {int8.PATH_NAMES[path]} path")
    if path is not None:
        kernels.lib.int8_set_path(path)
    machine = {"cpu": cpu_model(), "python": platform.python_version(), "threads": threads,
               "int8_path": int8.PATH_NAMES[kernels.path()]}
    say(f"# {machine['cpu']}; {threads} thread(s); integer path {machine['int8_path']}; [{n_out} x {n_in}]; "
        f"medians of {repeats}")
    # the steps' order on VNNI and the tiles, where the tiles run (`int8.STEP_TILES`)
    steps = (int8.STEP_TILES,) if kernels.tiles() else ()
    sides = (0, int8.WIDE) + steps
    key = {int8.WIDE: "int16", int8.STEP_TILES: "step_tiles"}
    suffix = {int8.WIDE: "_int16", int8.STEP_TILES: "_step_tiles"}
    say(f"{'type':6} {'rows':>4} {'float us':>9} " + " ".join(f"{key[k] + ' us':>10}" for k in sides[1:])
        + " " + " ".join(f"{key[k]:>7}" for k in sides[1:]) + " " + " ".join(f"{key[k] + ' diff':>11}" for k in sides[1:]))
    results = []
    for name in types:
        # with several, each call goes through all of them: past the caches, as a forward's weights
        ws = [random_matrix(name, n_out, n_in, seed=i) for i in range(matrices)]
        w = ws[0]
        # 16-bit activations are for the 256-weight types; the others take the float path alone
        timed = sides if name in K_TYPES else sides[:1]
        for S in rows:
            x = torch.randn(S, n_in, generator=torch.Generator().manual_seed(S))
            times: dict[int, list[float]] = {side: [] for side in timed}
            for i in range(repeats + 2):
                for side in (timed if i % 2 == 0 else timed[::-1]):
                    t0 = time.perf_counter()
                    for wm in ws:
                        y = kernels.product(x, wm, side, threads)
                    if i >= 2:  # two warm-up passes
                        times[side].append((time.perf_counter() - t0) / len(ws))
            yf = kernels.product(x, w, 0, threads)
            us = {k: statistics.median(times[k]) * 1e6 for k in timed}
            row = {"type": name, "rows": S, "float_us": round(us[0], 1)}
            for k in timed[1:]:
                y = kernels.product(x, w, k, threads)
                row[f"{key[k]}_us"] = round(us[k], 1)
                row[f"ratio{suffix[k]}"] = round(us[0] / us[k], 3)
                # the fastest call of each: least disturbed by other work
                row[f"best_ratio{suffix[k]}"] = round(min(times[0]) / min(times[k]), 3)
                row[f"relative_difference{suffix[k]}"] = float((y - yf).norm() / yf.norm())
            cell = lambda k, f: f(k) if k in timed else "-"  # noqa: E731
            say(f"{name:6} {S:4d} {us[0]:9.1f} " + " ".join(f"{cell(k, lambda k: f'{us[k]:.1f}'):>10}" for k in sides[1:])
                + " " + " ".join(f"{cell(k, lambda k: f'{us[0] / us[k]:.2f}x'):>7}" for k in sides[1:])
                + " " + " ".join(f"{cell(k, lambda k: format(row[f'relative_difference{suffix[k]}'], '.2e')):>11}"
                                 for k in sides[1:]))
            results.append({**row, **machine})
    if path is not None:
        kernels.lib.int8_set_path(-1)
    return {"machine": machine, "shape": [n_out, n_in], "matrices": matrices, "repeats": repeats, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="GGML types, comma-separated (default: %(default)s)")
    parser.add_argument("--rows", default="1,7", help="activation rows per product (default: %(default)s)")
    parser.add_argument("--shape", default="2048x2048", help="outputs x inputs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: PyTorch's intra-op count)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per side (default: %(default)s)")
    parser.add_argument("--matrices", type=int, default=1,
                        help="random matrices of the shape, each call through all of them, times per matrix: enough "
                        "of them to outgrow the caches reads the weights from memory, as a forward does (default: %(default)s)")
    parser.add_argument("--path", choices=[n for n in int8.PATH_NAMES.values()], default=None,
                        help="force the integer path's vector instructions (default: the widest this processor runs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES or t in ("F32", "F16")]
    if bad:
        parser.error(f"not a quantized type the kernels read: {', '.join(bad)} (use {', '.join(sorted(set(TYPES) - {'F32', 'F16'}))})")
    try:
        n_out, n_in = (int(v) for v in args.shape.lower().split("x"))
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error("--shape is OUTxIN and --rows a comma-separated list of integers")
    if any(n_in % (256 if t in K_TYPES else 32) for t in types) or n_out < 1 or not all(1 <= r <= 64 for r in rows):
        parser.error("inputs must be whole blocks of every type (256 for the K types), rows 1..64")
    path = None if args.path is None else next(p for p, n in int8.PATH_NAMES.items() if n == args.path)
    if not 1 <= args.matrices <= 1000:
        parser.error("--matrices takes 1 to 1000")
    report = measure(types, rows, n_out, n_in, args.threads or torch.get_num_threads(), args.repeats, path,
                     matrices=args.matrices)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
