"""A prefill's products of the 256-weight types on AMX tiles (`int8.TILES`, `csrc/q_k_tiles.c`).
What they claim:

- The tiles give the scalar reference's products bit for bit (rows past one tile and one group
  of rows, outputs past a tile's 16, one thread and two, extreme inputs); where the tiles do not
  run here, the tests that need them skip.
- A row's result does not depend on the rows beside it.
- The products are those of the 16-bit activations times the weights, to float32 rounding (a
  negative control: the two levels' inputs are not), the same integers as `int8.WIDE`'s summed
  in another order: close to its products, not always equal.
- In a stack the Q4_K, Q5_K and Q6_K parts take the tiles, float16 and 32-weight parts keep the
  float path's products exactly.
- A model's prefill takes them (past the native layers' rows, where no step or verification
  comes) where its `Arithmetic.prefill_tiles` says so (the default where they run); the disk
  cache's key names it; speculation still equals
  autoregressive decoding token for token.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.gguf_files import random_blocks
from tests.helpers.gguf_engine import greedy_answer, gguf_pair
from tests.helpers.products import (Q4_K_M_LIKE, activation_rows, assert_16_bit_products, assert_each_part_as_alone,
                                    edge_rows, mixed_stack, random_matrix, sixteen_bits)

from triforce_core.models import int8
from triforce_core.models.arithmetic import EXACT, arithmetic_key, measured_default
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
TILES, WIDE = int8.TILES, int8.WIDE
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _reference(kernels, x, m, threads=1):
    with kernels.forced(int8.SCALAR):
        assert not kernels.tiles()  # the scalar path never takes the tiles
        return kernels.product(x, m, TILES, threads=threads)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_the_tiles_equal_the_scalar_reference_bit_for_bit(tiles, qtype):
    m, _ = random_matrix(qtype, 37, 768, seed=3)  # 37 outputs: two whole tiles and 5
    x = activation_rows(150, 768, seed=2)
    for S in (1, 5, 16, 18, 33, 150):  # 150: past one group of 128 rows
        want = _reference(tiles, x[:S], m)
        for threads in (1, 2):
            assert torch.equal(tiles.product(x[:S], m, TILES, threads=threads), want), f"{S} rows, {threads} threads"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_the_tiles_at_the_edges_of_the_inputs(tiles, qtype):
    x = edge_rows(20)
    m, _ = random_matrix(qtype, 20, 512, seed=5)
    got, want = tiles.product(x, m, TILES, threads=2), _reference(tiles, x, m)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[1].isnan().all())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_the_largest_weights_and_inputs_stay_exact(kernels, qtype):
    """Every weight at its type's extreme (Q4_K 15 x 63, Q5_K 31 x 63, Q6_K (0 - 32) x -128 and
    (63 - 32) x -128) against inputs at +-32767: the integer sums stay in range, so the products
    are the 16-bit activations' times the weights, as for ordinary blocks, on every path."""
    rng = np.random.default_rng(13)
    raw = random_blocks(qtype, 32, 512, rng).reshape(32, 2, -1)
    if qtype == Q.Q6_K:  # ql 0..127, qh 128..191, scales 192..207
        raw[:16, :, :192], raw[16:, :, :192] = 0x00, 0xFF
        raw[:, :, 192:208] = 0x80
    else:  # d, dmin, 12 bytes of scales (all 63), Q5_K's fifth bits, the nibbles (all 15)
        raw[:, :, 4:16] = 0xFF
        raw[:, :, 16:] = 0xFF
    t = StoredTensor(int(qtype), torch.from_numpy(raw.reshape(32, -1).copy()), (32, 512))
    m, w = Matrix(stored=(t,)), t.dequantized()
    x = torch.full((20, 512), 3.0)
    x[1::2] = -3.0
    x[2, ::3] = -3.0
    y = kernels.product(x, m, TILES, threads=2)
    with kernels.forced(int8.SCALAR):
        assert torch.equal(kernels.product(x, m, TILES, threads=1), y)
    d, q = sixteen_bits(x.numpy())
    want = torch.from_numpy(d.astype(np.float64) * q) @ w.double().t()
    assert ((y.double() - want).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().t())).all()


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_rows_in_one_call_equal_one_row_calls(kernels, qtype):
    m, _ = random_matrix(qtype, 40, 1024, seed=8)
    x = activation_rows(40, 1024, seed=9)
    together = kernels.product(x, m, TILES, threads=2)
    for i in range(40):
        assert torch.equal(together[i], kernels.product(x[i : i + 1], m, TILES, threads=1)[0]), f"row {i}"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_16_bit_activations(kernels, qtype):
    y, slack = assert_16_bit_products(kernels, qtype, TILES, 24)
    m, _ = random_matrix(qtype, 31, 768, seed=6)
    wide = kernels.product(activation_rows(24, 768, seed=7), m, WIDE, threads=2).double()  # the same integers, another order
    assert ((y - wide).abs() <= slack).all()


