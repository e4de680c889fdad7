"""Random-weight files with real models' shapes (`bench/desktop_models.py`): the writer only.

No llama.cpp here (its quantizer is a build away): a miniature shape is written as F16 by the
same code, with the tokenizer of a tiny test file, and our loader must open it as that shape and
run it as Hugging Face's reading of the same file does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.models import make_hf
from gguf import GGUFReader
from tests.helpers.gguf_files import hf_from_gguf, write_gguf
from tests.helpers.native import needs_compiler

from bench import desktop_models as dm
from triforce_core.kv import FullCache
from triforce_core.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

MINI = {
    "llama": dm.Shape("mini-llama", "llama", layers=2, width=64, mlp=128, heads=4, kv_heads=2, head_dim=16,
                      rope_theta=500000.0, rms_eps=1e-5, context=512),
    "qwen2": dm.Shape("mini-qwen", "qwen2", layers=2, width=64, mlp=96, heads=4, kv_heads=1, head_dim=16,
                      rope_theta=1e6, rms_eps=1e-6, context=512, qkv_bias=True),
    # a head size (24) apart from width / heads (16): only the header's key length gives it
    "qwen3": dm.Shape("mini-qwen3", "qwen3", layers=2, width=64, mlp=96, heads=4, kv_heads=2, head_dim=24,
                      rope_theta=1e6, rms_eps=1e-6, context=512, qk_norm=True),
    # six layers: readers take every sixth as the full one; a window shorter than the prompt
    "gemma3": dm.Shape("mini-gemma3", "gemma3", layers=6, width=64, mlp=128, heads=4, kv_heads=2, head_dim=32,
                       rope_theta=1e6, rms_eps=1e-6, context=512, qk_norm=True, sandwich=True, window=8,
                       rope_scaling=("linear", 8.0)),
}
PROMPT = 20  # tokens: past the mini Gemma's window


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny GGUF file whose tokenizer the written files copy."""
    return write_gguf(make_hf("llama_mha", seed=0), tmp_path_factory.mktemp("tok") / "tok.gguf", {})


def test_the_shapes_are_the_real_models():
    """With the real vocabularies, the parameter counts are the published models' to the unit."""
    assert dm.parameter_count(dm.SHAPES["llama-3.2-1b"], 128256) == 1_235_814_400
    assert dm.parameter_count(dm.SHAPES["llama-3.2-3b"], 128256) == 3_212_749_824
    assert dm.parameter_count(dm.SHAPES["qwen2.5-1.5b"], 151936) == 1_543_714_304
    assert dm.parameter_count(dm.SHAPES["llama-3.1-8b"], 128256) == 8_030_261_248
    assert dm.parameter_count(dm.SHAPES["qwen3-4b"], 151936) == 4_022_468_096
    # Gemma 3 4B's language model, with its config's vocabulary (262,144 tokens and 64 image ones)
    assert dm.parameter_count(dm.SHAPES["gemma-3-4b"], 262208) == 3_880_263_168
    untied = dm.Shape(**{**dm.SHAPES["llama-3.2-1b"].__dict__, "tied": False})
    assert dm.parameter_count(untied, 128256) == 1_235_814_400 + 128256 * 2048  # the control: a head counts
    plain = dm.Shape(**{**dm.SHAPES["gemma-3-4b"].__dict__, "qk_norm": False, "sandwich": False})
    assert dm.parameter_count(plain, 262208) == 3_880_263_168 - 34 * (2 * 256 + 2 * 2560)  # and the norms do


