"""The command line `python -m triforce_core generate`, mostly called in-process via `main(argv)`.

Contract: exit code 0 and (with --json) one JSON object on stdout; for bad input exit code 2 and
exactly one line `error: ...` on stderr.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import SMALL_CACHE_FLAGS, run_main
from triforce_core.__main__ import main

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("triforce", "retrieval", "draft", "lookup", "autoregressive")
LEVELS = {"lookup", "draft", "retrieval", "target"}
SMALL = SMALL_CACHE_FLAGS
PROMPT_IDS = [random.Random(7).randrange(3, 97) for _ in range(100)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tiny_pair_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    paths = {**tiny_pair_dir}

    def write(name: str, text: str) -> str:
        (d / name).write_text(text)
        return str(d / name)

    paths["ids"] = write("ids.json", json.dumps(PROMPT_IDS))
    paths["bad_json"] = write("bad.json", "[5, 6,")
    paths["not_list"] = write("dict.json", '{"ids": [5, 6]}')
    paths["strings"] = write("strings.json", '["w5", "w6"]')
    paths["floats"] = write("floats.json", "[5.0, 6]")
    paths["out_of_vocab"] = write("oov.json", "[5, 6, 500]")
    paths["empty"] = write("empty.json", "[]")
    paths["too_long"] = write("long.json", json.dumps([5] * 1020))
    paths["prompt_txt"] = write("prompt.txt", "w5 w6 w7\n")
    return paths


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2") / "model"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=97, bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def pair_args(files):
    return ["generate", "--target", files["target"], "--draft", files["draft"], *SMALL]


def assert_one_error_line(code, out, err, *needles):
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    assert out == ""


# -- errors ------------------------------------------------------------------------------------

ARG_ERRORS = {
    # name: (extra arguments, substrings of the error line)
    "no_prompt": ([], ["--prompt", "required"]),
    "two_prompts": (["--prompt", "w5", "--prompt-ids-file", "x.json"], ["not allowed"]),
    "unknown_mode": (["--prompt", "w5", "--mode", "fastest"], ["--mode", "fastest"]),
    "negative_max_new_tokens": (["--prompt", "w5", "--max-new-tokens", "-3"], ["max_new_tokens", "-3"]),
    "zero_max_new_tokens": (["--prompt", "w5", "--max-new-tokens", "0"], ["max_new_tokens"]),
    "not_an_int": (["--prompt", "w5", "--max-new-tokens", "many"], ["--max-new-tokens", "many"]),
    "negative_temperature": (["--prompt", "w5", "--temperature", "-1"], ["temperature"]),
    "top_p_zero": (["--prompt", "w5", "--top-p", "0"], ["top_p"]),
    "negative_top_k": (["--prompt", "w5", "--top-k", "-1"], ["top_k"]),
    "budget_below_three_chunks": (["--prompt", "w5", "--budget", "11"], ["budget", "3 chunks"]),
    "gamma1_zero": (["--prompt", "w5", "--gamma1", "0"], ["gamma1"]),
    "gamma2_zero": (["--prompt", "w5", "--gamma2", "0"], ["gamma2"]),
    "num_samples_zero": (["--prompt", "w5", "--num-samples", "0"], ["--num-samples"]),
    "unknown_flag": (["--prompt", "w5", "--speed", "11"], ["unrecognized", "--speed"]),
    "bad_dtype": (["--prompt", "w5", "--dtype", "int3"], ["dtype", "int3"]),
}


@pytest.mark.parametrize("name", list(ARG_ERRORS))
def test_bad_arguments(files, name):
    extra, needles = ARG_ERRORS[name]
    # --budget 11 must win over SMALL's --budget 32: the last occurrence counts.
    assert_one_error_line(*run_main(pair_args(files) + extra), *needles)


def test_no_command_prints_help_and_fails():
    code, out, err = run_main([])
    assert code == 2
    assert "generate" in out


def test_missing_model_folder(tmp_path, files):
    missing = str(tmp_path / "no_such_model")
    code, out, err = run_main(["generate", "--target", missing, "--prompt", "w5", *SMALL])
    assert_one_error_line(code, out, err, "not found", "no_such_model")


def test_folder_without_config(tmp_path):
    code, out, err = run_main(["generate", "--target", str(tmp_path), "--prompt", "w5", *SMALL])
    assert_one_error_line(code, out, err, "config.json")


def test_missing_draft_folder(tmp_path, files):
    missing = str(tmp_path / "no_draft")
    code, out, err = run_main(["generate", "--target", files["target"], "--draft", missing, "--prompt", "w5", *SMALL])
    assert_one_error_line(code, out, err, "not found", "no_draft")


def test_draft_with_another_vocabulary(files):
    argv = ["generate", "--target", files["target"], "--draft", files["other_vocab"], "--prompt", "w5", *SMALL]
    assert_one_error_line(*run_main(argv), "vocabulary", "other_vocab")


def test_unsupported_architecture(gpt2_dir):
    argv = ["generate", "--target", gpt2_dir, "--prompt-ids-file", "unused.json", *SMALL]
    assert_one_error_line(*run_main(argv), "gpt2")


@pytest.mark.parametrize("mode", ["draft", "triforce"])
def test_mode_needing_a_draft_without_one(files, mode):
    argv = ["generate", "--target", files["target"], "--prompt", "w5", "--mode", mode, *SMALL]
    assert_one_error_line(*run_main(argv), f"mode {mode} needs a small draft", "retrieval, lookup, autoregressive")


@pytest.mark.parametrize(
    "key,needles",
    [
        ("bad_json", ["not valid JSON"]),
        ("not_list", ["list of integers"]),
        ("strings", ["list of integers"]),
        ("floats", ["list of integers"]),
        ("out_of_vocab", ["500", "vocabulary"]),
        ("empty", ["empty"]),
    ],
)
def test_bad_prompt_ids_file(files, key, needles):
    argv = pair_args(files) + ["--prompt-ids-file", files[key]]
    assert_one_error_line(*run_main(argv), *needles)


def test_missing_prompt_ids_file(files, tmp_path):
    argv = pair_args(files) + ["--prompt-ids-file", str(tmp_path / "nope.json")]
    assert_one_error_line(*run_main(argv), "not found", "nope.json")


def test_missing_prompt_file(files, tmp_path):
    argv = pair_args(files) + ["--prompt-file", str(tmp_path / "nope.txt")]
    assert_one_error_line(*run_main(argv), "prompt file not found", "nope.txt")


def test_prompt_longer_than_the_context_window(files):
    argv = pair_args(files) + ["--prompt-ids-file", files["too_long"], "--max-new-tokens", "20"]
    assert_one_error_line(*run_main(argv), "context window", "1024")


# -- help ------------------------------------------------------------------------------------


def test_help_exits_zero_and_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--gamma2", "--gamma1", "--budget", "--prompt-ids-file", "--num-samples", "--json", "--mode"):
        assert flag in out


def test_top_level_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code in (0, None)
    assert "generate" in capsys.readouterr().out


# -- successful runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_json(files):
    """mode -> parsed --json output of a greedy 20-token run on the 100-id prompt."""
    results = {}
    for mode in MODES:
        argv = pair_args(files) + [
            "--prompt-ids-file", files["ids"], "--mode", mode, "--ignore-eos", "--max-new-tokens", "20", "--json",
        ]
        code, out, err = run_main(argv)
        assert code == 0, err
        assert len(out.splitlines()) == 1, "--json prints exactly one line"
        results[mode] = json.loads(out)
    return results


@pytest.fixture(scope="module")
def hf_greedy(files):
    """Independent reference: transformers' own model decoding greedily, one token at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files["target"], dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        for _ in range(20):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(PROMPT_IDS) :].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_greedy_json_run(greedy_json, mode):
    out = greedy_json[mode]
    assert set(out) == {"samples", "stats"}
    assert len(out["samples"]) == 1
    sample = out["samples"][0]
    assert set(sample) == {"token_ids", "levels", "text", "stats"}
    ids, levels = sample["token_ids"], sample["levels"]
    assert len(ids) == 20
    assert all(isinstance(t, int) and 0 <= t < 97 for t in ids)
    assert len(levels) == len(ids)
    assert set(levels) <= LEVELS
    allowed = {"triforce": LEVELS, "retrieval": {"lookup", "retrieval", "target"},
               "draft": {"lookup", "draft", "target"}, "lookup": {"lookup", "target"}, "autoregressive": {"target"}}[mode]
    assert set(levels) <= allowed
    stats = sample["stats"]
    assert stats["mode"] == mode
    assert stats["prompt_tokens"] == len(PROMPT_IDS)
    assert stats["new_tokens"] == 20
    assert stats["stop_reason"] == "max_new_tokens"
    assert stats["committed_by_level"] == {lvl: levels.count(lvl) for lvl in LEVELS}
    assert stats["mean_accepted"] == pytest.approx(20 / stats["rounds"])
    # One sample: the summary is that sample's own figures.
    assert out["stats"] == stats


