"""Hugging Face's `generate(do_sample=False)` as the oracle of greedy output.

Prompts are longer than the retrieval budget (so retrieval is really sparse) and the small
draft's window (so StreamingLLM really evicts). A divergence is tolerated only at a genuine
near-tie of Hugging Face's top-2 logits (gap < TIE_GAP).
"""

from __future__ import annotations

import functools

import torch

from tests.helpers.models import DRAFT_OVERRIDES, make_hf, to_ours
from triforce_core import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.config import PAPER_METHOD

PROMPT_LEN = 160
NEW = 40
TIE_GAP = 1e-4
CACHE = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_sinks=4, draft_window=32, refresh_every=16)
TARGETS = ["llama_gqa_llama3", "llama_mha", "qwen2_tied", "mistral", "mistral_window"]


@functools.lru_cache(maxsize=None)
def hf_greedy(kind: str):
    """(Hugging Face's target, ours, our draft, the prompt's ids, Hugging Face's greedy tokens after
    it, the top-2 logit gap at each of them)."""
    target = make_hf(kind, seed=0)
    draft = make_hf(kind, seed=11, **DRAFT_OVERRIDES)
    ids = torch.randint(3, target.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = target.generate(
            ids[None],
            attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref = out.sequences[0, PROMPT_LEN:].tolist()
    gaps = [float(l[0].topk(2).values[0] - l[0].topk(2).values[1]) for l in out.logits]
    t = to_ours(target)
    return target, t, to_ours(draft), ids.tolist(), ref, gaps


def assert_same_as_hf(got: list[int], ref: list[int], gaps: list[float]) -> None:
    """`got` is Hugging Face's greedy `ref`, or leaves it only at a near-tie (see `hf_greedy`)."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < TIE_GAP, f"diverged from HF at token {i} ({a} != {b}) with top-2 gap {gaps[i]:.3g}"
            return  # a genuine tie: the continuations legitimately differ from here on


def greedy_config(mode: str, g1: int, g2: int, cache: CacheConfig = CACHE, lookup: bool = False, **spec_kw) -> GenerationConfig:
    """Lookup is off unless asked: these tests are about the model levels' acceptance."""
    if not lookup:  # the paper's levels: small draft under retrieval, a fixed gamma2
        spec_kw = {**PAPER_METHOD, **spec_kw}
    else:  # a fixed price of a verification row, not this machine's: the proposals do not depend on it
        spec_kw = {"lookup": True, "lookup_row_cost": 0.3, **spec_kw}
    spec = SpeculationConfig(mode=mode, gamma1=g1, gamma2=g2, max_new_tokens=NEW, ignore_eos=True, **spec_kw)
    return GenerationConfig(speculation=spec, cache=cache)
