"""The KV caches: O(1) rollback, StreamingLLM eviction, retrieval selection and its exactness.

Model-based tests use the tiny random checkpoints of tests/helpers/models.py (CPU, float32). Retrieval
selection is checked on hand-built full caches against a plain loop implementation of the
scoring rule (chunk-mean keys, softmax per query head, summed over the grouped query heads).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.models import CPU, DRAFT_OVERRIDES, VOCAB, make_hf, to_ours

from triforce_core.kv import CacheFullError, FullCache, KVStore, RetrievalCache, StreamingCache
from triforce_core.models.rotary import apply_rotary
from triforce_core.kv import store

F32 = torch.float32


# -- helpers -----------------------------------------------------------------------------------


_MODELS: dict = {}


def _model(kind: str, seed: int = 0, **overrides):
    """Our decoder (and the HF oracle) for a tiny config, built once per test session."""
    key = (kind, seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        hf = make_hf(kind, seed=seed, **overrides)
        _MODELS[key] = (hf, to_ours(hf))
    return _MODELS[key]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _full_for(model, capacity: int) -> FullCache:
    s = model.spec
    return FullCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, model.dtype, CPU)


def _filled_full(k: torch.Tensor, v: torch.Tensor, capacity: int | None = None) -> FullCache:
    """A FullCache holding keys/values k, v: [L, Hkv, T, D], written through the cache API."""
    L, Hkv, T, D = k.shape
    full = FullCache(L, Hkv, D, capacity or T + 8, k.dtype, CPU)
    for layer in range(L):
        full.view(layer, k[layer], v[layer], None)
    full.advance(T)
    return full


def _rotate(x: torch.Tensor, rotary, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., S, D] by the (unscaled) rotary angles of `positions` [S]."""
    cos, sin = rotary.cos_sin(positions, x.dtype, scaled=False)
    return apply_rotary(x, cos, sin)


def _reference_select(k, queries, upto, budget, C, recent):
    """Straightforward loop implementation of the documented selection rule.

    Returns (dense, recent_start, chunk_ids [L][Hkv] list of lists or None,
             rows [L][Hkv] list of gathered token indices).
    """
    L, Hkv, _, D = k.shape
    H = queries.shape[1]
    G = H // Hkv
    r0 = max(C, upto - recent) // C * C
    n_recent = upto - r0
    n_keep = (budget - C - n_recent) // C
    cands = list(range(1, r0 // C))
    if upto <= budget or n_keep >= len(cands):
        rows = [[list(range(upto)) for _ in range(Hkv)] for _ in range(L)]
        return True, 0, None, rows
    ids, rows = [], []
    for layer in range(L):
        ids.append([])
        rows.append([])
        for h in range(Hkv):
            means = [k[layer, h, c * C : (c + 1) * C].double().mean(dim=0) for c in cands]
            mass = [0.0] * len(cands)
            for g in range(G):
                q = queries[layer, h * G + g].double()
                scores = [float(q @ m) / math.sqrt(D) for m in means]
                top = max(scores)
                e = [math.exp(s - top) for s in scores]
                z = sum(e)
                for i in range(len(cands)):
                    mass[i] += e[i] / z
            best = sorted(range(len(cands)), key=lambda i: -mass[i])[:n_keep]
            chosen = sorted(cands[i] for i in best)
            ids[-1].append(chosen)
            rows[-1].append(
                list(range(C)) + [t for c in chosen for t in range(c * C, (c + 1) * C)] + list(range(r0, upto))
            )
    return False, r0, ids, rows


def _gather(x: torch.Tensor, rows) -> torch.Tensor:
    """x [L, Hkv, T, D] -> [L, Hkv, n, D] picking rows[l][h] (all the same length)."""
    return torch.stack(
        [torch.stack([x[l, h, rows[l][h]] for h in range(x.shape[1])]) for l in range(x.shape[0])]
    )


# -- 1. rollback -------------------------------------------------------------------------------


def test_a_steps_rotary_rows_are_the_tables_and_the_positions_own():
    """A decoding step's consecutive positions read the precomputed block as views; any other
    positions (a block boundary crossed, out of order) are computed or gathered: every way gives
    the values of computing those positions alone, bit for bit."""
    rotary = _model("llama_gqa_llama3")[1].rotary
    for positions in ([5], [300, 301, 302], [254, 255, 256, 257], [9, 4, 4], [511]):
        p = torch.tensor(positions)
        cos, sin = rotary.cos_sin(p, torch.float32)
        want_cos, want_sin = rotary._compute(p, torch.float32, True)
        assert cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "mistral_window"])
