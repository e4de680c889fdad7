"""Greedy decoding over a 16-bit K/V cache: a tiny pair, a prompt, each mode's settings with a
K/V dtype, and our autoregressive decoding written out as the reference."""

from __future__ import annotations

import functools

import torch

from tests.helpers.models import CPU, DRAFT_OVERRIDES, make_hf, to_ours
from triforce_core import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.config import PAPER_METHOD
from triforce_core.kv import FullCache

@functools.lru_cache(maxsize=None)
def model_pair(kind: str = "llama_gqa_llama3"):
    """Our target and draft of `kind` (float32 weights), made once."""
    return to_ours(make_hf(kind, seed=0)), to_ours(make_hf(kind, seed=11, **DRAFT_OVERRIDES))


PROMPT = torch.randint(3, 97, (160,), generator=torch.Generator().manual_seed(7)).tolist()
CACHE = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_sinks=4, draft_window=32, refresh_every=16)


def kv_config(mode: str, kv: str, cache: CacheConfig = CACHE, new: int = 40, lookup: bool = False, **spec_kw):
    """`mode`'s greedy settings (the paper's levels, or lookup) with a `kv` K/V cache."""
    spec_kw = {"lookup": True, **spec_kw} if lookup else {**PAPER_METHOD, **spec_kw}
    return GenerationConfig(speculation=SpeculationConfig(mode=mode, gamma1=2, gamma2=6, max_new_tokens=new,
                                                          ignore_eos=True, **spec_kw),
                            cache=CacheConfig(**{**cache.__dict__, "kv_dtype": kv}))


def greedy_reference(model, prompt: list[int], new: int, dtype: torch.dtype) -> tuple[list[int], list[float]]:
    """Our autoregressive greedy decoding with a `dtype` cache, written out: the prompt but its
    last token in one forward (as the engine prefills), then one token a forward; the tokens
    and each step's top-2 logit gap."""
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(prompt) + new, dtype, CPU)
    model.forward(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), cache, logits_rows=None)
    out, gaps, last = [], [], prompt[-1]
    for _ in range(new):
        logits = model.forward(torch.tensor([last]), torch.tensor([cache.length]), cache).logits[0]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        last = int(logits.argmax())
        out.append(last)
    return out, gaps


# the speculative modes (with lookup or not) whose greedy output must be autoregressive decoding's
MODES = [("triforce", False), ("retrieval", False), ("draft", False), ("lookup", True), ("triforce", True)]
