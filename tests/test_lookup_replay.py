"""The offline replay of lookup's rules (`python -m bench.lookup_replay`) against the decoder.

The replay claims to decode a recorded greedy answer (with or without a repetition penalty) as
the decoding loop would with each lookup setting. Checked here: on the same recorded chat, its
rounds, proposed and accepted tokens equal what the real decoder counts in mode `lookup`,
setting by setting; speed is not asserted.
"""

from __future__ import annotations

import pytest
from tests.helpers.models import words

from bench import lookup_replay
from triforce_core.config import GenerationConfig, SamplingConfig, SpeculationConfig

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


def _looping_text() -> str:
    """A document that repeats passages with small changes: lookup finds runs, rivals and
    single-token backoffs in it, and the tiny target copies some of them."""
    a, b = words(40, seed=3), words(40, seed=4)
    return " ".join([a, b, a, words(10, seed=5), a, b])


ROW_COST = 0.3
# A forward priced at one step plus ROW_COST a row: the replay's rule then sees ROW_COST (row_cost_of).
PRICED = {r: 1.0 + ROW_COST * (r - 1) for r in range(1, lookup_replay.MAX_ROWS + 1)}


@pytest.mark.parametrize("penalty", [1.0, 1.2])
@pytest.mark.parametrize("setting", ["cost", "cost, no rival cut", "cost, longest 16", "cost, no backoff"])
def test_replay_counts_what_the_decoder_does(chat_engine, setting, penalty):
    """Also with a repetition penalty: greedy decoding stays deterministic, and each verification
    row is penalized by its own prefix, so a proposal is accepted up to where it leaves the
    recorded answer whatever was proposed."""
    turns = lookup_replay.record(chat_engine, _looping_text(), seed=1, max_new_tokens=NEW, repetition_penalty=penalty)
    assert len(turns) == 6 and all(t["answer"] for t in turns)
    s = dict(lookup_replay.SETTINGS[setting])
    replayed = lookup_replay.replay(turns, PRICED, max_new_tokens=NEW, **s)
    spec = SpeculationConfig(mode="lookup", max_new_tokens=NEW, lookup_agree="rival_slack" not in s,
                             lookup_backoff=s.get("backoff", True), lookup_max=s.get("lookup_max", 8),
                             lookup_row_cost=ROW_COST)
    sampling = SamplingConfig(repetition_penalty=penalty)
    rounds = proposed = accepted = 0
    for t in turns:
        res = chat_engine.run(t["prompt"], GenerationConfig(sampling=sampling, speculation=spec))
        assert res.token_ids == t["answer"]
        rounds += res.stats.rounds
        n = res.stats.proposed_by_proposer.get("lookup:target", 0)
        proposed += n
        accepted += round(res.stats.acceptance_by_proposer.get("lookup:target", 0.0) * n)
    assert proposed > 0  # the workload exercises lookup
    assert (replayed["rounds"], replayed["proposed"], replayed["accepted"]) == (rounds, proposed, accepted)


def test_the_settings_differ_on_this_workload(chat_engine):
    turns = lookup_replay.record(chat_engine, _looping_text(), seed=1, max_new_tokens=NEW)
    results = lookup_replay.replay_all({"w": turns}, {"w": PRICED}, NEW, {"all": ["w"]})
    assert set(results) == set(lookup_replay.SETTINGS)
    assert len({r["workloads"]["w"]["proposed"] for r in results.values()}) > 1
    assert all(r["geomean_speedup"] == r["geomean_speedup, all"] > 0 for r in results.values())


def test_bad_input_is_one_line(tmp_path, capsys):
    assert lookup_replay.main(["--document", str(tmp_path / "missing.txt")]) == 2
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert lookup_replay.main(["--document", str(short)]) == 2
    assert lookup_replay.main(["--document", str(short), "--seeds", ","]) == 2
    long = tmp_path / "long.txt"
    long.write_text(words(400, seed=2))
    assert lookup_replay.main(["--document", str(long), "--repetition-penalty", "0"]) == 2
    assert lookup_replay.main(["--document", str(long), "--repetition-penalty", "strong"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("error: ") for line in err)


def test_forward_cost_is_priced_for_every_row_count(chat_engine):
    cost = lookup_replay.forward_ms(chat_engine, context=40, repeats=1)
    assert sorted(cost) == list(range(1, lookup_replay.MAX_ROWS + 1))
    assert all(ms > 0 for ms in cost.values())