def test_full_cache_rollback_is_exact(kind):
    """Truncate + rewrite gives exactly what a cache that only saw the final sequence gives."""
    hf, model = _model(kind)
    n_prefix, n_branch = 60, 7  # > 48: the mistral_window layers slice the cache
    prefix = _ids(n_prefix, 10)
    branch_a = _ids(n_branch, 11)
    branch_b = _ids(n_branch, 12)
    assert not torch.equal(branch_a, branch_b)
    end = n_prefix + n_branch
    pos_branch = torch.arange(n_prefix, end)

    cache = _full_for(model, 96)
    model.forward(prefix, torch.arange(n_prefix), cache, logits_rows=None)
    la = model.forward(branch_a, pos_branch, cache).logits
    assert cache.length == end
    cache.truncate(n_prefix)  # reject the whole branch
    assert cache.length == n_prefix
    lb = model.forward(branch_b, pos_branch, cache).logits

    fresh = _full_for(model, 96)
    model.forward(prefix, torch.arange(n_prefix), fresh, logits_rows=None)
    lf = model.forward(branch_b, pos_branch, fresh).logits

    assert torch.equal(lb, lf)  # same computation on the same cache contents: bit-identical
    assert torch.equal(cache.k[:, :, :end], fresh.k[:, :, :end])
    assert torch.equal(cache.v[:, :, :end], fresh.v[:, :, :end])
    assert (la - lb).abs().max() > 1e-2  # the discarded branch really produced other logits

    # Roll back into the prefix (a partial acceptance), then re-feed the rest plus branch b.
    cache.truncate(41)
    lr = model.forward(torch.cat([prefix[41:], branch_b]), torch.arange(41, end), cache).logits
    assert torch.allclose(lr[-n_branch:], lf, atol=1e-5, rtol=0)

    # And the whole final sequence agrees with Hugging Face's model.
    with torch.no_grad():
        ref = hf(torch.cat([prefix, branch_b])[None]).logits[0, -n_branch:]
    assert (lb - ref).abs().max() < 1e-4


def test_truncate_and_reserve_limits():
    cache = KVStore(2, 2, 4, capacity=10, dtype=F32, device=CPU)
    cache.advance(6)
    with pytest.raises(ValueError):
        cache.truncate(7)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    assert cache.length == 6  # a refused truncate changes nothing
    cache.reserve(4)  # exactly fills the capacity: allowed
    with pytest.raises(CacheFullError):
        cache.reserve(5)
    cache.truncate(0)
    cache.reserve(10)
    with pytest.raises(CacheFullError):
        cache.reserve(11)
    assert issubclass(CacheFullError, RuntimeError)

    full = FullCache(1, 1, 4, capacity=8, dtype=F32, device=CPU)
    full.advance(3)
    with pytest.raises(ValueError):
        full.truncate(4)
    with pytest.raises(CacheFullError):
        full.reserve(6)
    with pytest.raises(ValueError):
        KVStore(1, 1, 4, capacity=0, dtype=F32, device=CPU)


def test_make_room_grows_with_room_for_later_turns_and_keeps_the_tokens():
    cache = KVStore(1, 2, 4, capacity=100, dtype=F32, device=CPU)
    cache.k[:, :, :60] = torch.randn(1, 2, 60, 4)
    cache.advance(60)
    kept = cache.k[:, :, :60].clone()
    cache.make_room(90)  # fits: nothing is reallocated
    assert cache.capacity == 100
    k = cache.k
    cache.make_room(110)  # a quarter of the capacity beyond the need
    assert cache.capacity == 135 and cache.k is not k
    assert torch.equal(cache.k[:, :, :60], kept) and cache.length == 60
    k = cache.k
    cache.make_room(130)  # the next turn fits in what the last growth left
    assert cache.k is k and cache.capacity == 135
    big = KVStore(1, 1, 4, capacity=40_000, dtype=F32, device=CPU)
    big.make_room(40_001)
    assert big.capacity == 40_001 + store.GROW_SLACK  # the extra is bounded


