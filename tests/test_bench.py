"""The benchmark command `python -m triforce_core bench` (contract) on tiny random models.

Speed is not asserted here (performance lives in bench/); what is checked: the JSON report's
keys, that every mode's greedy output equals our autoregressive output (checked by the run
itself), the break-even arithmetic, the default mode, and one-line errors with exit code 2.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from tests.helpers.cli import SMALL_CACHE_FLAGS
from tests.helpers.models import words

from bench.sweep import break_even
from triforce_core.__main__ import main
from triforce_core.config import DEFAULT_MODE

SMALL = SMALL_CACHE_FLAGS
ALL_MODES = {"triforce", "retrieval", "draft", "lookup", "autoregressive", "hf-generate", "hf-assisted"}
RUN_KEYS = {"mode", "tokens_per_s", "decode_s", "prefill_s", "acceptance", "mean_accepted",
            "output_identical_to_autoregressive"}


pytestmark = pytest.mark.usefixtures("one_thread")


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def bench_args(pair, *extra):
    return ["bench", "--target", pair["target"], "--draft", pair["draft"], *SMALL, *extra]


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "doc.txt"
    path.write_text(words(150, seed=3) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def report(tiny_pair_dir, document, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results" / "new" / "report.json"  # folders made by the command
    code, stdout, err = run_main(bench_args(
        tiny_pair_dir, "--document", document, "--max-new-tokens", "12", "--repeats", "2", "--json", str(out),
    ))
    assert code == 0, err
    return json.loads(out.read_text()), err


def test_report_has_the_contract_keys(report):
    rep, _ = report
    assert {"machine", "context_tokens", "runs", "limit"} <= set(rep)
    assert {"cpu", "cores", "torch", "device", "dtype", "threads"} <= set(rep["machine"])
    assert rep["machine"]["dtype"] == "float32" and rep["machine"]["device"] == "cpu"
    assert rep["context_tokens"] > 150
    # a Hugging Face folder's default: float32 K/V, Hugging Face's arithmetic
    assert rep["settings"]["kv_dtype"] == "float32" and rep["settings"]["arithmetic"] == "exact"
    assert {r["mode"] for r in rep["runs"]} == ALL_MODES
    for run in rep["runs"]:
        assert RUN_KEYS <= set(run), run["mode"]
        assert run["tokens_per_s"] > 0 and run["decode_s"] > 0 and run["prefill_s"] > 0
        assert run["new_tokens"] == 12
    lim = rep["limit"]
    assert {"bytes_per_token", "bandwidth_gbs", "tokens_per_s"} <= set(lim)
    assert lim["bandwidth_gbs"] > 0 and lim["bytes_per_token"] > 0
    assert lim["tokens_per_s"] == pytest.approx(lim["bandwidth_gbs"] * 1e9 / lim["bytes_per_token"])


def test_every_mode_matches_autoregressive_in_greedy(report):
    rep, _ = report
    for run in rep["runs"]:
        assert run["output_identical_to_autoregressive"] is True, run["mode"]


def test_acceptance_is_reported_for_speculative_modes(report):
    by = {r["mode"]: r for r in report[0]["runs"]}
    # The retrieval level verifies what a lower level proposed (lookup or the small draft).
    assert {"target"} <= set(by["triforce"]["acceptance"]) <= {"retrieval", "target"}
    assert set(by["draft"]["acceptance"]) == {"target"}
    assert by["autoregressive"]["acceptance"] is None
    assert by["autoregressive"]["mean_accepted"] == 1.0
    assert by["triforce"]["mean_accepted"] >= 1.0


def test_one_progress_line_per_run(report):
    _, err = report
    runs = [line for line in err.splitlines() if line.startswith("[bench] repeat")]
    assert len(runs) == 2 * len(ALL_MODES)


def test_context_tokens_builds_a_prompt_of_that_length(tiny_pair_dir):
    code, out, err = run_main(bench_args(
        tiny_pair_dir, "--context-tokens", "300", "--modes", "draft,autoregressive", "--max-new-tokens", "4",
        "--repeats", "1", "--no-bandwidth", "--temperature", "0.7", "--seed", "1", "--json", "-",
    ))
    assert code == 0, err
    rep = json.loads(out[out.index("{"):])
    assert rep["context_tokens"] == 300
    assert "limit" not in rep
    # Sampling: independent samples differ by design, nothing is compared.
    assert all(r["output_identical_to_autoregressive"] is None for r in rep["runs"])


BAD = {
    "unknown_mode": (["--modes", "triforce,fastest"], "fastest"),
    "zero_repeats": (["--repeats", "0"], "--repeats"),
    "unknown_flag": (["--speed", "3"], "--speed"),
    "both_prompts": (["--context-tokens", "100", "--document", "x.txt"], "not allowed"),
    "too_long": (["--context-tokens", "1020", "--max-new-tokens", "16"], "context window"),
    "missing_document": (["--document", "no_such_file.txt"], "no_such_file"),
    "bad_budget": (["--budget", "5"], "budget"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_and_exit_2(tiny_pair_dir, name):
    extra, needle = BAD[name]
    code, out, err = run_main(bench_args(tiny_pair_dir, *extra))
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle.lower() in lines[0].lower()


def test_break_even_interpolates_the_crossing():
    def rep(n, ar, tf):
        return {"context_tokens": n, "runs": [{"mode": "autoregressive", "tokens_per_s": ar},
                                              {"mode": "triforce", "tokens_per_s": tf}]}

    be = break_even([rep(2000, 100, 50), rep(4000, 100, 150)])
    assert be["context_tokens"] == 3000 and not be["upper_bound"]
    assert break_even([rep(2000, 100, 50), rep(4000, 100, 90)])["context_tokens"] is None
    assert break_even([rep(2000, 100, 150)])["upper_bound"]


def test_default_mode_is_the_measured_best():
    # No length measured so far where the retrieval level pays (document chat, 16K-64K).
    assert DEFAULT_MODE == "lookup"
