"""Integer products over 16-bit activations (`int8.WIDE`, `csrc/q_k_int16.c`) for the 256-weight
types, the float path for the others. What they claim, one order per output:

- Activations are quantized as defined: d = max|x| / 32767 per 256, q = round(x / d) half away
  from zero, stored of each 64 inputs the even ones first, and the sums of q per 32.
- Every vector path gives the scalar reference's products bit for bit (1-17 rows, one thread and
  two), and a row's result does not depend on the rows beside it: a verification equals its steps.
- The products are those of the 16-bit inputs times the weights, to float32 rounding; the
  two-level inputs' products (a negative control) are not.
- They are closer to the float path than two levels of 8 bits' inputs, and a float16 or 32-weight part
  in the stack keeps the float path's products exactly.
- Speculation over a model in this mode equals its autoregressive decoding token for token
  (tests/test_integer_products.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.products import (activation_rows, assert_16_bit_products, assert_each_part_as_alone, mixed_stack,
                                    one_level, random_matrix, sixteen_bits, two_levels)

from triforce_core.models import int8
from triforce_core.models.quantized import Matrix

pytestmark = needs_compiler
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
WIDE = int8.WIDE
Q16_DTYPE = np.dtype([("qs", "<i2", 256), ("d", "<f4"), ("bsums", "<i4", 8), ("pad", "<i4", 7)])


def test_activations_are_quantized_as_defined(kernels):
    x = activation_rows(5, 768, seed=1)
    raw = kernels.quantize16(x).numpy().view(Q16_DTYPE).reshape(5, 3)
    d, q = sixteen_bits(x.numpy())
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
    rows = activation_rows(8, 512, seed=4).numpy().copy()
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


def test_unknown_or_unrunnable_paths_and_modes_are_refused(kernels):
    with pytest.raises(ValueError, match="cannot run"):
        with kernels.forced(7):
            pass
    assert kernels.path() == max(kernels.paths())  # the widest again
    m, _ = random_matrix(Q.Q4_K, 4, 256, seed=1)
    for gone in (1, 2, 3, True):  # 8-bit activations, one level or two: no mode any longer
        with pytest.raises(ValueError, match="no products' mode"):
            kernels.product(activation_rows(1, 256, seed=1), m, gone)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_every_path_equals_the_scalar_reference_bit_for_bit(kernels, qtype):
    m, _ = random_matrix(qtype, 37, 768, seed=int(qtype))
    x = activation_rows(33, 768, seed=2)
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
    m, _ = random_matrix(qtype, 64, 1024, seed=8)
    x = activation_rows(33, 1024, seed=9)
    for path in kernels.paths():
        with kernels.forced(path):
            alone = [kernels.product(x[i : i + 1], m, WIDE, threads=2)[0] for i in range(33)]
            for S in (2, 7, 16, 17, 32, 33):  # 33 rows: two groups of the kernel's 32
                together = kernels.product(x[:S], m, WIDE, threads=2)
                for i in range(S):
                    assert torch.equal(together[i], alone[i]), f"{int8.PATH_NAMES[path]}: row {i} of {S}"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_16_bit_activations(kernels, qtype):
    assert_16_bit_products(kernels, qtype, WIDE, 5)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_16_bits_are_closer_to_the_float_path_than_two_levels_of_8(kernels, qtype):
    """Against the inputs 8-bit activations carry (one level, llama.cpp's; two: the row, then
    its residual) times the weights, by their definitions."""
    m, w = random_matrix(qtype, 64, 768, seed=3)
    x = torch.randn(7, 768, generator=torch.Generator().manual_seed(4))
    y_float = kernels.product(x, m, 0, threads=1)
    d, q = one_level(x.numpy(), 256)
    inputs = {"int8": torch.from_numpy(d.astype(np.float64) * q), "int8x2": torch.from_numpy(two_levels(x.numpy(), 256))}
    err = {name: float(((v @ w.double().t()).float() - y_float).norm() / y_float.norm()) for name, v in inputs.items()}
    err["int16"] = float((kernels.product(x, m, WIDE, threads=1) - y_float).norm() / y_float.norm())
    assert 0 < err["int16"] < err["int8x2"] * 1.5 and err["int16"] < err["int8"] / 100, err


def test_float_and_32_weight_parts_keep_the_float_path_in_a_stack(kernels):
    parts = mixed_stack(np.random.default_rng(11), 512)
    x = activation_rows(9, 512, seed=12)
    assert_each_part_as_alone(kernels, x, parts, WIDE)
    # negative control: the K parts did not take the float path
    m = Matrix(stored=(parts[Q.Q4_K],))
    assert not torch.equal(kernels.product(x, m, WIDE, threads=1), kernels.product(x, m, 0, threads=1))


def test_the_mode_is_named():
    assert int8.LEVEL_NAMES[WIDE] == "int16" and int8.MODE_WORDS["int16"] == WIDE
