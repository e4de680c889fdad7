"""Phi-3 and Phi-4-mini in the one forward: fused q/k/v and gate/up tensors, longrope, a rotary
embedding over part of each head.

- Tiny random Phi-3 (the whole head rotated) and Phi-4-mini-style checkpoints (12 of 16 numbers
  a head rotated, longrope) give Hugging Face's greedy answer in every mode; their logits (a
  prefill, a step, a verification, and verifications across longrope's switch to its long
  factors at position 180) are Hugging Face's to float32 rounding, against its cached forward
  (each forward's rows rotated by its own length, no cached key re-rotated); sampling follows
  its law (chi-square).
- Phi-3's `generate` drops its cache where the sequence passes the switch and recomputes every
  position with the long factors (shown here): a generation that reaches the switch is refused
  in one line, as re-rotating cached keys is not done.
- The native layer before attention rotates only the first rotary numbers of each head (the
  float64 reference; the negative control: the whole head rotated is caught), per layer and in
  one call alike.
- A phi3 GGUF file written by the tests' writer loads and equals Hugging Face's reading of it;
  a Phi-4-mini file (partial rotary and longrope, which transformers' reading leaves out) equals
  the checkpoint it was written from; a fused tensor of the wrong rows is refused in one line.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.helpers.forwards import assert_one_call_equals_per_layer, chunk_logits
from tests.helpers.gguf_files import file_pair, write_gguf
from tests.helpers.greedy import NEW, PROMPT_LEN, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import built, needs_compiler

import triforce_core.models.gguf_file as gguf_file
import triforce_core.models.native_layers as native_layers
from triforce_core import TriForceEngine
from triforce_core.engine import ContextLengthError
from triforce_core.models.loading import ModelLoadError, load_model
from triforce_core.models.spec import InconsistentModelError, ModelSpec

KINDS = ("phi3", "phi4_mini")
GREEDY_KINDS = ("phi3", "phi4_mini_within")  # phi4_mini_within: longrope's switch at 256, past the answer
SWITCH = 180  # phi4_mini's original_max_position_embeddings (tests/helpers/models.PHI4_ROPE)


def _hf_cached(hf, ids: list[int], prompt: int) -> torch.Tensor:
    """Hugging Face's logits as its `generate` computes them: the prompt in one forward, then one
    token a forward over its cache."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = hf(torch.tensor([ids[:prompt]]), cache=DynamicCache(config=hf.config), use_cache=True)
        rows = [out.logits[0]]
        for i in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[i]]]), cache=out.past_key_values, use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows)


def test_the_spec_reads_phi3_and_phi4_mini():
    _, t, *_ = hf_greedy("phi3")
    assert t.spec.model_type == "phi3" and t.spec.rotated == t.spec.head_dim == 16 and t.rotary.long_from is None
    assert t.layers[0].wqkv.n_out == (4 + 2 * 2) * 16 and t.layers[0].w_gate_up.n_out == 2 * 128
    _, t, *_ = hf_greedy("phi4_mini")
    assert t.spec.rope_type == "longrope" and t.spec.rotary_dim == t.spec.rotated == 12
    assert t.rotary.long_from == SWITCH and t.rotary.scaling > 1  # the attention factor on cos/sin
    assert not torch.equal(t.rotary.inv_freq, t.rotary.long_inv_freq)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_hugging_face(kind):
    """A prefill, a one-token step and a seven-token verification over one cache."""
    hf, t, _, ids, _, _ = hf_greedy(kind)
    with torch.no_grad():
        want = hf(torch.tensor([ids[:108]])).logits[0]
    got = torch.cat(chunk_logits(t, [ids[:100], ids[100:101], ids[101:108]]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_logits_across_the_longrope_switch_equal_hugging_faces_cached_forward():
    """Verifications of 7 rows across position 180 against Hugging Face's one token a forward;
    the negative control: Hugging Face's one forward over all 190 tokens (every position with the
    long factors) is far from both."""
    hf, t, _, ids, _, _ = hf_greedy("phi4_mini")
    ids = ids + list(range(3, 40))  # past the 160-token prompt
    want = _hf_cached(hf, ids[:190], 170)
    got = torch.cat(chunk_logits(t, [ids[:170], ids[170:171], ids[171:178], ids[178:185], ids[185:190]]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        all_long = hf(torch.tensor([ids[:190]])).logits[0]
    assert (all_long[SWITCH:] - want[SWITCH:]).abs().max() > 0.1


def test_our_rotary_gives_hugging_faces_cos_sin_by_position():
    """Each position's cos/sin as Hugging Face's rotary embedding gives it in a one-token forward
    (short factors below 180, long from there), through the table and without it."""
    hf, t, *_ = hf_greedy("phi4_mini")
    emb = hf.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    for p in (0, 5, 179, 180, 181, 250, 600):
        want = emb(x, torch.tensor([[p]]))
        for got in (t.rotary.cos_sin(torch.tensor([p]), torch.float32), t.rotary._compute(torch.tensor([p]), torch.float32, True)):
            assert torch.equal(got[0], want[0][0]) and torch.equal(got[1], want[1][0]), p


@pytest.mark.parametrize("kind", GREEDY_KINDS)
@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("triforce", True),
                                         ("retrieval", False), ("draft", False), ("lookup", True)])
def test_greedy_equals_hugging_face_in_every_mode(kind, mode, lookup):
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, lookup=lookup, draft_confidence=0.0))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.new_tokens == NEW


