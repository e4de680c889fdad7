"""Gemma 3's text decoder in the one forward: four norms a layer (sandwich) whose weights w are
applied as 1 + w, q/k norms, GeGLU, the embedding scaled by the width's square root, a query
scale of its own, and sliding-window layers (a window far shorter than the prompts) with a
rotary base apart from the full layers'.

- A tiny random Gemma 3 (two local layers of window 24, then a full one; random norm weights)
  gives Hugging Face's greedy answer in every mode, and its logits (a prefill, a step, a
  verification, past the window) are Hugging Face's to float32 rounding; sampling from the
  three levels follows its law (chi-square).
- The native layer after attention applies the sandwich's norms and GeGLU as the float64
  reference does (negative controls: the two output norms exchanged, silu for GELU).
- The retrieval level: a local layer's slots, once a selection is sparse, hold the positions
  just before the new tokens, so its window is applied exactly (its output equals the full
  cache's); the full layers alone choose chunks, and the counts are theirs.
- A Gemma 3 GGUF file written by the tests' own writer (norms stored as 1 + w, as llama.cpp's
  converter writes them) loads and equals Hugging Face's reading of the same file.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.forwards import chunk_logits
from tests.helpers.gguf_files import file_pair, write_gguf
from tests.helpers.greedy import NEW, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.models import CPU, make_hf, to_ours
from tests.helpers.native import built, needs_compiler

import triforce_core.models.gguf_file as gguf_file
import triforce_core.models.native_layers as native_layers
from triforce_core import TriForceEngine
from triforce_core.kv import FullCache
from triforce_core.kv.retrieval import RetrievalCache
from triforce_core.models.loading import ModelLoadError, load_model
from triforce_core.models.spec import ModelSpec, UnsupportedModelError

KIND = "gemma3"


def test_the_spec_reads_what_gemma_3_adds():
    hf, t, *_ = hf_greedy(KIND)
    s = t.spec
    assert s.model_type == "gemma3_text" and s.qk_norm and s.sandwich and s.norm_plus_one
    assert s.activation == "gelu_tanh" and s.embed_scale == 8.0 and s.query_scale == 20**-0.5
    assert s.sliding_windows == (24, 24, None)
    assert s.rope_layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    bases = [1 / r.inv_freq[1].item() ** (s.head_dim / 2) for r in t.layer_rotary]
    assert [round(b, -2) for b in bases] == [10_000, 10_000, 1_000_000]
    assert hf.config.tie_word_embeddings and t.lm_head.data_ptr() == t.embed.data_ptr()
    llama = ModelSpec.from_config(make_hf("llama_mha").config)
    assert not (llama.sandwich or llama.norm_plus_one) and llama.activation == "silu" and llama.embed_scale == 1.0


def test_soft_capping_is_refused():
    config = make_hf(KIND).config
    config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping is set"):
        ModelSpec.from_config(config)


def test_logits_equal_hugging_face_past_the_window():
    """A prefill of 100 (four windows), a one-token step and a seven-token verification."""
    hf, t, _, ids, _, _ = hf_greedy(KIND)
    chunks = [ids[:100], ids[100:101], ids[101:108]]
    with torch.no_grad():
        want = hf(torch.tensor([ids[:108]])).logits[0]
    got = torch.cat(chunk_logits(t, chunks))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_window_matters():
    """The negative control: the same weights with a window wider than the prompt (the same
    layer types and rotary bases) are not Hugging Face's."""
    from triforce_core.models.transformer import Transformer

    hf, _, _, ids, _, _ = hf_greedy(KIND)
    config = make_hf(KIND).config
    config.sliding_window = 1000
    wide = Transformer(config, hf.state_dict(), CPU, torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids[:100]])).logits[0]
    got = torch.cat(chunk_logits(wide, [ids[:100]]))
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("triforce", True),
                                         ("retrieval", False), ("draft", False), ("lookup", True)])
def test_greedy_equals_hugging_face_in_every_mode(mode, lookup):
    """A random draft (a one-layer Gemma 3) and a sparse retrieval cache: proposals are mostly
    rejected and rolled back."""
    _, t, d, ids, ref, gaps = hf_greedy(KIND)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, lookup=lookup, draft_confidence=0.0))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.new_tokens == NEW


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_greedy_equals_hugging_face_exactly(mode):
    _, t, d, ids, ref, gaps = hf_greedy(KIND)
    res = TriForceEngine(t, d, exact=True).run(ids, greedy_config(mode, 2, 6))
    assert_same_as_hf(res.token_ids, ref, gaps)


