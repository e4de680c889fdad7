"""Integer products over GGUF blocks (`Transformer.integer_products`, `TRIFORCE_INT8=1`,
`csrc/int8_rows.c`) are the arithmetic they claim, one order per output.

- Every vector path the processor runs (AVX2, AVX-512 VNNI) gives the scalar reference's
  products bit for bit: every type, row counts 1-17, whole and partial groups of blocks, a
  stack of parts mixing the types and a float16 part, one thread and two.
- The activations are quantized as defined (d = max|x| / 127 per block, q = round(x / d)).
- The products are those of the 8-bit activations, to float32 rounding; and they stay within
  what 8-bit activations allow of the float product. Negative controls: the unquantized
  activations miss the first bound, a scale shared across the rows and a scale one step off
  miss the second.
- A row's result does not depend on the rows beside it (S rows in one call = S one-row calls,
  bit for bit); negative control: rows quantized with a scale shared across them.
- Through the model: with the switch on, greedy lookup and triforce speculation equal our own
  autoregressive decoding token for token, a verification's logits equal the steps' bit for
  bit, and the logits do differ from the float path's; the switch is off by default.
- The switch is per model: two models of one file in one process, one with integer products and
  one without, give different logits, each equal to itself across row counts and calls; an
  engine gives its models `TRIFORCE_INT8` unless `exact`, and the disk cache keys each apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from tests.helpers.gguf_engine import gguf_pair, greedy_answer, repeating_prompt
from tests.helpers.gguf_files import K_MIX, LLAMA, random_blocks, write_gguf
from tests.helpers.products import activation_rows

import triforce_core.models.native_layers as native_layers
from triforce_core import CacheConfig, GenerationConfig, SpeculationConfig, TriForceEngine
from triforce_core.models import int8
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Inputs per type: a partial group of 32-blocks (3 blocks, odd), a whole group and one more, one
# and three super-blocks.
WIDTHS = {True: (256, 768), False: (96, 288, 512)}
Q8_32_DTYPE = np.dtype([("d", "<f4", 8), ("sum", "<i4", 8), ("qs", "i1", 256)])  # struct block_q8_32x8
Q8_K_DTYPE = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])  # struct block_q8_k


# Where a block's 16-bit scales lie (d; Q4_1's m and the K types' dmin beside it).
SCALE_BYTES = {Q.Q4_0: slice(0, 2), Q.Q4_1: slice(0, 4), Q.Q8_0: slice(0, 2), Q.Q4_K: slice(0, 4), Q.Q5_K: slice(0, 4),
               Q.Q6_K: slice(208, 210)}


def _matrix(qtype, rows: int, cols: int, seed: int) -> tuple[Matrix, torch.Tensor]:
    """A one-part matrix of random blocks, row 0's first block with zero scales (as a pruned
    row's), and its weights dequantized ([rows, cols] float32)."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    raw[0, SCALE_BYTES[qtype]] = 0
    t = StoredTensor(int(qtype), torch.from_numpy(raw), (rows, cols))
    return Matrix(stored=(t,)), t.dequantized()


