"""Steps' and verifications' products in one order on AMX's tiles and on VNNI (`int8.STEP_TILES`,
the kernels of `csrc/q_k_steps.c`). What they claim:

- Q4_K, Q5_K and Q6_K parts give the scalar reference's products bit for bit: up to three rows on VNNI
  (16 outputs in the lanes), more on the tiles (groups of seven rows), outputs past a tile's 16,
  one thread and two, extreme inputs; where the tiles do not run here, those tests skip.
- A row's result does not depend on the rows beside it: one row (VNNI) equals the same row in a
  call of 2 to 40 (VNNI, then the tiles), so a verification's rows equal its steps'.
- The products are those of the 16-bit activations times the weights, to float32 rounding (a
  negative control: the two levels' inputs are not), summed in another order than `int8.WIDE`'s.
- In a stack, float and 32-weight parts keep the float path's products exactly.
- A model decoding in this mode: a verification's logits equal the steps' bit for bit, and
  lookup and the paper's hierarchy equal autoregressive decoding token for token; its steps'
  logits differ from WIDE's (a control that the mode took). Where the tiles do not run, the
  default is WIDE.
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

from triforce_core.kv import FullCache
from triforce_core.models import int8
from triforce_core.models.arithmetic import arithmetic_key, measured_default
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
STEP_TILES, WIDE = int8.STEP_TILES, int8.WIDE
STEP_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _reference(kernels, x, m, threads=1):
    with kernels.forced(int8.SCALAR):
        return kernels.product(x, m, STEP_TILES, threads=threads)


@pytest.mark.parametrize("qtype", STEP_TYPES, ids=lambda q: q.name)
def test_vnni_and_the_tiles_equal_the_scalar_reference_bit_for_bit(tiles, qtype):
    m, _ = random_matrix(qtype, 37, 768, seed=3)  # 37 outputs: two whole jobs of 16 and 5
    x = activation_rows(40, 768, seed=2)
    for S in (1, 2, 3, 4, 7, 8, 14, 15, 40):  # VNNI up to 3, then groups of 7 rows on the tiles
        want = _reference(tiles, x[:S], m)
        for threads in (1, 2):
            assert torch.equal(tiles.product(x[:S], m, STEP_TILES, threads=threads), want), f"{S} rows, {threads} threads"


@pytest.mark.parametrize("qtype", STEP_TYPES, ids=lambda q: q.name)
def test_a_row_is_the_same_whatever_the_rows_beside_it(kernels, qtype):
    m, _ = random_matrix(qtype, 40, 1024, seed=8)
    x = activation_rows(40, 1024, seed=9)
    alone = [kernels.product(x[i : i + 1], m, STEP_TILES, threads=1)[0] for i in range(40)]
    for S in (2, 3, 7, 17, 40):
        together = kernels.product(x[:S], m, STEP_TILES, threads=2)
        for i in range(S):
            assert torch.equal(together[i], alone[i]), f"row {i} of {S}"


@pytest.mark.parametrize("qtype", STEP_TYPES, ids=lambda q: q.name)
def test_the_edges_of_the_inputs(tiles, qtype):
    """`edge_rows`' inputs, one row at a time (VNNI) and seven at once (tiles)."""
    x = edge_rows(7)
    m, _ = random_matrix(qtype, 20, 512, seed=5)
    for S in (7, 1):
        for i in range(0, 7, S):
            got, want = tiles.product(x[i : i + S], m, STEP_TILES, threads=2), _reference(tiles, x[i : i + S], m)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert bool(tiles.product(x[1:2], m, STEP_TILES)[0].isnan().all())


@pytest.mark.parametrize("qtype", STEP_TYPES, ids=lambda q: q.name)
def test_the_largest_weights_and_inputs_stay_exact(kernels, qtype):
    """Every weight and scale at its type's extreme (Q4_K 15 x 63, Q5_K 31 x 63, Q6_K (0 - 32) x
    -128 and (63 - 32) x -128) against inputs at +-32767: each sub-block's sum stays exact, so the
    products are the 16-bit activations' times the weights, on the scalar reference and on the
    vector paths alike."""
    rng = np.random.default_rng(13)
    raw = random_blocks(qtype, 32, 512, rng).reshape(32, 2, -1)
    if qtype == Q.Q6_K:  # ql 0..127, qh 128..191, scales 192..207
        raw[:16, :, :192], raw[16:, :, :192] = 0x00, 0xFF
        raw[:, :, 192:208] = 0x80
    else:
        raw[:, :, 4:16] = 0xFF  # every sc_j and m_j 63
        raw[:, :, 16:] = 0xFF   # Q5_K's fifth bits, the nibbles: every weight at its top
    t = StoredTensor(int(qtype), torch.from_numpy(raw.reshape(32, -1).copy()), (32, 512))
    m, w = Matrix(stored=(t,)), t.dequantized()
    x = torch.full((9, 512), 3.0)
    x[1::2] = -3.0
    x[2, ::3] = -3.0
    for S in (1, 9):
        y = kernels.product(x[:S], m, STEP_TILES, threads=2)
        with kernels.forced(int8.SCALAR):
            assert torch.equal(kernels.product(x[:S], m, STEP_TILES, threads=1), y)
        d, q = sixteen_bits(x[:S].numpy())
        want = torch.from_numpy(d.astype(np.float64) * q) @ w.double().t()
        assert ((y.double() - want).abs() <= 1e-6 * (x[:S].double().abs() @ w.double().abs().t())).all()