# -- the retrieval level's local layers ----------------------------------------------------------
def test_a_local_layer_sees_its_exact_window_in_a_sparse_selection():
    """After a sparse selection, the local layers' chosen chunks are the ones just before the
    recent tokens: a step's logits over the retrieval cache equal the full cache's in the local
    layers (checked by a model whose every layer is local), and the full layers alone count."""
    _, t, _, ids, _, _ = hf_greedy(KIND)
    s = t.spec
    n = 120
    full = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, n + 8, torch.float32, CPU)
    out = t.forward(torch.tensor(ids[:n]), torch.arange(n), full, capture_queries=True)
    rc = RetrievalCache(full, budget=48, chunk_size=4, recent=8, room=8, windows=s.sliding_windows)
    sel = rc.select(out.queries[:, -1], n)
    assert not sel.dense and sel.heads == 1 * s.num_kv_heads  # one full layer chooses
    assert sel.chunk_counts.max().item() <= sel.heads
    local = sel.chunk_ids[0]  # layer 0 is local: the chunks just before the recent tokens
    assert torch.equal(local, torch.arange(sel.recent_start // 4 - local.shape[1], sel.recent_start // 4).expand_as(local))
    assert rc.window_exact(24) and not rc.window_exact(None)
    # every layer local: the retrieval level is then the target itself
    config = make_hf(KIND).config
    config.layer_types = ["sliding_attention"] * 3
    from triforce_core.models.transformer import Transformer

    hf = hf_greedy(KIND)[0]
    local_model = Transformer(config, hf.state_dict(), CPU, torch.float32)
    full = FullCache(3, s.num_kv_heads, s.head_dim, n + 8, torch.float32, CPU)
    local_model.forward(torch.tensor(ids[:n]), torch.arange(n), full)
    rc = RetrievalCache(full, budget=48, chunk_size=4, recent=8, room=8, windows=local_model.spec.sliding_windows)
    rc.select(torch.zeros(3, s.num_heads, s.head_dim), n)
    step = torch.tensor(ids[n : n + 3])
    pos = torch.arange(n, n + 3)
    got = local_model.forward(step, pos, rc).logits
    want = local_model.forward(step, pos, full).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the negative control: without the windows, the same selection reads older keys
    blind = RetrievalCache(full, budget=48, chunk_size=4, recent=8, room=8)
    full.truncate(n)
    blind.select(torch.zeros(3, s.num_heads, s.head_dim), n)
    assert (local_model.forward(step, pos, blind).logits - want).abs().max() > 1e-3


# -- the native layer after attention ------------------------------------------------------------
def _reference_layer_out(x, attn, w_o, norm, eps, w_gu, w_down, post_attn, post_mlp):
    """float64: x + n1(o @ w_o); then + n2(GeGLU(n(x)))."""
    def rms(t, w):
        t = t.double()
        return w.double() * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    S = x.shape[0]
    o = attn.double().transpose(0, 1).reshape(S, -1) @ w_o.double()
    x = x.double() + rms(o, post_attn)
    g, u = (rms(x, norm) @ w_gu.double()).chunk(2, dim=-1)
    m = (torch.nn.functional.gelu(g, approximate="tanh") * u) @ w_down.double()
    return x + rms(m, post_mlp)


@needs_compiler
@pytest.mark.parametrize("S", [1, 7, 16])
def test_the_native_sandwich_and_geglu_equal_the_float64_reference(S):
    layers = built(native_layers)
    g = torch.Generator().manual_seed(S)
    E, H, D, I = 64, 4, 24, 96
    x, attn = torch.randn(S, E, generator=g), torch.randn(H, S, D, generator=g)
    w_o = torch.randn(H * D, E, generator=g) / (H * D) ** 0.5
    w_gu, w_down = torch.randn(E, 2 * I, generator=g) / E**0.5, torch.randn(I, E, generator=g) / I**0.5
    norm, n1, n2 = (1 + 0.5 * torch.randn(E, generator=g) for _ in range(3))
    want = _reference_layer_out(x, attn, w_o, norm, 1e-6, w_gu, w_down, n1, n2)
    got = x.clone()
    layers.layer_out(got, attn, w_o, norm, 1e-6, w_gu, w_down, 0, n1, n2, True)
    assert (got.double() - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    for wrong in (dict(post_attn_norm=n2, post_mlp_norm=n1, gelu=True), dict(post_attn_norm=n1, post_mlp_norm=n2, gelu=False)):
        bad = x.clone()
        layers.layer_out(bad, attn, w_o, norm, 1e-6, w_gu, w_down, 0, **wrong)
        assert (bad.double() - want).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match="the MLP output's norm"):
        layers.layer_out(x.clone(), attn, w_o, norm, 1e-6, w_gu, w_down, 0, n1, n2[:-1], True)


def test_sampling_follows_hugging_faces_law():
    """The first two sampled tokens of the three levels against the joint law Hugging Face's
    Gemma 3 gives them (chi-square over a 16-token vocabulary), the prompt past the window."""
    from tests.helpers.sampling import CACHE, PAPER, SMALL, chi2_pvalue, first_two_counts, first_two_law
    from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig

    settings = {**SMALL, "head_dim": 12, "sliding_window": 16}
    hf = make_hf(KIND, seed=21, **settings)
    draft = to_ours(make_hf(KIND, seed=22, **{**settings, "num_hidden_layers": 1}))
    prompt = torch.randint(0, 16, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=0),
                           speculation=SpeculationConfig(mode="triforce", gamma1=2, gamma2=2, max_new_tokens=2,
                                                         ignore_eos=True, lookup=False, **PAPER), cache=CACHE)
    counts = first_two_counts(TriForceEngine(to_ours(hf), draft), prompt, cfg, 3000)
    assert chi2_pvalue(counts, first_two_law(hf, prompt)) > 1e-3


# -- GGUF files ----------------------------------------------------------------------------------
# Six layers: a reader of a gemma3 file takes every sixth layer as the full one (llama.cpp and
# transformers alike), the others sliding.
GGUF_SETTINGS = dict(vocab_size=300, num_hidden_layers=6, sliding_window_pattern=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma3-gguf")


@functools.lru_cache(maxsize=None)
def _file(folder: Path):
    """A Gemma 3 target (Q8_0, the norms F32 as 1 + w) and a one-layer draft, ours of both,
    Hugging Face's model of the target file and its greedy answer."""
    return file_pair(folder, "gemma3", make_hf(KIND, seed=0, **GGUF_SETTINGS), make_hf(KIND, seed=5, **{**GGUF_SETTINGS, "num_hidden_layers": 1}), NEW)


@needs_compiler
def test_a_gguf_file_equals_hugging_faces_reading_of_it(folder):
    hf, t, _, ids, _, _ = _file(folder)
    s = t.model.spec
    assert t.model.quantized and s.sandwich and s.head_dim == 24 and s.sliding_windows == (24,) * 5 + (None,)
    assert gguf_file.refusal_of(folder / "gemma3-target.gguf") is None  # the picker offers it
    assert hf.config.model_type == "gemma3_text"
    with torch.no_grad():
        want = hf(torch.tensor([ids[:100]])).logits[0]
    got = torch.cat(chunk_logits(t.model, [ids[:90], ids[90:91], ids[91:98], ids[98:100]]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("triforce", True),
                                         ("retrieval", False), ("draft", False)])
def test_a_gguf_files_greedy_answer_is_hugging_faces_in_every_mode(folder, mode, lookup):
    _, t, d, ids, ref, gaps = _file(folder)
    got = TriForceEngine(t.model, d.model, exact=True).run(ids, greedy_config(mode, 2, 6, lookup=lookup)).token_ids
    assert_same_as_hf(got, ref, gaps)


def _one(target: str, how):
    return lambda name, a: how(name, a) if name == target else [(name, a)]


@needs_compiler
@pytest.mark.parametrize("edit,message", [
    (_one("blk.2.post_ffw_norm.weight", lambda n, a: []), r"blk\.2\.post_ffw_norm\.weight is missing"),
    (_one("blk.0.post_attention_norm.weight", lambda n, a: [(n, a[:-1])]),
     r"blk\.0\.post_attention_norm\.weight is \[63\], expected \[64\] \(width 64\)"),
    (_one("blk.1.ffn_norm.weight", lambda n, a: [(n, np.concatenate([a, a]))]), r"blk\.1\.ffn_norm\.weight is \[128\]"),
])
def test_a_lying_norm_is_refused_in_one_line(tmp_path, edit, message):
    path = write_gguf(make_hf(KIND, seed=3, **GGUF_SETTINGS), tmp_path / "lie.gguf", {}, edit=edit)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(str(path), CPU, torch.float32)
    assert "\n" not in str(e.value) and str(e.value).startswith(path.name)


@needs_compiler
@pytest.mark.parametrize("at", [100, 400, 700])
def test_a_verification_equals_its_one_token_steps_bit_for_bit(at):
    """Past a window of 300 (wider than the kernel's blocks of 256 keys), on float16 K/V (a
    windowed model's default; float32 keys shorter than the kernel's minimum go to PyTorch's
    paths in every model, the full layers' here too): the local layers' band of keys is read by the native kernel in the
    same blocks for a 7-row verification as for each one-token step (`kv.full.window_start`,
    `attention.Mask.firsts`), so speculation decides on the very logits plain decoding has. The
    negative control: the view cut at the window's own first key, not at a block's, gives other
    bits."""
    from triforce_core.kv import full as full_module

    t = _wide_window()
    s = t.spec
    ids = torch.randint(3, 97, (at + 7,), generator=torch.Generator().manual_seed(at)).tolist()

    def both():
        cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, at + 16, torch.float16, CPU)
        t.forward(torch.tensor(ids[:at]), torch.arange(at), cache, logits_rows=None)
        steps = torch.cat([t.forward(torch.tensor([x]), torch.tensor([at + i]), cache).logits
                           for i, x in enumerate(ids[at:])])
        cache.truncate(at)
        return t.forward(torch.tensor(ids[at:]), torch.arange(at, at + 7), cache).logits, steps

    rows, steps = both()
    assert torch.equal(rows, steps)
    if at == 700:  # a window's start that is not a block's, its band across two blocks
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(full_module, "ATTENTION_BLOCK", 1)
            rows, steps = both()
        assert not torch.equal(rows, steps)


@functools.lru_cache(maxsize=None)
def _wide_window():
    return to_ours(make_hf(KIND, seed=4, sliding_window=300))