def test_full_cache_sliding_window_view():
    full = FullCache(1, 2, 4, capacity=32, dtype=F32, device=CPU)
    k = torch.randn(2, 20, 4, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 20, 4, generator=torch.Generator().manual_seed(1))
    keys, values, start = full.view(0, k[:, :12], v[:, :12], 8)
    assert start == 0 and keys.shape[1] == 12  # nothing to cut yet
    full.advance(12)
    keys, values, start = full.view(0, k[:, 12:15], v[:, 12:15], 8)
    # The first new query (position 12) sees keys > 12 - 8, i.e. from position 5 on; the view
    # begins at the multiple of the attention's blocks below it (here 0), the mask does the rest.
    assert start == 0
    assert torch.equal(keys, k[:, :15]) and torch.equal(values, v[:, :15])
    keys, _, start = full.view(0, k[:, 12:15], v[:, 12:15], None)
    assert start == 0 and torch.equal(keys, k[:, :15])
    # past a block: from the block that holds the first query's window (position 600 - 8 + 1 = 593)
    from triforce_core.models.native_attention import BLOCK

    long = FullCache(1, 2, 4, capacity=700, dtype=F32, device=CPU)
    kl = torch.randn(2, 603, 4, generator=torch.Generator().manual_seed(2))
    long.view(0, kl[:, :600], kl[:, :600], 8)
    long.advance(600)
    keys, _, start = long.view(0, kl[:, 600:], kl[:, 600:], 8)
    assert start == 593 // BLOCK * BLOCK == 512 and torch.equal(keys, kl[:, 512:603])


