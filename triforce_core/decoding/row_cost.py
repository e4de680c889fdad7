"""What one more verification row costs on this machine, as a fraction of a decoding step.

Lookup's proposal length (`schedule.LookupLength`) weighs each proposed token's chance of being
accepted against this price. It is a property of the machine and the model's arithmetic, not of
the text: the processor, the thread count, the model's shapes and weight formats, the products'
mode (`Transformer.arithmetic`) and the K/V dtype. So it is measured once per such key and
kept on disk under `config.cache_home()/row-cost`, like the native kernels and the prefilled K/V:

    c = (t(ROWS rows) - t(1 row)) / ((ROWS - 1) * t(1 row))       rounded to a multiple of STEP

with t the least time of a target forward over a cache of CONTEXT tokens (random K/V: a
forward's time does not depend on the values); docs/results.md has measured prices. A
file that cannot be read, or does not hold a sane number, is measured again and replaced; a
folder that cannot be written only costs a measurement at each start. Measured on a busy
machine the price comes out high (the fastest of REPEATS forwards is kept against that); a
kept file is deleted to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from ..config import cache_home
from ..kv import new_full_cache
from ..kv.store import kv_dtype_name
from ..models.arithmetic import arithmetic_key
from ..models.loading import sync_device
from ..models.transformer import Transformer
from .lanes import Lane

log = logging.getLogger(__name__)

# Tokens in the cache the calibration's forwards attend to (fewer where the model's window is
# shorter): long, as the documents lookup copies from are; a row costs more of a step as the
# context grows, and a price measured over a short cache proposed too much on document chat
# (docs/benchmarks.md, `bench.lookup_replay`).
CONTEXT = 8192
ROWS = 5  # the wider forward: a typical lookup proposal of 4 tokens and its bonus row
REPEATS = 7
STEP = 0.05  # coarse, so that noise between two measurements rarely changes the price
LOWEST, HIGHEST = STEP, 4.0  # what a kept file may hold

_measured: dict[str, float] = {}  # key -> c: once a process knows a price it reads no file for it again


def row_cost_of(one_row_s: float, rows_s: float, rows: int = ROWS) -> float:
    """c from the time of a 1-row forward and of a `rows`-row one, rounded to STEP (at least STEP)."""
    if not (one_row_s > 0 and rows > 1 and math.isfinite(rows_s)):
        raise ValueError(f"no row cost from {rows_s} s for {rows} rows against {one_row_s} s for one")
    c = (rows_s - one_row_s) / ((rows - 1) * one_row_s)
    return min(HIGHEST, max(LOWEST, round(c / STEP) * STEP))


def cost_key(model: Transformer, kv_dtype: torch.dtype) -> str:
    """What a forward's cost follows from: the processor, threads, arithmetic (native kernels,
    products' mode, torch), K/V dtype, and the model's shapes and weight formats (not its values)."""
    parts = [
        f"calibration {CONTEXT} {ROWS}",
        _processor(model.device),
        f"threads {torch.get_num_threads()}",
        arithmetic_key(model.device, model.arithmetic),
        f"kv {kv_dtype_name(kv_dtype)}",
        repr(model.spec),
        str(model.dtype),
        ";".join(f"{t.dtype} {tuple(t.shape)}" for t in model.weight_tensors()),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def measured_row_cost(model: Transformer, kv_dtype: torch.dtype, folder: Path | None = None) -> float:
    """c for `model` with K/V in `kv_dtype` on this machine: kept in `folder` (default
    `config.cache_home()/row-cost`), measured when it holds none (a few forwards)."""
    key = cost_key(model, kv_dtype)
    if key in _measured:
        return _measured[key]
    folder = Path(folder) if folder is not None else cache_home() / "row-cost"
    path = folder / f"{key}.json"
    c = _read(path)
    if c is None:
        one, wide, context = measure(model, kv_dtype)
        c = row_cost_of(one, wide)
        _write(path, {"row_cost": c, "one_row_ms": one * 1e3, f"rows_{ROWS}_ms": wide * 1e3, "context": context,
                      "threads": torch.get_num_threads(), "kv_dtype": kv_dtype_name(kv_dtype)})
    _measured[key] = c
    return c


def measure(model: Transformer, kv_dtype: torch.dtype, rows: int = ROWS, repeats: int = REPEATS) -> tuple[float, float, int]:
    """The least seconds of a 1-row and of a `rows`-row target forward after `context` cached
    tokens, and that context (CONTEXT, or less where the model's window is shorter)."""
    s = model.spec
    context = max(1, min(CONTEXT, s.max_position_embeddings - rows - 1))
    cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, context + rows + 1, kv_dtype, model.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (s.num_kv_heads, context, s.head_dim)
    # a layer at a time: drawn whole, the float32 K (then V) of 8K tokens came to 0.9 GB beside
    # the cache on a 3B, 1.1 GB on an 8B, at the first start of every desktop-size model
    for layer in range(s.num_layers):
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        cache.write(layer, 0, k.to(cache.device), v.to(cache.device))
    cache.length = context
    lane = Lane(model, cache, model.vocab_size)
    lane.covered = context
    times: dict[int, list[float]] = {1: [], rows: []}
    for i in range(repeats + 1):
        for n in (1, rows) if i % 2 else (rows, 1):  # alternated: a drift slows both alike
            dt = _forward_seconds(lane, n, context)
            if i:  # the first pass warms up (a kernel's first call may build or page in)
                times[n].append(dt)
    # The fastest of each: other work on the machine only ever slows a forward down.
    return min(times[1]), min(times[rows]), context


def _forward_seconds(lane: Lane, rows: int, context: int) -> float:
    """One forward of `rows` new tokens after `context`, rolled back afterwards."""
    sync_device(lane.model.device)
    t0 = time.perf_counter()
    lane.advance([0] * rows)
    sync_device(lane.model.device)
    dt = time.perf_counter() - t0
    lane.cache.truncate(context)
    lane.fed, lane.pending = [], []
    return dt


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def _read(path: Path) -> float | None:
    """The kept c, or None where the file is missing or not what this module writes."""
    try:
        c = json.loads(path.read_text(encoding="utf-8"))["row_cost"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the row-cost file %s (%s): measuring again", path, type(e).__name__)
        return None
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not LOWEST <= c <= HIGHEST:
        log.warning("ignoring the row-cost file %s (row_cost %r): measuring again", path, c)
        return None
    return float(c)


def _write(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the row cost in %s (%s): it is measured again at the next start", path, e)
