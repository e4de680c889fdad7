"""The real Gemma 3 270M file (`gemma3-270m`, installed by `make`): Google's base model in
llama.cpp's Q4_K_M mix (Q5_0, Q4_K, Q8_0, Q6_K blocks), read as stored.

- `--exact` greedy equals Hugging Face's reading of the same file token for token, on prompts
  past the 512-token sliding window, with plain decoding and with lookup's speculation.
- The default arithmetic's greedy answer on the same prompt, with its speculation, equals its own
  plain decoding (speculation is lossless in every arithmetic).
- It writes English: a known continuation.
"""

from __future__ import annotations

import functools

import pytest
import torch

from triforce_core import GenerationConfig, SpeculationConfig, TriForceEngine
from triforce_core.models.chunked_file import GEMMA3

# one worker loads the file once (its first load converts a 262,144-token vocabulary)
pytestmark = [pytest.mark.skipif(not GEMMA3.installed(), reason="the gemma3-270m packages are not installed "
                                 "(make install installs them)"),
              pytest.mark.xdist_group("gemma3_270m")]
NEW = 24
# A prompt past the window: the sample chapter's opening (the local layers then read only their
# last 512 keys), then a sentence to continue.
CHARS = 3200


@functools.lru_cache(maxsize=None)
def _prompts() -> list[list[int]]:
    from tests.helpers import ROOT

    engine = _engine(True)
    text = (ROOT / "assets" / "sample" / "python-tutorial-classes.txt").read_text(encoding="utf-8")
    tok = engine.tokenizer
    return [tok(text[:CHARS] + "\n\nIn short, a class")["input_ids"], tok("The capital of France is Paris. The capital of Germany is")["input_ids"]]


@functools.lru_cache(maxsize=None)
def _engine(exact: bool) -> TriForceEngine:
    return TriForceEngine.from_pretrained("gemma3-270m", device="cpu", exact=exact)


@functools.lru_cache(maxsize=None)
def _hf():
    """Hugging Face's model read from the same file (transformers dequantizes it)."""
    from transformers import AutoModelForCausalLM

    path = GEMMA3.final_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _hf_greedy(i: int) -> list[int]:
    hf = _hf()
    ids = _prompts()[i]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _ours(exact: bool, i: int, mode: str) -> list[int]:
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=NEW, ignore_eos=True))
    return _engine(exact).run(_prompts()[i], cfg).token_ids


def test_the_file_is_gemma_3_with_its_window():
    s = _engine(True).target.spec
    assert s.model_type == "gemma3_text" and s.sandwich and s.head_dim == 256 and s.num_kv_heads == 1
    assert s.sliding_windows == ((512,) * 5 + (None,)) * 3
    assert len(_prompts()[0]) > 600  # past the window
    types = {n for layer in _engine(True).target.layers for n in layer.wqkv.type_names()}
    assert {"Q5_0", "Q8_0"} <= types


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("mode", ["autoregressive", "lookup"])
def test_exact_greedy_equals_hugging_face_on_the_same_file(i, mode):
    assert _ours(True, i, mode) == _hf_greedy(i)


@pytest.mark.parametrize("mode", ["lookup", "retrieval"])
def test_the_default_arithmetic_speculates_losslessly(mode):
    assert _ours(False, 0, mode) == _ours(False, 0, "autoregressive")


def test_it_writes_english():
    text = _engine(False).tokenizer.decode(_ours(False, 1, "autoregressive"))
    assert text.lstrip().startswith("Berlin")
