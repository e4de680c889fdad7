"""The exact law of the first two sampled tokens and the chi-square test against it.

A 16-token vocabulary makes the joint law of the first two generated tokens (256 cells)
computable from Hugging Face's model and its own logits warpers; samples from a mode are
compared with it by `chi2_pvalue`. `break_verifier` is the negative control: the public
reference implementation's bug, which the same test must catch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import triforce_core.decoding.loop as speculation
from tests.helpers.models import make_hf, to_ours
from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import PAPER_METHOD
from triforce_core.decoding.sampling import VerifyResult, sample


V = 16
PROMPT_LEN = 48
N_SAMPLES = 3000
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.5, bos_token_id=None, eos_token_id=None)
# Budget 16 of 47 cached tokens: the retrieval level sees a third of the context.
CACHE = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=0)


@functools.lru_cache(maxsize=None)
def law_models():
    """(the target as Hugging Face's model, the target and the draft as ours, the prompt)."""
    target = make_hf("llama_gqa_llama3", seed=21, **SMALL)
    draft = make_hf("llama_gqa_llama3", seed=22, **{**SMALL, "num_hidden_layers": 1})
    prompt = torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
    return target, to_ours(target), to_ours(draft), prompt


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for w in warpers:
        logits = w(None, logits)
    return logits.softmax(-1)


@functools.lru_cache(maxsize=None)
def exact_joint(temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """P(x1, x2) under the target, from Hugging Face's forward and logits warpers: [V, V]."""
    target, _, _, prompt = law_models()
    return first_two_law(target, prompt, temperature, top_k, top_p)


def first_two_law(hf, prompt: list[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """P(x1, x2) after `prompt` under a Hugging Face model with its logits warpers: [V, V]."""
    ids = torch.tensor(prompt)
    v = hf.config.vocab_size
    with torch.no_grad():
        p1 = hf_warp(hf(ids[None]).logits[:, -1].double(), temperature, top_k, top_p)[0]  # [V]
        both = torch.cat([ids.repeat(v, 1), torch.arange(v)[:, None]], dim=1)  # [V, L+1]
        p2 = hf_warp(hf(both).logits[:, -1].double(), temperature, top_k, top_p)  # [V, V]
    joint = (p1[:, None] * p2).numpy()
    return joint / joint.sum()


def first_two_counts(engine: TriForceEngine, prompt: list[int], cfg: GenerationConfig, samples: int) -> np.ndarray:
    """How often each pair of first two tokens came out of `samples` independent samples."""
    v = engine.target.vocab_size
    counts = np.zeros((v, v))
    for r in engine.run_samples(prompt, cfg, samples):
        assert len(r.token_ids) == 2
        counts[r.token_ids[0], r.token_ids[1]] += 1
    return counts


def sample_counts(mode: str, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  gammas=(2, 2), lookup: bool = False, cache: CacheConfig = CACHE, penalty: dict | None = None,
                  samples: int = N_SAMPLES, **spec_kw) -> np.ndarray:
    """`first_two_counts` of `samples` samples of `mode` after the law's prompt."""
    _, t, d, prompt = law_models()
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **(penalty or {})),
        speculation=SpeculationConfig(mode=mode, gamma1=gammas[0], gamma2=gammas[1], max_new_tokens=2, ignore_eos=True,
                                      lookup=lookup, **{**(LOOKUP if lookup else PAPER), **spec_kw}),
        cache=cache,
    )
    return first_two_counts(TriForceEngine(t, d), prompt, cfg, samples)


def chi2_pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected below 5 are pooled into one."""
    obs, exp = counts.ravel(), law.ravel() * counts.sum()
    small = exp < 5
    o = np.append(obs[~small], obs[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    return float(chisquare(o, e).pvalue)


PAPER = {k: v for k, v in PAPER_METHOD.items() if k != "lookup"}  # with lookup=False: the paper's levels
# Rows free (lookup_row_cost 0): lookup proposes every token it finds, whatever it has seen
# accepted, so the point masses' verification decides many tokens (the price only shortens
# proposals, which any prefix-determined length may: `test_long_sample_exactness.py`).
LOOKUP = {"lookup_min_match": 1, "lookup_row_cost": 0.0}


def broken_verify(draft_tokens, q, p, generator):
    """The reference implementation's bug: after a rejection, resample from p, not the residual.

    For a point-mass proposal (q None, context lookup) that is: resample from p without removing
    the rejected token."""
    gamma = len(draft_tokens)
    u = torch.rand(gamma, generator=generator, device=generator.device)  # (a GPU's generator: TRIFORCE_TEST_DEVICE)
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if q is None else q[i, x]
        if u[i] * q_x >= p[i, x]:
            return VerifyResult(accepted=i, token=sample(p[i], generator), bonus=False)
    return VerifyResult(accepted=gamma, token=sample(p[gamma], generator), bonus=True)


def break_verifier(monkeypatch) -> None:
    """Every level verifies with `broken_verify` (the negative controls)."""
    monkeypatch.setattr(speculation, "verify_stochastic", broken_verify)
    monkeypatch.setattr(speculation.MiddleLevel, "verify", staticmethod(broken_verify))


# The selection following the target's attention, refreshed after every round: the second token
# is drafted over chunks chosen from what the target attended to while verifying the first.
FOLLOWING = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=1,
                        refresh_acceptance=0.0, select_by="attention")
