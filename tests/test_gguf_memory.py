"""A GGUF file's weights are held once, as the file stores them.

- Every matrix the loaded model holds is the file's bytes (q and k rows regrouped by head as
  llama.cpp's order is undone), the embedding included: no float32 copy of a quantized
  embedding, tied (the head is the same tensor) or not.
- An embedding lookup dequantizes only the rows looked up, and they equal the rows of the
  whole dequantized table, and ggml's own package's (transformers' arithmetic), bit for bit.
- A stacked matrix's float32 tile (a prefill's products) is dequantized into one buffer: the
  same values as the parts' concatenation, with the kernel and with the package's fallback.
- Loading peaks at the weights plus a small margin over what the process held with its config
  and tokenizer read (measured in a child process): the file is read tensor by tensor into
  the buffers that keep them, not mapped and copied (which peaked at twice the weights).
- A file in the other byte order, whose numbers would be read swapped, is refused in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers import ROOT
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants
from tests.helpers.gguf_files import write_gguf

from triforce_core.models import gguf_file, native_layers
from triforce_core.models.loading import load_model
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
# hidden 256: the K types' blocks; the embedding of each kind in another type
LLAMA = dict(hidden_size=256, intermediate_size=512, vocab_size=300)
LLAMA_TYPES = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K,
               "token_embd.weight": Q.Q6_K, "output.weight": Q.Q8_0}
QWEN_TYPES = {"attn_v.weight": Q.F16, "token_embd.weight": Q.Q4_1}  # tied: the embedding is the head


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp("memory") / f"{kind}.gguf"
    if kind == "llama":
        write_gguf(make_hf("llama_mha", seed=1, **LLAMA), path, LLAMA_TYPES)
    else:
        write_gguf(make_hf("qwen2_tied", seed=1, vocab_size=300), path, QWEN_TYPES)
    return kind, path, load_model(str(path), CPU, torch.float32)


def _file_matrices(path: Path) -> dict[str, np.ndarray]:
    """Each 2-D tensor's bytes as the file stores them, [rows, row bytes], by the decoder's name."""
    reader = GGUFReader(path)
    return {gguf_file._hf_name(reader, path, t.name): np.ascontiguousarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)
            for t in reader.tensors if len(t.shape) == 2}


def test_the_embedding_is_the_files_quantized_bytes_not_a_float32_table(loaded):
    kind, path, t = loaded
    model = t.model
    stored = _file_matrices(path)["model.embed_tokens.weight"]
    assert isinstance(model.embed, Matrix) and model.embed.quantized
    (embed,) = model.embed.stored
    assert embed.type == (Q.Q6_K if kind == "llama" else Q.Q4_1)
    assert np.array_equal(embed.raw.numpy(), stored)
    if kind == "qwen2":  # tied: the head reads the same bytes, not a copy
        assert model.lm_head is model.embed
    vocab, hidden = embed.shape
    floats = [w for w in model.weight_tensors() if w.dtype == torch.float32 and w.numel() >= vocab * hidden]
    assert floats == [], "a float32 tensor as large as the embedding is held"


def test_every_matrix_is_the_files_bytes_once(loaded):
    kind, path, t = loaded
    model = t.model
    stored = _file_matrices(path)
    heads, kv_heads = model.spec.num_heads, model.spec.num_kv_heads
    held = {"model.embed_tokens.weight": model.embed.stored[0]}
    if not isinstance(model.lm_head, Matrix) or model.lm_head is not model.embed:
        held["lm_head.weight"] = model.lm_head.stored[0]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        names = [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                 p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                 p + "mlp.down_proj.weight"]
        parts = [*layer.wqkv.stored, *layer.wo.stored, *layer.w_gate_up.stored, *layer.w_down.stored]
        held.update(zip(names, parts, strict=True))
    assert set(held) == set(stored)
    for name, w in held.items():
        expected = stored[name]
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            expected = expected[gguf_file._unpermute_rows(len(expected), heads if "q_proj" in name else kv_heads)]
        assert np.array_equal(w.raw.numpy(), expected), name
    raw = {w.raw.data_ptr() for w in held.values()}
    assert len(raw) == len(held), "two matrices share one buffer"
    matrices = sum(a.nbytes for a in stored.values())
    assert model.weight_bytes() - matrices == sum(w.numel() * 4 for w in model.weight_tensors() if w.dim() == 1)


def test_embedding_rows_equal_the_dequantized_tables_rows_bit_for_bit(loaded):
    _, _, t = loaded
    model = t.model
    (embed,) = model.embed.stored
    table = embed.dequantized()  # [V, hidden] float32, the whole table (what the model no longer holds)
    reference = quants.dequantize(embed.raw.numpy(), Q(embed.type))  # ggml's package: transformers' values
    assert np.array_equal(table.numpy(), reference)
    ids = torch.tensor([0, 1, 299, 7, 7, 150, 298, 2])
    got = model._embed(ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), embed.shape[1])
    assert torch.equal(got, table[ids])
    # read in place by index, as indexing counts: from the end for negative ids, none past it
    assert torch.equal(model._embed(torch.tensor([-1, -300])), table[[299, 0]])
    with pytest.raises(IndexError):
        model._embed(torch.tensor([300]))


@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "gguf package"])
def test_a_stacked_tile_dequantized_into_one_buffer_equals_the_concatenation(monkeypatch, with_kernel):
    from tests.helpers.gguf_files import random_blocks

    rng = np.random.default_rng(5)
    parts = [StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, 256, rng)), (rows, 256))
             for q, rows in ((Q.Q4_K, 40), (Q.Q6_K, 24), (Q.Q8_0, 17))]
    if not with_kernel:
        monkeypatch.setattr(native_layers, "kernel", lambda: None)
    concatenated = torch.cat([torch.from_numpy(quants.dequantize(p.raw.numpy(), Q(p.type))) for p in parts])
    tile = Matrix(stored=tuple(parts)).dense_t()  # [inputs, outputs]
    assert tile.shape == (256, 81) and torch.equal(tile, concatenated.t())


CHILD = r"""
import json, sys
import torch
from triforce_core.models import gguf_file, loading

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

