"""A prefix draft (`prefix_draft`): the target's first layers plus a trained low-rank adapter.

- The adapter the training script writes, loaded over a GGUF target, gives the logits of Hugging
  Face's model with those layers' weights W + B @ A (rounded to Q8_0 as the draft keeps them):
  the script and the loader agree on the format. Negative control: the same model without the
  update differs.
- The draft shares the target's embedding and head (no second copy).
- Greedy output with the draft, in every mode that uses it, equals autoregressive decoding;
  sampling with it follows the target's law (chi-square), and a broken verifier is caught.
- An adapter for another model, or for more layers than the target has, is refused in one line.
- SmolLM2 gets its shipped draft by default.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from gguf import quants
from tests.helpers.gguf_files import hf_from_gguf, write_gguf
from tests.helpers.sampling import break_verifier, chi2_pvalue, first_two_counts, first_two_law

from scripts import train_smollm2_draft as training
from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.models import loading, prefix_draft
from triforce_core.config import PAPER_METHOD
from triforce_core.kv import FullCache
from triforce_core.models.loading import ModelLoadError, default_model_names, load_draft, load_model

pytestmark = needs_compiler
TYPES = {"attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_1, "ffn_down.weight": Q.Q4_1}
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
CACHE = CacheConfig(budget=48, chunk_size=4, recent_tokens=12, draft_sinks=4, draft_window=24, refresh_every=16)


def _adapter(student, seed: int) -> dict[str, torch.Tensor]:
    """The script's adapter after "training": random updates and norms, as it saves them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if p.requires_grad:
                p.copy_(p + torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.05))
    return training.adapter_state(student)


@functools.lru_cache(maxsize=None)
def _pair(folder: Path, layers: int = 2, rank: int = 4):
    target = write_gguf(make_hf("llama_mha", seed=3, **SHAPE), folder / "target.gguf", TYPES)
    hf = hf_from_gguf(target)
    student = training.make_student(hf, layers, rank, alpha=rank)
    adapter = _adapter(student, seed=1)
    prefix_draft.write(folder / "draft", adapter, layers, target.name, rank=rank)
    return target, hf, adapter, folder / "draft"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefix")


def _oracle(hf, adapter: dict, layers: int, with_update: bool = True):
    """Hugging Face's Llama with the target's first layers, W + B @ A rounded through Q8_0."""
    import copy

    from transformers import LlamaForCausalLM

    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = layers
    model = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in hf.state_dict().items() if k in model.state_dict()}
    for name in list(state):
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and with_update:
            base = name.removesuffix(".weight")
            w = (state[name] + adapter[base + ".lora_b"].half().float() @ adapter[base + ".lora_a"].half().float())
            w = quants.dequantize(quants.quantize(w.numpy(), Q.Q8_0), Q.Q8_0)
            state[name] = torch.from_numpy(np.ascontiguousarray(w))
        elif "norm" in name:
            state[name] = adapter[name].half().float()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _logits(model, ids: list[int]) -> torch.Tensor:
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids), model.dtype, model.device)
    return model.forward(torch.tensor(ids), cache.positions(0, len(ids)), cache).logits


def test_the_loaded_draft_is_the_adapted_prefix(folder):
    target, hf, adapter, draft_dir = _pair(folder)
    t = load_model(str(target), CPU, torch.float32)
    d = load_draft(str(draft_dir), t, CPU, torch.float32)
    assert d.model.spec.num_layers == 2 and d.model.quantized
    assert d.model.layers[0].wqkv.type_names() == ["Q8_0"] * 3
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = _logits(d.model, ids)
    with torch.no_grad():
        ref = _oracle(hf, adapter, 2)(torch.tensor([ids])).logits[0]
        without = _oracle(hf, adapter, 2, with_update=False)(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), float((ours - ref).abs().max())
    assert not torch.allclose(ours, without, atol=1e-2)  # the update is really applied


def test_the_draft_shares_the_targets_embedding(folder):
    target, _, _, draft_dir = _pair(folder)
    t = load_model(str(target), CPU, torch.float32)
    d = load_draft(str(draft_dir), t, CPU, torch.float32)
    assert d.model.embed.stored[0].raw.data_ptr() == t.model.embed.stored[0].raw.data_ptr()
    assert d.model.lm_head.stored[0].raw.data_ptr() == t.model.lm_head.stored[0].raw.data_ptr()
    assert d.tokenizer is t.tokenizer


