"""The event stream of `TriForceEngine.generate`: order, content and the statistics in Finished.

Every test uses the session's tiny saved target/draft pair (CPU, float32). Generations are
cached per (mode, sampling) so that each configuration is decoded only once per module.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from triforce_core.config import PAPER_METHOD, CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.decoding.events import LEVELS, ChunksSelected, Committed, Drafted, Finished, Prefilled, Verified

MODES = ("triforce", "retrieval", "draft", "autoregressive")
SPECULATIVE = ("triforce", "retrieval", "draft")
PROMPT = [random.Random(1234).randrange(3, 97) for _ in range(80)]
MAX_NEW = 16
GAMMA1, GAMMA2 = 2, 6
# Small caches for the tiny models: the 80-token prompt does not fit the budget, so the
# retrieval level really is sparse (and re-selects its chunks while decoding).
CACHE = CacheConfig(budget=32, chunk_size=4, draft_window=16)
# A fixed price of a verification row (not this machine's measured one), so that what lookup
# proposes does not depend on the machine.
ROW_COST = 0.2
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0), "sampled": SamplingConfig(temperature=0.8, seed=11)}


def make_config(mode: str, sampling: str = "greedy", ignore_eos: bool = True, max_new: int = MAX_NEW, cache=CACHE,
                lookup: bool = False):
    """Lookup off unless asked: most tests here pin the structure of the paper's levels."""
    return GenerationConfig(
        sampling=SAMPLINGS[sampling],
        speculation=SpeculationConfig(
            mode=mode, gamma1=GAMMA1, gamma2=GAMMA2, max_new_tokens=max_new, ignore_eos=ignore_eos,
            lookup_max=12, **({"lookup": True, "lookup_row_cost": ROW_COST} if lookup else PAPER_METHOD),
        ),
        cache=cache,
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
    thread hand-offs make decoding ~10x slower; restored after this module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def engine(tiny_pair_dir):
    return TriForceEngine.from_pretrained(tiny_pair_dir["target"], tiny_pair_dir["draft"], device="cpu")


@pytest.fixture(scope="module")
def decoded(engine):
    """(mode, sampling) -> (events of generate(), result of run()) for the same config and seed."""
    cache: dict = {}

    def get(mode: str, sampling: str):
        key = (mode, sampling)
        if key not in cache:
            config = make_config(mode, sampling)
            events = list(engine.generate(PROMPT, config))
            cache[key] = (events, engine.run(PROMPT, config))
        return cache[key]

    return get


CASES = [(m, s) for m in MODES for s in SAMPLINGS]


def _committed(events):
    return [e for e in events if isinstance(e, Committed)]


def _verified(events, level):
    return [e for e in events if isinstance(e, Verified) and e.level == level]


@pytest.mark.parametrize("mode,sampling", CASES)
def test_prefill_and_initial_selection(engine, decoded, mode, sampling):
    events, _ = decoded(mode, sampling)
    first = events[0]
    assert isinstance(first, Prefilled)
    assert first.tokens == len(PROMPT)
    assert first.reused_tokens == 0
    assert first.seconds >= 0
    selections = [e for e in events if isinstance(e, ChunksSelected)]
    if mode in ("triforce", "retrieval"):
        sel = events[1]
        assert isinstance(sel, ChunksSelected)
        heads_total = engine.target.spec.num_layers * engine.target.spec.num_kv_heads
        assert sel.step == 0
        assert sel.heads_total == heads_total
        assert sel.chunk_size == CACHE.chunk_size
        assert sel.budget == CACHE.budget
        assert sel.context_tokens == len(PROMPT) - 1  # the last prompt token is still pending
        assert not sel.dense
        assert len(sel.chunk_token_spans) == len(sel.scores_or_counts) > 0
        previous_end = 0
        for (start, end), count in zip(sel.chunk_token_spans, sel.scores_or_counts):
            assert 0 <= start < end <= len(PROMPT)
            assert end - start <= sel.chunk_size
            assert start >= previous_end  # in sequence order, no overlap
            previous_end = end
            assert 1 <= count <= heads_total
        # The sink chunk and the recent tokens are chosen by every (layer, KV head) pair.
        assert sel.chunk_token_spans[0] == (0, CACHE.chunk_size)
        assert sel.scores_or_counts[0] == heads_total
        assert sel.chunk_token_spans[-1][1] == sel.context_tokens
        assert sel.scores_or_counts[-1] == heads_total
        # Sparse: fewer tokens than the context are attended to.
        covered = sum(end - start for start, end in sel.chunk_token_spans)
        assert covered < sel.context_tokens
    else:
        assert selections == []


@pytest.mark.parametrize("mode,sampling", CASES)
def test_committed_events_match_run(decoded, mode, sampling):
    events, result = decoded(mode, sampling)
    committed = _committed(events)
    assert committed, "no Committed event"
    ids: list[int] = []
    levels: list[str] = []
    for ev in committed:
        assert len(ev.token_ids) >= 1
        assert len(ev.levels) == len(ev.token_ids)
        assert set(ev.levels) <= set(LEVELS)
        ids += ev.token_ids
        levels += ev.levels
    assert ids == result.token_ids
    assert levels == result.levels
    assert len(ids) == MAX_NEW
    assert all(0 <= t < 97 for t in ids)
    assert "".join(ev.text for ev in committed) == result.text
    # Same config and seed: generate() and run() also produce the same statistics.
    stats = events[-1].stats
    assert stats.rounds == result.stats.rounds
    assert stats.proposed == result.stats.proposed
    assert stats.accepted == result.stats.accepted


@pytest.mark.parametrize("mode,sampling", CASES)
def test_finished_stats_are_consistent(decoded, mode, sampling):
    events, _ = decoded(mode, sampling)
    assert isinstance(events[-1], Finished)
    assert sum(isinstance(e, Finished) for e in events) == 1
    stats = events[-1].stats
    labels = [lvl for ev in _committed(events) for lvl in ev.levels]

    assert stats.mode == mode
    assert stats.prompt_tokens == len(PROMPT)
    assert stats.new_tokens == len(labels) == MAX_NEW
    assert stats.stop_reason == "max_new_tokens"
    assert stats.reused_tokens == 0
    assert stats.committed_by_level == {lvl: labels.count(lvl) for lvl in LEVELS}
    assert stats.rounds >= 1
    assert stats.mean_accepted == pytest.approx(stats.new_tokens / stats.rounds)
    assert stats.decode_s >= 0 and stats.prefill_s >= 0 and stats.tokens_per_s >= 0

    expected_levels = {"triforce": {"retrieval", "target"}, "retrieval": {"target"}, "draft": {"target"},
                       "autoregressive": set()}[mode]
    assert set(stats.proposed) == expected_levels
    assert set(stats.accepted) <= expected_levels
    assert set(stats.acceptance) == expected_levels
    for level in expected_levels:
        proposed, accepted = stats.proposed[level], stats.accepted.get(level, 0)
        assert 0 <= accepted <= proposed
        assert stats.acceptance[level] == pytest.approx(accepted / proposed)
        verified = _verified(events, level)
        assert sum(v.proposed for v in verified) == proposed
        assert sum(v.accepted for v in verified) == accepted

    target_verified = _verified(events, "target")
    if mode in SPECULATIVE:
        assert len(target_verified) == stats.rounds
    else:
        assert target_verified == []
        assert stats.rounds == stats.new_tokens  # one target forward per token
        assert set(labels) == {"target"}
    # Whoever proposed a token, the target's own token closes every round.
    assert stats.committed_by_level["target"] >= stats.rounds - 1


@pytest.mark.parametrize("mode,sampling", CASES)
def test_drafted_and_verified_events(decoded, mode, sampling):
    events, _ = decoded(mode, sampling)
    drafted_levels = {e.level for e in events if isinstance(e, Drafted)}
    if mode in ("triforce", "draft"):
        assert drafted_levels == {"draft"}
    elif mode == "retrieval":
        assert drafted_levels == {"retrieval"}
    else:
        assert drafted_levels == set()
        assert not any(isinstance(e, Verified) for e in events)
    if mode != "triforce":
        assert _verified(events, "retrieval") == []
    labels = {lvl for ev in _committed(events) for lvl in ev.levels}
    allowed = {"triforce": set(LEVELS), "retrieval": {"retrieval", "target"}, "draft": {"draft", "target"},
               "autoregressive": {"target"}}[mode]
    assert labels <= allowed

    for v in (e for e in events if isinstance(e, Verified)):
        assert v.level in ("retrieval", "target")
        assert 0 <= v.accepted <= v.proposed
        assert len(v.rejected_ids) == v.proposed - v.accepted
        if v.accepted == v.proposed:
            assert v.bonus_id is not None and v.resampled_id is None
        else:
            assert v.resampled_id is not None and v.bonus_id is None
        if v.level == "target":
            assert v.proposed == GAMMA2
        else:
            assert 1 <= v.proposed <= GAMMA1


@pytest.mark.parametrize("mode,sampling", [(m, s) for m in SPECULATIVE for s in SAMPLINGS])
def test_each_round_commits_what_the_target_verified(decoded, mode, sampling):
    """Per round: ..., Verified(target), Committed = accepted prefix + the target's own token."""
    events, _ = decoded(mode, sampling)
    n_new = 0
    for i, ev in enumerate(events):
        if not isinstance(ev, Committed):
            continue
        ver = events[i - 1]
        assert isinstance(ver, Verified) and ver.level == "target"
        room = MAX_NEW - n_new
        own = ver.bonus_id if ver.bonus_id is not None else ver.resampled_id
        # Accepted proposals keep their proposer's label; the target's own token closes the round
        # (unless the token limit cut the round short).
        assert all(lvl != "target" for lvl in ev.levels[: ver.accepted])
        if len(ev.token_ids) == ver.accepted + 1:
            assert ev.levels[-1] == "target"
            assert ev.token_ids[-1] == own
        else:
            assert len(ev.token_ids) == room < ver.accepted + 1
        if mode != "triforce":
            # The proposal is the last Drafted event before the target's verification.
            drafted = [e for e in events[:i] if isinstance(e, Drafted)][-1]
            assert len(drafted.token_ids) == ver.proposed
            assert ver.rejected_ids == drafted.token_ids[ver.accepted :]
            assert list(ev.token_ids) == (list(drafted.token_ids[: ver.accepted]) + [own])[:room]
            assert set(ev.levels[: ver.accepted]) <= {mode}
        n_new += len(ev.token_ids)
    assert n_new == MAX_NEW


@pytest.mark.parametrize("mode,sampling", [(m, s) for m in ("triforce", "retrieval") for s in SAMPLINGS])
def test_refresh_selections_follow_a_commit(decoded, mode, sampling):
    """events.py: per round ..., Committed, ChunksSelected? (after a refresh)."""
    events, _ = decoded(mode, sampling)
    stats = events[-1].stats
    later = [i for i, e in enumerate(events) if isinstance(e, ChunksSelected) and i != 1]
    assert len(later) == stats.refreshes
    committed_so_far = 0
    for i, ev in enumerate(events):
        if isinstance(ev, Committed):
            committed_so_far += len(ev.token_ids)
        elif isinstance(ev, ChunksSelected) and i != 1:
            assert isinstance(events[i - 1], Committed), "a refresh selection must come after the round's commit"
            assert ev.step >= 1
            # The selection covers everything committed except the pending last token.
            assert ev.context_tokens == len(PROMPT) + committed_so_far - 1
            assert all(0 <= a < b <= ev.context_tokens for a, b in ev.chunk_token_spans)


def test_greedy_output_is_identical_in_every_mode(decoded):
    reference = decoded("autoregressive", "greedy")[1].token_ids
    for mode in SPECULATIVE:
        assert decoded(mode, "greedy")[1].token_ids == reference, mode


@pytest.mark.parametrize("mode", MODES)
def test_close_after_first_commit_stops_cleanly(engine, decoded, mode):
    gen = engine.generate(PROMPT, make_config(mode, "greedy"))
    seen = []
    for ev in gen:
        seen.append(ev)
        if isinstance(ev, Committed):
            break
    gen.close()  # must not raise
    assert list(gen) == []
    with pytest.raises(StopIteration):
        next(gen)
    assert isinstance(seen[0], Prefilled)
    assert not any(isinstance(e, Finished) for e in seen)
    # The first round matches the full generation.
    full_events, result = decoded(mode, "greedy")
    assert [type(e) for e in seen] == [type(e) for e in full_events[: len(seen)]]
    first = seen[-1]
    assert first == full_events[len(seen) - 1]
    assert list(first.token_ids) == result.token_ids[: len(first.token_ids)]


def test_engine_is_reusable_after_a_close(engine, decoded):
    gen = engine.generate(PROMPT, make_config("triforce", "sampled"))
    next(gen), next(gen), next(gen)
    gen.close()
    again = engine.run(PROMPT, make_config("triforce", "sampled"))
    assert again.token_ids == decoded("triforce", "sampled")[1].token_ids


@pytest.fixture(scope="module")
def eos_setup(engine, decoded):
    """An engine whose EOS is the 5th token the target emits greedily on PROMPT."""
    reference = decoded("autoregressive", "greedy")[1].token_ids
    eos = reference[4]
    stop_at = reference.index(eos)  # first occurrence (<= 4)
    eos_engine = TriForceEngine(engine.target, engine.draft, engine.tokenizer, eos_token_ids=[eos])
    return eos_engine, eos, reference[: stop_at + 1]


@pytest.mark.parametrize("mode", MODES)
def test_generation_stops_at_eos(eos_setup, mode):
    eos_engine, eos, expected = eos_setup
    events = list(eos_engine.generate(PROMPT, make_config(mode, "greedy", ignore_eos=False)))
    assert isinstance(events[-1], Finished)
    ids = [t for ev in _committed(events) for t in ev.token_ids]
    assert ids == expected
    assert ids[-1] == eos and eos not in ids[:-1]
    stats = events[-1].stats
    assert stats.stop_reason == "eos"
    assert stats.new_tokens == len(expected)
    assert stats.mean_accepted == pytest.approx(stats.new_tokens / stats.rounds)
    if mode in SPECULATIVE:
        assert len(_verified(events, "target")) == stats.rounds


def test_ignore_eos_keeps_generating(eos_setup, decoded):
    eos_engine, eos, _ = eos_setup
    result = eos_engine.run(PROMPT, make_config("retrieval", "greedy", ignore_eos=True))
    assert result.stats.stop_reason == "max_new_tokens"
    assert result.token_ids == decoded("retrieval", "greedy")[1].token_ids
    assert eos in result.token_ids


def test_sampled_generation_stops_at_eos(engine, decoded):
    """Sampling: the output is cut right after the first EOS the sampler produces."""
    reference = decoded("draft", "sampled")[1].token_ids
    eos = reference[6]
    stop_at = reference.index(eos)
    eos_engine = TriForceEngine(engine.target, engine.draft, engine.tokenizer, eos_token_ids=[eos])
    result = eos_engine.run(PROMPT, make_config("draft", "sampled", ignore_eos=False))
    # Same seed, same random draws up to the stop: the prefix is unchanged.
    assert result.token_ids == reference[: stop_at + 1]
    assert result.stats.stop_reason == "eos"


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_draft_equal_to_target_accepts_everything(engine, decoded, sampling):
    """With the target as its own draft and a window covering the whole prompt, p == q."""
    self_engine = TriForceEngine(engine.target, engine.target, engine.tokenizer, engine.eos_token_ids)
    cache = CacheConfig(draft_window=512, budget=32, chunk_size=4)
    events = list(self_engine.generate(PROMPT, make_config("draft", sampling, cache=cache)))
    stats = events[-1].stats
    assert stats.acceptance["target"] == 1.0
    assert stats.accepted["target"] == stats.proposed["target"]
    for v in _verified(events, "target"):
        assert v.accepted == v.proposed == GAMMA2
        assert v.rejected_ids == () and v.bonus_id is not None
    labels = [lvl for ev in _committed(events) for lvl in ev.levels]
    assert labels.count("draft") > len(labels) // 2
    # gamma2 drafted tokens + one bonus per round.
    assert stats.rounds == math.ceil(MAX_NEW / (GAMMA2 + 1))
    assert stats.committed_by_level == {lvl: labels.count(lvl) for lvl in LEVELS}
    if sampling == "greedy":
        ids = [t for ev in _committed(events) for t in ev.token_ids]
        assert ids == decoded("autoregressive", "greedy")[1].token_ids


# A prompt that repeats itself: lookup proposes in most rounds.
LOOP_PROMPT = PROMPT[:30] * 3


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("mode", ["lookup", "triforce", "retrieval", "draft"])
def test_lookup_events(engine, mode, sampling):
    """Lookup runs: Drafted("lookup") then Verified("target") of at most lookup_max tokens;
    inside triforce's middle level Drafted("lookup") is verified by the retrieval level; every
    label is a known level and the stats count the lookup's proposals."""
    config = make_config(mode, sampling, lookup=True)
    events = list(engine.generate(LOOP_PROMPT, config))
    drafted = [e for e in events if isinstance(e, Drafted)]
    assert any(e.level == "lookup" for e in drafted)
    for i, ev in enumerate(events):
        if isinstance(ev, Drafted) and ev.level == "lookup":
            nxt = next(e for e in events[i + 1:] if isinstance(e, Verified))
            assert nxt.proposed == len(ev.token_ids) <= 12
            if mode != "triforce":
                assert nxt.level == "target"
    labels = {lvl for ev in _committed(events) for lvl in ev.levels}
    assert labels <= set(LEVELS)
    stats = events[-1].stats
    assert stats.proposed_by_proposer.get("lookup:target", 0) + stats.proposed_by_proposer.get("lookup:retrieval", 0) > 0
    assert stats.committed_by_level == {lvl: sum(ev.levels.count(lvl) for ev in _committed(events)) for lvl in LEVELS}
    assert set(stats.level_seconds) >= {"target", "lookup"}
    assert stats.new_tokens == MAX_NEW
