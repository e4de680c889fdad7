"""The native decoder layers for few rows (`triforce_core.models.native_layers`) are exact.

- Against a float64 reference: the layer before attention (norm, q/k/v projection with and
  without bias, rotary), the layer after it (output projection, norm, SwiGLU, residuals) and
  the final logits, over row counts 1-16, widths with and without the vector path, grouped
  and multi-head attention, padded and contiguous weight rows.
- Through the model: greedy output equals Hugging Face's across the model zoo and modes, with
  the kernel counted as running; sampled output follows the target's law (chi-square).
- Negative controls: a layer whose gate and up projections are swapped (a plausible loading
  bug) fails the reference comparison, greedy equality and the chi-square test.
- The attention mask, now built over the new columns only, equals its definition.
"""

from __future__ import annotations

import dataclasses
import itertools
import platform

import pytest
import torch
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.models import make_hf, to_ours
from tests.helpers.native import built, needs_compiler
from tests.helpers.greedy import TARGETS, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.sampling import chi2_pvalue, exact_joint, sample_counts

import triforce_core.models.native_layers as native_layers
from triforce_core import TriForceEngine
from triforce_core.models.attention import attention_mask
from triforce_core.models.transformer import KeyMass, _transposed
from triforce_core.models.quantized import Matrix
from triforce_core.models.native_build import build

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def layers():
    return built(native_layers)


