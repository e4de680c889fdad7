"""Integer products over a GGUF file's K-type blocks (`csrc/q_k_int16.c`, `csrc/q_k_steps.c`,
`csrc/q_k_tiles.c`):
the modes a model's `Arithmetic.products` names, and a thin wrapper for tests and benchmarks.

On desktop-size models (1B-8B, Q4_K_M) the native layers' float32 products are compute-bound:
each weight is widened to a float and multiplied by a float. The integer products quantize each
activation row to 16 bits in blocks of 256 (about 16 bits of each input: a weight times its
sub-block's integer scale fits 16 bits too, so `vpdpwssd` multiplies them) and multiply integers;
the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and float parts keep the float path, where the integer
products do not pay. Why 16 bits and not llama.cpp's 8: an 8-bit activation moves the model's
top token too often to be a default (the measurements: docs/benchmarks.md).

- 0: the float path (`arithmetic.EXACT`).
- WIDE: the K types over 16-bit activations, one order per output (`csrc/q_k_int16.c`), on
  AVX-512 VNNI, AVX2 or the scalar reference: the default where AMX's tiles do not run.
- STEP_TILES: WIDE's activations and integers with the K types' parts summed a sub-block at a
  time in an order every row count shares (`csrc/q_k_steps.c`, the steps' order), on VNNI up to
  3 rows and on AMX's tiles for more: the default for steps and verifications where the tiles run.
- TILES: WIDE's activations and integers on AMX's tiles (`csrc/q_k_tiles.c`), summed a super-block at a time in an
  order of their own, so only for a prefill's rows (`Transformer._project`,
  `Arithmetic.prefill_tiles`). Where the tiles do not run, STEP_TILES and TILES take the scalar
  reference of their order (the tests' way to check it).

What every mode keeps: each row is quantized on its own and every output's float arithmetic
follows one order (the kernel's header), so a verification's rows equal a step's bit for bit,
whatever the threads or the vector path (tests/test_int16_rows.py, test_step_tiles.py,
test_tile_rows.py).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Iterator

import torch

from .ggml_types import Stacked

# The kernel's vector paths (int8_set_path's numbers).
SCALAR, AVX2, AVX512_VNNI = 0, 1, 2
PATH_NAMES = {SCALAR: "scalar", AVX2: "avx2", AVX512_VNNI: "avx512-vnni"}
# What a product's `int8` argument (the C side's too) asks for: 0 the float path, else one of
# these (the numbers are the C side's enum).
WIDE, TILES, STEP_TILES = 4, 5, 6
MODES = (0, WIDE, TILES, STEP_TILES)
# The few-row modes whose prefill (more than `native_layers.ROWS` rows) takes TILES where they run:
# the same 16-bit activations and integers (`Transformer._project`; the disk cache's key says so).
PREFILL_TILES_FROM = (WIDE, STEP_TILES)
LEVEL_NAMES = {0: "float", WIDE: "int16", TILES: "tiles", STEP_TILES: "step-tiles"}
Q16_BLOCK = (256, 576)  # struct block_q16_k: 256 inputs as int16, their scale and sums per 32
# The words the benchmarks' flags take for a mode (`--products`, `+products-MODE`).
MODE_WORDS = {"0": 0, "float": 0, "int16": WIDE, "step-tiles": STEP_TILES}


class Int8:
    """The integer products of the layers' library (`native_layers.Layers.int8`), for the tests
    and benchmarks; the layers themselves call them from C."""

    def __init__(self, lib: ctypes.CDLL):
        P, I = ctypes.c_void_p, ctypes.c_int
        lib.int8_path.argtypes = []
        lib.int8_set_path.argtypes = [I]
        lib.int16_quantize_rows.argtypes = [P, I, I, P]
        lib.parts_product.argtypes = [P, I, I, P, I, P, I, I]
        lib.int8_tiles.argtypes = []
        for f in (lib.int8_path, lib.int8_set_path, lib.int8_tiles, lib.int16_quantize_rows, lib.parts_product):
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

    def product(self, x: torch.Tensor, w: Stacked, int8: int = WIDE, threads: int | None = None) -> torch.Tensor:
        """y [S, N] = x [S, K] @ W^T for a `quantized.Matrix` W ([N, K]), as the layers compute it:
        in mode `int8` (one of MODES, 0 the float path)."""
        if int8 not in MODES:
            raise ValueError(f"int8: no products' mode {int8!r} (one of {MODES})")
        S, K = x.shape
        if (w.n_in, x.dtype) != (K, torch.float32):
            raise ValueError(f"int8: x is {x.dtype} {tuple(x.shape)} for a matrix of {w.n_in} inputs")
        x = x.contiguous()
        y = torch.empty(S, w.n_out)
        if self.lib.parts_product(x.data_ptr(), S, K, w.parts, w.n_parts, y.data_ptr(), threads or torch.get_num_threads(),
                                  int(int8)):
            raise MemoryError("int8: out of memory for the product's scratch")
        return y