def _quantized(kernels, x: torch.Tensor, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's quantization of x [S, K]: (d per input, q per input), each [S, K]."""
    raw = kernels.quantize(x, kind).numpy()
    S, K = x.shape
    if kind == int8.Q8_K:
        blocks = raw.view(Q8_K_DTYPE).reshape(S, -1)
        return np.repeat(blocks["d"], 256, axis=1), blocks["qs"].reshape(S, -1)
    groups = raw.view(Q8_32_DTYPE).reshape(S, -1)
    return np.repeat(groups["d"].reshape(S, -1), 32, axis=1)[:, :K], groups["qs"].reshape(S, -1)[:, :K]


def _quantize_by_definition(x: np.ndarray, per: int, shared_rows: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """d = max|x| / 127 per block of `per` (float32), q = round(x * (1 / d)) half away from zero,
    clamped to +-127. `shared_rows`: one d per block position for all rows (the bug the tests
    must catch)."""
    S, K = x.shape
    blocks = x.astype(np.float32).reshape(S, K // per, per)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    if shared_rows:
        amax = np.broadcast_to(amax.max(axis=0, keepdims=True), amax.shape)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    v = (blocks * inv).astype(np.float64)
    q = np.clip(np.trunc(v + np.copysign(0.5, v)), -127, 127)
    return np.broadcast_to(d, blocks.shape).reshape(S, K), q.reshape(S, K)


def _per(qtype) -> int:
    return 256 if qtype in K_TYPES else 32


# -- the paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_path_equals_the_scalar_reference_bit_for_bit(kernels, qtype):
    paths = kernels.paths()
    assert int8.SCALAR in paths
    for K in WIDTHS[qtype in K_TYPES]:
        m, _ = _matrix(qtype, 37, K, seed=K)
        x = activation_rows(17, K, seed=K)
        for S in (1, 3, 7, 17):
            with kernels.forced(int8.SCALAR):
                want = kernels.product(x[:S], m, threads=1)
            for path in paths:
                with kernels.forced(path):
                    for threads in (1, 2):
                        got = kernels.product(x[:S], m, threads=threads)
                        assert torch.equal(got, want), f"{int8.PATH_NAMES[path]}, K {K}, {S} rows, {threads} threads"


def test_a_stack_of_mixed_parts_takes_each_parts_path(kernels):
    """q/k/v of a Q4_K_M file mix types in one product; a float16 part keeps the float path."""
    rng = np.random.default_rng(5)
    parts = [StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, 512, rng)), (rows, 512))
             for q, rows in ((Q.Q4_K, 20), (Q.Q8_0, 9), (Q.Q6_K, 17), (Q.Q4_1, 5), (Q.Q5_K, 3))]
    f16 = StoredTensor(int(Q.F16), torch.from_numpy(rng.standard_normal((6, 512)).astype(np.float16).view(np.uint8)), (6, 512))
    stack = Matrix(stored=(*parts, f16))
    x = activation_rows(7, 512, seed=2)
    with kernels.forced(int8.SCALAR):
        want = kernels.product(x, stack, threads=1)
    for path in kernels.paths():
        with kernels.forced(path):
            assert torch.equal(kernels.product(x, stack, threads=2), want), int8.PATH_NAMES[path]
    start = 0
    for p in parts:  # each part's rows are its own product
        alone = kernels.product(x, Matrix(stored=(p,)), threads=1)
        assert torch.equal(want[:, start : start + p.shape[0]], alone)
        start += p.shape[0]
    assert torch.equal(want[:, start:], kernels.product(x, Matrix(stored=(f16,)), int8=False, threads=1))


def test_unknown_or_unrunnable_paths_are_refused(kernels):
    with pytest.raises(ValueError, match="cannot run"):
        with kernels.forced(7):
            pass
    assert kernels.path() == max(kernels.paths())  # the widest again


# -- the arithmetic ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,per", [(int8.Q8_32, 32), (int8.Q8_K, 256)])
def test_activations_are_quantized_as_defined(kernels, kind, per):
    x = activation_rows(5, 768, seed=per)
    d, q = _quantized(kernels, x, kind)
    d_want, q_want = _quantize_by_definition(x.numpy(), per)
    assert np.array_equal(d, d_want) and np.array_equal(q, q_want)
    assert np.abs(x.numpy() - d * q).max() <= (d / 2).max()  # half a step at most


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_are_those_of_the_8_bit_activations(kernels, qtype):
    """y = sum_e w_e (d q_e) in float64, to float32 rounding: the combination of exact integer
    sums with the scales rounds ~K / 32 + 8 times in float32 (2^-24 relative each, at most), so
    2e-5 of sum |w_e d q_e| bounds it with room. Negative control: against the unquantized x
    the same bound fails (8 bits leave ~1e-3 relative, far above float32 rounding)."""
    K = 768 if qtype in K_TYPES else 288
    m, w = _matrix(qtype, 29, K, seed=3)
    x = activation_rows(7, K, seed=4)
    y = kernels.product(x, m, threads=1).double()
    d, q = _quantized(kernels, x, int8.Q8_K if qtype in K_TYPES else int8.Q8_32)
    xq = torch.from_numpy(d.astype(np.float64) * q)
    w64 = w.double()
    want = xq @ w64.t()
    scale = xq.abs() @ w64.abs().t()
    assert ((y - want).abs() <= 2e-5 * scale + 1e-30).all()
    bad = x.double() @ w64.t()
    assert not ((y - bad).abs() <= 2e-5 * (x.double().abs() @ w64.abs().t())).all()


