"""The picker pairs a GGUF file with a draft from the same folders, as desktop tools offer one:
the smallest other file with the same token list (tokens and ids, from the header alone) whose
size is at most `registry.DRAFT_SHARE` of the target's. A file of another vocabulary, one too
large to pay as a draft, or one the engine does not run is never offered; a pick loads the pair.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import make_hf

from triforce_core.models import gguf_header
from triforce_core.models.folders import ModelFolders
from triforce_core.models.gguf_file import header_facts
from triforce_core.models.loading import DEMO_TARGET
from triforce_core.serving.registry import DRAFT_SHARE, ServedModels

BIG = dict(vocab_size=300, num_hidden_layers=6, sliding_window_pattern=6, hidden_size=128, intermediate_size=512)
SMALL = dict(vocab_size=300, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, head_dim=16,
             num_key_value_heads=1)


@pytest.fixture(scope="module")
def shelf(tmp_path_factory) -> Path:
    shelf = tmp_path_factory.mktemp("shelf")
    write_gguf(make_hf("gemma3", seed=0, **BIG), shelf / "gemma-big.gguf", {})
    write_gguf(make_hf("gemma3", seed=1, **SMALL), shelf / "gemma-small.gguf", {})
    write_gguf(make_hf("gemma3", seed=2, **{**SMALL, "num_hidden_layers": 2}), shelf / "gemma-smaller-not.gguf", {})
    write_gguf(make_hf("llama_mha", seed=3, vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
               shelf / "other-vocabulary.gguf", {})
    write_gguf(make_hf("llama_mha", seed=4, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
               shelf / "experts.gguf", {}, settings={"expert_count": 8})
    return shelf


def _served(shelf: Path) -> ServedModels:
    def load(choice):
        raise AssertionError("the catalogue loads nothing")

    return ServedModels(load, ModelFolders([], [shelf]), started=(str(DEMO_TARGET), None))


def test_the_header_names_the_vocabulary(shelf):
    big, small, other = (header_facts(shelf / n)[1] for n in ("gemma-big.gguf", "gemma-small.gguf", "other-vocabulary.gguf"))
    assert big == small and big != other and len(big) == 64
    settings = gguf_header.header_settings(shelf / "gemma-big.gguf")
    assert settings[gguf_header.VOCABULARY] == big and gguf_header.TOKENS not in settings


def test_the_picker_pairs_the_smallest_draft_that_shares_the_tokens(shelf):
    choices = {c.id: c for c in _served(shelf).choices()}
    big = next(c for i, c in choices.items() if "gemma-big" in i)
    assert big.draft == str(shelf / "gemma-small.gguf") and "draft" in big.note and "gemma-small" in big.label
    sizes = {p.name: p.stat().st_size for p in shelf.iterdir()}
    assert sizes["gemma-small.gguf"] <= DRAFT_SHARE * sizes["gemma-big.gguf"]
    # the drafts themselves are not paired (nothing is small enough beside them), nor is a file
    # of another vocabulary; the refused file is offered to nobody
    for name in ("gemma-small", "gemma-smaller-not", "other-vocabulary", "experts"):
        choice = next(c for i, c in choices.items() if name in i)
        assert choice.draft is None, name


def test_a_draft_too_large_to_pay_is_not_offered(tmp_path):
    write_gguf(make_hf("gemma3", seed=0, **BIG), tmp_path / "target.gguf", {})
    write_gguf(make_hf("gemma3", seed=2, **{**BIG, "num_hidden_layers": 3}), tmp_path / "half.gguf", {})
    files = [c for c in _served(tmp_path).choices() if c.target.startswith(str(tmp_path))]
    assert len(files) == 2 and all(c.draft is None for c in files)


def test_gemma_3_270m_is_offered_as_a_gemma_3_targets_draft(tmp_path):
    """A file with Gemma 3's own token list, four times the 270M file's size or more (a sparse
    file: only its header is read to list it), is paired with `gemma3-270m` by its name."""
    from gguf import GGUFWriter

    from bench.desktop_models import copy_tokenizer
    from triforce_core.models.chunked_file import GEMMA3 as FILE
    from triforce_core.models.gguf_file import GEMMA3, resolve

    if not FILE.installed():
        pytest.skip("the gemma3-270m packages are not installed (make install installs them)")
    small = resolve(GEMMA3)  # assembled into this run's cache
    big = tmp_path / "gemma-3-4b-like.gguf"
    writer = GGUFWriter(str(big), "gemma3")
    writer.add_block_count(34)
    copy_tokenizer(writer, small)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.truncate(big, 4 * small.stat().st_size + 1)
    choices = {c.id: c for c in _served(tmp_path).choices()}
    target = next(c for i, c in choices.items() if "gemma-3-4b-like" in i)
    assert target.draft == GEMMA3 and f"draft {GEMMA3}" in target.note
    assert choices[GEMMA3].draft is None
