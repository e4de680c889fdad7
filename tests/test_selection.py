"""Selection that follows the target: the attention mass its verifications gave each chunk."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.models import make_hf, to_ours
from tests.helpers.greedy import assert_same_as_hf, greedy_config, hf_greedy

from triforce_core import CacheConfig, TriForceEngine
from triforce_core.decoding.events import ChunksSelected
from triforce_core.kv import FullCache, RetrievalCache
from triforce_core.models.transformer import KeyMass


def test_key_mass_is_the_attention_each_chunk_received():
    model = to_ours(make_hf("llama_gqa_llama3", seed=3))
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, 128, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(1))
    model.forward(ids[:66], torch.arange(66), cache, logits_rows=None)
    probe = KeyMass(chunk=8)
    out = model.forward(ids[66:], torch.arange(66, 70), cache, logits_rows=None, capture_queries=True, key_mass=probe)
    assert len(probe.layers) == s.num_layers
    G = s.num_heads // s.num_kv_heads
    for layer, mass in enumerate(probe.layers):
        q = out.queries[layer].transpose(0, 1)  # [H, 4, D]
        k = cache.k[layer, :, :70].repeat_interleave(G, dim=0)  # [H, 70, D]
        scores = q @ k.transpose(1, 2) * s.head_dim**-0.5
        scores = scores.masked_fill(torch.ones(4, 70, dtype=torch.bool).triu(67), float("-inf"))
        probs = scores.softmax(-1)[:, :, :64].reshape(s.num_kv_heads, G, 4, 8, 8).sum(dim=(1, 4))
        assert mass.shape == (s.num_kv_heads, 4, 8)
        torch.testing.assert_close(mass, probs, rtol=1e-5, atol=1e-6)


def test_the_selection_follows_the_mass():
    L, H, D, C = 2, 2, 4, 4
    full = FullCache(L, H, D, 256, torch.float32, torch.device("cpu"))
    full.k.normal_(generator=torch.Generator().manual_seed(0))
    full.length = 200
    cache = RetrievalCache(full, budget=24, chunk_size=C, recent=8, room=16)
    queries = torch.randn(L, H, D, generator=torch.Generator().manual_seed(1))
    by_queries = cache.select(queries, 200).chunk_ids
    mass = torch.zeros(L, H, 50)
    mass[:, 0, 7] = mass[:, 0, 30] = 1.0  # head 0 attended to chunks 7 and 30; head 1 to 12 only
    mass[:, 1, 12] = 1.0
    picked = cache.select(queries, 200, mass).chunk_ids  # k = (24 - 4 - 8) / 4 = 3 per head
    assert picked.shape == (L, H, 3)
    for layer in range(L):
        assert {7, 30} <= set(picked[layer, 0].tolist()) and 12 in picked[layer, 1].tolist()
    assert not torch.equal(picked, by_queries)


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "llama_mha", "mistral_window"])
@pytest.mark.parametrize("mode", ["triforce", "retrieval"])
def test_greedy_output_is_unchanged_by_attention_selection(kind, mode):
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    cache = CacheConfig(budget=64, chunk_size=4, recent_tokens=16, draft_window=32, refresh_every=4,
                        refresh_acceptance=0.0, select_by="attention")
    selections = []
    engine = TriForceEngine(t, d)
    for ev in engine.generate(ids, greedy_config(mode, 2, 6, cache)):
        if isinstance(ev, ChunksSelected):
            selections.append(ev)
    res = engine.run(ids, greedy_config(mode, 2, 6, cache))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.refreshes >= 3 and len(selections) >= 4
    by_queries = [ev for ev in engine.generate(ids, greedy_config(mode, 2, 6, CacheConfig(
        budget=64, chunk_size=4, recent_tokens=16, draft_window=32, refresh_every=4, refresh_acceptance=0.0,
        select_by="queries")))
        if isinstance(ev, ChunksSelected)]
    # The refreshes really chose other chunks than the queries' estimate would have.
    picked = [(s.chunk_token_spans, s.scores_or_counts) for s in selections[1:]]
    unchanged = picked == [(s.chunk_token_spans, s.scores_or_counts) for s in by_queries[1:]]
    # A sliding-window model's cache is read from its window's start: no mass is measured and the
    # queries rank the chunks as before. Elsewhere the refreshes really chose other chunks.
    assert unchanged == (kind == "mistral_window")