@pytest.mark.parametrize("mode,paper", [("draft", True), ("triforce", True), ("triforce", False)])
def test_greedy_with_the_prefix_draft_equals_autoregressive(folder, mode, paper):
    target, _, _, draft_dir = _pair(folder)
    engine = TriForceEngine.from_pretrained(str(target), str(draft_dir), device="cpu")
    ids = torch.randint(3, 300, (120,), generator=torch.Generator().manual_seed(7)).tolist()

    def run(m: str, spec: dict):
        cfg = GenerationConfig(speculation=SpeculationConfig(mode=m, max_new_tokens=32, ignore_eos=True, **spec),
                               cache=CACHE)
        return engine.run(ids, cfg)

    ref = run("autoregressive", {}).token_ids
    got = run(mode, dict(PAPER_METHOD) if paper else {})
    assert got.token_ids == ref
    assert got.stats.level_calls.get("draft", 0) > 0  # the draft really proposed


# --- sampling --------------------------------------------------------------------------------
V, SAMPLES = 16, 3000
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.5, bos_token_id=None, eos_token_id=None)
SMALL_CACHE = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=0)


@functools.lru_cache(maxsize=None)
def _small(folder: Path):
    target = write_gguf(make_hf("llama_mha", seed=21, **SMALL), folder / "small.gguf", TYPES)
    hf = hf_from_gguf(target)
    prefix_draft.write(folder / "small-draft", _adapter(training.make_student(hf, 1, 4, 4.0), seed=2), 1, target.name)
    prompt = torch.randint(0, V, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    # exact: the law is Hugging Face's float32 one
    engine = TriForceEngine.from_pretrained(str(target), str(folder / "small-draft"), device="cpu", exact=True)
    return engine, prompt, first_two_law(hf, prompt)


def _counts(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    engine, prompt, joint = _small(folder)
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode="draft", gamma2=2, max_new_tokens=2, ignore_eos=True, lookup=False),
        cache=SMALL_CACHE,
    )
    return first_two_counts(engine, prompt, cfg, SAMPLES), joint


def test_sampling_with_the_prefix_draft_is_exact(folder):
    counts, joint = _counts(folder)
    assert chi2_pvalue(counts, joint) > 1e-3


def test_negative_control_broken_verifier_is_caught_with_the_prefix_draft(folder, monkeypatch):
    break_verifier(monkeypatch)
    counts, joint = _counts(folder)
    assert chi2_pvalue(counts, joint) < 1e-3


# --- bad adapters and the default ------------------------------------------------------------
def test_an_adapter_for_another_model_is_refused_in_one_line(folder, tmp_path):
    target, _, adapter, _ = _pair(folder)
    t = load_model(str(target), CPU, torch.float32)
    wrong = {k: (v[:, :32] if k.endswith("lora_a") else v) for k, v in adapter.items()}
    prefix_draft.write(tmp_path / "wrong", wrong, 2, "other.gguf")
    with pytest.raises(ModelLoadError) as e:
        load_draft(str(tmp_path / "wrong"), t, CPU, torch.float32)
    assert "another model (other.gguf)" in str(e.value) and "\n" not in str(e.value)
    prefix_draft.write(tmp_path / "deep", adapter, 3, target.name)
    with pytest.raises(ModelLoadError, match="keeps 3 layers but the target has only 3"):
        load_draft(str(tmp_path / "deep"), t, CPU, torch.float32)
    (tmp_path / "deep" / prefix_draft.WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot read the draft adapter"):
        load_draft(str(tmp_path / "deep"), t, CPU, torch.float32)


def test_smollm2_gets_its_shipped_draft_by_default(monkeypatch, tmp_path):
    assert prefix_draft.is_prefix_draft(str(loading.SMOLLM2_DRAFT))
    manifest = json.loads((loading.SMOLLM2_DRAFT / prefix_draft.MANIFEST).read_text())
    assert manifest["target_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_names("smollm2", None) == ("smollm2", str(loading.SMOLLM2_DRAFT))
    assert default_model_names("smollm2", "other") == ("smollm2", "other")
    assert default_model_names(str(tmp_path / "model.gguf"), None)[1] is None