@pytest.fixture
def counted(monkeypatch, layers):
    """Counts the rows of every native layer call."""
    calls = []
    original = native_layers.Layers.layer_in

    def counting(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    def counting_all(self, x, *args, **kwargs):  # every layer in one call: its rows too
        calls.append(x.shape[0])
        return original_all(self, x, *args, **kwargs)

    original_all = native_layers.Layers.decode_layers
    monkeypatch.setattr(native_layers.Layers, "layer_in", counting)
    monkeypatch.setattr(native_layers.Layers, "decode_layers", counting_all)
    return calls


def _swap_halves(w) -> torch.Tensor:
    """[E, 2I] (a tensor, or the model's float `Matrix`) -> the same with its two halves exchanged
    (up first, then gate), rows padded alike."""
    w = w.dense_t() if hasattr(w, "dense_t") else w
    half = w.shape[1] // 2
    return _transposed(torch.cat([w[:, half:], w[:, :half]], dim=1).t().contiguous())


@pytest.fixture
def swapped(monkeypatch, counted):
    """The negative control: the MLP computes silu(up) * gate."""
    original = native_layers.Layers.layer_out

    def broken(self, x, attn, w_o, norm, eps, w_gate_up, w_down):
        return original(self, x, attn, w_o, norm, eps, _swap_halves(w_gate_up), w_down)

    def broken_all(self, x, table, *args, **kwargs):  # every layer in one call: a table of swapped weights
        swapped = native_layers.LayerTable([dataclasses.replace(layer, w_gate_up=Matrix(dense_t=_swap_halves(layer.w_gate_up)))
                                            for layer in table.layers])
        return original_all(self, x, swapped, *args, **kwargs)

    original_all = native_layers.Layers.decode_layers  # (the counting one)
    monkeypatch.setattr(native_layers.Layers, "layer_out", broken)
    monkeypatch.setattr(native_layers.Layers, "decode_layers", broken_all)


# -- float64 references ------------------------------------------------------------------------
def _rms(x, w, eps):
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def ref_layer_in(x, norm, eps, w_qkv, bias, H, Hkv, cos, sin):
    S, D = x.shape[0], cos.shape[1]
    qkv = _rms(x, norm, eps) @ w_qkv.double()
    if bias is not None:
        qkv = qkv + bias.double()
    qk = _rotate(qkv[:, : (H + Hkv) * D].reshape(S, H + Hkv, D).transpose(0, 1), cos.double(), sin.double())
    return qk[:H], qk[H:], qkv[:, (H + Hkv) * D :].reshape(S, Hkv, D).transpose(0, 1)


def ref_layer_out(x, attn, w_o, norm, eps, w_gate_up, w_down):
    S = x.shape[0]
    x = x.double() + attn.double().transpose(0, 1).reshape(S, -1) @ w_o.double()
    gate, up = (_rms(x, norm, eps) @ w_gate_up.double()).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ w_down.double()


def _weights(E, N, g, padded):
    w = torch.randn(N, E, generator=g) / E**0.5  # [out, in], as a checkpoint stores it
    return _transposed(w) if padded else w.t().contiguous()


def _close(a, b, tol=2e-5):
    return (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


SHAPES = [  # (S, E, H, Hkv, D, I, bias, padded)
    (1, 256, 4, 4, 64, 768, False, True), (7, 256, 4, 4, 64, 768, False, True), (16, 256, 4, 4, 64, 768, True, True),
    (3, 128, 2, 2, 64, 256, False, False), (2, 64, 4, 2, 16, 96, True, True), (5, 40, 2, 1, 20, 52, True, False),
    (1, 96, 6, 2, 16, 40, False, True), (13, 48, 3, 3, 16, 80, True, True),
]


@pytest.mark.parametrize("S,E,H,Hkv,D,I,bias,padded", SHAPES, ids=[f"s{s[0]}-e{s[1]}-h{s[2]}-{s[3]}-d{s[4]}-i{s[5]}"
                                                                    for s in SHAPES])
def test_layers_match_float64_reference(layers, S, E, H, Hkv, D, I, bias, padded):
    g = torch.Generator().manual_seed(S * 131 + E)
    x = torch.randn(S, E, generator=g)
    norm1, norm2 = 1 + 0.1 * torch.randn(E, generator=g), 1 + 0.1 * torch.randn(E, generator=g)
    N = (H + 2 * Hkv) * D
    w_qkv = _weights(E, N, g, padded)
    b = torch.randn(N, generator=g) if bias else None
    angles = torch.arange(S)[:, None] * 0.37 + torch.rand(D // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    q, k, v = layers.layer_in(x, norm1, 1e-5, w_qkv, b, H, Hkv, cos, sin)
    for got, want in zip((q, k, v), ref_layer_in(x, norm1, 1e-5, w_qkv, b, H, Hkv, cos, sin)):
        assert got.shape == want.shape and _close(got, want)

    attn = torch.randn(H, S, D, generator=g)
    w_o, w_gu, w_down = _weights(H * D, E, g, padded), _weights(E, 2 * I, g, padded), _weights(I, E, g, padded)
    out = x.clone()
    layers.layer_out(out, attn, w_o, norm2, 1e-6, w_gu, w_down)
    assert _close(out, ref_layer_out(x, attn, w_o, norm2, 1e-6, w_gu, w_down))

    lm_head = torch.randn(300, E, generator=g)
    logits = layers.logits(x, norm1, 1e-5, lm_head)
    assert logits.shape == (S, 300) and _close(logits, _rms(x, norm1, 1e-5) @ lm_head.double().t())


def test_negative_control_swapped_gate_and_up_is_caught(layers):
    g = torch.Generator().manual_seed(3)
    S, E, H, D, I = 4, 64, 2, 32, 96
    x, attn, norm = torch.randn(S, E, generator=g), torch.randn(H, S, D, generator=g), torch.ones(E)
    w_o, w_gu, w_down = _weights(H * D, E, g, True), _weights(E, 2 * I, g, True), _weights(I, E, g, True)
    out = x.clone()
    layers.layer_out(out, attn, w_o, norm, 1e-6, _swap_halves(w_gu), w_down)
    assert not _close(out, ref_layer_out(x, attn, w_o, norm, 1e-6, w_gu, w_down), tol=1e-3)


# -- through the model -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("retrieval", True)])
def test_greedy_matches_hf_through_native_layers(counted, kind, mode, lookup):
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, lookup=lookup))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert counted and (mode == "autoregressive" or max(counted) > 1)  # verifications included


@pytest.mark.parametrize("kind", TARGETS)
def test_a_verification_row_equals_the_step_it_stands_for(monkeypatch, counted, kind):
    """Seven new tokens in one forward give, row by row, the logits of seven one-token steps,
    bit for bit: the layers and the few-row attention (forced at this short length) sum in one
    order whatever the rows beside. (The sliding-window model's short window keeps PyTorch's
    attention, whose order does depend on the rows: it is left out.)"""
    import triforce_core.models.native_attention as native_attention

    if kind == "mistral_window":
        pytest.skip("a window cut keeps PyTorch's attention")
    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)
    _, t, _, ids, _, _ = hf_greedy(kind)
    assert_verification_rows_equal_steps(t, ids)
    assert 7 in counted and 1 in counted


