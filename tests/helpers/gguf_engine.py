"""A tiny Llama target and its one-layer draft written as GGUF files and loaded, and their
greedy answers in a mode."""

from __future__ import annotations

import torch

from tests.helpers.gguf_files import LLAMA, write_gguf
from tests.helpers.models import make_hf
from triforce_core import CacheConfig, GenerationConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import PAPER_METHOD

CACHE = CacheConfig(budget=48, chunk_size=4, recent_tokens=12, draft_sinks=4, draft_window=24, refresh_every=16)
NEW = 24


def gguf_pair(folder, types: dict, seed: int = 0) -> TriForceEngine:
    """A tiny Llama target and its one-layer draft written as GGUF files of `types`, loaded."""
    target = write_gguf(make_hf("llama_mha", seed=seed, **LLAMA), folder / "target.gguf", types)
    draft = write_gguf(make_hf("llama_mha", seed=5, **{**LLAMA, "num_hidden_layers": 1}), folder / "draft.gguf", types)
    return TriForceEngine.from_pretrained(str(target), draft=str(draft), device="cpu")


def repeating_prompt() -> list[int]:
    """Random tokens, then the same run again: lookup finds its continuations."""
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    return ids + ids


def greedy_answer(engine, mode: str, ids: list[int] | None = None) -> list[int]:
    """`mode`'s greedy answer (lookup, triforce: the paper's hierarchy, or autoregressive) to `ids`
    (`repeating_prompt()` when None)."""
    spec = {"lookup": True} if mode == "lookup" else dict(PAPER_METHOD)
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=NEW, ignore_eos=True, **spec), cache=CACHE)
    return engine.run(repeating_prompt() if ids is None else ids, cfg).token_ids
