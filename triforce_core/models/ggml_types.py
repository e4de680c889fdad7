"""GGML's block types as the native kernels read them: type numbers, block sizes, the struct
that describes one stacked piece of a matrix to `csrc/float_products.c`, and what a matrix of them
offers the kernels (`Stacked`).

Data only: `quantized` (the weights) and `native_layers` (the kernels' Python side) both read
it, and neither has to import the other's module to agree on a type number.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

# GGML's type numbers (the file's own), for the types the kernels read.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14
IN_OUT = 255  # float32 stored [inputs, outputs]: a Hugging Face checkpoint's projections
# (weights per block, bytes per block)
BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K",
              Q5_K: "Q5_K", Q6_K: "Q6_K"}
LANES = 32  # the kernel's sums run over inputs in steps of this many (csrc/float_products.c)


class Part(ctypes.Structure):
    """One stacked piece of a matrix, as `struct part` in csrc/float_products.c."""

    _fields_ = [("data", ctypes.c_void_p), ("ld", ctypes.c_int64), ("type", ctypes.c_int32), ("rows", ctypes.c_int32)]


class Stacked(Protocol):
    """What the kernels read of a `quantized.Matrix`: the parts that describe it and its shape.
    (A protocol, not an import: `quantized` imports the kernels' modules to dequantize.)"""

    parts: ctypes.Array
    n_parts: int
    n_in: int
    n_out: int
