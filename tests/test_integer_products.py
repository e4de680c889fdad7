"""Integer products over GGUF blocks in a model (`Arithmetic.products`, `int8.WIDE`): the
engine's choice and what it changes.

- With them, greedy lookup and the paper's hierarchy equal our own autoregressive decoding
  token for token, a verification's logits equal the steps' bit for bit, and the logits do
  differ from the float path's.
- An engine gives its models the default measured for this processor (`measured_default`), or
  the float path with `exact`; no environment variable changes it.
- The arithmetic is per model: two models of one file in one process, one with integer products
  and one without, give different logits, each equal to itself across row counts and calls; the
  disk cache keys each apart.
- A prefill's projections of K-type blocks take them where their VNNI path runs, in blocks of
  rows for the MLP, with the same bits.
(The kernels themselves: tests/test_int16_rows.py, test_tile_rows.py, test_step_tiles.py.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.gguf_engine import gguf_pair, greedy_answer, repeating_prompt
from tests.helpers.gguf_files import K_MIX, LLAMA, write_gguf
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler

import triforce_core.models.native_layers as native_layers
from triforce_core import CacheConfig, GenerationConfig, SpeculationConfig, TriForceEngine
from triforce_core.models import int8
from triforce_core.models.arithmetic import EXACT, measured_default

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return gguf_pair(tmp_path_factory.mktemp("int8"), K_MIX)


@pytest.fixture
def rows(monkeypatch):
    """The row counts of the native layers' forwards; the few-row attention at any length, so
    that every forward's arithmetic is row by row (as in tests/test_gguf.py)."""
    import triforce_core.models.native_attention as native_attention

    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)
    seen: list[int] = []
    original = native_layers.Layers.decode_layers

    def counting(self, x, *args, **kwargs):
        seen.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(native_layers.Layers, "decode_layers", counting)
    return seen


def test_speculation_equals_autoregressive_decoding_with_integer_products(engine, rows, monkeypatch):
    assert engine.target.quantized
    for model in (engine.target, engine.draft):
        monkeypatch.setattr(model, "arithmetic", replace(model.arithmetic, products=int8.WIDE))
    reference = greedy_answer(engine, "autoregressive")
    for mode in ("lookup", "triforce"):
        rows.clear()
        assert greedy_answer(engine, mode) == reference, mode
        assert max(rows) > 1, f"{mode}: no verification of several rows ran"
    assert_verification_rows_equal_steps(engine.target, repeating_prompt())


def _logits(model, n: int = 9) -> torch.Tensor:
    """The logits of the prompt's first n tokens in one forward over a fresh float32 cache."""
    from triforce_core.kv import FullCache

    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, 64, torch.float32, CPU)
    return model.forward(torch.tensor(repeating_prompt()[:n]), torch.arange(n), cache).logits


def test_an_engine_gives_its_models_the_default_and_integer_products_change_the_logits(engine, monkeypatch):
    tiles = native_layers.kernel().int8.tiles()
    default = measured_default()
    assert default.products == (int8.STEP_TILES if tiles else int8.WIDE) and default.prefill_tiles == tiles
    model = engine.target
    monkeypatch.setenv("TRIFORCE_INT8", "1")  # no environment variable changes what an engine gives
    TriForceEngine(model, engine.draft)  # what an engine gives its models by default
    assert model.arithmetic == engine.draft.arithmetic == default
    TriForceEngine(model, engine.draft, exact=True)
    assert model.arithmetic == engine.draft.arithmetic == EXACT and EXACT.products == 0
    floats = _logits(model)
    monkeypatch.setattr(model, "arithmetic", replace(EXACT, products=int8.WIDE))  # the target mixes K and 32-weight types
    on = _logits(model)
    assert not torch.equal(on, floats)
    assert (on - floats).abs().max() <= 0.05 * floats.abs().max()