def test_the_new_shapes_have_their_norms_and_own_head_size():
    names = dict(dm.tensors(dm.SHAPES["gemma-3-4b"], 100))
    assert names["blk.0.attn_q_norm.weight"] == (256,) and names["blk.33.post_ffw_norm.weight"] == (2560,)
    assert names["blk.0.attn_q.weight"] == (2048, 2560) and names["blk.0.attn_output.weight"] == (2560, 2048)
    assert "blk.0.post_attention_norm.weight" not in dict(dm.tensors(dm.SHAPES["qwen3-4b"], 100))
    assert dm.SHAPES["qwen3-4b"].key_length == 128 and dm.SHAPES["gemma-3-4b"].key_length == 256
    assert "output.weight" not in names  # tied
    assert dm.SHAPES["llama-3.2-3b"].key_length is None  # their files stay as they were: no key length
    assert all(key in dm.__doc__ for key in dm.SHAPES)  # --help lists every shape


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_written_file_loads_as_its_shape(tmp_path, tokenizer_file, arch):
    shape = MINI[arch]
    path = dm.write_f16(shape, tmp_path / f"{arch}.F16.gguf", tokenizer_file, seed=3)
    assert not list(tmp_path.glob("*.tmp"))
    source, written = GGUFReader(tokenizer_file), GGUFReader(path)
    for key in (k for k in source.fields if k.startswith("tokenizer.")):
        assert written.fields[key].contents() == source.fields[key].contents(), key
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    assert {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in written.tensors} == dict(dm.tensors(shape, vocab))

    loaded = load_model(str(path), torch.device("cpu"), torch.float32)
    s = loaded.model.spec
    assert (s.num_layers, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == (
        shape.layers, shape.width, shape.mlp, shape.heads, shape.kv_heads, shape.head_dim, vocab)
    assert (s.qk_norm, s.sandwich, s.norm_plus_one) == (shape.qk_norm, shape.sandwich, shape.sandwich)
    full = [shape.window is None or i % 6 == 5 for i in range(shape.layers)]
    assert s.sliding_windows == tuple(None if f else shape.window for f in full)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == vocab
    if shape.rope_scaling is not None:  # written as llama.cpp's converter writes it...
        assert written.fields["gemma3.rope.scaling.type"].contents() == "linear"
        assert written.fields["gemma3.rope.scaling.factor"].contents() == 8.0
        assert s.rope_type == "default"  # ...and left out by transformers' reading of the header


@needs_compiler
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_written_file_runs_as_hugging_faces_reading_of_it(tmp_path, tokenizer_file, arch):
    """A forward over a prompt past the mini Gemma's window (its full layer sees it all)."""
    shape = MINI[arch]
    path = dm.write_f16(shape, tmp_path / f"{arch}.F16.gguf", tokenizer_file, seed=4)
    loaded = load_model(str(path), torch.device("cpu"), torch.float32)
    s = loaded.model.spec
    ids = torch.randint(3, s.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, PROMPT, torch.float32, torch.device("cpu"))
    got = loaded.model.forward(ids, torch.arange(PROMPT), cache).logits
    with torch.no_grad():
        want = hf_from_gguf(path, head_dim=shape.head_dim)(ids[None]).logits[0]
    assert not torch.allclose(want[0], want[-1], rtol=0, atol=1e-3)  # the control: the rows differ
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_weights_are_small_seeded_and_streamed_in_chunks(monkeypatch):
    a = dm.random_tensor("blk.0.ffn_up.weight", (300, 64), seed=1)
    assert a.dtype == np.float16 and abs(float(a.astype(np.float32).std()) - dm.STD) < 0.002
    monkeypatch.setattr(dm, "CHUNK", 64 * 7)  # 7 rows a draw: the same numbers
    assert np.array_equal(dm.random_tensor("blk.0.ffn_up.weight", (300, 64), seed=1), a)
    assert not np.array_equal(dm.random_tensor("blk.0.ffn_up.weight", (300, 64), seed=2), a)
    assert not np.array_equal(dm.random_tensor("blk.1.ffn_up.weight", (300, 64), seed=1), a)
    assert np.all(dm.random_tensor("blk.0.attn_norm.weight", (64,), seed=1) == 1)


def test_unknown_names_are_one_line():
    with pytest.raises(dm.DesktopModelError, match="unknown type Q3_X: choose from"):
        dm._names("Q4_K_M,Q3_X", dm.TYPES, "type")
    assert dm._names("Q8_0, Q8_0,Q4_K_M", dm.TYPES, "type") == ["Q8_0", "Q4_K_M"]


def test_existing_files_are_kept(tmp_path, tokenizer_file):
    """Nothing is written or built when every asked file is there (no llama.cpp is needed)."""
    for t in ("Q4_K_M", "Q8_0"):
        (tmp_path / dm.file_name("llama-3.2-1b", t)).write_bytes(b"x")
    said = []
    paths = dm.make(["llama-3.2-1b"], ["Q4_K_M", "Q8_0"], tmp_path, 0, False, tokenizer_file, say=said.append)
    assert [p.name for p in paths] == ["llama-3.2-1b-shape.Q4_K_M.gguf", "llama-3.2-1b-shape.Q8_0.gguf"]
    assert all("exists: kept" in m for m in said) and len(said) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, tokenizer_file, monkeypatch):
    class Usage:
        free = 10**9  # 1 GB: not an 8B's 15 GB of F16

    monkeypatch.setattr(dm.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(dm.DesktopModelError, match=r"need about 1[0-9]\.\d GB free in .* which has 1\.0 GB"):
        dm.make(["llama-3.1-8b"], ["Q4_K_M"], tmp_path, 0, False, tokenizer_file, say=lambda m: None)
    assert list(tmp_path.iterdir()) == []
    # a kept F16 file is not counted again: only the quantized file's few bytes a weight
    count = dm.parameter_count(dm.SHAPES["llama-3.1-8b"], 100)
    dm.check_space(tmp_path, dm.SHAPES["llama-3.1-8b"], count // 8, ["Q4_K_M"], write_f16=False)

