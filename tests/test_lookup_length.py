"""How long a lookup proposal is (`schedule.LookupLength`): as long as its tokens pay for their
verification rows, at the price of a row the config names or this machine measured.

The rule as pure arithmetic first, then in the decoder: greedy output stays the autoregressive
one whatever the price (`test_greedy_exactness.py` runs every mode), nothing is proposed where
rows are dear and copies rare, and long proposals where the answer copies its context.
"""

from __future__ import annotations

import random

import pytest

from bench import lookup_replay
from triforce_core.config import GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.decoding.events import Committed, Drafted, Verified
from triforce_core.decoding.lookup import ContextIndex
from triforce_core.decoding.schedule import LookupLength

pytestmark = pytest.mark.usefixtures("one_thread")


def test_docstring_example():
    rule = LookupLength(0.4)
    assert [rule.take(m, 8) for m in (3, 5, 8, 2)] == [1, 2, 6, 1]
    assert LookupLength(0.45).take(2, 1) == 0  # a backoff token at a dearer row: a plain step


def test_free_rows_take_everything_offered_and_dear_rows_nothing():
    assert LookupLength(0.0).take(3, 8) == 8
    assert LookupLength(1.0).take(16, 8) == 0  # a(n) < 1 always: no token is sure enough
    assert LookupLength(0.4).take(3, 0) == 0


def test_misses_stop_the_proposals_and_hits_lengthen_them():
    rule = LookupLength(0.3)
    assert rule.take(3, 8) == 1
    for _ in range(6):
        rule.update(3, 1, 0)  # the first token after a 3-token match: rejected every time
    assert rule.take(3, 8) == 0
    copying = LookupLength(0.3)
    assert copying.take(4, 8) < 8
    for _ in range(6):
        copying.update(4, 8, 8)  # whole copies: every token up to the 8th taken
    assert copying.take(4, 8) == 8


def test_only_the_tokens_tried_are_counted():
    rule, prior = LookupLength(0.3), LookupLength(0.3)
    rule.update(3, 8, 2)  # match 3: tokens at 3 and 4 taken, 5 rejected; 6.. never verified
    assert rule.rate(3) > prior.rate(3) and rule.rate(4) > prior.rate(4)
    assert rule.rate(5) < prior.rate(5)
    assert rule.rate(6) == prior.rate(6) and rule.rate(16) == prior.rate(16)
    frozen = LookupLength(0.3, learn=False)
    frozen.update(3, 8, 0)
    assert frozen.rate(3) == prior.rate(3)