@pytest.mark.parametrize("rows", [1, 5, 24])
@pytest.mark.parametrize("qtype", STEP_TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_16_bit_activations(kernels, qtype, rows):
    y, slack = assert_16_bit_products(kernels, qtype, STEP_TILES, rows)
    m, _ = random_matrix(qtype, 31, 768, seed=6)
    wide = kernels.product(activation_rows(rows, 768, seed=7), m, WIDE, threads=2).double()  # the same integers, another order
    assert ((y - wide).abs() <= slack).all()


def test_summed_in_an_order_of_their_own(tiles):
    """Not WIDE's lanes: over many outputs some differ in the last bits, for a step and a
    verification alike (so a model's steps must take this mode for its verifications too)."""
    m, _ = random_matrix(Q.Q4_K, 256, 2048, seed=10)
    x = activation_rows(7, 2048, seed=11)
    for S in (1, 7):
        assert not torch.equal(tiles.product(x[:S], m, STEP_TILES, threads=2), tiles.product(x[:S], m, WIDE, threads=2))


def test_a_stack_gives_each_part_as_alone(kernels):
    """The K types in this mode, float16 and 32-weight parts the float path's products exactly."""
    parts = mixed_stack(np.random.default_rng(11), 512)
    for S in (1, 9):
        assert_each_part_as_alone(kernels, activation_rows(S, 512, seed=12), parts, STEP_TILES)


def test_the_mode_is_named_and_the_default_where_the_tiles_run(kernels):
    assert int8.LEVEL_NAMES[STEP_TILES] == "step-tiles" and int8.MODE_WORDS["step-tiles"] == STEP_TILES
    assert measured_default().products == (STEP_TILES if kernels.tiles() else WIDE)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return gguf_pair(tmp_path_factory.mktemp("step_tiles"), Q4_K_M_LIKE, seed=2)


@pytest.fixture
def step_tiles(tiles, engine):
    """The engine's models in this mode, their default where the tiles run."""
    models = [m for m in (engine.target, engine.draft) if m is not None]
    before = [m.arithmetic for m in models]
    for m in models:
        m.arithmetic = measured_default()
    yield engine
    for m, own in zip(models, before):
        m.arithmetic = own


def test_a_verification_equals_the_steps_in_this_mode(step_tiles):
    model = step_tiles.target
    assert model.arithmetic.products == STEP_TILES
    ids = torch.randint(3, 300, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    for rows in (2, 3, 7, 9):  # VNNI against VNNI, then the tiles against VNNI's steps
        assert_verification_rows_equal_steps(model, ids, rows=rows)


def test_a_step_in_this_mode_differs_from_one_in_wide(step_tiles):
    """The control for the model-level tests: a step's logits are this mode's, not WIDE's; the
    disk cache's key tells the two apart."""
    model = step_tiles.target
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()

    def step() -> torch.Tensor:
        s = model.spec
        cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids) + 1, torch.float32, model.device)
        model.forward(torch.tensor(ids[:-1]), cache.positions(0, len(ids) - 1), cache, logits_rows=None)
        return model.forward(torch.tensor(ids[-1:]), cache.positions(len(ids) - 1, 1), cache).logits

    mine = step()
    own = model.arithmetic
    model.arithmetic = replace(own, products=WIDE)
    wide = step()
    model.arithmetic = own
    assert not torch.equal(mine, wide) and (mine - wide).abs().max() < 1e-3
    assert arithmetic_key("cpu", own) != arithmetic_key("cpu", replace(own, products=WIDE))


def test_speculation_equals_autoregressive_decoding_in_this_mode(step_tiles):
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(7)).tolist() * 2
    reference = greedy_answer(step_tiles, "autoregressive", ids)
    for mode in ("lookup", "triforce"):
        assert greedy_answer(step_tiles, mode, ids) == reference, mode