# -- 2. StreamingLLM eviction ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "llama_yarn", "qwen2_tied"])
def test_streaming_compaction_rebases_keys(kind):
    _, model = _model(kind)
    s = model.spec
    sinks, window, margin = 4, 16, 8
    cache = StreamingCache(s.num_layers, s.num_kv_heads, s.head_dim, sinks, window, margin, model.rotary, F32, CPU)
    assert cache.slack == 16 and cache.capacity == sinks + window + 16 + margin
    tokens = _ids(39, 20)

    def feed(ids):
        cache.reserve(len(ids))
        pos = cache.positions(123456, len(ids))  # the logical start is ignored: slot positions
        assert torch.equal(pos, torch.arange(cache.length, cache.length + len(ids)))
        return model.forward(ids, pos, cache, logits_rows=slice(-1, None)).logits

    feed(tokens[:20])
    feed(tokens[20:36])
    assert cache.length == 36 and cache.room == 0
    cache.compact()  # length == sinks + window + slack: nothing to do yet
    assert cache.length == 36 and cache.evicted == 0
    feed(tokens[36:39])
    k_before = cache.k[:, :, :39].clone()
    v_before = cache.v[:, :, :39].clone()

    cache.compact()
    keep_from = 39 - window  # 23
    shift = keep_from - sinks  # 19 tokens dropped
    assert cache.length == sinks + window
    assert cache.evicted == shift
    assert cache.room == cache.slack
    # Sinks untouched, values moved verbatim.
    assert torch.equal(cache.k[:, :, :sinks], k_before[:, :, :sinks])
    assert torch.equal(cache.v[:, :, :sinks], v_before[:, :, :sinks])
    assert torch.equal(cache.v[:, :, sinks : sinks + window], v_before[:, :, keep_from:39])
    # Every layer: the kept keys are the old ones un-rotated from their old slot and rotated to
    # the new one (independent of the engine's single shift rotation).
    old_pos = torch.arange(keep_from, 39)
    new_pos = torch.arange(sinks, sinks + window)
    expect = _rotate(_rotate(k_before[:, :, keep_from:39], model.rotary, -old_pos), model.rotary, new_pos)
    assert torch.allclose(cache.k[:, :, sinks : sinks + window], expect, atol=1e-5, rtol=1e-5)
    # Layer 0: keys depend only on the token, so they must equal the model's own keys for those
    # tokens written at the new slots (for yarn this includes the attention scaling once).
    ref = _full_for(model, window)
    model.forward(tokens[keep_from:39], new_pos, ref, logits_rows=None)
    assert torch.allclose(cache.k[0, :, sinks : sinks + window], ref.k[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(cache.v[0, :, sinks : sinks + window], ref.v[0], atol=1e-6, rtol=0)

    # New tokens continue right after the kept window.
    assert torch.equal(cache.positions(39, 3), torch.arange(sinks + window, sinks + window + 3))
    feed(_ids(3, 21))
    assert cache.length == sinks + window + 3
    cache.compact()  # below the slack: nothing
    assert cache.length == sinks + window + 3 and cache.evicted == shift
    cache.compact(force=True)
    assert cache.length == sinks + window and cache.evicted == shift + 3
    cache.compact(force=True)  # nothing beyond sinks + window left to evict
    assert cache.length == sinks + window and cache.evicted == shift + 3


def test_streaming_compaction_equals_never_seeing_the_middle():
    """One-layer draft: after compaction the cache is exactly that of sinks + window tokens."""
    _, draft = _model("llama_gqa_llama3", seed=1, **DRAFT_OVERRIDES)
    s = draft.spec
    assert s.num_layers == 1
    sinks, window, margin = 4, 16, 8

    def new_cache():
        return StreamingCache(s.num_layers, s.num_kv_heads, s.head_dim, sinks, window, margin, draft.rotary, F32, CPU)

    tokens = _ids(50, 30)
    nxt = _ids(4, 31)
    cache = new_cache()
    for a, b in ((0, 30), (30, 37), (37, 50)):  # 50 > sinks + window + slack after the last
        if cache.room < b - a:
            cache.compact(force=True)
        cache.reserve(b - a)
        draft.forward(tokens[a:b], cache.positions(a, b - a), cache, logits_rows=None)
    cache.compact(force=True)
    assert cache.length == sinks + window
    got = draft.forward(nxt, cache.positions(50, 4), cache).logits

    kept = torch.cat([tokens[:sinks], tokens[-window:]])
    ref_cache = new_cache()
    draft.forward(kept, ref_cache.positions(0, len(kept)), ref_cache, logits_rows=None)
    want = draft.forward(nxt, ref_cache.positions(len(kept), 4), ref_cache).logits
    assert cache.evicted == 50 - sinks - window
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert torch.allclose(cache.k[:, :, : cache.length], ref_cache.k[:, :, : ref_cache.length], atol=1e-5, rtol=1e-5)


# -- 3. retrieval selection --------------------------------------------------------------------


def test_chunk_means_and_low_water():
    g = torch.Generator().manual_seed(40)
    L, Hkv, D, C = 2, 2, 4, 4
    k = torch.randn(L, Hkv, 40, D, generator=g)
    full = _filled_full(k, torch.zeros_like(k), capacity=64)

    def plain(n_chunks, c=C):
        return full.k[:, :, : n_chunks * c].reshape(L, Hkv, n_chunks, c, D).float().mean(dim=3)

    m = full.chunk_means(C, 10).clone()
    assert m.shape == (L, Hkv, 10, D) and m.dtype == torch.float32
    assert torch.allclose(m, plain(10), atol=1e-6)
    with pytest.raises(ValueError):
        full.chunk_means(C, 11)

    # The means are cached: a change that bypasses the cache API is not seen ...
    full.k[:, :, 5] += 100.0
    assert torch.equal(full.chunk_means(C, 10), m)
    # ... until a truncate below that chunk lowers the low-water mark.
    full.truncate(6)
    assert full.low_water == 6
    assert torch.allclose(full.chunk_means(C, 1), plain(1), atol=1e-6)
    for layer in range(L):  # rewrite tokens 6.. with new keys
        full.view(layer, torch.randn(Hkv, 34, D, generator=g), torch.zeros(Hkv, 34, D), None)
    full.advance(34)
    assert torch.allclose(full.chunk_means(C, 10), plain(10), atol=1e-6)
    assert full.chunk_means(C, 10)[:, :, 1].abs().max() > 10  # the +100 of token 5 is seen now

    # A truncate into the middle of a chunk; several truncates before the next call.
    full.truncate(30)
    for layer in range(L):
        full.view(layer, torch.randn(Hkv, 10, D, generator=g), torch.zeros(Hkv, 10, D), None)
    full.advance(10)
    full.truncate(37)
    for layer in range(L):
        full.view(layer, torch.randn(Hkv, 3, D, generator=g), torch.zeros(Hkv, 3, D), None)
    full.advance(3)
    assert torch.allclose(full.chunk_means(C, 10), plain(10), atol=1e-6)
    # A smaller call after a truncate, then a larger one after rewriting.
    full.truncate(9)
    assert torch.allclose(full.chunk_means(C, 2), plain(2), atol=1e-6)
    for layer in range(L):
        full.view(layer, torch.randn(Hkv, 31, D, generator=g), torch.zeros(Hkv, 31, D), None)
    full.advance(31)
    assert torch.allclose(full.chunk_means(C, 10), plain(10), atol=1e-6)
    # Another chunk size recomputes from scratch.
    assert torch.allclose(full.chunk_means(8, 5), plain(5, 8), atol=1e-6)
    assert torch.allclose(full.chunk_means(C, 10), plain(10), atol=1e-6)

    # Half-precision keys: the means are computed in float32.
    half = _filled_full(k.to(torch.bfloat16), k.to(torch.bfloat16))
    want = half.k[:, :, :40].float().reshape(L, Hkv, 10, C, D).mean(dim=3)
    got = half.chunk_means(C, 10)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)


def test_retrieval_selects_planted_chunks_per_kv_head():
    g = torch.Generator().manual_seed(50)
    L, Hkv, G, D, C, T = 2, 2, 2, 8, 4, 64
    H = Hkv * G
    k = 0.1 * torch.randn(L, Hkv, T, D, generator=g)
    v = torch.randn(L, Hkv, T, D, generator=g)
    q = torch.randn(L, H, D, generator=g)
    planted = {(0, 0): 5, (0, 1): 9, (1, 0): 11, (1, 1): 3}
    for (layer, h), c in planted.items():
        direction = q[layer, h * G] + q[layer, h * G + 1]
        k[layer, h, c * C : (c + 1) * C] = 4 * direction / direction.norm() + 0.05 * torch.randn(C, D, generator=g)
    full = _filled_full(k, v)
    recent = 8
    # budget = sink chunk + one chunk + 8 recent tokens: exactly one chunk per (layer, KV head).
    rc = RetrievalCache(full, budget=16, chunk_size=C, recent=recent, room=8)
    sel = rc.select(q, T)
    assert not sel.dense and sel.recent_start == T - recent
    assert sel.chunk_ids.shape == (L, Hkv, 1)
    for (layer, h), c in planted.items():
        assert sel.chunk_ids[layer, h].tolist() == [c]
        assert torch.equal(rc.k[layer, h, C : 2 * C], k[layer, h, c * C : (c + 1) * C])
        assert torch.equal(rc.v[layer, h, C : 2 * C], v[layer, h, c * C : (c + 1) * C])
    assert rc.length == 16
    assert torch.equal(rc.k[:, :, :C], k[:, :, :C]) and torch.equal(rc.v[:, :, :C], v[:, :, :C])
    assert torch.equal(rc.k[:, :, 2 * C : 16], k[:, :, T - recent :])
    assert torch.equal(rc.v[:, :, 2 * C : 16], v[:, :, T - recent :])
    # Every (layer, KV head) pair chose a different chunk once; sink and recent chunks always.
    counts = sel.chunk_counts.tolist()
    assert counts[0] == L * Hkv and counts[-2:] == [L * Hkv] * 2
    assert [counts[c] for c in (3, 5, 9, 11)] == [1, 1, 1, 1]
    assert sum(counts) == 4 + 3 * L * Hkv
    assert [(a, b) for a, b, _ in sel.spans()] == [(0, 4), (12, 16), (20, 24), (36, 40), (44, 48), (56, 60), (60, 64)]

    # With room for two chunks the planted chunk stays, the rest follows the reference rule.
    rc2 = RetrievalCache(full, budget=20, chunk_size=C, recent=recent, room=8)
    sel2 = rc2.select(q, T)
    ref_ids = _reference_select(k, q, T, 20, C, recent)[2]
    assert sel2.chunk_ids.tolist() == ref_ids
    for (layer, h), c in planted.items():
        assert c in ref_ids[layer][h]


def test_retrieval_grouped_query_aggregation():
    """The chunk with the largest summed per-head softmax wins, not that of one head or of
    the summed raw scores."""
    L, Hkv, G, D, C = 1, 2, 2, 4, 4
    T, recent = 24, 4  # candidates: chunks 1..4; recent tokens 20..23
    a = 2.0  # query scale: score = q . m / sqrt(4) = m[axis] for q = 2 * e_axis
    q = torch.zeros(L, Hkv * G, D)
    q[0, 0, 0] = q[0, 2, 0] = a  # query head 0 of each KV head reads axis 0
    q[0, 1, 1] = q[0, 3, 1] = a  # query head 1 reads axis 1
    means = torch.zeros(Hkv, 6, D)
    # KV head 0: head 0 strongly prefers chunk 3, head 1 prefers chunk 1 and hates chunk 3.
    #   softmax sums: chunk 3 ~ 0.993, chunk 1 ~ 0.789 -> chunk 3; summed raw scores pick chunk 1.
    means[0, 1] = torch.tensor([0.0, 2.0, 0, 0])
    means[0, 3] = torch.tensor([6.0, -100.0, 0, 0])
    # KV head 1: head 0 mildly prefers chunk 4, head 1 strongly prefers chunk 2.
    #   softmax sums: chunk 2 ~ 1.12, chunk 4 ~ 0.35 -> chunk 2; head 0 alone would pick chunk 4.
    means[1, 2] = torch.tensor([0.0, 3.0, 0, 0])
    means[1, 4] = torch.tensor([0.5, -3.0, 0, 0])
    k = means.repeat_interleave(C, dim=1)[None]  # every key of a chunk equals its mean
    full = _filled_full(k, torch.randn(k.shape, generator=torch.Generator().manual_seed(0)))
    rc = RetrievalCache(full, budget=12, chunk_size=C, recent=recent, room=4)  # k = 1 chunk
    sel = rc.select(q, T)
    assert sel.chunk_ids[0].tolist() == [[3], [2]]

    # The decision really depends on the aggregation rule (guards the construction above).
    scores = torch.einsum("hgd,hcd->hgc", q[0].view(Hkv, G, D), means[:, 1:5]) * D**-0.5
    assert scores.sum(1).argmax(-1).tolist() == [0, 1]  # summed raw scores: chunks 1 and 2
    assert scores[:, 1].argmax(-1).tolist() == [0, 1]  # query head 1 only: chunks 1 and 2
    assert scores[:, 0].argmax(-1).tolist() == [2, 3]  # query head 0 only: chunks 3 and 4
    ref = _reference_select(full.k[:, :, :T], q, T, 12, C, recent)
    assert ref[2] == [[[3], [2]]]


def test_retrieval_selection_sweep_matches_reference():
    g = torch.Generator().manual_seed(60)
    L, Hkv, G, D, C, T = 2, 2, 2, 8, 4, 80
    k = torch.randn(L, Hkv, T, D, generator=g)
    v = torch.randn(L, Hkv, T, D, generator=g)
    full = _filled_full(k, v)
    n_checked = n_sparse = 0
    for budget in (12, 16, 20, 28, 40, 64, 80, 100):
        for recent in (1, 4, 6, 9):
            if recent > budget - 2 * C:  # outside what CacheConfig accepts
                continue
            rc = RetrievalCache(full, budget=budget, chunk_size=C, recent=recent, room=8)
            for upto in (0, 1, 3, 4, 5, 17, 33, 47, 64, 79, 80):
                q = torch.randn(L, Hkv * G, D, generator=g)
                sel = rc.select(q, upto)
                dense, r0, ids, rows = _reference_select(k, q, upto, budget, C, recent)
                where = f"budget={budget} recent={recent} upto={upto}"
                assert rc.length <= budget, where
                assert sel.upto == upto and sel.dense == dense, where
                n_chunks = (upto + C - 1) // C
                assert sel.chunk_counts.shape == (n_chunks,), where
                if dense:
                    assert rc.length == upto and sel.chunk_ids is None, where
                    assert torch.equal(rc.k[:, :, :upto], k[:, :, :upto]), where
                    assert torch.equal(rc.v[:, :, :upto], v[:, :, :upto]), where
                    assert sel.chunk_counts.tolist() == [L * Hkv] * n_chunks, where
                    continue
                n_sparse += 1
                assert sel.recent_start == r0, where
                assert sel.chunk_ids.tolist() == ids, where
                n = len(rows[0][0])
                assert rc.length == n, where
                assert torch.equal(rc.k[:, :, :n], _gather(k, rows)), where
                assert torch.equal(rc.v[:, :, :n], _gather(v, rows)), where
                # Sink chunk first, recent tokens last, always.
                assert torch.equal(rc.k[:, :, :C], k[:, :, :C]), where
                assert torch.equal(rc.k[:, :, n - (upto - r0) : n], k[:, :, r0:upto]), where
                expect_counts = torch.zeros(n_chunks, dtype=torch.long)
                for per_layer in ids:
                    for chosen in per_layer:
                        expect_counts[chosen] += 1
                expect_counts[0] = L * Hkv
                expect_counts[r0 // C :] = L * Hkv
                assert torch.equal(sel.chunk_counts, expect_counts), where
                spans = sel.spans()
                assert all(cnt > 0 and b <= upto and b - a <= C for a, b, cnt in spans), where
                assert spans[-1][1] == upto, where
                n_checked += 1
    assert n_sparse >= 40  # the sweep really exercised sparse selections
    assert n_checked == n_sparse


def test_retrieval_append_from_full_and_limits():
    g = torch.Generator().manual_seed(70)
    k = torch.randn(1, 2, 40, 4, generator=g)
    v = torch.randn(1, 2, 40, 4, generator=g)
    full = _filled_full(k, v)
    rc = RetrievalCache(full, budget=16, chunk_size=4, recent=4, room=6)
    with pytest.raises(ValueError):
        rc.select(torch.randn(1, 4, 4, generator=g), 41)
    sel = rc.select(torch.randn(1, 4, 4, generator=g), 32)
    assert not sel.dense and rc.length <= 16
    n = rc.length
    rc.append_from_full(32, 38)
    assert rc.length == n + 6
    assert torch.equal(rc.k[:, :, n : n + 6], k[:, :, 32:38])
    assert torch.equal(rc.v[:, :, n : n + 6], v[:, :, 32:38])
    with pytest.raises(CacheFullError):
        rc.append_from_full(38, 40 + rc.free - 1)


# -- 4. dense retrieval is the exact target ----------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "llama_mha", "qwen2_tied"])
def test_dense_retrieval_forward_equals_full(kind):
    _, model = _model(kind)
    prompt = _ids(40, 80)
    step1, step2 = _ids(5, 81), _ids(3, 82)
    full = _full_for(model, 96)
    out = model.forward(prompt, torch.arange(40), full, logits_rows=None, capture_queries=True)
    rc = RetrievalCache(full, budget=64, chunk_size=8, recent=16, room=24)
    sel = rc.select(out.queries[:, -1], 40)
    assert sel.dense and rc.length == 40

    lf = model.forward(step1, torch.arange(40, 45), full).logits
    lr = model.forward(step1, rc.positions(40, 5), rc).logits
    assert torch.allclose(lr, lf, atol=1e-6, rtol=0)
    assert torch.equal(rc.k[:, :, :45], full.k[:, :, :45])

    # Commit like the retrieval lane: drop its own speculative KV, copy the exact KV from full.
    rc.truncate(40)
    rc.append_from_full(40, 45)
    assert rc.length == 45
    lf2 = model.forward(step2, torch.arange(45, 48), full).logits
    lr2 = model.forward(step2, rc.positions(45, 3), rc).logits
    assert torch.allclose(lr2, lf2, atol=1e-6, rtol=0)

    # A sparse selection from the model's real queries follows the reference rule.
    rc_sparse = RetrievalCache(full, budget=24, chunk_size=8, recent=8, room=8)
    sel = rc_sparse.select(out.queries[:, -1], 40)
    dense, r0, ids, rows = _reference_select(full.k, out.queries[:, -1], 40, 24, 8, 8)
    assert not sel.dense and not dense and sel.recent_start == r0 == 32
    assert sel.chunk_ids.tolist() == ids
    assert rc_sparse.length == 24
    assert torch.equal(rc_sparse.k[:, :, :24], _gather(full.k, rows))


def test_dense_retrieval_forward_equals_full_sliding_window():
    _, model = _model("mistral_window")  # 48-token window on every layer
    prompt, step = _ids(70, 90), _ids(5, 91)
    full = _full_for(model, 96)
    out = model.forward(prompt, torch.arange(70), full, logits_rows=None, capture_queries=True)
    rc = RetrievalCache(full, budget=96, chunk_size=8, recent=16, room=16)
    assert rc.select(out.queries[:, -1], 70).dense
    lf = model.forward(step, torch.arange(70, 75), full).logits
    lr = model.forward(step, rc.positions(70, 5), rc).logits
    assert torch.allclose(lr, lf, atol=1e-5, rtol=0)