def test_integer_products_are_per_model(engine, monkeypatch, rows, tmp_path):
    """Two models of one file in one process: the one with integer products and the one without
    give different logits, each the same at every call and across row counts (a verification's
    rows equal the steps); `exact` reaches a new engine's models; the disk cache never gives one
    model's prefill to the other. Control: both without, the same logits (the difference is the
    arithmetic's)."""
    from triforce_core.models.loading import load_model

    path = engine.source
    a = load_model(path, CPU, torch.float32).model
    b = load_model(path, CPU, torch.float32).model
    on, off = replace(EXACT, products=int8.WIDE), EXACT
    a.arithmetic, b.arithmetic = on, off
    first_a, first_b = _logits(a), _logits(b)
    assert not torch.equal(first_a, first_b)
    assert torch.equal(_logits(a), first_a) and torch.equal(_logits(b), first_b)  # interleaved: no shared state
    for model in (a, b):
        assert_verification_rows_equal_steps(model, repeating_prompt())
    b.arithmetic = on
    assert torch.equal(_logits(b), first_a)
    b.arithmetic = off
    a.arithmetic = off
    assert torch.equal(_logits(a), first_b)  # the control

    assert TriForceEngine(a, exact=True).target.arithmetic == EXACT
    assert TriForceEngine(b).target.arithmetic == measured_default()

    cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=2, ignore_eos=True),
                           cache=CacheConfig(prefill_chunk=32))
    by_flag = {}
    for flag in (True, False, True):
        engine_ = TriForceEngine(load_model(path, CPU, torch.float32).model)
        engine_.target.arithmetic = on if flag else off
        engine_.use_disk_cache(str(tmp_path))
        by_flag.setdefault(flag, []).append(engine_.run(repeating_prompt(), cfg).stats.disk_tokens)
    assert by_flag == {True: [0, 96], False: [0]}  # each finds only its own blocks


def test_a_prefills_projections_of_256_weight_blocks_take_the_integer_products(engine, monkeypatch):
    """A forward of more rows than the native layers take (a prefill) projects through
    `Transformer._project`: a matrix of K-type blocks alone (q/k/v here: Q4_K, Q4_K, Q6_K) by the
    integer products where they run their VNNI path, bit for bit the kernel's product of those
    rows (each row a decoding step's arithmetic); a stack with 32-weight blocks (gate/up: Q4_0,
    Q4_1), `exact` (0) or a processor without VNNI by the float path. Control: the integer
    projection is not the float one."""
    model = engine.target
    layer = model.layers[0]
    kernel = native_layers.kernel()
    x = torch.randn(40, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    floats = x @ layer.wqkv.dense_t()
    monkeypatch.setattr(model, "arithmetic", measured_default())  # WIDE, or where the tiles run STEP_TILES
    got = model._project(x, layer.wqkv)
    if kernel.int8.path() == int8.AVX512_VNNI:  # where AMX's tiles run, the Q4_K parts on them (tests/test_tile_rows.py)
        assert torch.equal(got, kernel.int8.product(x, layer.wqkv, int8.TILES if kernel.int8.tiles() else int8.WIDE))
        assert not torch.equal(got, floats)
        assert (got - floats).abs().max() <= 1e-3 * floats.abs().max()
    else:
        assert torch.equal(got, floats)
    assert layer.wqkv.all_k_blocks() and not layer.w_gate_up.all_k_blocks()
    assert torch.equal(model._project(x, layer.w_gate_up), x @ layer.w_gate_up.dense_t())
    monkeypatch.setattr(model, "arithmetic", EXACT)
    assert torch.equal(model._project(x, layer.wqkv), floats)


def test_a_prefills_mlp_runs_its_rows_in_blocks_with_the_same_bits(tmp_path, monkeypatch):
    """Where both MLP matrices take the integer products, a prefill's MLP runs `MLP_ROWS` rows
    at a time (smaller transient outputs); each row's products do not depend on the rows beside
    it, so the layer's output is bit for bit the one of all rows at once. Control: the blocks
    were really taken."""
    import triforce_core.models.transformer as transformer

    all_k = {**K_MIX, "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q5_K}
    path = write_gguf(make_hf("llama_mha", seed=2, **LLAMA), tmp_path / "all-k.gguf", all_k)
    model = TriForceEngine.from_pretrained(str(path), device="cpu").target
    if not model._integer(model.layers[0].w_gate_up):
        pytest.skip("the integer products' VNNI path does not run here")
    layer, S = model.layers[0], 40
    g = torch.Generator().manual_seed(4)
    x = torch.randn(S, model.spec.hidden_size, generator=g)
    out = torch.randn(model.spec.num_heads, S, model.spec.head_dim, generator=g)
    monkeypatch.setattr(transformer, "MLP_ROWS", 10**9)
    whole = model._layer_out(x, out, layer)
    blocks = []
    monkeypatch.setattr(transformer, "MLP_ROWS", 16)
    monkeypatch.setattr(model, "_mlp", lambda h, lay, rows, f=model._mlp: blocks.append(h.shape[0]) or f(h, lay, rows))
    assert torch.equal(model._layer_out(x, out, layer), whole)
    assert blocks == [16, 16, 8]
