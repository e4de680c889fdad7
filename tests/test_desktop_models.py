"""Random-weight files with real models' shapes (`bench/desktop_models.py`): the writer only.

No llama.cpp here (its quantizer is a build away): a miniature shape is written as F16 by the
same code, with the tokenizer of a tiny test file, and our loader must open it as that shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.models import make_hf
from gguf import GGUFReader
from tests.helpers.gguf_files import write_gguf

from bench import desktop_models as dm
from triforce_core.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

MINI = {
    "llama": dm.Shape("mini-llama", "llama", layers=2, width=64, mlp=128, heads=4, kv_heads=2, head_dim=16,
                      rope_theta=500000.0, rms_eps=1e-5, context=512),
    "qwen2": dm.Shape("mini-qwen", "qwen2", layers=2, width=64, mlp=96, heads=4, kv_heads=1, head_dim=16,
                      rope_theta=1e6, rms_eps=1e-6, context=512, qkv_bias=True),
}


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
    untied = dm.Shape(**{**dm.SHAPES["llama-3.2-1b"].__dict__, "tied": False})
    assert dm.parameter_count(untied, 128256) == 1_235_814_400 + 128256 * 2048  # the control: a head counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
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
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == vocab


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

