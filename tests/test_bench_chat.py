"""The document-chat workload benchmark (`python -m bench.chat`) on tiny random models.

Speed is not asserted (it is measured by the benchmark itself); what is checked: every
configuration answers every turn, repeats give the same greedy answer, greedy answers equal
autoregressive ones, the report carries its keys, and bad input is one line with exit code 2.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from tests.helpers.models import words

from bench import chat
from triforce_core.config import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_configuration_answers_every_turn_identically(chat_engine):
    text = words(300, seed=11)
    turns = chat.workload(text, quotes=2, open_count=1, seed=1)
    assert [k for k, _ in turns] == ["quote", "quote", "open"]
    lines: list[str] = []
    names = ["triforce", "triforce-paper", "triforce-paper+inspect", "retrieval+budget-48", "lookup", "autoregressive"]
    report = chat.run(chat_engine, text, turns, names, SamplingConfig(), 12, say=lines.append, repeats=2)
    assert report["repeats"] == 2 and len(report["turns"]) == 3
    # one line per configuration, turn and repeat
    assert sum("turn " in line for line in lines) == len(names) * len(turns) * 2
    for row in report["turns"]:
        assert set(row["tokens_per_s"]) == set(names)
        assert all(row["identical_to_autoregressive"].values()), row
    for name, s in report["results"].items():
        assert s["identical_to_autoregressive"] is True
        assert s["new_tokens"] == 2 * sum(row["new_tokens"][name] for row in report["turns"])
        assert s["rounds"] >= 1 and s["tokens_per_target_forward"] >= 1.0
        assert set(s["by_kind"]) == {"quote", "open"}
    assert report["results"]["autoregressive"]["speedup_vs_autoregressive"] == 1.0
    assert report["results"]["autoregressive"]["tokens_per_target_forward"] == 1.0
    assert "lookup" in report["results"]["lookup"]["round_ms_by_level"]
    assert report["configs"]["retrieval+budget-48"]["budget"] == 48 and report["configs"]["triforce"]["budget"] == 4096


def test_a_setting_suffix_sets_that_setting_only():
    assert chat.split_name("retrieval-paper+budget-8192+pytorch-layers") == (
        "retrieval-paper", {"+budget-8192", "+pytorch-layers"})
    cfg = chat.make_config("retrieval-paper+budget-8192", SamplingConfig(), 8)
    assert cfg.cache.budget == 8192 and cfg.speculation == chat.make_config("retrieval-paper", SamplingConfig(), 8).speculation
    cfg = chat.make_config("lookup+gamma2-3+lookup_max-12", SamplingConfig(), 8)
    assert (cfg.speculation.gamma2, cfg.speculation.lookup_max, cfg.speculation.mode) == (3, 12, "lookup")
    cfg = chat.make_config("lookup+lookup_row_cost-0.3", SamplingConfig(), 8)  # the price of a row, set
    assert cfg.speculation.lookup_row_cost == 0.3


@pytest.mark.parametrize("argv, message", [
    (["--configs", "nope"], "unknown configuration"),
    (["--configs", "lookup,lookup"], "twice"),
    (["--configs", "retrieval+budget-3"], "budget (3) must be at least 3 chunks"),
    (["--configs", "retrieval+budget-64+budget-128"], "sets budget twice"),
    (["--configs", "lookup+gamma3-4"], "no integer setting 'gamma3'"),
    (["--repeats", "0"], "--repeats"),
    (["--quotes", "0", "--open", "0"], "not both 0"),
    (["--document", "no/such/file.txt"], "no such document"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = chat.main(argv)
    assert code == 2
    assert err.getvalue().count("\n") == 1 and message in err.getvalue(), err.getvalue()
