"""Few-row attention over a 16-bit cache on AMX's bfloat16 tiles (`native_attention`, the tile
path of `csrc/few_rows.c`). What it claims:

- The result is close to a float64 reference over the same 16-bit K/V: keys and values split
  exactly, queries and probabilities to 16 bits (rows 1 to 136, head sizes 16 to 128, causal
  limits, blocks a row cannot see, the chunks' attention mass).
- A row's result does not depend on the rows beside it, bit for bit (1 to 136 rows a call).
- It is another arithmetic than the float32 path (a control that the tiles ran), which
  `TRIFORCE_ATTENTION_TILES=0` (the default) keeps; float32 K/V and head sizes that are not a
  multiple of 16 keep the float32 path; the disk cache's key names it.
- A model decoding over a float16 cache on the tiles: a verification's logits equal the steps'
  bit for bit (7 and 17 rows), its forwards do take the tiles (a control), and every
  speculative mode's greedy output equals autoregressive decoding's, no tie tolerated.

Where the tiles do not run, the tests that need them skip.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.models import DRAFT_OVERRIDES, make_hf, to_ours
from tests.helpers.native import built, needs_compiler
from tests.helpers.half_cache import MODES, PROMPT, greedy_reference, kv_config, model_pair, no_tiles

import triforce_core.models.native_attention as native_attention
from triforce_core import TriForceEngine
from triforce_core.models import switches
from triforce_core.models.arithmetic import arithmetic_key

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernel() -> native_attention.Kernel:
    return built(native_attention)


@pytest.fixture
def tiles(kernel, monkeypatch) -> native_attention.Kernel:
    """The kernel with the tiles switched on (`TRIFORCE_ATTENTION_TILES=1`, opt-in)."""
    if not kernel.tiles_run():
        pytest.skip("AMX's bfloat16 tiles do not run on this machine")
    monkeypatch.setenv(native_attention.TILES_ENV, "1")
    assert kernel.tiles()
    return kernel


def _inputs(H, R, T, D, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    room = 29  # a head stride longer than T
    k = (torch.randn(H, T + room, D, generator=g) * 2).to(dtype)[:, :T]
    v = torch.randn(H, T + room, D, generator=g).to(dtype)[:, :T]
    return torch.randn(H, R, D, generator=g), k, v


def _reference(q, k, v, limits, scale, chunk):
    H, R, _ = q.shape
    T = k.shape[1]
    lim = limits if limits is not None else torch.full((R,), T)
    s = torch.matmul(q.double() * scale, k.double().transpose(1, 2))
    s = s.masked_fill(torch.arange(T)[None, None, :] >= lim[None, :, None], float("-inf"))
    p = s.softmax(-1)
    mass = p[..., : T // chunk * chunk].reshape(H, R, T // chunk, chunk).sum(-1) if chunk else None
    return torch.matmul(p, v.double()), mass


SHAPES = [(4, 1, 4099, 64), (2, 7, 257, 64), (8, 28, 3000, 64), (1, 17, 2049, 128), (2, 40, 777, 32),
          (3, 136, 1100, 64), (2, 5, 300, 16)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("H,R,T,D", SHAPES, ids=[f"h{h}-r{r}-t{t}-d{d}" for h, r, t, d in SHAPES])
def test_the_tiles_are_close_to_a_float64_reference(tiles, dtype, H, R, T, D):
    """Over a bfloat16 cache, head sizes 32 to 128 take its keys and values as stored, 16 the
    split path."""
    q, k, v = _inputs(H, R, T, D, seed=H * 1000 + R + T, dtype=dtype)
    limits = None if R == 1 else torch.arange(T - R + 1, T + 1)
    out, mass = tiles.attention(q, k, v, limits, D**-0.5, 16)
    ref, ref_mass = _reference(q, k, v, limits, D**-0.5, 16)
    # 16-bit queries and probabilities: a few units in the 5th digit, next to float16's 3rd
    # (the largest seen: 2.0e-5, 136 rows over 1,100 keys, either cache)
    assert (out.double() - ref).abs().max() < 3e-5
    assert (mass.double() - ref_mass).abs().max() < 3e-5


def test_rows_that_see_nothing_of_a_block_and_a_long_cut(tiles):
    """Limits far below the keys: whole blocks a row cannot see (m = -inf, no weight)."""
    H, R, T, D = 2, 20, 2000, 64
    q, k, v = _inputs(H, R, T, D, seed=5)
    limits = torch.tensor([1, 2, 17, 255, 256, 257, 300, 511, 512, 513] + [1900 + i for i in range(10)])
    out, _ = tiles.attention(q, k, v, limits, 0.125)
    ref, _ = _reference(q, k, v, limits, 0.125, 0)
    assert (out.double() - ref).abs().max() < 2e-5
    assert torch.equal(out[:, 0], v[:, 0].float())  # one key seen: its value, exactly


@pytest.mark.parametrize("dtype,D", [(torch.float16, 64), (torch.bfloat16, 64), (torch.bfloat16, 16)],
                         ids=["float16", "bfloat16", "bfloat16-head16"])
def test_a_row_is_the_same_bit_for_bit_whatever_the_rows_beside_it(tiles, dtype, D):
    """A bfloat16 cache's keys and values go to the tiles as stored where the head size is a
    multiple of 32, split as a float16 cache's below that (head 16): both paths."""
    H, R, T = 4, 136, 1500
    q, k, v = _inputs(H, R, T, D, seed=9, dtype=dtype)
    limits = torch.arange(T - R + 1, T + 1)
    seen: dict[int, tuple] = {}
    for rows in (1, 4, 7, 17, 28, 136):
        for start in range(0, R, rows):
            stop = min(start + rows, R)
            out, mass = tiles.attention(q[:, start:stop], k, v, limits[start:stop], 0.125, chunk=16)
            for r in range(start, stop):
                first = seen.setdefault(r, (out[:, r - start], mass[:, r - start]))
                assert torch.equal(out[:, r - start], first[0]) and torch.equal(mass[:, r - start], first[1]), \
                    f"row {r} in calls of {rows}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_the_tiles_are_another_arithmetic_which_the_default_keeps_off(tiles, dtype):
    q, k, v = _inputs(2, 7, 3000, 64, seed=3, dtype=dtype)
    limits = torch.arange(3000 - 6, 3001)
    on, _ = tiles.attention(q, k, v, limits, 0.125)
    with no_tiles():
        assert not tiles.tiles()
        off, _ = tiles.attention(q, k, v, limits, 0.125)
        wide, _ = tiles.attention(q, k.float(), v.float(), limits, 0.125)
    assert tiles.tiles()
    assert torch.equal(off, wide)  # off: the float32 path over the widened K/V
    assert not torch.equal(on, off)  # the control: the tiles really ran
    assert (on - off).abs().max() < 1e-5
    # float32 K/V never take them; nor a head size that is not a multiple of 16
    on32, _ = tiles.attention(q, k.float(), v.float(), limits, 0.125)
    assert torch.equal(on32, wide)
    q48, k48, v48 = _inputs(2, 7, 3000, 40, seed=4, dtype=dtype)  # 40: not a multiple of 16
    a, _ = tiles.attention(q48, k48, v48, limits, 0.125)
    b, _ = tiles.attention(q48, k48.float(), v48.float(), limits, 0.125)
    assert torch.equal(a, b)