def test_the_length_is_a_function_of_the_outcomes():
    """Deterministic given the sequence and the price: a seeded sample stays reproducible."""
    outcomes = [(random.Random(i).randrange(2, 20), random.Random(i + 1).randrange(1, 9)) for i in range(40)]
    lengths = []
    for _ in range(2):
        rule, seen = LookupLength(0.35), []
        for match, n in outcomes:
            k = rule.take(match, n)
            seen.append(k)
            rule.update(match, k, k // 2)
        lengths.append(seen)
    assert lengths[0] == lengths[1] and any(lengths[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="row_cost"):
        LookupLength(-0.1)
    with pytest.raises(ValueError, match="prior"):
        LookupLength(0.3, prior=(0.5,))


# -- over a text, as the decoder's rounds run: copied, or not ----------------------------------
def _document(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 600) for _ in range(n)]


def _replay(prompt: list[int], answer: list[int], row_cost: float) -> dict:
    """The loop's rounds over a known answer (`bench.lookup_replay`), at a given row cost."""
    cost = {r: 1.0 + row_cost * (r - 1) for r in range(1, lookup_replay.MAX_ROWS + 1)}
    return lookup_replay.replay([{"prompt": prompt, "answer": answer}], cost, max_new_tokens=len(answer) + 1)


def test_an_answer_that_copies_its_context_gets_long_proposals():
    doc = _document(400, seed=1)
    answer = doc[100:180]  # a quoted passage
    prompt = doc + [7, 8] + doc[98:100]  # "... what follows <doc[98:100]>?": the copy starts right away
    r = _replay(prompt, answer, 0.45)
    assert r["accepted"] >= 0.8 * len(answer) and r["proposed"] - r["accepted"] <= 8
    assert r["speedup"] > 1.7  # at most 9 tokens for 1 + 8 * 0.45 steps: 1.96
    index, rule, seq, sizes = ContextIndex(), LookupLength(0.45), list(prompt), []
    index.reset(prompt)
    while len(seq) < len(prompt) + len(answer) - 8:
        prop, match = index.propose(seq, 8)
        k = rule.take(match, len(prop))
        sizes.append(k)
        rule.update(match, k, k)
        seq += answer[len(seq) - len(prompt):][: k + 1]
        index.extend(seq[len(index.tokens):])
    assert max(sizes) == 8 and sizes[-1] == 8


def test_an_answer_that_copies_nothing_gets_plain_steps():
    """A text of 6 words: every 3-word context recurs, and the answer (random words) follows
    its earlier continuation about one time in six."""
    rng = random.Random(3)
    doc, answer = [rng.randrange(6) for _ in range(400)], [rng.randrange(6) for _ in range(80)]
    free, cheap, dear = (_replay(doc, answer, c) for c in (0.0, 0.3, 0.9))
    assert free["proposed"] > 80 and free["accepted"] < 0.2 * free["proposed"]  # the text offers a token a round
    assert dear["proposed"] == 0 and dear["speedup"] == pytest.approx(1.0)  # no token pays a row that dear
    # At a row of 0.3 the first proposals go (a 3-token match's prior is 0.45), and the misses
    # this generation counts stop most of them: within a few % of plain steps.
    assert cheap["proposed"] < 0.4 * free["proposed"] and cheap["speedup"] > 0.95


# -- in the decoder ---------------------------------------------------------------------------
def test_the_decoder_proposes_nothing_where_rows_cost_more_than_any_token_pays(chat_engine):
    prompt = chat_engine.encode("w10 w11 w12 w13 w14 w15 " * 6 + "w10 w11 w12")
    free = chat_engine.run(prompt, _config(lookup_row_cost=0.0))
    assert free.stats.proposed_by_proposer.get("lookup:target", 0) > 0  # the context offers lookups
    dear = chat_engine.run(prompt, _config(lookup_row_cost=1.0))
    assert dear.stats.proposed_by_proposer.get("lookup:target", 0) == 0
    assert dear.token_ids == free.token_ids == chat_engine.run(prompt, _config(mode="autoregressive")).token_ids


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(repetition_penalty=1.2),
                                      SamplingConfig(temperature=0.8, seed=4)], ids=["greedy", "penalty", "sampled"])
def test_the_decoder_sizes_its_proposals_by_the_rule(chat_engine, sampling):
    """Round by round, each lookup proposal is what `LookupLength` keeps of what the index
    offers, fed the generation's own outcomes (no proposal: a plain step); a seeded sample is
    the same twice."""
    prompt = chat_engine.encode("w10 w11 w12 w13 w14 w15 w16 w17 " * 5 + "w10 w11 w12")
    config = _config(lookup_row_cost=0.3, sampling=sampling)
    spec = config.speculation
    events = list(chat_engine.generate(prompt, config))
    index, rule = ContextIndex(spec.lookup_min_match, backoff=spec.lookup_backoff), LookupLength(0.3)
    seq, made, checked = list(prompt), 0, 0
    index.reset(prompt)
    round_: list = []
    for ev in events:
        if not isinstance(ev, Committed):
            round_.append(ev)
            continue
        offered, match = index.propose(seq, min(spec.lookup_max, spec.max_new_tokens - made - 1))
        k = rule.take(match, len(offered))
        drafted = [e for e in round_ if isinstance(e, Drafted) and e.level == "lookup"]
        assert [list(e.token_ids) for e in drafted] == ([offered[:k]] if k else [])
        if k:
            rule.update(match, k, next(e for e in round_ if isinstance(e, Verified)).accepted)
            checked += 1
        seq += ev.token_ids
        made += len(ev.token_ids)
        index.extend(list(ev.token_ids))
        round_ = []
    assert checked >= 1  # some rounds proposed (the others were checked to be plain steps)
    assert chat_engine.run(prompt, config).token_ids == seq[len(prompt):]


def _config(mode: str = "lookup", sampling: SamplingConfig | None = None, **spec) -> GenerationConfig:
    return GenerationConfig(sampling=sampling or SamplingConfig(),
                            speculation=SpeculationConfig(mode=mode, max_new_tokens=24, ignore_eos=True, **spec))
