"""Two levels of 8-bit activations (`int8.TWO_LEVELS`, `csrc/int8_rows.c` `quantize_two_levels`):
each row quantized, then its residual quantized with its own scales, both multiplied by the same
integer kernels and added. The arithmetic they claim, one order per output:

- Every vector path gives the scalar reference's products bit for bit (every type, row counts
  1-17, one thread and two), and a row's result does not depend on the rows beside it.
- The products are those of the two levels as defined here in NumPy, to float32 rounding; the
  one-level products (a negative control) are not.
- They are ~250 times closer to the float path than one level's: the measure by which the
  two-level path may be a default (bench/fidelity.py gives the model-level figure).
- A float16 part in the stack keeps the float path's products exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.gguf_files import random_blocks
from tests.helpers.products import activation_rows, one_level, random_matrix, two_levels

from triforce_core.models import int8
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
TWO = int8.TWO_LEVELS


def _per(qtype) -> int:
    return 256 if qtype in K_TYPES else 32


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_path_equals_the_scalar_reference_bit_for_bit(kernels, qtype):
    K = 768 if qtype in K_TYPES else 288
    m, _ = random_matrix(qtype, 37, K, seed=K)
    x = activation_rows(17, K, seed=K)
    for S in (1, 3, 7, 17):
        with kernels.forced(int8.SCALAR):
            want = kernels.product(x[:S], m, TWO, threads=1)
        for path in kernels.paths():
            with kernels.forced(path):
                for threads in (1, 2):
                    got = kernels.product(x[:S], m, TWO, threads=threads)
                    assert torch.equal(got, want), f"{int8.PATH_NAMES[path]}, {S} rows, {threads} threads"


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_rows_in_one_call_equal_one_row_calls(kernels, qtype):
    m, _ = random_matrix(qtype, 64, 1024, seed=8)
    x = activation_rows(17, 1024, seed=9)
    alone = [kernels.product(x[i : i + 1], m, TWO, threads=2)[0] for i in range(17)]
    for S in (2, 7, 9, 17):  # 9 rows are 18 quantized ones: two groups of the kernel's 16
        together = kernels.product(x[:S], m, TWO, threads=2)
        for i in range(S):
            assert torch.equal(together[i], alone[i]), f"row {i} of {S}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_two_levels(kernels, qtype):
    """Within float32 rounding (1e-5 of sum |w x|) of the two levels' inputs times the weights;
    the one-level inputs are not."""
    per = _per(qtype)
    K = 768 if qtype in K_TYPES else 288
    m, w = random_matrix(qtype, 31, K, seed=6)
    x = activation_rows(5, K, seed=7)
    x[2, 5] = 4.0
    y = kernels.product(x, m, TWO, threads=1).double()
    wd = w.double()
    slack = 1e-5 * (x.double().abs() @ wd.abs().t()) + 1e-30
    want = torch.from_numpy(two_levels(x.numpy(), per)) @ wd.t()
    assert ((y - want).abs() <= slack).all()
    d, q = one_level(x.numpy(), per)
    one = torch.from_numpy(d.astype(np.float64) * q) @ wd.t()
    assert not ((y - one).abs() <= slack).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_two_levels_are_far_closer_to_the_float_path_than_one(kernels, qtype):
    K = 768 if qtype in K_TYPES else 288
    m, _ = random_matrix(qtype, 64, K, seed=3)
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(4))
    y_float = kernels.product(x, m, 0, threads=1)
    err1 = (kernels.product(x, m, int8.ONE_LEVEL, threads=1) - y_float).norm() / y_float.norm()
    err2 = (kernels.product(x, m, TWO, threads=1) - y_float).norm() / y_float.norm()
    assert err1 > 1e-3  # 8 bits: the switch took
    assert err2 < err1 / 50, (float(err1), float(err2))


def test_a_float16_part_keeps_the_float_path(kernels):
    rng = np.random.default_rng(5)
    q4 = StoredTensor(int(Q.Q4_K), torch.from_numpy(random_blocks(Q.Q4_K, 20, 512, rng)), (20, 512))
    f16 = StoredTensor(int(Q.F16), torch.from_numpy(rng.standard_normal((6, 512)).astype(np.float16).view(np.uint8)), (6, 512))
    x = activation_rows(7, 512, seed=2)
    y = kernels.product(x, Matrix(stored=(q4, f16)), TWO, threads=1)
    assert torch.equal(y[:, 20:], kernels.product(x, Matrix(stored=(f16,)), 0, threads=1))
    assert torch.equal(y[:, :20], kernels.product(x, Matrix(stored=(q4,)), TWO, threads=1))


def test_the_fast_mode_takes_two_levels_for_k_types_and_floats_for_the_others(kernels):
    """`int8.FAST`: a Q4_K or Q6_K part as two levels, a Q8_0 or Q4_1 part as the float path,
    in one stack as alone; its rows equal its one-row calls."""
    rng = np.random.default_rng(11)
    parts = {q: StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, 512, rng)), (rows, 512))
             for q, rows in ((Q.Q4_K, 20), (Q.Q8_0, 9), (Q.Q6_K, 17), (Q.Q4_1, 5))}
    x = activation_rows(9, 512, seed=12)
    stack = kernels.product(x, Matrix(stored=tuple(parts.values())), int8.FAST, threads=2)
    start = 0
    for q, p in parts.items():
        alone = Matrix(stored=(p,))
        want = kernels.product(x, alone, TWO if q in K_TYPES else 0, threads=1)
        assert torch.equal(stack[:, start:start + p.shape[0]], want), q.name
        assert torch.equal(kernels.product(x, alone, int8.FAST, threads=1), want), q.name
        start += p.shape[0]
    for i in range(9):
        assert torch.equal(kernels.product(x[i:i + 1], Matrix(stored=tuple(parts.values())), int8.FAST, threads=2)[0],
                           stack[i]), f"row {i}"
    # negative control: the modes differ where they should
    m = Matrix(stored=(parts[Q.Q4_K],))
    assert not torch.equal(kernels.product(x, m, int8.FAST, threads=1), kernels.product(x, m, 0, threads=1))