@pytest.mark.parametrize("past", [40, 1100], ids=["short-cache", "long-cache"])
def test_a_lookup_run_on_four_query_heads_per_kv_head_equals_its_steps(monkeypatch, past):
    """A 16-token lookup run and its bonus row on a model with 4 query heads per KV head (Llama 3's
    shape) is 68 query rows: they must take the same attention path as a step, or the run's
    logits are not the steps' and speculation is not lossless against autoregressive decoding.
    Short and long caches (the per-layer kernel's threshold is 1,024 keys). Negative control:
    with the native rows capped at 51, as before, the run leaves the step's path and differs."""
    import triforce_core.models.attention as attention
    import triforce_core.models.transformer as transformer

    model = to_ours(make_hf("llama_gqa_llama3", seed=5, num_attention_heads=8, num_key_value_heads=2))
    assert model.spec.num_heads // model.spec.num_kv_heads == 4
    ids = [(7 * i) % 29 + 3 for i in range(past)]
    assert_verification_rows_equal_steps(model, ids, rows=17)
    for module in (attention, transformer):
        monkeypatch.setattr(module, "NATIVE_QUERY_ROWS", 51)
    with pytest.raises(AssertionError, match="differ from steps"):
        assert_verification_rows_equal_steps(model, ids, rows=17)


def test_negative_control_swapped_layers_break_greedy_equality(swapped):
    _, t, d, ids, ref, gaps = hf_greedy("llama_gqa_llama3")
    res = TriForceEngine(t, d).run(ids, greedy_config("autoregressive", 2, 6))
    assert res.token_ids != ref


def test_sampling_through_native_layers_is_exact(counted):
    p = chi2_pvalue(sample_counts("triforce", 1.0), exact_joint(1.0))
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    assert max(counted) > 1


def test_negative_control_swapped_layers_fail_the_chi_square(swapped):
    p = chi2_pvalue(sample_counts("triforce", 1.0), exact_joint(1.0))
    assert p < 1e-3, f"the swapped layers were not detected (p = {p:.2e})"


def _forwards(model, news, kv_dtype, one_call: bool, prompt: int = 1100, length=None):
    """Logits of each forward of `news` after a `prompt`-token prefill, and the cache after them.
    `length`: what the one-call forward is told is cached (the negative control)."""
    from triforce_core.kv import FullCache

    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, prompt + 64, kv_dtype, torch.device("cpu"))
    ids = torch.randint(3, model.vocab_size, (prompt,), generator=torch.Generator().manual_seed(5))
    model.forward(ids, torch.arange(prompt), cache, logits_rows=None)
    model.one_call = one_call
    out = []
    try:
        for i, new in enumerate(news):
            pos = torch.arange(cache.length, cache.length + len(new))
            if length is not None:
                cache.length += length
            if i % 2:  # every other forward as the target's verification with a retrieval level runs
                mass = KeyMass(chunk=8)
                f = model.forward(new, pos, cache, capture_queries=True, key_mass=mass)
                out += [f.logits, f.queries, *mass.layers]
            else:
                out.append(model.forward(new, pos, cache).logits)
            cache.length -= length or 0
    finally:
        del model.one_call  # the class's default again
    n = cache.length
    return out, cache.k[:, :, :n].float(), cache.v[:, :, :n].float()


ONE_CALL_MODELS = [k for k in TARGETS if k != "mistral_window"] + ["gguf_k_mix", "gguf_q5_mix"]


