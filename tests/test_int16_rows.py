"""Integer products over 16-bit activations (`int8.WIDE`, `csrc/int16_rows.c`) for the 256-weight
types, the float path for the others. What they claim, one order per output:

- Activations are quantized as defined: d = max|x| / 32767 per 256, q = round(x / d) half away
  from zero, stored of each 64 inputs the even ones first, and the sums of q per 32.
- Every vector path gives the scalar reference's products bit for bit (1-17 rows, one thread and
  two), and a row's result does not depend on the rows beside it: a verification equals its steps.
- The products are those of the 16-bit inputs times the weights, to float32 rounding; the
  two-level inputs' products (a negative control) are not.
- They are closer to the float path than two levels of 8 bits, and a float16 or 32-weight part
  in the stack keeps the float path's products exactly.
- Speculation over a model in this mode equals its autoregressive decoding token for token
  (tests/test_int8_rows.py, with every mode).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.native import built, needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.gguf_files import random_blocks
from test_int8_rows import _rows
from test_int8_two_levels import _matrix, _two_levels

import triforce_core.models.native_layers as native_layers
from triforce_core.models import int8
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
WIDE = int8.WIDE
Q16_DTYPE = np.dtype([("qs", "<i2", 256), ("d", "<f4"), ("bsums", "<i4", 8), ("pad", "<i4", 7)])


@pytest.fixture(scope="module")
def kernels() -> int8.Int8:
    return built(native_layers).int8


def _sixteen_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d, q) per input as defined: d = max|x| / 32767 per 256 (float32), q = round(x / d) half
    away from zero (x times the float32 inverse of d), clamped to +-32767."""
    S, K = x.shape
    blocks = x.astype(np.float32).reshape(S, K // 256, 256)
    d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(32767)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    v = (blocks * inv).astype(np.float64)
    q = np.clip(np.trunc(v + np.copysign(0.5, v)), -32767, 32767)
    return np.broadcast_to(d, blocks.shape).reshape(S, K), q.reshape(S, K)


def test_activations_are_quantized_as_defined(kernels):
    x = _rows(5, 768, seed=1)
    raw = kernels.quantize16(x).numpy().view(Q16_DTYPE).reshape(5, 3)
    d, q = _sixteen_bits(x.numpy())
    assert np.array_equal(np.repeat(raw["d"], 256, axis=1), d)
    stored = q.reshape(5, -1, 32, 2).transpose(0, 1, 3, 2).reshape(5, -1)  # of each 64: evens, then odds
    assert np.array_equal(raw["qs"].reshape(5, -1), stored)
    assert np.array_equal(raw["bsums"].reshape(5, -1), q.reshape(5, -1, 32).sum(axis=2))
    assert raw["qs"].max() == 32767 and raw["qs"][3].max() == 0  # a block's largest input; the row of zeros
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.quantize16(torch.zeros(2, 300))


def test_every_path_quantizes_as_the_scalar_reference(kernels):
    """The vector quantizers give the scalar loop's bytes, at the edges too: halves (a block whose
    largest input is 32767 scales by exactly 1), values just under a half, the clamp, zeros of
    either sign, denormals, and NaN or infinity (the block's d NaN or its inverse 0)."""
    rows = _rows(8, 512, seed=4).numpy().copy()
    edges = np.array([32767, 2.5, -2.5, 0.5, -0.5, np.nextafter(np.float32(0.5), np.float32(0)), 1.5, -1.5,
                      32766.5, -32766.5, 0.0, -0.0, 1e-40, -3e-39, 7.5, -7.5], dtype=np.float32)
    rows[0, :16] = edges  # the first block's scale is exactly 1
    rows[1, 3] = np.nan
    rows[2, 300] = np.inf
    rows[3, :256] = 1e-40  # a block of denormals: d rounds to 0
    rows[4, 256:] = 0.0
    rows[5, 10] = 3.4e38  # a huge block
    x = torch.from_numpy(rows)
    with kernels.forced(int8.SCALAR):
        want = kernels.quantize16(x)
    for path in kernels.paths():
        with kernels.forced(path):
            assert torch.equal(kernels.quantize16(x), want), int8.PATH_NAMES[path]
    # halves go away from zero (round-half-to-even would give 2, -2, 0, 0, 32766): input e of 64
    # is stored at e / 2 when even, at 32 + e / 2 when odd
    q = want.numpy().view(Q16_DTYPE).reshape(8, 2)["qs"][0, 0]
    assert (q[32], q[1], q[33], q[2], q[34], q[4], q[36]) == (3, -3, 1, -1, 0, 32767, -32767)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_every_path_equals_the_scalar_reference_bit_for_bit(kernels, qtype):
    m, _ = _matrix(qtype, 37, 768, seed=int(qtype))
    x = _rows(33, 768, seed=2)
    for S in (1, 3, 7, 17, 33):  # 33: two of the many-row products' groups of 32
        with kernels.forced(int8.SCALAR):
            want = kernels.product(x[:S], m, WIDE, threads=1)
        for path in kernels.paths():
            with kernels.forced(path):
                for threads in (1, 2):
                    got = kernels.product(x[:S], m, WIDE, threads=threads)
                    assert torch.equal(got, want), f"{int8.PATH_NAMES[path]}, {S} rows, {threads} threads"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_rows_in_one_call_equal_one_row_calls(kernels, qtype):
    m, _ = _matrix(qtype, 64, 1024, seed=8)
    x = _rows(33, 1024, seed=9)
    for path in kernels.paths():
        with kernels.forced(path):
            alone = [kernels.product(x[i : i + 1], m, WIDE, threads=2)[0] for i in range(33)]
            for S in (2, 7, 16, 17, 32, 33):  # 33 rows: two groups of the kernel's 32
                together = kernels.product(x[:S], m, WIDE, threads=2)
                for i in range(S):
                    assert torch.equal(together[i], alone[i]), f"{int8.PATH_NAMES[path]}: row {i} of {S}"


def assert_16_bit_products(kernels, qtype, mode: int, rows: int) -> torch.Tensor:
    """`mode`'s products (16-bit activations) of `rows` rows are within float32 rounding (1e-6 of
    sum |w x|) of the 16-bit inputs times the weights; the two levels' inputs, which carry about
    one bit less, are not (the negative control). Returns them, with their slack."""
    m, w = _matrix(qtype, 31, 768, seed=6)
    x = _rows(rows, 768, seed=7)
    y = kernels.product(x, m, mode, threads=2).double()
    wd = w.double()
    slack = 1e-6 * (x.double().abs() @ wd.abs().t()) + 1e-30
    d, q = _sixteen_bits(x.numpy())
    assert ((y - torch.from_numpy(d.astype(np.float64) * q) @ wd.t()).abs() <= slack).all()
    two = torch.from_numpy(_two_levels(x.numpy(), 256)) @ wd.t()
    assert not ((y - two).abs() <= slack).all()
    return y, slack


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_16_bit_activations(kernels, qtype):
    assert_16_bit_products(kernels, qtype, WIDE, 5)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_16_bits_are_closer_to_the_float_path_than_two_levels_of_8(kernels, qtype):
    m, _ = _matrix(qtype, 64, 768, seed=3)
    x = torch.randn(7, 768, generator=torch.Generator().manual_seed(4))
    y_float = kernels.product(x, m, 0, threads=1)
    err = {mode: float((kernels.product(x, m, mode, threads=1) - y_float).norm() / y_float.norm())
           for mode in (int8.ONE_LEVEL, int8.TWO_LEVELS, WIDE)}
    assert 0 < err[WIDE] < err[int8.TWO_LEVELS] * 1.5 and err[WIDE] < err[int8.ONE_LEVEL] / 100, err


def mixed_stack(rng, K: int) -> dict:
    """One matrix's parts of every kind, by type: the three K types, two 32-weight ones, float16."""
    parts = {q: StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, K, rng)), (rows, K))
             for q, rows in ((Q.Q4_K, 20), (Q.Q8_0, 9), (Q.Q6_K, 17), (Q.Q4_1, 5), (Q.Q5_K, 3))}
    parts[Q.F16] = StoredTensor(int(Q.F16), torch.from_numpy(rng.standard_normal((6, K)).astype(np.float16).view(np.uint8)), (6, K))
    return parts


