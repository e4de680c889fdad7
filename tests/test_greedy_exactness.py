"""Greedy output of every mode equals Hugging Face's `generate(do_sample=False)` token for token.

Prompts are longer than the retrieval budget (so retrieval is really sparse) and the small
draft's window (so StreamingLLM really evicts). A divergence would be tolerated only at a genuine
near-tie of HF's top-2 logits (gap < 1e-4); the checks report any such case.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.greedy import NEW, TARGETS, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.models import perturbed, to_ours

from triforce_core import CacheConfig, TriForceEngine

GAMMAS = [(1, 3), (2, 6), (3, 9)]


@pytest.mark.parametrize("kind", TARGETS)
def test_autoregressive_matches_hf(kind):
    _, t, _, ids, ref, gaps = hf_greedy(kind)
    res = TriForceEngine(t).run(ids, greedy_config("autoregressive", 1, 1))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert set(res.levels) == {"target"}


CASES = [(k, (2, 6)) for k in TARGETS] + [("llama_gqa_llama3", g) for g in GAMMAS if g != (2, 6)]


@pytest.mark.parametrize("kind,gammas", CASES, ids=[f"{k}-g{g[0]}-{g[1]}" for k, g in CASES])
@pytest.mark.parametrize("mode", ["triforce", "retrieval", "draft"])
@pytest.mark.parametrize("variant", ["paper", "adaptive", "lookup"])
def test_speculative_modes_match_hf_with_random_draft(kind, mode, gammas, variant):
    """A random draft and a sparse retrieval cache: most proposals are rejected (adaptive: the
    draft length then shrinks and plain target steps come in between). The draft proposes
    whatever its confidence (its gate has a test of its own)."""
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    extra = {"adaptive_gamma": True} if variant == "adaptive" else {}
    extra["draft_confidence"] = 0.0
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, *gammas, lookup=variant == "lookup", **extra))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.new_tokens == NEW
    if kind == "mistral_window" and mode != "draft":
        # every layer sliding, its window within the budget: the retrieval level's local layers
        # read exactly the target's window (`kv.retrieval`), so the target accepts all it
        # proposes (a lookup's copies may still be rejected)
        assert variant == "lookup" or res.stats.acceptance["target"] == 1.0
    else:
        assert res.stats.acceptance["target"] < 0.9  # proposals really were rejected


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("mode", ["triforce", "draft"])
def test_the_draft_gate_matches_hf(kind, mode):
    """The small draft proposes only tokens its law is sure of (`draft_confidence`): at 0.1 this
    random draft keeps some of its proposals and drops others, and the output is HF's."""
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    engine = TriForceEngine(t, d)

    def draft_tokens(res) -> int:
        return sum(n for k, n in res.stats.proposed_by_proposer.items() if k.startswith("draft:"))

    gated = engine.run(ids, greedy_config(mode, 2, 6, draft_confidence=0.1))
    assert_same_as_hf(gated.token_ids, ref, gaps)
    assert 0 < draft_tokens(gated) < draft_tokens(engine.run(ids, greedy_config(mode, 2, 6)))


@pytest.mark.parametrize("mode", ["triforce", "draft"])
def test_same_draft_is_always_accepted(mode):
    """Draft = the target itself with a window covering everything: every proposal is accepted."""
    _, t, _, ids, ref, gaps = hf_greedy("llama_gqa_llama3")
    cache = CacheConfig(budget=512, chunk_size=4, draft_sinks=4, draft_window=512)
    res = TriForceEngine(t, t).run(ids, greedy_config(mode, 2, 6, cache))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.acceptance["target"] == 1.0
    if mode == "triforce":
        assert res.stats.acceptance["retrieval"] == 1.0
    assert res.stats.mean_accepted > 6  # gamma2 accepted + a bonus per round (last round cut)


def test_dense_retrieval_is_always_accepted():
    """When the prompt fits the budget, the retrieval level is the exact target."""
    _, t, _, ids, ref, gaps = hf_greedy("qwen2_tied")
    cache = CacheConfig(budget=1024, chunk_size=4)
    res = TriForceEngine(t).run(ids, greedy_config("retrieval", 1, 5, cache))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.acceptance["target"] == 1.0


@pytest.mark.parametrize("mode", ["triforce", "draft", "retrieval"])
def test_partial_acceptance(mode):
    """A perturbed copy of the target as draft and a wider budget: acceptance strictly in between."""
    target, t, _, ids, ref, gaps = hf_greedy("llama_gqa_llama3")
    d = to_ours(perturbed(target, 0.02))
    cache = CacheConfig(budget=128, chunk_size=4, draft_sinks=4, draft_window=192)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, cache))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert 0.05 < res.stats.acceptance["target"] < 0.95
    assert res.stats.mean_accepted > 1.0


def test_no_refresh_and_frequent_refresh_agree():
    """Refreshing the retrieval selection changes speed, never the output."""
    _, t, d, ids, ref, gaps = hf_greedy("llama_gqa_llama3")
    for every in (0, 4):
        cache = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_window=32, refresh_every=every,
                            refresh_acceptance=0.0)
        res = TriForceEngine(t, d).run(ids, greedy_config("triforce", 2, 6, cache))
        assert_same_as_hf(res.token_ids, ref, gaps)
        assert (res.stats.refreshes == 0) == (every == 0)


# -- context lookup -------------------------------------------------------------------------
LOOKUP_COMBOS = [
    ("lookup", {}),
    ("lookup", {"lookup_agree": False}),  # runs never cut by a rival occurrence
    ("lookup", {"lookup_backoff": False}),  # no token from the shorter context
    ("lookup", {"lookup_min_match": 2}),  # the backoff by single tokens, often
    ("lookup", {"lookup_row_cost": 0.0}),  # rows free: every token lookup offers
    ("lookup", {"lookup_row_cost": 0.9}),  # only where its acceptance has been near certain
    ("lookup", {"lookup_row_cost": None}),  # this machine's measured price
    ("triforce", {}),  # the default: lookup runs to the target, lookup then small draft below retrieval
    ("retrieval", {}),
    ("draft", {}),
]


def _looping_prompt(kind: str) -> tuple[list[int], list[int], list[float]]:
    """A prompt that repeats itself, and HF's greedy continuation of it: lookup finds matches
    everywhere, and the random target sometimes follows them and sometimes not."""
    target, *_ = hf_greedy(kind)
    base = torch.randint(3, target.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([base, base[:30], base, base[:20]])
    with torch.no_grad():
        out = target.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                              max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
    ref = out.sequences[0, len(ids):].tolist()
    gaps = [float(l[0].topk(2).values[0] - l[0].topk(2).values[1]) for l in out.logits]
    return ids.tolist(), ref, gaps


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("mode,extra", LOOKUP_COMBOS, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'default'}" for m, e in LOOKUP_COMBOS])
def test_lookup_combinations_match_hf(kind, mode, extra):
    """Every proposer combination the defaults can use, on a self-repeating prompt and a random one."""
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    loop_ids, loop_ref, loop_gaps = _looping_prompt(kind)
    engine = TriForceEngine(t, d)
    for g1, g2 in GAMMAS:
        res = engine.run(loop_ids, greedy_config(mode, g1, g2, lookup=True, lookup_max=16, **extra))
        assert_same_as_hf(res.token_ids, loop_ref, loop_gaps)
        assert res.stats.proposed_by_proposer.get("lookup:target", 0) > 0  # lookup really proposed
    res = engine.run(ids, greedy_config(mode, 2, 6, lookup=True, **extra))
    assert_same_as_hf(res.token_ids, ref, gaps)
