"""Integer products over a GGUF file's blocks (`csrc/int8_rows.c`, `csrc/int16_rows.c`, `csrc/tile_rows.c`), in one of six modes.

On desktop-size models (1B-8B, Q4_K_M) the native layers' float32 products are compute-bound:
each weight is widened to a float and multiplied by a float. llama.cpp instead quantizes each
activation row to 8 bits in blocks (32 for Q4_0/Q4_1/Q8_0, 256 with per-16 sums for the K types)
and multiplies integers. The native layers can do the same for the quantized matrices of a
few-row forward (steps, verifications, the head); float32 weights keep their path.

- ONE_LEVEL (`TRIFORCE_INT8=1`, opt-in): llama.cpp's arithmetic. An 8-bit activation is off by
  up to half a step (max|x| / 254 per block): on SmolLM2 the top token then agrees with HF
  float32 at 97.9 % of positions, below the 98 % a default must keep.
- TWO_LEVELS: the row, then what that left, each quantized to 8 bits: about 15 bits of each
  input (99.90 %, as the float path's 99.93 %), for twice the integer work.
- FAST: two levels for the 256-weight types, where they beat the float products (Q4_K 1.9x at
  one row), the float path for the 32-weight ones, where two levels lose to it.
- WIDE (the default on the fast path where AMX's tiles do not run; `exact` takes the float path): the 256-weight types over
  16-bit activations, one integer product a row (about 16 bits of each input: a weight times its
  sub-block's integer scale fits 16 bits, so `vpdpwssd` multiplies them); the float path for the
  32-weight ones. Faster than FAST at every row count, and closer to the float path.

What every mode keeps: each row is quantized on its own and every output's float arithmetic
follows one order (the kernel's header), so a verification's rows equal a step's bit for bit,
whatever the threads or the vector path (tests/test_int8_rows.py, tests/test_int8_two_levels.py,
tests/test_int16_rows.py).

Measured (`python -m bench.int8_rows`, one [2048 x 2048] matrix, one thread, float time / integer
time, one row and seven): on an AMD EPYC (Zen 4, AVX-512 VNNI), one level: Q4_K 2.4x and 2.0x,
Q5_K 2.7x and 2.3x, Q6_K 2.8x and 2.2x, Q8_0 1.0-1.2x and 1.5x, Q4_1 1.0x and 1.6x, a one-row
Q4_0 0.85x; 16-bit activations Q4_K 1.88x and 1.78x, Q5_K 2.1x and 1.5x, Q6_K 2.4x and 1.5x
(two levels there: Q4_K 1.70x and 1.04x); on a Xeon (Sapphire Rapids class), one level Q4_K 2.7x and 2.2x, Q6_K 3.6x and
2.7x, two levels Q4_K 1.9x and 1.15x, Q6_K 2.6x and 1.5x, Q8_0 0.8x and 0.6x, Q4_1 0.85x and 0.5x
(bench/results/int8-rows-xeon-amx-host.json).

- TILES (a prefill's rows where AMX's integer tiles run): WIDE's activations and integers on
  tiles, 3.0-3.3x WIDE's Q4_K products at 128-256 rows on a Sapphire-Rapids-class Xeon.
- STEP_TILES (the default where AMX's integer tiles run, `default_mode`; WIDE elsewhere):
  WIDE's activations and integers with the K types' parts summed a sub-block at a time in an
  order every row count shares, up to 3 rows on VNNI (16 outputs in the lanes), more on the
  tiles. Over 16384 x 2048 matrices read from memory, against WIDE's time: Q4_K 1 row 1.09x,
  2 rows 1.00x, 3 rows 0.78x, 7 rows 0.62x; Q6_K 0.95x, 1.07x, 1.15x and 1.04x (`python -m
  bench.int8_rows --types Q4_K,Q6_K --rows 1,2,3,7 --shape 16384x2048 --matrices 19`,
  bench/results/int8-rows-step-tiles-from-memory.json).

Data and a thin wrapper only: `native_layers` loads the library; each model says which mode it
takes (`Transformer.integer_products`, which the engine sets from `mode()`).
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from . import switches
from .ggml_types import Stacked

ENV = "TRIFORCE_INT8"
# The kernel's vector paths (int8_set_path's numbers).
SCALAR, AVX2, AVX512_VNNI = 0, 1, 2
PATH_NAMES = {SCALAR: "scalar", AVX2: "avx2", AVX512_VNNI: "avx512-vnni"}
# Activation layouts (int8_quantize_rows' kinds): struct block_q8_32x8 (eight 32-blocks, a row
# of K inputs takes ceil(K / 256) of them, K a multiple of 32) and block_q8_k (K / 256 of them).
Q8_32, Q8_K = 0, 1
# What a product's `int8` argument (the C side's too) asks for: 0 the float path; ONE_LEVEL each
# row quantized once (llama.cpp's arithmetic); TWO_LEVELS each row quantized, then what that left
# quantized again, both multiplied and added: about 15 bits of each input for twice the integer
# work over the same unpacked weights (`csrc/int8_rows.c`, `quantize_two_levels`); FAST two levels
# for the 256-weight types (Q4_K, Q5_K, Q6_K) and the float path for the 32-weight ones, where two
# levels cost more than the float products (`python -m bench.int8_rows`).
# WIDE: the 256-weight types' products over 16-bit activations (`csrc/int16_rows.c`: each row
# quantized once to 16 bits, the weights times their scales widened to 16 bits, one vpdpwssd per
# 32 of them), the float path for the 32-weight ones.
# TILES: WIDE's 16-bit activations with the 256-weight types' parts on AMX tiles
# (`csrc/tile_rows.c`: the same integers, summed a super-block at a time in an order of their own),
# so only for a prefill's rows (`Transformer._project`): a step's and a verification's rows keep
# WIDE's order, which makes them equal bit for bit. Where the tiles do not run, the same order by
# the scalar reference (tests only; a prefill there takes WIDE).
# STEP_TILES: WIDE's activations with the K types' parts in an order every row count shares
# (`csrc/tile_rows.c`, the steps' order: the weights as stored, each sub-block's sums scaled
# after), on VNNI for up to 3 rows and on AMX's tiles for more, so steps and verifications alike.
ONE_LEVEL, TWO_LEVELS, FAST, WIDE, TILES, STEP_TILES = 1, 2, 3, 4, 5, 6
# The few-row modes whose prefill (more than `native_layers.ROWS` rows) takes TILES where they run:
# the same 16-bit activations and integers (`Transformer._project`; the disk cache's key says so).
PREFILL_TILES_FROM = (WIDE, STEP_TILES)
LEVEL_NAMES = {0: "float", ONE_LEVEL: "int8", TWO_LEVELS: "int8x2", FAST: "fast", WIDE: "int16", TILES: "tiles",
               STEP_TILES: "step-tiles"}
ACT_BLOCKS = {Q8_32: (32, 320), Q8_K: (256, 292)}  # (K a multiple of, bytes a block)
Q16_BLOCK = (256, 576)  # struct block_q16_k: 256 inputs as int16, their scale and sums per 32


def act_bytes(K: int, kind: int) -> int:
    """Bytes of one quantized row of K inputs."""
    return -(-K // 256) * ACT_BLOCKS[kind][1]


# A model's few-row products where nothing says (`TRIFORCE_INT8` unset, not `exact`): WIDE, the
# fastest mode measured whose agreement with the float model is the float path's. On SmolLM2
# requantized by llama-quantize to Q6_K (its 576-wide rows take no K type, so the K-type matrices
# are the MLP's down projections, Q6_K; the rest Q8_0), teacher-forced over 4,096 positions:
# 16-bit activations agree with HF float32's top token at 99.95 % of positions, mean KL 9.9e-7,
# as the float path with float16 K/V (99.95 %, 8.5e-7) (`python -m bench.fidelity --target FILE
# --configs float/kv-float16,int16/kv-float16`). Two levels of 8 bits scored 99.90 % and 9.3e-7 on
# SmolLM2 itself, one level 97.90 % and 2.4e-3. On a Llama-3.2-1B-shape Q4_K_M file a step took
# 0.86x FAST's time at 8K tokens and 0.89x at 32K, a 7-row verification 0.84x and 0.86x; chat at
# 4.5K tokens decoded 1.11x faster (`python -m bench.level_steps --products 0,fast,int16,int8`,
# `python -m bench.chat ...+products-int16`, docs/results.md).
# The engine gives each model its mode (`Transformer.integer_products`). Where AMX's integer
# tiles run, `default_mode` is STEP_TILES instead: the same integers, a step at WIDE's cost and
# a verification cheaper (below, and docs/results.md).
FAST_PATH_DEFAULT = WIDE
# What TRIFORCE_INT8 may name: "0" the float path, "1" (or "int8") one level, "2" ("int8x2") two,
# "3" ("fast") two levels for the K types and floats for the others, "4" ("int16") 16-bit
# activations for the K types and floats for the others, "6" ("step-tiles") those in the order
# steps and verifications share on AMX's tiles (WIDE where they do not run).
MODE_WORDS = {"0": 0, "off": 0, "1": ONE_LEVEL, "int8": ONE_LEVEL, "2": TWO_LEVELS, "int8x2": TWO_LEVELS,
              "3": FAST, "fast": FAST, "4": WIDE, "int16": WIDE, "6": STEP_TILES, "step-tiles": STEP_TILES}


def default_mode(tiles: bool) -> int:
    """The products' mode where `TRIFORCE_INT8` says nothing, given whether the native layers'
    integer products run on AMX's tiles (`native_layers.products_mode` asks): STEP_TILES there (a
    step at WIDE's cost, a verification cheaper: `python -m bench.level_steps --products
    int16,step-tiles`), else FAST_PATH_DEFAULT."""
    return STEP_TILES if tiles else FAST_PATH_DEFAULT


def mode(tiles: bool = False) -> int:
    """The products' mode (`TRIFORCE_INT8`, `default_mode(tiles)` when unset; anything else it
    cannot read is one level, as any other switch reads as on). STEP_TILES where the tiles do not
    run is WIDE: its order there would be the scalar reference's, a test's, not a decoder's."""
    value = os.environ.get(ENV)
    if value is None:
        return default_mode(tiles)
    chosen = MODE_WORDS.get(value.strip().lower(), ONE_LEVEL)
    return WIDE if chosen == STEP_TILES and not tiles else chosen


# TRIFORCE_TILES=0 keeps a prefill on WIDE where the tiles run (the benchmarks' comparison).
TILES_ENV = "TRIFORCE_TILES"


def tiles_wanted() -> bool:
    """Whether a prefill may take the tiles (`TRIFORCE_TILES`, on unless "0"/"off")."""
    return switches.is_on(TILES_ENV)


def enabled() -> bool:
    """Whether the few-row products take an integer path at all (`mode`)."""
    return mode() != 0


def switched(on: bool | int):
    """The products' mode inside the block (True: one level, False: the float path), as before after it."""
    return switches.switched(ENV, str(int(on)))


class Int8:
    """The integer products of the layers' library (`native_layers.Layers.int8`), for the tests
    and benchmarks; the layers themselves call them from C."""

    def __init__(self, lib: ctypes.CDLL):
        P, I = ctypes.c_void_p, ctypes.c_int
        lib.int8_path.argtypes = []
        lib.int8_set_path.argtypes = [I]
        lib.int8_quantize_rows.argtypes = [P, I, I, I, P]
        lib.int16_quantize_rows.argtypes = [P, I, I, P]
        lib.int8_product_q.argtypes = [P, P, P, I, I, P, I, P, I]
        lib.parts_product.argtypes = [P, I, I, P, I, P, I, I]
        lib.int8_tiles.argtypes = []
        for f in (lib.int8_path, lib.int8_set_path, lib.int8_tiles, lib.int8_quantize_rows, lib.int16_quantize_rows, lib.int8_product_q,
                  lib.parts_product):
            f.restype = I
        self.lib = lib

    def path(self) -> int:
        """The vector path the products take now."""
        return self.lib.int8_path()

    def tiles(self) -> bool:
        """Whether this process runs AMX's integer tiles on the path taken now (the kernel asked
        for their state once; the processor's word, then the system's)."""
        return bool(self.lib.int8_tiles())

    def paths(self) -> list[int]:
        """The paths this processor runs, narrowest first (asked of the processor, not tried)."""
        now, runs = self.path(), []
        for p in PATH_NAMES:
            if self.lib.int8_set_path(p) == p:
                runs.append(p)
        self.lib.int8_set_path(now)
        return runs

    @contextmanager
    def forced(self, path: int) -> Iterator[None]:
        """Every product inside the block takes `path` (ValueError where the processor cannot);
        the widest path again after it. Not for concurrent products: the choice is the library's."""
        if self.lib.int8_set_path(path) != path:
            raise ValueError(f"this processor cannot run the {PATH_NAMES.get(path, path)} path")
        try:
            yield
        finally:
            self.lib.int8_set_path(-1)

    def quantize(self, x: torch.Tensor, kind: int) -> torch.Tensor:
        """x [S, K] float32 -> [S, act_bytes(K, kind)] uint8: block_q8_32x8 (Q8_32) or block_q8_k (Q8_K)."""
        per = ACT_BLOCKS[kind][0]
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % per:
            raise ValueError(f"int8: rows to quantize are float32 [S, K] with K a multiple of {per}, not "
                             f"{x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], act_bytes(x.shape[1], kind), dtype=torch.uint8)
        if self.lib.int8_quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], kind, out.data_ptr()):
            raise ValueError("int8: the rows could not be quantized")
        return out

    def quantize16(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, K] float32 (K a multiple of 256) -> [S, K / 256, 576] uint8: struct block_q16_k."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % Q16_BLOCK[0]:
            raise ValueError(f"int16: rows to quantize are float32 [S, K] with K a multiple of {Q16_BLOCK[0]}, not "
                             f"{x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], x.shape[1] // Q16_BLOCK[0], Q16_BLOCK[1], dtype=torch.uint8)
        if self.lib.int16_quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()):
            raise ValueError("int16: the rows could not be quantized")
        return out

    def product(self, x: torch.Tensor, w: Stacked, int8: int = ONE_LEVEL, threads: int | None = None) -> torch.Tensor:
        """y [S, N] = x [S, K] @ W^T for a `quantized.Matrix` W ([N, K]), as the layers compute it:
        the integer path (`int8`: a mode, ONE_LEVEL .. TILES; True is ONE_LEVEL) or the float one (0, False)."""
        S, K = x.shape
        if (w.n_in, x.dtype) != (K, torch.float32):
            raise ValueError(f"int8: x is {x.dtype} {tuple(x.shape)} for a matrix of {w.n_in} inputs")
        x = x.contiguous()
        y = torch.empty(S, w.n_out)
        if self.lib.parts_product(x.data_ptr(), S, K, w.parts, w.n_parts, y.data_ptr(), threads or torch.get_num_threads(),
                                  int(int8)):
            raise MemoryError("int8: out of memory for the product's scratch")
        return y

    def product_quantized(self, w: Stacked, S: int, x32: torch.Tensor | None = None, xk: torch.Tensor | None = None,
                          x: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """y [S, N] from rows already quantized (`quantize`'s output for each layout W's parts
        need; `x` float32 for its F32/F16 parts, if any)."""
        K = w.n_in
        for t, kind in ((x32, Q8_32), (xk, Q8_K)):
            want = (S, act_bytes(K, kind))
            if t is not None and (t.dtype != torch.uint8 or tuple(t.shape) != want or not t.is_contiguous()):
                raise ValueError(f"int8: quantized rows are {t.dtype} {tuple(t.shape)}, expected contiguous uint8 {want}")
        if x is not None and (x.dtype != torch.float32 or tuple(x.shape) != (S, K) or not x.is_contiguous()):
            raise ValueError(f"int8: x is {x.dtype} {tuple(x.shape)}, expected contiguous float32 {(S, K)}")
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        y = torch.empty(S, w.n_out)
        failed = self.lib.int8_product_q(ptr(x), ptr(x32), ptr(xk), S, K, w.parts, w.n_parts, y.data_ptr(),
                                         threads or torch.get_num_threads())
        if failed == -2:
            raise ValueError("int8: a part's input (a quantized layout, or x for a float part) is missing")
        if failed:
            raise MemoryError("int8: out of memory for the product's scratch")
        return y