@pytest.mark.parametrize("kind", ONE_CALL_MODELS)
def test_one_call_forward_equals_the_per_layer_forward_bit_for_bit(counted, kind, tmp_path_factory):
    """Every layer in one native call (`decode_layers`) gives the per-layer path's logits and
    cache, bit for bit, and the queries and per-chunk attention a retrieval level reads: steps
    and verifications of 1, 3 and 7 rows over 1,100 cached keys (where the per-layer path takes
    the native attention too), float32, float16 and bfloat16 K/V, GQA and multi-head, q/k/v
    bias (qwen2), and GGUF files mixing the stored types as Q4_K_M does (and of the 5-bit
    32-weight types, q/k Q5_0 stacked with v Q8_0)."""
    if kind in ("gguf_k_mix", "gguf_q5_mix"):
        from tests.helpers.gguf_files import K_MIX, LLAMA, Q5_MIX, write_gguf

        from tests.helpers.models import make_hf
        from triforce_core.models.loading import load_model

        path = write_gguf(make_hf("llama_mha", seed=0, **LLAMA), tmp_path_factory.mktemp("one-call") / "t.gguf",
                          K_MIX if kind == "gguf_k_mix" else Q5_MIX)
        model = load_model(str(path), torch.device("cpu"), torch.float32).model
        assert model.quantized
    else:
        model = hf_greedy(kind)[1]
    g = torch.Generator().manual_seed(9)
    news = [torch.randint(3, model.vocab_size, (n,), generator=g) for n in (1, 7, 3, 1)]
    for kv_dtype in (torch.float32, torch.float16, torch.bfloat16):
        counted.clear()
        one = _forwards(model, news, kv_dtype, True)
        assert counted == [1, 7, 3, 1], "the one-call path did not run"
        per_layer = _forwards(model, news, kv_dtype, False)
        assert len(one[0]) == len(per_layer[0]) == 2 + 2 * (2 + model.spec.num_layers)
        for a, b in zip(one[0], per_layer[0]):
            assert torch.equal(a, b), kv_dtype
        assert torch.equal(one[1], per_layer[1]) and torch.equal(one[2], per_layer[2]), kv_dtype


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "llama_mha"])
def test_a_16_token_lookup_run_and_its_bonus_row_stay_native(monkeypatch, kind):
    """The default's longest lookup run (16 tokens) and its bonus row: 17 rows, one native call
    (past `ROWS` a forward would take PyTorch's products, which dequantize a GGUF model's every
    matrix), equal to the per-layer path bit for bit."""
    calls = []
    original = native_layers.Layers.decode_layers

    def counting(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(native_layers.Layers, "decode_layers", counting)
    assert native_layers.ROWS >= 17
    model = hf_greedy(kind)[1]
    news = [torch.arange(3, 20)]
    one = _forwards(model, news, torch.float32, True)
    assert calls == [17]
    per_layer = _forwards(model, news, torch.float32, False)
    assert torch.equal(one[0][0], per_layer[0][0]) and torch.equal(one[1], per_layer[1])


def test_negative_control_one_call_told_a_wrong_length_is_caught(counted):
    """The comparison above can fail: the one-call forward writing and reading one slot off
    (told one token more is cached) differs from the per-layer forward."""
    model = hf_greedy("llama_gqa_llama3")[1]
    news = [torch.tensor([5, 6, 7])]
    wrong = _forwards(model, news, torch.float32, True, length=1)
    right = _forwards(model, news, torch.float32, False)
    assert not torch.equal(wrong[0][0], right[0][0])


def test_an_arithmetic_without_them_keeps_pytorch_and_prefill_keeps_pytorch(monkeypatch, counted):
    """A model whose `Arithmetic.native_layers` is off (the benchmarks' comparison) never calls
    them, and gives the same greedy answer; an environment variable turns nothing off."""
    _, t, d, ids, ref, gaps = hf_greedy("llama_mha")
    monkeypatch.setenv("TRIFORCE_NATIVE_LAYERS", "0")
    engine = TriForceEngine(t, d)
    for m in (t, d):
        m.arithmetic = dataclasses.replace(m.arithmetic, native_layers=False)
    res = engine.run(ids, greedy_config("autoregressive", 2, 6))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert counted == []
    TriForceEngine(t, d).run(ids, greedy_config("autoregressive", 2, 6))  # an engine gives them the default again
    assert counted and max(counted) <= native_layers.ROWS  # the prompt's prefill is not theirs


def test_build_is_cached_and_leaves_nothing_else(tmp_path):
    first = build(native_layers.SOURCE, native_layers.LAYER_FLAGS, tmp_path)
    assert build(native_layers.SOURCE, native_layers.LAYER_FLAGS, tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    out = native_layers.Layers(first, threads=1).logits(torch.ones(1, 4), torch.ones(4), 0.0, torch.eye(4))
    assert torch.allclose(out, torch.ones(1, 4))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 levels")
@pytest.mark.parametrize("level", ["x86-64", "x86-64-v3"])
def test_the_library_builds_and_runs_for_older_x86_machines(tmp_path, level):
    """-march=native on a machine without AVX-512 (x86-64-v3: AVX2) or without AVX2 (x86-64)
    compiles the vector paths only through their target attributes: every intrinsic a path uses
    must be in its attribute (a path once used an AVX512-DQ one outside it, and a define the
    integer products need sat inside the AVX2 block: neither built there)."""
    flags = tuple(f"-march={level}" if f == "-march=native" else f for f in native_layers.LAYER_FLAGS)
    assert flags != native_layers.LAYER_FLAGS
    lib = native_layers.Layers(build(native_layers.SOURCE, flags, tmp_path), threads=1)
    out = lib.logits(torch.ones(1, 4), torch.ones(4), 0.0, torch.eye(4))
    assert torch.allclose(out, torch.ones(1, 4))


# -- the mask ----------------------------------------------------------------------------------
def _mask_by_definition(S, T, key_start, window, G):
    """[G*S, T]: new query i (position key_start + T - S + i) sees key j (position key_start + j)
    when j <= T - S + i and, with a window, key_start + j > its position - window."""
    past = T - S
    vis = torch.zeros(S, T, dtype=torch.bool)
    for i, j in itertools.product(range(S), range(T)):
        vis[i, j] = j <= past + i and (window is None or j > past + i - window)
    return vis.repeat(G, 1)


@pytest.mark.parametrize("S,T,window,G", [(s, t, w, g) for s, t, w, g in itertools.product(
    (1, 2, 5, 9), (9, 40), (None, 4, 16, 40), (1, 3)) if s <= t])
def test_attention_mask_equals_its_definition(S, T, window, G):
    want = _mask_by_definition(S, T, 3, window, G)
    mask = attention_mask(S, T, 3, window, G, torch.device("cpu"))
    if mask is None:
        assert want.all()
        return
    assert torch.equal(mask.visible, want)
    assert not want[:, : mask.start].logical_not().any() and torch.equal(mask.hidden, ~want[:, mask.start :])
    if mask.firsts is not None:  # a window cut: every row sees a band of keys, [first, limit)
        band = [(want[r].nonzero().min().item(), want[r].nonzero().max().item() + 1) for r in range(want.shape[0])]
        assert [(int(a), int(b)) for a, b in zip(mask.firsts, mask.limits)] == band
        assert all(want[r, a:b].all() for r, (a, b) in enumerate(band))
    elif mask.limits is not None:  # every row sees a prefix: its length
        assert torch.equal(mask.limits, want.sum(1)) and all(want[r, : int(n)].all() for r, n in enumerate(mask.limits))
    if mask.new_bias is not None:
        assert torch.equal(mask.new_bias == 0, want[:, T - S :])


# -- the GPU's few-row path, run here with the CPU's flash kernel in the CUDA kernel's place --------
def _cpu_flash(q, k, v, scale):
    """The CPU flash kernel called as `cuda_few_rows` calls CUDA's: (output, log-sum-exp)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)


@pytest.mark.parametrize("S,T,G", [(1, 50, 4), (7, 50, 4), (7, 7, 3), (17, 300, 1), (2, 40, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_few_rows_equals_attention_by_definition(S, T, G, dtype):
    """The cached keys through the flash kernel, the new ones through products, merged by
    log-sum-exps: the masked softmax of the definition (float64), to the dtype's rounding."""
    from triforce_core.models.attention import cuda_few_rows

    g = torch.Generator().manual_seed(S * 100 + T)
    Hkv, D = 2, 64
    q = torch.randn(Hkv, G * S, D, generator=g).to(dtype)
    k = torch.randn(Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(Hkv, T, D, generator=g).to(dtype)
    scale = D**-0.5
    mask = attention_mask(S, T, 0, None, G, torch.device("cpu"))
    got = cuda_few_rows(q, k, v, mask, scale, flash=_cpu_flash)
    assert got.dtype == dtype and got.shape == q.shape
    scores = (q.double() @ k.double().transpose(1, 2)) * scale
    visible = _mask_by_definition(S, T, 0, None, G)
    want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.double()
    err = (got.double() - want).norm() / want.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    # a negative control: the merge with the new keys' weights left out is far off
    if T > S:  # (the CPU kernel fails on zero keys)
        broken = _cpu_flash(q[None], k[None, :, : T - S], v[None, :, : T - S], scale)[0][0]
        assert (broken.double() - want).norm() / want.norm() > 1e-2