def test_a_generation_across_the_longrope_switch_is_refused_in_one_line():
    """Hugging Face's greedy answer past position 180 is its forward over the whole sequence with
    the long factors (its cache dropped), not its cached forward: our engine refuses to get there."""
    hf, t, d, ids, ref, _ = hf_greedy("phi4_mini")
    assert PROMPT_LEN < SWITCH < PROMPT_LEN + NEW
    seq = ids + ref
    with torch.no_grad():
        all_long = hf(torch.tensor([seq[:SWITCH + 1]])).logits[0, -1]
    cached = _hf_cached(hf, seq[: SWITCH + 1], PROMPT_LEN)[-1]
    assert int(all_long.argmax()) == ref[SWITCH - PROMPT_LEN + 1] and (all_long - cached).abs().max() > 0.1
    engine = TriForceEngine(t, d)
    with pytest.raises(ContextLengthError, match=r"prompt \(160 tokens\) \+ max_new_tokens \(40\) pass this "
                                                 r"model's longrope switch at 180 tokens") as e:
        engine.run(ids, greedy_config("autoregressive", 2, 6))
    assert "\n" not in str(e.value)
    cfg = greedy_config("autoregressive", 2, 6)  # 21 new tokens: the last forward at position 179, within
    cfg = dataclasses.replace(cfg, speculation=dataclasses.replace(cfg.speculation, max_new_tokens=SWITCH - PROMPT_LEN + 1))
    engine.check_prompt(ids, cfg)
    got = engine.run(ids, cfg).token_ids
    assert got == ref[: SWITCH - PROMPT_LEN + 1]


@pytest.mark.parametrize("key,value,message", [
    ("long_factor", [1.0] * 8, r"longrope's long_factor is 8 numbers, not 6 positive numbers"),
    ("short_factor", [1.0] * 5 + [-1.0], r"longrope's short_factor is 6 numbers, not 6 positive"),
    ("original_max_position_embeddings", 0, r"original_max_position_embeddings is 0, outside"),
])
def test_lying_longrope_settings_are_refused_in_one_line(key, value, message):
    config = make_hf("phi4_mini").config
    config.rope_parameters = {**config.rope_parameters, key: value}
    with pytest.raises(InconsistentModelError, match=message):
        ModelSpec.from_config(config)


# -- the native layer before attention ----------------------------------------------------------
def _reference_layer_in(x, norm, eps, w_qkv, H, Hkv, D, cos, sin):
    """float64: norm, q/k/v, the first R = cos's width numbers of each head rotated."""
    S, R = x.shape[0], cos.shape[1]
    xd = x.double()
    h = norm.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
    qkv = h @ w_qkv.double()
    qk = qkv[:, : (H + Hkv) * D].reshape(S, H + Hkv, D).transpose(0, 1)
    part, half = qk[..., :R], R // 2
    turned = part * cos.double() + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin.double()
    qk = torch.cat([turned, qk[..., R:]], dim=-1)
    return qk[:H], qk[H:], qkv[:, (H + Hkv) * D :].reshape(S, Hkv, D).transpose(0, 1)