def test_greedy_output_is_the_same_in_every_mode(greedy_json, hf_greedy):
    outputs = {mode: greedy_json[mode]["samples"][0]["token_ids"] for mode in MODES}
    assert outputs["autoregressive"] == hf_greedy
    for mode in MODES:
        assert outputs[mode] == hf_greedy, mode
        assert greedy_json[mode]["samples"][0]["text"] == greedy_json["autoregressive"]["samples"][0]["text"]


def _sampled(files, seed: int):
    argv = pair_args(files) + [
        "--prompt-ids-file", files["ids"], "--temperature", "1", "--seed", str(seed), "--num-samples", "3",
        "--ignore-eos", "--max-new-tokens", "12", "--json",
    ]
    code, out, err = run_main(argv)
    assert code == 0, err
    return json.loads(out)


def test_num_samples_with_seed_is_reproducible(files):
    first = _sampled(files, 7)
    again = _sampled(files, 7)
    samples = first["samples"]
    assert len(samples) == 3
    for s in samples:
        assert len(s["token_ids"]) == 12 == len(s["levels"])
        assert set(s["levels"]) <= LEVELS
        assert s["stats"]["new_tokens"] == 12
        assert s["stats"]["mode"] == "lookup"  # the default for short prompts
    assert [s["token_ids"] for s in again["samples"]] == [s["token_ids"] for s in samples]
    assert [s["levels"] for s in again["samples"]] == [s["levels"] for s in samples]
    # Independent samples of 12 tokens over a 97-token vocabulary at temperature 1 differ.
    assert len({tuple(s["token_ids"]) for s in samples}) == 3
    summary = first["stats"]
    assert summary["samples"] == 3
    assert summary["new_tokens"] == 36
    assert summary["rounds"] == sum(s["stats"]["rounds"] for s in samples)
    assert summary["mean_accepted"] == pytest.approx(36 / summary["rounds"])
    for level, proposed in summary["proposed"].items():
        assert proposed == sum(s["stats"]["proposed"].get(level, 0) for s in samples)
        assert summary["acceptance"][level] == pytest.approx(summary["accepted"].get(level, 0) / proposed)


