"""Which arithmetic a forward runs: the key under which its results may be kept and reused.

Two forwards of the same weights over the same tokens give the same bits only on the same
path: a native kernel sums in another order than PyTorch's, AVX-512 in another than AVX2, and
a new PyTorch release may pick another matrix-product kernel. The disk cache keys every block
with this, so K/V computed on one path is never read back on another (`kv.disk`).

The kernels' sums do not depend on the number of threads (each output is summed by one
thread, in a fixed order), so the thread count is not part of the key.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from . import int8, native_attention, native_layers
from .native_build import library_key

# Every prefill with a disk cache asks for the key: the libraries' sources and the processor are
# read and hashed once per process (the library loaded is the one built from them then).
_library = functools.cache(library_key)

# Raised when Python-side arithmetic of the forward changes the order of its operations (an
# attention split, a fused norm): K/V kept under the old number is then never reused. 2: a
# prefill's projections of 256-weight blocks take the integer products (`Transformer._project`).
# 3: and their Q4_K parts AMX's tiles where they run (the key then says so).
ARITHMETIC_VERSION = 3


def arithmetic_key(device: torch.device | str = "cpu", integer_products: bool | int = False) -> str:
    """A short key naming the arithmetic of a forward on `device` as it runs now (with the
    environment switches of the native kernels as they are set now), of a model whose
    `integer_products` is as given (`Transformer.integer_products`)."""
    device = torch.device(device)
    parts = [f"arithmetic {ARITHMETIC_VERSION}", device.type, torch.__version__]
    if device.type == "cpu":
        attention = native_attention.kernel() is not None
        layers = native_layers.kernel() is not None
        parts.append(f"attention {_library(native_attention.SOURCE) if attention else 'torch'}")
        parts.append(f"layers {_library(native_layers.SOURCE, native_layers.LAYER_FLAGS) if layers else 'torch'}")
        # 8-bit activations give other numbers, each level its own; its three vector paths give
        # the same bits (int8_rows.c). True counts as 1 (one level).
        parts.append(f"int8 {int(integer_products) if layers else 0}")
        # a prefill's Q4_K products on tiles sum in their own order (`Transformer._project`)
        tiles = (layers and int(integer_products) in int8.PREFILL_TILES_FROM and int8.tiles_wanted()
                 and native_layers.kernel().int8.tiles())
        parts.append(f"tiles {int(tiles)}")
        # few-row attention over a 16-bit cache on AMX's tiles sums in its own order
        parts.append(f"attention tiles {int(attention and native_attention.kernel().tiles())}")
    else:
        parts.append(torch.version.cuda or "")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
