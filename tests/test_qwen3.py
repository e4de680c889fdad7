"""Qwen3 (dense) in the one forward: an RMSNorm on each head's queries and keys before the
rotary embedding, a head size apart from width / heads, tied embeddings.

- A tiny random Qwen3 (4 heads of 24 on width 64, random q/k norm weights) gives Hugging Face's
  greedy answer in every mode, and its logits (a prefill, a step, a verification) are Hugging
  Face's to float32 rounding; sampling from the three levels follows its law (chi-square).
- The native layer before attention normalizes each head as the float64 reference does (the
  negative control: the q and k norms exchanged are caught), and every layer in one native call
  gives the per-layer path's logits bit for bit.
- A Qwen3 GGUF file written by the tests' own writer loads and equals Hugging Face's reading of
  the same file (logits, and greedy output in every mode); a file whose head size is not
  Qwen3's usual 128 is read at its own key length (transformers' reading keeps 128 there).
- The hostile-file checks cover the norms: a wrong shape or a missing one is refused in one
  line naming the tensor; a Llama file carrying q/k norms is refused, not silently ignored.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.helpers.forwards import assert_one_call_equals_per_layer, chunk_logits
from tests.helpers.gguf_files import file_pair, write_gguf
from tests.helpers.greedy import NEW, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import built, needs_compiler

import triforce_core.models.gguf_file as gguf_file
import triforce_core.models.native_layers as native_layers
from triforce_core import TriForceEngine
from triforce_core.models.loading import ModelLoadError, load_model
from triforce_core.models.spec import ModelSpec

KIND = "qwen3_tied"
GGUF_SETTINGS = dict(vocab_size=300, head_dim=128)  # Qwen3's own head size, the one transformers reads
TIE_GAP = 1e-4


def test_the_spec_reads_qwen3_and_only_qwen3_has_q_k_norms():
    hf, t, *_ = hf_greedy(KIND)
    assert t.spec.model_type == "qwen3" and t.spec.qk_norm and t.spec.head_dim == 24 != 64 // 4
    assert hf.config.tie_word_embeddings and t.lm_head.data_ptr() == t.embed.data_ptr()  # one storage
    assert not ModelSpec.from_config(make_hf("qwen2_tied").config).qk_norm


def test_logits_equal_hugging_face():
    """A prefill, a one-token step and a seven-token verification over one cache."""
    hf, t, _, ids, _, _ = hf_greedy(KIND)
    chunks = [ids[:100], ids[100:101], ids[101:108]]
    with torch.no_grad():
        want = hf(torch.tensor([ids[:108]])).logits[0]
    got = torch.cat(chunk_logits(t, chunks))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("triforce", True),
                                         ("retrieval", False), ("draft", False), ("lookup", True)])
def test_greedy_equals_hugging_face_in_every_mode(mode, lookup):
    """A random draft and a sparse retrieval cache: proposals are mostly rejected and rolled back."""
    _, t, d, ids, ref, gaps = hf_greedy(KIND)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, lookup=lookup, draft_confidence=0.0))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.new_tokens == NEW


# -- the native layer before attention ----------------------------------------------------------
def _reference_layer_in(x, norm, eps, w_qkv, qk_norm, H, Hkv, cos, sin):
    """float64: norm, q/k/v, each head's q and k normalized by its own weights, rotary."""
    S, D = x.shape[0], cos.shape[1]

    def rms(t, w):
        t = t.double()
        return w.double() * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    qkv = rms(x, norm) @ w_qkv.double()
    q = rms(qkv[:, : H * D].reshape(S, H, D), qk_norm[:D])
    k = rms(qkv[:, H * D : (H + Hkv) * D].reshape(S, Hkv, D), qk_norm[D:])
    qk = torch.cat([q, k], dim=1).transpose(0, 1)
    half = D // 2
    qk = qk * cos.double() + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin.double()
    return qk[:H], qk[H:], qkv[:, (H + Hkv) * D :].reshape(S, Hkv, D).transpose(0, 1)


def _close(a, b, tol=2e-5) -> bool:
    return (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@needs_compiler
@pytest.mark.parametrize("S,E,H,Hkv,D", [(1, 64, 4, 2, 24), (7, 256, 4, 4, 128), (16, 48, 3, 1, 16)])
def test_the_native_q_k_norms_equal_the_float64_reference(S, E, H, Hkv, D):
    layers = built(native_layers)
    g = torch.Generator().manual_seed(S * 7 + D)
    x, norm = torch.randn(S, E, generator=g), 1 + 0.1 * torch.randn(E, generator=g)
    w_qkv = torch.randn(E, (H + 2 * Hkv) * D, generator=g) / E**0.5
    qk_norm = 1 + 0.5 * torch.randn(2 * D, generator=g)
    angles = torch.arange(S)[:, None] * 0.37 + torch.rand(D // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    got = layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, cos, sin, qk_norm=qk_norm)
    want = _reference_layer_in(x, norm, 1e-6, w_qkv, qk_norm, H, Hkv, cos, sin)
    for a, b in zip(got, want):
        assert a.shape == b.shape and _close(a, b)
    # the negative control: k's norm applied to q and q's to k
    swapped = layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, cos, sin, qk_norm=qk_norm.roll(D))
    assert not _close(swapped[0], want[0], tol=1e-3)
    with pytest.raises(ValueError, match="the q/k norms"):
        layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, cos, sin, qk_norm=qk_norm[:D])


@needs_compiler
def test_one_native_call_equals_the_per_layer_path_bit_for_bit():
    """Steps and a verification after a 1,100-token prefill (where the per-layer path takes the
    native attention too): every layer in one call (`decode_layers`, the norms read from its
    table) against a native call per side of each layer."""
    t = hf_greedy(KIND)[1]
    assert_one_call_equals_per_layer(t)


