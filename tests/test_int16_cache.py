"""The int16 K/V cache (`kv.int16`, `--kv-dtype int16`): exact against our own decoding over it.

- The kernel's writer and reader equal `int16_kv`'s PyTorch reference bit for bit (planes,
  steps, widened tokens); a span (the disk cache's unit) reads back whole and depends on its
  tokens only.
- The cache grows, truncates, widens its chunk means and feeds the retrieval level as a float
  cache of the same values does.
- A verification's rows equal the steps they stand for bit for bit (one native call for every
  layer, and a layer at a time), and greedy output of every mode equals our autoregressive
  decoding over the int16 cache, with no tie tolerated; a negative control (a step writing its
  key off the grid) breaks that equality.
- The disk cache keeps an int16 prefill and reads it back bit for bit; refusals in one line.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tests.helpers.cli import run_main
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.models import CPU, DRAFT_OVERRIDES, make_hf, perturbed, to_ours
from tests.helpers.native import built, needs_compiler
from tests.helpers.disk_cache import CHUNK, block_files, config as disk_config, document_end, new_engine, two_turns
from tests.helpers.sampling import chi2_pvalue, first_two_counts

import triforce_core.models.native_attention as native_attention
from triforce_core import CacheConfig, ConfigError, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import PAPER_METHOD
from triforce_core.kv import INT16, FullCache, Int16Cache, RetrievalCache, new_full_cache, resolve_kv_dtype
from triforce_core.models import int16_kv, native_layers

pytestmark = needs_compiler
# Head size 64, the integer kernel's smallest: 4 query heads over 2 KV heads of 64.
WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROMPT = torch.randint(3, 97, (300,), generator=torch.Generator().manual_seed(7)).tolist()
CACHE = CacheConfig(budget=128, chunk_size=8, recent_tokens=32, draft_sinks=4, draft_window=32, refresh_every=16,
                    kv_dtype="int16")


@pytest.fixture(scope="module")
def kernel():
    return built(native_attention)


@functools.lru_cache(maxsize=None)
def _pair():
    return to_ours(make_hf("llama_gqa_llama3", seed=0, **WIDE)), to_ours(make_hf("llama_gqa_llama3", seed=11,
                                                                                **DRAFT_OVERRIDES))


def _kv(H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(H, T, D, generator=g) * 3, torch.randn(H, T, D, generator=g)
    k[1, 5] = 0  # a zero vector: step 0
    k[0, 7, 3] = 1e30  # one huge element: the rest round to 0
    return k, v


# -- the kernel's writer and reader ---------------------------------------------------------------
@pytest.mark.parametrize("D", [64, 128])
def test_the_kernels_writes_and_reads_equal_the_reference_bit_for_bit(kernel, D):
    H, T = 3, 200
    k, v = _kv(H, T, D, seed=D)
    ref = int16_kv.pack(k, v, 256)
    heads = int16_kv.empty(H, 256, D)
    kernel.integer_write(heads, k[:, :100], v[:, :100], 0)  # in two writes, as a prefill then steps
    kernel.integer_write(heads, k[:, 100:], v[:, 100:], 100)
    for got, want in ((heads.k, ref.k), (heads.v, ref.v), (heads.sk, ref.sk), (heads.sv, ref.sv)):
        assert torch.equal(got, want)
    views = int16_kv.empty(H, 256, D)  # [T, H, D] tensors seen as [H, T, D], as a prefill's are: no copy
    kernel.integer_write(views, k.transpose(0, 1).contiguous().transpose(0, 1),
                         v.transpose(0, 1).contiguous().transpose(0, 1), 0)
    assert all(torch.equal(a, b) for a, b in ((views.k, ref.k), (views.v, ref.v), (views.sk, ref.sk), (views.sv, ref.sv)))
    index = torch.randint(0, T, (H, 50), generator=torch.Generator().manual_seed(1))
    kw, vw = kernel.integer_tokens(heads, index)
    dk, dv = int16_kv.dequantized(k, v)
    at = index[..., None].expand(-1, -1, D)
    assert torch.equal(kw, dk.gather(1, at)) and torch.equal(vw, dv.gather(1, at))


def test_the_writer_and_reader_refuse_what_they_cannot_hold(kernel):
    heads = int16_kv.empty(2, 64, 64)
    k = torch.zeros(2, 10, 64)
    with pytest.raises(ValueError, match="do not follow"):
        kernel.integer_write(heads, k, k, 5)  # a gap after the 0 tokens held
    with pytest.raises(ValueError, match="do not follow"):
        kernel.integer_write(heads, torch.zeros(2, 65, 64), torch.zeros(2, 65, 64), 0)  # past the capacity
    with pytest.raises(ValueError, match="heads of 64"):
        kernel.integer_write(heads, torch.zeros(3, 1, 64), torch.zeros(3, 1, 64), 0)
    kernel.integer_write(heads, k, k, 0)
    with pytest.raises(ValueError, match="outside the 10 cached"):
        kernel.integer_tokens(heads, torch.tensor([[0, 10], [1, 2]]))
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernel.integer_tokens(int16_kv.Int16Heads(heads.k[:, :100], heads.v, heads.sk, heads.sv, 64, 10),
                              torch.zeros(2, 1, dtype=torch.long))


# -- the cache ------------------------------------------------------------------------------------
def test_the_cache_grows_reads_and_gives_spans_back_whole(kernel):
    L, H, D, T = 2, 2, 64, 150
    cache = Int16Cache(L, H, D, 100)
    assert cache.capacity == 128 and cache.dtype == INT16  # whole groups of 64 tokens
    ks, vs = zip(*(_kv(H, T, D, seed=layer) for layer in range(L)))
    for layer in range(L):
        cache.write(layer, 0, ks[layer][:, :90], vs[layer][:, :90])
    cache.advance(90)
    cache.grow(300)  # between generations: the cached tokens move over
    assert cache.capacity == 320
    for layer in range(L):
        cache.write(layer, 90, ks[layer][:, 90:], vs[layer][:, 90:])
    cache.advance(T - 90)
    for layer in range(L):
        dk, dv = int16_kv.dequantized(ks[layer], vs[layer])
        assert torch.equal(cache.keys(layer, 0, T), dk)
        k, v = cache.gather(layer, torch.arange(T).expand(H, T))
        assert torch.equal(k, dk) and torch.equal(v, dv)
    # chunk means: those of the widened keys, a layer at a time
    means = cache.chunk_means(8, 10)
    want = torch.stack([int16_kv.dequantized(ks[layer], vs[layer])[0][:, :80].reshape(H, 10, 8, D).mean(2)
                        for layer in range(L)])
    assert torch.equal(means, want)
    # a span from a multiple of 16 to a token inside a group: whole, and its bytes its tokens' only
    span = cache.span(32, 141)
    assert span.numel() == cache.span_nbytes(141 - 32)
    other = Int16Cache(L, H, D, 200)
    for layer in range(L):
        other.write(layer, 0, ks[layer][:, :32], vs[layer][:, :32])
    other.advance(32)
    other.put_span(32, 141, span)
    other.length = 141
    for layer in range(L):
        assert torch.equal(other.keys(layer, 0, 141), cache.keys(layer, 0, 141))
    cache.truncate(141)  # what lies past token 141 of its group differs; the span does not
    for layer in range(L):
        cache.write(layer, 141, torch.randn(H, 9, D), torch.randn(H, 9, D))
    assert torch.equal(cache.span(32, 141), span)
    with pytest.raises(ValueError, match="multiple of 16"):
        cache.span(8, 40)
    with pytest.raises(ValueError, match="takes"):
        other.put_span(32, 141, span[:-1])


def test_the_retrieval_level_holds_the_int16_tokens_widened_to_float16(kernel):
    L, H, D, T = 2, 2, 64, 256
    full = Int16Cache(L, H, D, T)
    wide = FullCache(L, H, D, T, torch.float32, CPU)
    for layer in range(L):
        k, v = _kv(H, T, D, seed=layer)
        full.write(layer, 0, k, v)
        wide.write(layer, 0, *int16_kv.dequantized(k, v))
    full.advance(T)
    wide.advance(T)
    q = torch.randn(L, 2 * H, D, generator=torch.Generator().manual_seed(3))
    picked = []
    for source in (full, wide):
        level = RetrievalCache(source, budget=64, chunk_size=8, recent=16, room=16)
        selection = level.select(q, T)
        level.append_from_full(T - 4, T)
        picked.append((level, selection))
    (a, sa), (b, sb) = picked
    assert a.dtype == torch.float16 and torch.equal(sa.chunk_ids, sb.chunk_ids)
    assert a.length == b.length
    assert torch.equal(a.k[:, :, : a.length], b.k[:, :, : b.length].half())
    assert torch.equal(a.v[:, :, : a.length], b.v[:, :, : b.length].half())


def test_int16_is_resolved_and_refused_where_it_cannot_run(kernel):
    assert resolve_kv_dtype("int16", torch.float32, "cpu") == INT16
    # the default for a GGUF file with heads of 128 or more where the kernel's vector paths run
    vector = bool({"vnni", "tiles"} & set(kernel.integer_paths()))
    assert resolve_kv_dtype(None, torch.float32, "cpu", quantized=True, head_dim=128) == (INT16 if vector else torch.float16)
    assert resolve_kv_dtype(None, torch.float32, "cpu", quantized=True, head_dim=64) == torch.float16
    assert resolve_kv_dtype(None, torch.float32, "cpu", quantized=True, head_dim=128, chunk_size=12) == torch.float16
    assert resolve_kv_dtype(None, torch.float32, "cpu", quantized=False, head_dim=128) == torch.float32
    assert resolve_kv_dtype("float16", torch.float32, "cpu", quantized=True, head_dim=128) == torch.float16
    with pytest.raises(ConfigError, match="float32 model on the CPU"):
        resolve_kv_dtype("int16", torch.bfloat16, "cpu")
    with pytest.raises(ConfigError, match="exact"):
        TriForceEngine(_pair()[0], kv_dtype="int16", exact=True)
    t, d = to_ours(make_hf("llama_gqa_llama3", seed=0)), None  # head size 16
    cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=2), cache=CACHE)
    with pytest.raises(ConfigError, match="multiple of 64"):
        TriForceEngine(t).run(PROMPT[:20], cfg)
    odd = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=2),
                           cache=CacheConfig(kv_dtype="int16", chunk_size=12))
    with pytest.raises(ConfigError, match="divides 256"):
        TriForceEngine(_pair()[0]).run(PROMPT[:20], odd)


# -- exactness --------------------------------------------------------------------------------------
def greedy_reference(model, prompt: list[int], new: int) -> list[int]:
    """Our autoregressive greedy decoding over an int16 cache, written out."""
    s = model.spec
    cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, len(prompt) + new, INT16, CPU)
    model.forward(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), cache, logits_rows=None)
    out, last = [], prompt[-1]
    for _ in range(new):
        last = int(model.forward(torch.tensor([last]), torch.tensor([cache.length]), cache).logits[0].argmax())
        out.append(last)
    return out


def _config(mode: str, lookup: bool = False) -> GenerationConfig:
    spec = {"lookup": True, "lookup_max": 16} if lookup else PAPER_METHOD
    return GenerationConfig(speculation=SpeculationConfig(mode=mode, gamma1=2, gamma2=6, max_new_tokens=40,
                                                          ignore_eos=True, **spec), cache=CACHE)


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "layer-by-layer"])
def test_a_verifications_rows_equal_steps_bit_for_bit(kernel, one_call, monkeypatch):
    t, _ = _pair()
    monkeypatch.setattr(t, "one_call", one_call)
    for rows in (7, 17):  # a verification; a 16-token lookup run and its bonus row (68 query rows: the tiles)
        assert_verification_rows_equal_steps(t, PROMPT, INT16, rows)


def test_one_call_and_layer_by_layer_forwards_give_the_same_logits(kernel, monkeypatch):
    t, _ = _pair()
    got = []
    for one_call in (True, False):
        monkeypatch.setattr(t, "one_call", one_call)
        s = t.spec
        cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, 400, INT16, CPU)
        t.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, logits_rows=None)
        got.append(t.forward(torch.tensor(PROMPT[:5]), torch.arange(300, 305), cache).logits)
    assert torch.equal(got[0], got[1])


def test_a_cache_described_once_is_checked_again_when_another_comes(kernel):
    """decode_layers keeps the last int16 cache's description while that cache stands (no views
    of it a step); other memory or other sizes are checked again, and a mis-sized one refused."""
    t, _ = _pair()
    s = t.spec
    L, Hkv, D = s.num_layers, s.num_kv_heads, s.head_dim
    describe = native_layers.Layers._int16_planes
    cache = new_full_cache(L, Hkv, D, 128, INT16, CPU)
    k, v, (sk, sv) = cache.native_storage
    first = describe(k, v, (sk, sv), L, Hkv, D, 4, kernel)
    assert describe(k, v, (sk, sv), L, Hkv, D, 4, kernel)[0] is first[0]
    with pytest.raises(ValueError, match="int16 planes"):
        describe(k, v, (sk[:, :, :-1], sv), L, Hkv, D, 4, kernel)
    other = new_full_cache(L, Hkv, D, 256, INT16, CPU)
    k2, v2, steps2 = other.native_storage
    second = describe(k2, v2, steps2, L, Hkv, D, 4, kernel)
    assert second[0] is not first[0] and second[0].k == k2.data_ptr() and second[1] >= 256


MODES = [("autoregressive", False), ("triforce", False), ("retrieval", False), ("draft", False), ("lookup", True),
         ("triforce", True)]


def test_greedy_every_mode_equals_autoregressive_over_the_int16_cache(kernel):
    t, d = _pair()
    ref = greedy_reference(t, PROMPT, 40)
    engine = TriForceEngine(t, d)
    for mode, lookup in MODES:
        res = engine.run(PROMPT, _config(mode, lookup))
        assert res.token_ids == ref, (mode, lookup)
        if mode != "autoregressive" and not lookup:
            assert res.stats.acceptance["target"] < 0.9  # proposals really were rejected


def test_negative_control_a_step_off_the_grid_breaks_equality(kernel, monkeypatch):
    """The same comparison with steps whose new key's first element is written a little off
    (a layer at a time, where the cache's own `write` runs): a verification's rows then differ
    from them, and the comparison sees it."""
    t, _ = _pair()
    monkeypatch.setattr(t, "one_call", False)
    write = Int16Cache.write

    def off_grid(self, layer, start, k, v):
        if k.shape[1] == 1:  # a step's token
            k = k.clone()
            k[:, :, 0] += 1e-2 * k.abs().amax()
        write(self, layer, start, k, v)

    monkeypatch.setattr(Int16Cache, "write", off_grid)
    with pytest.raises(AssertionError, match="differ from steps"):
        assert_verification_rows_equal_steps(t, PROMPT, INT16, 7)


# -- sampling ------------------------------------------------------------------------------------------
CHI = dict(vocab_size=16, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
           initializer_range=0.5, bos_token_id=None, eos_token_id=None)


@functools.lru_cache(maxsize=None)
def _chi_setup():
    target = to_ours(make_hf("llama_gqa_llama3", seed=21, **CHI))
    prompt = torch.randint(0, 16, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    # the exact law of the first two tokens, decoding over an int16 cache: [V, V]
    s, n = target.spec, len(prompt)
    cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, n + 2, INT16, CPU)
    p1 = target.forward(torch.tensor(prompt), torch.arange(n), cache, logits_rows=slice(-1, None)).logits[0]
    p1 = p1.double().softmax(-1)
    p2 = torch.empty(16, 16, dtype=torch.float64)
    for x in range(16):
        cache.truncate(n)
        p2[x] = target.forward(torch.tensor([x]), torch.tensor([n]), cache).logits[0].double().softmax(-1)
    joint = (p1[:, None] * p2).numpy()
    return target, prompt, joint / joint.sum()


def _chi_counts(mode: str, lookup: bool):
    target, prompt, _ = _chi_setup()
    spec = {"lookup_min_match": 1, "lookup_row_cost": 0.0} if lookup else {k: v for k, v in PAPER_METHOD.items()
                                                                         if k != "lookup"}
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode=mode, gamma1=2, gamma2=2, max_new_tokens=2, ignore_eos=True, lookup=lookup,
                                      **spec),
        cache=CacheConfig(budget=16, chunk_size=4, recent_tokens=4, refresh_every=0, kv_dtype="int16"))
    return first_two_counts(TriForceEngine(target), prompt, cfg, 3000)


@pytest.mark.parametrize("mode,lookup", [("retrieval", False), ("lookup", True)])
def test_sampling_over_an_int16_cache_follows_the_targets_law(kernel, mode, lookup):
    p = chi2_pvalue(_chi_counts(mode, lookup), _chi_setup()[2])
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_a_broken_verifier_fails_the_same_test(kernel, monkeypatch):
    from tests.helpers.sampling import break_verifier

    break_verifier(monkeypatch)
    p = chi2_pvalue(_chi_counts("retrieval", False), _chi_setup()[2])
    assert p < 1e-3, f"chi-square p = {p:.2e}: the test has no power here"


# -- the disk cache and the command line ---------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_weights():
    hf = make_hf("llama_gqa_llama3", seed=0, **WIDE)
    return hf, perturbed(hf, 0.02)


def test_disk_cache_keeps_an_int16_prefill_and_reads_it_back_bit_for_bit(wide_weights, tmp_path):
    base = disk_config("triforce")
    cfg = GenerationConfig(sampling=base.sampling, speculation=base.speculation,
                           cache=CacheConfig(**{**base.cache.__dict__, "kv_dtype": "int16"}))
    reference, _, _ = two_turns(new_engine(wide_weights), cfg)
    written, stats, _ = two_turns(new_engine(wide_weights, tmp_path), cfg)
    assert written == reference and stats[0].disk_tokens == 0
    files = block_files(tmp_path)
    end = document_end(new_engine(wide_weights), cfg)
    assert len(files) == end // CHUNK + 1  # the whole blocks and the document's tail
    assert all(b'"dtype": "int16"' in p.read_bytes() for p in files)
    read, stats, session = two_turns(new_engine(wide_weights, tmp_path), cfg)
    assert read == reference and stats[0].disk_tokens == end
    assert isinstance(session._slot.loop.full.cache, Int16Cache)


def test_command_line_takes_int16_and_refuses_it_with_exact(tmp_path):
    from tests.helpers.models import make_tokenizer, save_checkpoint

    folder = save_checkpoint(tmp_path / "wide", make_hf("llama_gqa_llama3", seed=0, **WIDE), make_tokenizer())
    code, out, err = run_main(["generate", "--target", folder, "--prompt", "w5 w6 w7", "--max-new-tokens", "4",
                               "--kv-dtype", "int16", "--mode", "autoregressive", "--temperature", "0"])
    assert code == 0 and out.strip(), err
    code, _, err = run_main(["generate", "--target", folder, "--prompt", "w5", "--kv-dtype", "int16", "--exact"])
    assert code == 2 and "--exact" in err