@pytest.fixture(scope="module")
def tokenizer(files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files["target"])


def test_text_prompt(files, tokenizer):
    argv = pair_args(files) + ["--prompt", "w5 w6 w7", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    code, out, err = run_main(argv)
    assert code == 0, err
    sample = json.loads(out)["samples"][0]
    assert sample["stats"]["prompt_tokens"] == 3
    assert len(sample["token_ids"]) == 8
    assert sample["text"] == tokenizer.decode(sample["token_ids"], skip_special_tokens=True)

    # The same prompt from a file, and streamed as plain text (no --json): same tokens, the text
    # on stdout and one statistics line on stderr.
    argv = pair_args(files) + ["--prompt-file", files["prompt_txt"], "--max-new-tokens", "8", "--ignore-eos"]
    code, out, err = run_main(argv)
    assert code == 0, err
    # prompt.txt ends with a newline, which the word-level tokenizer drops.
    assert out == sample["text"] + "\n"
    assert "\x1b[" not in out  # no colour when stdout is not a terminal
    assert len(err.splitlines()) == 1
    assert err.startswith("[lookup] 8 tokens")  # the default for short prompts


def test_module_entry_point_subprocess(files, greedy_json):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable, "-m", "triforce_core", "generate", "--target", files["target"], "--draft", files["draft"],
        *SMALL, "--prompt-ids-file", files["ids"], "--mode", "retrieval", "--ignore-eos",
        "--max-new-tokens", "5", "--json",
    ]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ids = out["samples"][0]["token_ids"]
    assert ids == greedy_json["autoregressive"]["samples"][0]["token_ids"][:5]
    assert out["stats"]["mode"] == "retrieval"


def test_generate_json_inspect_prints_the_checks(files):
    """--inspect adds each verification's checks (sampled: u, p, q consistent with the rule);
    without it the JSON has none; without --json it is refused with one line."""
    argv = pair_args(files) + ["--prompt-ids-file", files["ids"], "--mode", "triforce", "--ignore-eos",
                               "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "1", "--json"]
    code, out, err = run_main(argv + ["--inspect"])
    assert code == 0, err
    sample = json.loads(out)["samples"][0]
    verifications = sample["verifications"]
    assert {v["level"] for v in verifications} >= {"target"}
    checks = [c for v in verifications for c in v["checks"]]
    assert checks
    for c in checks:
        assert set(c) == {"token_id", "proposer", "verifier", "q", "p", "u", "accepted", "p_top", "q_top",
                          "residual_top", "text"}
        assert c["accepted"] == (c["u"] * c["q"] < c["p"])
        assert isinstance(c["text"], str)
    code, out, err = run_main(argv)
    assert code == 0 and "verifications" not in json.loads(out)["samples"][0]
    assert_one_error_line(*run_main(pair_args(files) + ["--prompt", "w5", "--inspect"]), "--inspect", "--json")