# -- GGUF files ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen3-gguf")


@functools.lru_cache(maxsize=None)
def _file(folder: Path):
    """A Qwen3 target (Q8_0, the norms F32) and a one-layer draft, ours of both, Hugging Face's
    model of the target file and its greedy answer."""
    return file_pair(folder, "qwen3", make_hf(KIND, seed=0, **GGUF_SETTINGS), make_hf(KIND, seed=5, num_hidden_layers=1, **GGUF_SETTINGS), NEW)


@needs_compiler
def test_a_gguf_file_equals_hugging_faces_reading_of_it(folder):
    hf, t, _, ids, _, _ = _file(folder)
    assert t.model.quantized and t.model.spec.qk_norm and t.model.spec.head_dim == 128
    assert gguf_file.refusal_of(folder / "qwen3-target.gguf") is None  # the picker offers it
    assert t.model.layers[0].wqkv.type_names() == ["Q8_0", "Q8_0", "Q8_0"]
    with torch.no_grad():
        want = hf(torch.tensor([ids[:100]])).logits[0]
    got = torch.cat(chunk_logits(t.model, [ids[:90], ids[90:91], ids[91:98], ids[98:100]]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("triforce", True),
                                         ("retrieval", False), ("draft", False)])
def test_a_gguf_files_greedy_answer_is_hugging_faces_in_every_mode(folder, mode, lookup):
    _, t, d, ids, ref, gaps = _file(folder)
    cfg = greedy_config(mode, 2, 6, lookup=lookup)
    got = TriForceEngine(t.model, d.model, exact=True).run(ids, cfg).token_ids
    assert_same_as_hf(got, ref, gaps)


@needs_compiler
def test_a_gguf_file_is_read_at_its_own_key_length(folder):
    """Head size 24: transformers' reading of a qwen3 header keeps Qwen3's default 128 and cannot
    load the tensors; ours takes the file's key length. Float32 tensors: the file's logits are
    those of the checkpoint it was written from."""
    hf = make_hf(KIND, seed=2, vocab_size=300)
    path = write_gguf(hf, folder / "qwen3-head-24.gguf", {}, default=Q.F32)
    t = load_model(str(path), CPU, torch.float32).model
    assert t.spec.head_dim == 24
    ids = list(range(3, 60))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat(chunk_logits(t, [ids[:50], ids[50:51], ids[51:]])), want, rtol=1e-4, atol=1e-4)


def _one(target: str, how):
    return lambda name, a: how(name, a) if name == target else [(name, a)]


@needs_compiler
@pytest.mark.parametrize("kind,edit,message", [
    (KIND, _one("blk.1.attn_q_norm.weight", lambda n, a: [(n, a[:-2])]),
     r"blk\.1\.attn_q_norm\.weight is \[22\], expected \[24\] \(head size 24\)"),
    (KIND, _one("blk.0.attn_k_norm.weight", lambda n, a: [(n, np.concatenate([a, a]))]),
     r"blk\.0\.attn_k_norm\.weight is \[48\], expected \[24\]"),
    (KIND, _one("blk.0.attn_k_norm.weight", lambda n, a: []), r"blk\.0\.attn_k_norm\.weight is missing"),
    ("llama_mha", lambda n, a: [(n, a)] + ([("blk.0.attn_q_norm.weight", a[0, :16])] if n == "blk.0.attn_q.weight" else []),
     r"blk\.0\.attn_q_norm\.weight is not a tensor this llama decoder reads"),
])
def test_a_lying_norm_is_refused_in_one_line(tmp_path, kind, edit, message):
    path = write_gguf(make_hf(kind, seed=3, vocab_size=300), tmp_path / f"lie-{kind}.gguf", {}, edit=edit)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(str(path), CPU, torch.float32)
    assert "\n" not in str(e.value) and str(e.value).startswith(path.name)


@needs_compiler
def test_a_prefix_draft_over_qwen3_is_refused_in_one_line(folder, tmp_path):
    """Prefix drafts' adapters are trained on Llama-family layers (no q/k norms)."""
    from triforce_core.models import prefix_draft
    from triforce_core.models.loading import load_draft

    _, t, _, _, _, _ = _file(folder)
    prefix_draft.write(tmp_path / "draft", {"model.norm.weight": torch.ones(t.model.spec.hidden_size)}, 1,
                       "qwen3-target.gguf")
    with pytest.raises(ModelLoadError, match=r"q/k norms \(Qwen3\) is not supported") as e:
        load_draft(str(tmp_path / "draft"), t, CPU, torch.float32)
    assert "\n" not in str(e.value)


def test_sampling_follows_hugging_faces_law():
    """The first two sampled tokens of the three levels against the joint law Hugging Face's
    Qwen3 gives them (chi-square over a 16-token vocabulary)."""
    from tests.helpers.sampling import CACHE, PAPER, SMALL, chi2_pvalue, first_two_counts, first_two_law
    from tests.helpers.models import to_ours
    from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig

    settings = {**SMALL, "head_dim": 12}
    hf = make_hf(KIND, seed=21, **settings)
    draft = to_ours(make_hf(KIND, seed=22, **{**settings, "num_hidden_layers": 1}))
    prompt = torch.randint(0, 16, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=0),
                           speculation=SpeculationConfig(mode="triforce", gamma1=2, gamma2=2, max_new_tokens=2,
                                                         ignore_eos=True, lookup=False, **PAPER), cache=CACHE)
    counts = first_two_counts(TriForceEngine(to_ours(hf), draft), prompt, cfg, 3000)
    assert chi2_pvalue(counts, first_two_law(hf, prompt)) > 1e-3