def test_summed_in_an_order_of_their_own(tiles):
    """Not WIDE's lanes: over many outputs some differ in the last bits (why steps and verifications
    take an order of their own, not a prefill's)."""
    m, _ = random_matrix(Q.Q4_K, 256, 2048, seed=10)
    x = activation_rows(32, 2048, seed=11)
    assert not torch.equal(tiles.product(x, m, TILES, threads=2), tiles.product(x, m, WIDE, threads=2))


def test_in_a_stack_the_256_weight_parts_take_them(kernels):
    assert_each_part_as_alone(kernels, activation_rows(30, 512, seed=12), mixed_stack(np.random.default_rng(11), 512), TILES)


def test_the_mode_name_and_the_default(kernels):
    assert int8.LEVEL_NAMES[TILES] == "tiles"
    assert measured_default().prefill_tiles == kernels.tiles() and EXACT.prefill_tiles is False


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return gguf_pair(tmp_path_factory.mktemp("tiles"), Q4_K_M_LIKE, seed=2)


def test_a_prefill_takes_them_and_the_disk_cache_key_says_so(tiles, engine, monkeypatch):
    model = engine.target
    own = model.arithmetic  # the default where the tiles run: the steps' own order on them, a prefill on the tiles
    few = own.products
    assert few == int8.STEP_TILES and own.prefill_tiles
    layer = model.layers[0]
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    on_key = arithmetic_key("cpu", own)
    assert torch.equal(model._project(x, layer.wqkv), tiles.product(x, layer.wqkv, TILES))
    assert torch.equal(model._project(x[:17], layer.wqkv), tiles.product(x[:17], layer.wqkv, few))  # a verification's rows
    monkeypatch.setattr(model, "arithmetic", replace(own, prefill_tiles=False))
    assert torch.equal(model._project(x, layer.wqkv), tiles.product(x, layer.wqkv, few))
    assert arithmetic_key("cpu", model.arithmetic) != on_key


def test_speculation_equals_autoregressive_decoding_after_a_prefill_on_tiles(tiles, engine, monkeypatch):
    """The prefill (120 tokens, past the native layers' rows) on tiles; the steps and
    verifications after it in their own order: lookup and the paper's hierarchy equal
    autoregressive decoding token for token. Control: the prefill really took the tiles."""
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(7)).tolist() * 2
    modes: list[int] = []
    original = int8.Int8.product
    monkeypatch.setattr(int8.Int8, "product", lambda self, x, w, m=int8.WIDE, threads=None:
                        modes.append(int(m)) or original(self, x, w, m, threads))
    reference = greedy_answer(engine, "autoregressive", ids)
    assert TILES in modes
    for mode in ("lookup", "triforce"):
        assert greedy_answer(engine, mode, ids) == reference, mode
    assert_verification_rows_equal_steps(engine.target, ids)