path = sys.argv[1]
gguf_file.config_and_tokenizer(gguf_file.resolve(path))  # the cache entry, and transformers' modules imported
base = status()["VmRSS"]
try:  # the peak so far forgotten (Linux >= 4.0); else VmHWM is at least the load's peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
model = loading.load_model(path, torch.device("cpu"), torch.float32).model
after = status()
print(json.dumps({"base": base, "peak": after["VmHWM"], "after": after["VmRSS"], "weights": model.weight_bytes()}))
"""
MB = 2**20
MARGIN = 48 * MB  # the second tokenizer (the child read one for its baseline), the reader's parse


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_loading_peaks_at_the_weights_plus_a_margin(tmp_path):
    # 96 MB of F16 matrices (3 layers of 16M weights): large against the margin, quick to write
    hf = make_hf("llama_mha", seed=2, hidden_size=1024, intermediate_size=4096, num_hidden_layers=3,
                 num_attention_heads=16, num_key_value_heads=16)
    path = write_gguf(hf, tmp_path / "f16.gguf", {}, default=Q.F16)
    del hf
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["weights"] > 90 * MB
    # the control: the measure sees the weights (they are resident after the load)
    assert m["after"] - m["base"] >= 0.9 * m["weights"], m
    assert m["peak"] - m["base"] <= m["weights"] + MARGIN, (
        f"loading peaked {(m['peak'] - m['base']) / MB:.0f} MB over the baseline for {m['weights'] / MB:.0f} MB of weights")


def test_a_file_in_the_other_byte_order_is_refused_in_one_line(tmp_path):
    """The weights are read as the file stores them: in the other byte order every float and
    block scale would be read swapped, so such a file is refused before anything is read."""
    from gguf import GGUFEndian, GGUFWriter

    from triforce_core.models.loading import ModelLoadError

    path = tmp_path / "swapped.gguf"
    other = GGUFEndian.BIG if sys.byteorder == "little" else GGUFEndian.LITTLE
    w = GGUFWriter(str(path), "llama", endianess=other)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"^swapped\.gguf: the file is stored (big|little)-endian, this machine is"):
        load_model(str(path), CPU, torch.float32)