def _close(a, b, tol=2e-5) -> bool:
    return (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@needs_compiler
@pytest.mark.parametrize("S,E,H,Hkv,D,R", [(1, 64, 4, 2, 16, 12), (7, 256, 4, 4, 128, 96), (16, 48, 3, 1, 16, 8)])
def test_the_native_partial_rotation_equals_the_float64_reference(S, E, H, Hkv, D, R):
    layers = built(native_layers)
    g = torch.Generator().manual_seed(S * 7 + D)
    x, norm = torch.randn(S, E, generator=g), 1 + 0.1 * torch.randn(E, generator=g)
    w_qkv = torch.randn(E, (H + 2 * Hkv) * D, generator=g) / E**0.5
    angles = torch.arange(S)[:, None] * 0.37 + torch.rand(R // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    got = layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, cos, sin, head_dim=D)
    want = _reference_layer_in(x, norm, 1e-6, w_qkv, H, Hkv, D, cos, sin)
    for a, b in zip(got, want):
        assert a.shape == b.shape and _close(a, b)
    # the rest passes through as it is: the same numbers as the head unrotated (cos 1, sin 0)
    plain = layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, torch.ones(S, D), torch.zeros(S, D))
    assert torch.equal(got[0][..., R:], plain[0][..., R:]) and torch.equal(got[1][..., R:], plain[1][..., R:])
    # the negative control: the same angles over the whole head (pairs D / 2 apart, not R / 2)
    whole_angles = torch.cat([angles, torch.zeros(S, (D - R) // 2)], 1)
    whole = layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, torch.cat([whole_angles.cos()] * 2, 1),
                            torch.cat([whole_angles.sin()] * 2, 1))
    assert not _close(whole[0], want[0], tol=1e-3) and not _close(whole[1], want[1], tol=1e-3)
    with pytest.raises(ValueError, match="cos is"):
        layers.layer_in(x, norm, 1e-6, w_qkv, None, H, Hkv, cos[:, :-1], sin[:, :-1], head_dim=D)


@needs_compiler
def test_one_native_call_equals_the_per_layer_path_bit_for_bit():
    """Steps and a verification after a 1,100-token prefill (where the per-layer path takes the
    native attention too): every layer in one call (`decode_layers`, partial rotary, the long
    factors) against a native call per side of each layer."""
    t = hf_greedy("phi4_mini")[1]
    assert_one_call_equals_per_layer(t)


def test_sampling_follows_hugging_faces_law():
    """The first two sampled tokens of the three levels against the joint law Hugging Face's
    Phi-4-mini-style model gives them (chi-square over a 16-token vocabulary)."""
    from tests.helpers.sampling import CACHE, PAPER, SMALL, chi2_pvalue, first_two_counts, first_two_law
    from tests.helpers.models import to_ours
    from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig

    settings = {**SMALL, "hidden_size": 64, "pad_token_id": None}  # head size 16: PHI4_ROPE's 12 rotated
    hf = make_hf("phi4_mini", seed=21, **settings)
    draft = to_ours(make_hf("phi4_mini", seed=22, **{**settings, "num_hidden_layers": 1}))
    prompt = torch.randint(0, 16, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=0),
                           speculation=SpeculationConfig(mode="triforce", gamma1=2, gamma2=2, max_new_tokens=2,
                                                         ignore_eos=True, lookup=False, **PAPER), cache=CACHE)
    counts = first_two_counts(TriForceEngine(to_ours(hf), draft), prompt, cfg, 3000)
    assert chi2_pvalue(counts, first_two_law(hf, prompt)) > 1e-3


# -- GGUF files ----------------------------------------------------------------------------------
GGUF_SETTINGS = dict(vocab_size=300, hidden_size=256, intermediate_size=512)  # Q8_0 rows of 256 inputs


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("phi3-gguf")


@functools.lru_cache(maxsize=None)
def _file(folder: Path):
    """A Phi-3 target (Q8_0, the norms F32) and a one-layer draft, ours of both, Hugging Face's
    model of the target file and its greedy answer."""
    return file_pair(folder, "phi3", make_hf("phi3", seed=0, **GGUF_SETTINGS), make_hf("phi3", seed=5, num_hidden_layers=1, **GGUF_SETTINGS), NEW)


@needs_compiler
def test_a_gguf_file_equals_hugging_faces_reading_of_it(folder):
    hf, t, _, ids, _, _ = _file(folder)
    assert t.model.quantized and t.model.spec.model_type == "phi3"
    assert gguf_file.refusal_of(folder / "phi3-target.gguf") is None  # the picker offers it
    # the fused tensors kept as stored: one part each
    assert t.model.layers[0].wqkv.type_names() == ["Q8_0"] and t.model.layers[0].w_gate_up.type_names() == ["Q8_0"]
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


@needs_compiler
def test_a_phi4_mini_gguf_file_keeps_its_partial_rotary_and_longrope(folder):
    """transformers' reading of a phi3 header rotates the whole head with the default rope; ours
    reads rope.dimension_count and the rope factor tensors. Float32 tensors: the file's logits
    are those of the checkpoint it was written from, across the switch too."""
    hf = make_hf("phi4_mini", seed=2, vocab_size=300)
    path = write_gguf(hf, folder / "phi4-mini.gguf", {}, default=Q.F32)
    t = load_model(str(path), CPU, torch.float32).model
    assert t.spec.rotary_dim == 12 and t.spec.rope_type == "longrope" and t.rotary.long_from == SWITCH
    ids = torch.randint(3, 300, (190,), generator=torch.Generator().manual_seed(1)).tolist()
    want = _hf_cached(hf, ids, 170)
    got = torch.cat(chunk_logits(t, [ids[:170], ids[170:171], ids[171:178], ids[178:190]]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _one(target: str, how):
    return lambda name, a: how(name, a) if name == target else [(name, a)]


@needs_compiler
@pytest.mark.parametrize("edit,message", [
    (_one("blk.1.attn_qkv.weight", lambda n, a: [(n, a[:-64])]),
     r"blk\.1\.attn_qkv\.weight is \[448, 256\], expected \[512, 256\] \(heads 4 x head size 64 \+ 2 x KV heads 2"),
    (_one("blk.0.ffn_up.weight", lambda n, a: [(n, a[:512])]),
     r"blk\.0\.ffn_up\.weight is \[512, 256\], expected \[1024, 256\] \(2 x MLP width 512"),
    (_one("blk.0.attn_qkv.weight", lambda n, a: []), r"blk\.0\.attn_qkv\.weight is missing"),
    (_one("blk.0.attn_qkv.weight", lambda n, a: [("blk.0.attn_q.weight", a[:256])]),
     r"blk\.0\.attn_q\.weight is not a tensor this phi3 decoder reads"),
])
def test_a_lying_fused_tensor_is_refused_in_one_line(tmp_path, edit, message):
    path = write_gguf(make_hf("phi3", seed=3, **GGUF_SETTINGS), tmp_path / "lie-phi3.gguf", {}, edit=edit)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(str(path), CPU, torch.float32)
    assert "\n" not in str(e.value) and str(e.value).startswith(path.name)


@needs_compiler
def test_a_lying_rope_factor_tensor_is_refused_in_one_line(tmp_path):
    edit = _one("rope_factors_long.weight", lambda n, a: [(n, np.concatenate([a, a]))])
    path = write_gguf(make_hf("phi4_mini", seed=3, vocab_size=300), tmp_path / "lie-phi4.gguf", {}, default=Q.F32,
                      edit=edit)
    with pytest.raises(ModelLoadError, match=r"tensor rope_factors_long\.weight holds 12 factors, expected 6") as e:
        load_model(str(path), CPU, torch.float32)
    assert "\n" not in str(e.value)