def test_the_disk_cache_key_names_the_attention_tiles(tiles):
    on = arithmetic_key("cpu")
    with no_tiles():
        off = arithmetic_key("cpu")
    assert on != off and arithmetic_key("cpu") == on


def test_the_default_keeps_the_float32_path(kernel, monkeypatch):
    monkeypatch.delenv(native_attention.TILES_ENV, raising=False)
    assert not kernel.tiles()


@pytest.mark.parametrize("word,on", [("1", True), ("yes", True), (" On ", True), ("0", False), ("off", False),
                                     ("False", False), (" no ", False)])
def test_a_switch_reads_the_words_people_write(monkeypatch, word, on):
    monkeypatch.setenv(native_attention.TILES_ENV, word)
    assert switches.is_on(native_attention.TILES_ENV, default=False) is on
    assert switches.is_on(native_attention.TILES_ENV, default=True) is on


# -- a model over a float16 cache --------------------------------------------------------------
def test_a_verification_over_a_float16_cache_equals_the_steps_on_the_tiles(tiles):
    model = to_ours(make_hf("llama_gqa_llama3", seed=0))  # head size 16: the tiles' smallest
    ids = torch.randint(3, 97, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_verification_rows_equal_steps(model, ids, torch.float16, rows=7)
    assert_verification_rows_equal_steps(model, ids, torch.float16, rows=17)


def test_a_step_on_the_tiles_differs_from_one_off_them(tiles):
    """The control for the model-level tests: a float16 cache's forward does take the tiles."""
    model, _ = model_pair()
    greedy_on = greedy_reference(model, PROMPT, 4, torch.float16)
    with no_tiles():
        greedy_off = greedy_reference(model, PROMPT, 4, torch.float16)
    assert greedy_on[1] != greedy_off[1]  # the top-2 gaps: other logits


def test_every_mode_on_the_tiles_equals_autoregressive_decoding_token_for_token(tiles):
    t, d = model_pair()
    ref, _ = greedy_reference(t, PROMPT, 40, torch.float16)
    engine = TriForceEngine(t, d)
    for mode, lookup in MODES:
        cfg = kv_config(mode, "float16", lookup=lookup, **({"lookup_max": 8} if lookup else {}))
        assert engine.run(PROMPT, cfg).token_ids == ref, mode


# -- a model over a bfloat16 cache, its keys and values on the tiles as stored ------------------
HEAD32 = dict(num_attention_heads=2, num_key_value_heads=1)  # head size 32: the stored path's smallest


def test_a_verification_over_a_bfloat16_cache_equals_the_steps_on_the_tiles(tiles):
    model = to_ours(make_hf("llama_gqa_llama3", seed=0, **HEAD32))
    assert model.spec.head_dim == 32
    ids = torch.randint(3, 97, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_verification_rows_equal_steps(model, ids, torch.bfloat16, rows=7)
    assert_verification_rows_equal_steps(model, ids, torch.bfloat16, rows=17)


def test_every_mode_over_a_bfloat16_cache_on_the_tiles_equals_autoregressive_decoding(tiles):
    t = to_ours(make_hf("llama_gqa_llama3", seed=0, **HEAD32))
    d = to_ours(make_hf("llama_gqa_llama3", seed=11, **DRAFT_OVERRIDES))
    ref, gaps = greedy_reference(t, PROMPT, 40, torch.bfloat16)
    with no_tiles():
        assert greedy_reference(t, PROMPT, 4, torch.bfloat16)[1] != gaps[:4]  # the control: the tiles ran
    engine = TriForceEngine(t, d)
    for mode, lookup in MODES:
        cfg = kv_config(mode, "bfloat16", lookup=lookup, **({"lookup_max": 8} if lookup else {}))
        assert engine.run(PROMPT, cfg).token_ids == ref, mode
