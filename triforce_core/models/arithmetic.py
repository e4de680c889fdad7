"""Which arithmetic a model's forwards run, chosen once, and the key under which their results
may be kept and reused.

`Arithmetic` is decided when an engine is built (`TriForceEngine`): `exact` takes `EXACT`, the
float path everywhere (float32 products, equal to Hugging Face's token for token); otherwise
`measured_default` asks the processor and gives the default measured for it
(docs/results.md): the K types' products over 16-bit activations (`int8.WIDE`), or where AMX's
integer tiles run, their steps' order on VNNI and the tiles (`int8.STEP_TILES`) with a prefill's
rows on the tiles (`int8.TILES`). A model reads it at every forward and nothing else decides a
path: tests and benchmarks that compare paths give a model another `Arithmetic`
(`dataclasses.replace(model.arithmetic, ...)`).

Two forwards of the same weights over the same tokens give the same bits only on the same
path: a native kernel sums in another order than PyTorch's, AVX-512 in another than AVX2, and
a new PyTorch release may pick another matrix-product kernel. The disk cache keys every block
with `arithmetic_key`, so K/V computed on one path is never read back on another (`kv.disk`).

The kernels' sums do not depend on the number of threads (each output is summed by one
thread, in a fixed order), so the thread count is not part of the key.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from . import int8, native_attention, native_layers
from .native_build import library_key


@dataclass(frozen=True)
class Arithmetic:
    """How a model computes: its products over GGUF blocks and the kernels its forwards take."""

    # the few-row products over GGUF blocks: an `int8` mode (0 the float path, int8.WIDE or
    # int8.STEP_TILES), also a prefill's K-type matrices' where the VNNI path runs
    products: int = 0
    # a prefill's K-type products on AMX's integer tiles (`int8.TILES`, where they run)
    prefill_tiles: bool = False
    # the native kernels where they build (`native_layers`, `native_attention`); False: PyTorch's
    native_layers: bool = True
    native_attention: bool = True

    def __post_init__(self) -> None:
        if self.products not in (0, int8.WIDE, int8.STEP_TILES):
            raise ValueError(f"a model's products are the float path (0), int8.WIDE or int8.STEP_TILES, not {self.products!r}")

    def layers(self) -> native_layers.Layers | None:
        """The native layers this arithmetic takes: built here and not turned off, else None."""
        return native_layers.kernel() if self.native_layers else None

    def attention(self) -> native_attention.Kernel | None:
        """The few-row attention kernel this arithmetic takes, else None."""
        return native_attention.kernel() if self.native_attention else None


EXACT = Arithmetic()  # `exact`: the float path everywhere


def measured_default(native: bool = True) -> Arithmetic:
    """The default arithmetic of a model on this processor (`native`: it may run the native
    layers, float32 on the CPU): where the layers' integer products run on AMX's tiles, the
    steps' order there and a prefill on the tiles; else the 16-bit activations (`int8.WIDE`)."""
    layers = native_layers.kernel() if native else None
    tiles = layers is not None and layers.int8.tiles()
    return Arithmetic(products=int8.STEP_TILES if tiles else int8.WIDE, prefill_tiles=tiles)


# Every prefill with a disk cache asks for the key: the libraries' sources and the processor are
# read and hashed once per process (the library loaded is the one built from them then).
_library = functools.cache(library_key)

# Raised when Python-side arithmetic of the forward changes the order of its operations (an
# attention split, a fused norm): K/V kept under the old number is then never reused. 2: a
# prefill's projections of 256-weight blocks take the integer products (`Transformer._project`).
# 3: and their Q4_K parts AMX's tiles where they run (the key then says so).
ARITHMETIC_VERSION = 3


def arithmetic_key(device: torch.device | str = "cpu", arithmetic: Arithmetic = EXACT) -> str:
    """A short key naming the arithmetic of a forward on `device` of a model whose arithmetic
    is `arithmetic`, with the kernels built here."""
    device = torch.device(device)
    parts = [f"arithmetic {ARITHMETIC_VERSION}", device.type, torch.__version__]
    if device.type == "cpu":
        attention = arithmetic.attention() is not None
        layers = arithmetic.layers()
        parts.append(f"attention {_library(native_attention.SOURCE) if attention else 'torch'}")
        parts.append(f"layers {_library(native_layers.SOURCE, native_layers.LAYER_FLAGS) if layers else 'torch'}")
        parts.append(f"int8 {arithmetic.products if layers else 0}")
        # a prefill's Q4_K products on tiles sum in their own order (`Transformer._project`)
        tiles = (layers is not None and arithmetic.products in int8.PREFILL_TILES_FROM and arithmetic.prefill_tiles
                 and layers.int8.tiles())
        parts.append(f"tiles {int(tiles)}")
    else:
        parts.append(torch.version.cuda or "")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