def _step_bound(x: np.ndarray, w: torch.Tensor, per: int) -> torch.Tensor:
    """|sum_e w_e (x_e - x^_e)| <= sum_e |w_e| d_b(e) / 2: rounding to nearest leaves each
    activation at most half its block's step d = max|x| / 127 from x (no clamping: |x| / d <= 127)."""
    S, K = x.shape
    d = np.repeat(np.abs(x.reshape(S, K // per, per)).max(axis=2).astype(np.float64) / 127.0, per, axis=1)
    return torch.from_numpy(d / 2) @ w.double().abs().t()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_stay_within_what_8_bit_activations_allow(kernels, qtype):
    """Against the float path (dequantize, then multiply): off by at most the bound above, plus
    float32 rounding of both products (1e-5 of sum |w x|). The bound is a worst case (errors of
    independent signs would need ~sqrt(K) times less); what it must catch, checked on plausible
    bugs computed by definition: one scale shared by the call's rows (a small row beside a large
    one loses its precision), and a scale for unsigned bytes (max|x| / 255, every x^ halved)."""
    per = _per(qtype)
    K = 768 if qtype in K_TYPES else 288
    m, w = _matrix(qtype, 31, K, seed=6)
    x = activation_rows(5, K, seed=7)
    x[2, 5] = 4.0  # a large input, not one that dwarfs its whole block
    y_float = kernels.product(x, m, int8=False, threads=1).double()
    slack = _step_bound(x.numpy(), w, per) * (1 + 1e-3) + 1e-5 * (x.double().abs() @ w.double().abs().t())

    def within(y: torch.Tensor) -> torch.Tensor:
        return (y - y_float).abs() <= slack

    assert within(kernels.product(x, m, threads=1).double()).all()
    x_shared = np.stack([x[0].numpy(), x[1].numpy()])  # a row 1,000 times smaller beside it
    d, q = _quantize_by_definition(x_shared, per, shared_rows=True)
    y_shared = torch.from_numpy(d.astype(np.float64) * q) @ w.double().t()
    assert not within(torch.cat([y_shared, y_float[2:]])).all()
    d, q = _quantize_by_definition(x.numpy(), per)
    y_off = torch.from_numpy(d.astype(np.float64) * 127 / 255 * q) @ w.double().t()
    assert not within(y_off).all()


# -- rows against steps ------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_rows_in_one_call_equal_one_row_calls(kernels, qtype):
    """[64 x 1024]: every call runs on two threads (S K N >= 2^16), whatever S."""
    m, _ = _matrix(qtype, 64, 1024, seed=8)
    x = activation_rows(17, 1024, seed=9)
    alone = [kernels.product(x[i : i + 1], m, threads=2)[0] for i in range(17)]
    for S in (1, 2, 7, 17):
        together = kernels.product(x[:S], m, threads=2)
        for i in range(S):
            assert torch.equal(together[i], alone[i]), f"row {i} of {S}"


def test_negative_control_rows_quantized_together_differ_from_steps(kernels):
    """The same comparison on rows quantized with one scale per block for all of them (built
    here, multiplied by the kernel) fails: the check can see a row depend on its neighbours."""
    m, _ = _matrix(Q.Q4_K, 64, 1024, seed=8)
    x = activation_rows(7, 1024, seed=9)
    d, q = _quantize_by_definition(x.numpy(), 256, shared_rows=True)
    blocks = np.zeros((7, 4), dtype=Q8_K_DTYPE)
    blocks["d"] = d[:, ::256]
    blocks["qs"] = q.reshape(7, 4, 256)
    blocks["bsums"] = q.reshape(7, 4, 16, 16).sum(axis=3)
    together = kernels.product_quantized(m, 7, xk=torch.from_numpy(blocks.view(np.uint8).reshape(7, -1)), threads=2)
    alone = torch.cat([kernels.product(x[i : i + 1], m, threads=2) for i in range(7)])
    assert not torch.equal(together, alone)
    # the kernel's own quantization through the same entry equals its one-call product
    xk = kernels.quantize(x, int8.Q8_K)
    assert torch.equal(kernels.product_quantized(m, 7, xk=xk, threads=2), kernels.product(x, m, threads=2))


# -- through the model -------------------------------------------------------------------------

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


@pytest.mark.parametrize("mode", [int8.ONE_LEVEL, int8.TWO_LEVELS, int8.FAST, int8.WIDE], ids=lambda m: int8.LEVEL_NAMES[m])
def test_speculation_equals_autoregressive_decoding_with_int8(engine, rows, monkeypatch, mode):
    assert engine.target.quantized
    for model in (engine.target, engine.draft):
        monkeypatch.setattr(model, "integer_products", mode)
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


def test_an_engine_gives_its_models_the_default_mode_and_integer_products_change_the_logits(engine, monkeypatch):
    monkeypatch.delenv(int8.ENV, raising=False)
    assert native_layers.products_mode() == int8.default_mode(native_layers.kernel().int8.tiles())
    model = engine.target
    TriForceEngine(model, engine.draft)  # what an engine gives its models by default
    assert model.integer_products == engine.draft.integer_products == native_layers.products_mode()
    TriForceEngine(model, engine.draft, exact=True)
    assert model.integer_products == engine.draft.integer_products == 0
    floats = _logits(model)
    with int8.switched(True):  # the process's switch is read when an engine is made, not per forward
        assert torch.equal(_logits(model), floats)
    for mode in (int8.ONE_LEVEL, int8.TWO_LEVELS, int8.FAST, int8.WIDE):  # the target mixes K and 32-weight types
        monkeypatch.setattr(model, "integer_products", mode)
        on = _logits(model)
        assert not torch.equal(on, floats), int8.LEVEL_NAMES[mode]
        assert (on - floats).abs().max() <= 0.05 * floats.abs().max()


def test_integer_products_are_per_model(engine, monkeypatch, rows, tmp_path):
    """Two models of one file in one process: the one with integer products and the one without
    give different logits, each the same at every call and across row counts (a verification's
    rows equal the steps); `TRIFORCE_INT8=1` reaches a new engine's models unless `exact`; the
    disk cache never gives one model's prefill to the other. Control: both without, the same
    logits (the difference is the flag's)."""
    from triforce_core.models.loading import load_model

    path = engine.source
    a = load_model(path, CPU, torch.float32).model
    b = load_model(path, CPU, torch.float32).model
    a.integer_products, b.integer_products = True, False
    first_a, first_b = _logits(a), _logits(b)
    assert not torch.equal(first_a, first_b)
    assert torch.equal(_logits(a), first_a) and torch.equal(_logits(b), first_b)  # interleaved: no shared state
    for model in (a, b):
        assert_verification_rows_equal_steps(model, repeating_prompt())
    b.integer_products = True
    assert torch.equal(_logits(b), first_a)
    b.integer_products = False
    a.integer_products = False
    assert torch.equal(_logits(a), first_b)  # the control

    monkeypatch.setenv(int8.ENV, "1")
    assert TriForceEngine(a, exact=True).target.integer_products == 0
    assert TriForceEngine(b).target.integer_products == int8.ONE_LEVEL
    monkeypatch.setenv(int8.ENV, "fast")
    assert TriForceEngine(b).target.integer_products == int8.FAST
    monkeypatch.setenv(int8.ENV, "0")
    assert TriForceEngine(b).target.integer_products == 0
    monkeypatch.delenv(int8.ENV)

    cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=2, ignore_eos=True),
                           cache=CacheConfig(prefill_chunk=32))
    by_flag = {}
    for on in (True, False, True):
        engine_ = TriForceEngine(load_model(path, CPU, torch.float32).model)
        engine_.target.integer_products = on
        engine_.use_disk_cache(str(tmp_path))
        by_flag.setdefault(on, []).append(engine_.run(repeating_prompt(), cfg).stats.disk_tokens)
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
    monkeypatch.setattr(model, "integer_products", int8.WIDE)
    got = model._project(x, layer.wqkv)
    if kernel.int8.path() == int8.AVX512_VNNI:  # where AMX's tiles run, the Q4_K parts on them (tests/test_tile_rows.py)
        assert torch.equal(got, kernel.int8.product(x, layer.wqkv, int8.TILES if kernel.int8.tiles() else int8.WIDE))
        assert not torch.equal(got, floats)
        assert (got - floats).abs().max() <= 1e-3 * floats.abs().max()
    else:
        assert torch.equal(got, floats)
    assert layer.wqkv.all_k_blocks() and not layer.w_gate_up.all_k_blocks()
    assert torch.equal(model._project(x, layer.w_gate_up), x @ layer.w_gate_up.dense_t())
    monkeypatch.setattr(model, "integer_products", 0)
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