def assert_each_part_as_alone(kernels, x, parts: dict, mode: int) -> None:
    """The stack's product in `mode` gives each part's outputs as that part alone does: `mode`
    for the K types, the float path for the others."""
    stack = kernels.product(x, Matrix(stored=tuple(parts.values())), mode, threads=2)
    start = 0
    for q, p in parts.items():
        want = kernels.product(x, Matrix(stored=(p,)), mode if q in K_TYPES else 0, threads=1)
        assert torch.equal(stack[:, start : start + p.shape[0]], want), q.name
        start += p.shape[0]


def test_float_and_32_weight_parts_keep_the_float_path_in_a_stack(kernels):
    parts = mixed_stack(np.random.default_rng(11), 512)
    x = _rows(9, 512, seed=12)
    assert_each_part_as_alone(kernels, x, parts, WIDE)
    # negative control: the K parts did not take the float path
    m = Matrix(stored=(parts[Q.Q4_K],))
    assert not torch.equal(kernels.product(x, m, WIDE, threads=1), kernels.product(x, m, 0, threads=1))


def test_the_mode_is_named_in_the_switch(monkeypatch):
    for word in ("4", "int16", " INT16 "):
        monkeypatch.setenv(int8.ENV, word)
        assert int8.mode() == WIDE
    assert int8.LEVEL_NAMES[WIDE] == "int16"
