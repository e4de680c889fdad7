"""A projection's weights as the decoder reads them: float32, or blocks as a GGUF file stores them.

A GGUF checkpoint's matrices stay in memory as the file stores them (4 to 8 bits a weight plus
16-bit scales), [outputs, inputs] with the blocks along the inputs. A decoding step or a
verification reads them through the native kernels (`csrc/float_products.c`), which dequantize in
registers; a prefill's large matrix products dequantize one matrix at a time into a float32
tile for PyTorch. The dequantized values equal, bit for bit, those transformers computes when
it loads the same file (it uses the `gguf` package's arithmetic, which the kernel follows).

Hugging Face checkpoints keep their float32 weights, stored [inputs, outputs] (see
`transformer._transposed`); one `Matrix` type carries either, so the forward has one path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import native_layers  # the kernel library is built at first use, not here
from .ggml_types import BLOCKS, F16, F32, IN_OUT, LANES, Q4_K, Q5_K, Q6_K, TYPE_NAMES, Part

K_TYPES = frozenset((Q4_K, Q5_K, Q6_K))  # the 256-weight types


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D weight as a GGUF file stores it: `raw` [rows, row bytes] uint8 of GGML `type`,
    logically [rows, cols] (rows = outputs)."""

    type: int
    raw: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        per_block, nbytes = BLOCKS[self.type]
        rows, cols = self.shape
        if cols % per_block or tuple(self.raw.shape) != (rows, cols // per_block * nbytes):
            raise ValueError(f"a {TYPE_NAMES[self.type]} tensor of shape {self.shape} cannot be {tuple(self.raw.shape)} bytes")

    def dequantized(self, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, cols] float32 of the given rows (all by default), written into `out` (contiguous
        [n, cols] float32) where given: a stacked matrix's parts go into one buffer, no copy."""
        kernel = native_layers.kernel()
        if kernel is not None and self.shape[1] % LANES == 0:
            if rows is not None and rows.dim() == 1 and rows.dtype == torch.int64 and rows.device.type == "cpu":
                # the kernel reads the rows in place by index (a step's embedding: no gathered
                # copy of their bytes, two operators fewer a step)
                return kernel.dequantize(self.raw, self.type, self.shape[1], out, rows=rows.tolist())
            return kernel.dequantize(self.raw if rows is None else self.raw[rows], self.type, self.shape[1], out)
        raw = self.raw if rows is None else self.raw[rows]
        from gguf import GGMLQuantizationType, dequantize

        if self.type == F32:
            values = raw.contiguous().view(torch.float32).clone()
        elif self.type == F16:
            values = raw.contiguous().view(torch.float16).float()
        else:
            values = torch.from_numpy(np.ascontiguousarray(dequantize(raw.numpy(), GGMLQuantizationType(self.type))))
        return values if out is None else out.copy_(values)


class Matrix:
    """A projection's weights, [outputs, inputs] in all, in the form the kernels take.

    Either one float32 tensor stored [inputs, outputs] (`dense_t`), or GGUF tensors stacked by
    output (q, k and v; gate and up) kept as stored. `parts` is the kernels' description."""

    def __init__(self, dense_t: torch.Tensor | None = None, stored: tuple[StoredTensor, ...] = ()):
        if (dense_t is None) == (not stored):
            raise ValueError("a Matrix is either dense or stored")
        self._dense_t = dense_t
        self.stored = stored
        if dense_t is not None:
            self.n_in, self.n_out = dense_t.shape
            pieces = [(dense_t.data_ptr(), dense_t.stride(0), IN_OUT, self.n_out)]
        else:
            self.n_in = stored[0].shape[1]
            if any(t.shape[1] != self.n_in for t in stored):
                raise ValueError("stacked tensors must have the same number of inputs")
            self.n_out = sum(t.shape[0] for t in stored)
            pieces = [(t.raw.data_ptr(), t.raw.stride(0), t.type, t.shape[0]) for t in stored]
        self.parts = (Part * len(pieces))(*pieces)
        self.n_parts = len(pieces)

    @property
    def quantized(self) -> bool:
        return self._dense_t is None

    def all_k_blocks(self) -> bool:
        """Whether every part is of a 256-weight type (Q4_K, Q5_K, Q6_K), the types whose integer
        products take any number of rows (`Transformer._project`)."""
        return self._dense_t is None and all(t.type in K_TYPES for t in self.stored)

    def dense_t(self) -> torch.Tensor:
        """[inputs, outputs] float32: the stored weights, or a fresh dequantized copy."""
        if self._dense_t is not None:
            return self._dense_t
        # each part dequantized into its rows of one buffer (no parts and their concatenation
        # alive at once: 256 MB, not 128, for Llama-3.2-1B's gate and up)
        out = torch.empty(self.n_out, self.n_in)
        start = 0
        for t in self.stored:
            t.dequantized(out=out[start : start + t.shape[0]])
            start += t.shape[0]
        return out.t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a one-tensor stored matrix as float32 [n, inputs] (a GGUF embedding's lookup)."""
        (t,) = self.stored
        return t.dequantized(ids)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the weights (for hashing and counting bytes)."""
        return [self._dense_t] if self._dense_t is not None else [t.raw for t in self.stored]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def type_names(self) -> list[str]:
        return ["F32"] if self._dense_t is not None else [TYPE_NAMES[t.type] for t in self.stored]
