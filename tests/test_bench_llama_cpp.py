"""llama.cpp as the benchmarks' CPU peer (`bench/llama_cpp.py`): the pure parts only.

Nothing here builds or runs llama.cpp (a build takes minutes): the tools' outputs are
fixtures written in their formats, and `bench.chat`'s comparison runs with a stand-in peer.
"""

from __future__ import annotations

import io
import json

import pytest
from tests.helpers.models import words

from bench import chat, llama_cpp
from triforce_core.config import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def bench_entry(n_prompt: int, n_gen: int, depth: int, fa: int, rate: float) -> dict:
    return {"build_commit": "unknown", "build_number": 0, "cpu_info": "Some CPU", "backends": "CPU",
            "model_filename": "m.gguf", "model_type": "llama ?B Q4_1", "model_size": 98000000, "n_threads": 2,
            "flash_attn": fa, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth, "avg_ns": 1000,
            "stddev_ns": 10, "avg_ts": rate, "stddev_ts": 0.5, "samples_ns": [1000], "samples_ts": [rate]}


BENCH_JSON = json.dumps([bench_entry(6000, 0, 0, 0, 900.0), bench_entry(6000, 0, 0, 1, 1100.0),
                         bench_entry(0, 64, 6000, 0, 120.0), bench_entry(0, 64, 6000, 1, 95.0)], indent=2)

LOOKUP_LOG = """\
some text the model wrote

encoded 6012 tokens in    7.500 seconds, speed:  810.000 t/s
decoded   65 tokens in    0.500 seconds, speed:  130.000 t/s

n_draft      = 3
n_predict    = 65
n_drafted    = 30
t_draft_flat = 1.20 ms
t_draft      = 0.50 ms, 16.67 us per token, 60000.00 tokens per second
n_accept     = 25
accept       = 83.333%

target:

common_perf_print:        load time =     100.00 ms
"""


def test_llama_bench_json_becomes_one_row_per_test():
    runs = llama_cpp.parse_bench_json(BENCH_JSON)
    assert [(r["kind"], r["tokens"], r["depth"], r["flash_attn"]) for r in runs] == [
        ("pp", 6000, 0, False), ("pp", 6000, 0, True), ("tg", 64, 6000, False), ("tg", 64, 6000, True)]
    assert runs[1]["tokens_per_s"] == 1100.0 and runs[0]["threads"] == 2


def test_the_better_flash_attention_setting_is_picked_per_kind():
    runs = llama_cpp.parse_bench_json(BENCH_JSON)
    assert llama_cpp.best_of(runs, "pp") == {"flash_attn_off": 900.0, "flash_attn_on": 1100.0, "best": 1100.0,
                                              "best_flash_attn": True}
    assert llama_cpp.best_of(runs, "tg")["best_flash_attn"] is False
    assert llama_cpp.best_of(runs[:2], "tg") is None


def test_bad_bench_output_is_a_peer_error():
    with pytest.raises(llama_cpp.PeerError, match="did not parse"):
        llama_cpp.parse_bench_json("main: error: failed to load model")


def test_the_lookup_summary_is_parsed_and_the_encode_rate_recomputed():
    r = llama_cpp.parse_lookup_log(LOOKUP_LOG)
    assert r["prompt_tokens"] == 6012 and r["encode_tokens_per_s"] == pytest.approx(6012 / 7.5)
    assert r["new_tokens"] == 65 and r["tokens_per_s"] == pytest.approx(130.0)
    assert (r["draft_max"], r["drafted"], r["accepted"]) == (3, 30, 25)
    assert r["acceptance"] == pytest.approx(25 / 30)
    assert r["tokens_per_target_forward"] == pytest.approx(65 / 40)
    with pytest.raises(llama_cpp.PeerError, match="lacks decoded"):
        llama_cpp.parse_lookup_log(LOOKUP_LOG.replace("decoded", "produced"))


def test_token_ids_are_counted_from_the_last_list():
    assert llama_cpp.parse_token_ids("load_model: ...\n[1, 17, 4005, 9]\n") == 4
    with pytest.raises(llama_cpp.PeerError):
        llama_cpp.parse_token_ids("error: no model")


def test_given_binaries_must_hold_every_tool(tmp_path):
    with pytest.raises(llama_cpp.PeerError, match="lacks one of"):
        llama_cpp.find_or_build(tmp_path)
    for tool in llama_cpp.TOOLS:
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    assert llama_cpp.find_or_build(tmp_path)["llama-lookup"] == tmp_path / "llama-lookup"


def peer_report() -> dict:
    runs = llama_cpp.parse_bench_json(BENCH_JSON)
    return {"llama_cpp": {"source": "test", "build_commit": "unknown", "tools": "/bin"},
            "machine": {"cpu": "Some CPU"}, "model": "m.gguf", "model_type": "llama ?B Q4_1", "threads": 2,
            "prompt_tokens": 6000, "depth_tokens": 6000, "new_tokens": 64, "repetitions": 1,
            "prompt_processing": llama_cpp.best_of(runs, "pp"), "generation": llama_cpp.best_of(runs, "tg"),
            "lookup": {**llama_cpp.parse_lookup_log(LOOKUP_LOG), "flash_attn": False}, "runs": runs}


def test_the_table_names_every_figure():
    table = llama_cpp.format_table(peer_report())
    assert "1100.0" in table and "120.0" in table and "130.0 tok/s" in table and "83.3 %" in table


def test_a_generation_only_report_leaves_prompt_processing_out():
    """`--generation-only` (llama-bench's test at a depth alone): no pp runs, no pp line."""
    report = peer_report()
    report["runs"] = [r for r in report["runs"] if r["kind"] == "tg"]
    report["prompt_processing"] = llama_cpp.best_of(report["runs"], "pp")
    assert report["prompt_processing"] is None
    table = llama_cpp.format_table({**report, "lookup": None})
    assert "generation of 64 at depth 6000" in table and "prompt processing" not in table


def test_chat_compares_every_configuration_with_the_peer(chat_engine):
    text = words(300, seed=11)
    turns = chat.workload(text, quotes=1, open_count=0, seed=1)
    seen = []

    def peer(prompt_text, prompt_tokens):
        seen.append((prompt_text, prompt_tokens))
        return peer_report()

    report = chat.run(chat_engine, text, turns, ["lookup", "autoregressive"], SamplingConfig(), 8,
                      say=lambda s: None, peer=peer)
    (prompt_text, prompt_tokens), = seen
    assert text in prompt_text and turns[0][1] in prompt_text and prompt_tokens > 300
    ours = report["llama_cpp"]["ours"]
    assert ours["prefill_tokens"] >= 300
    assert ours["prefill_vs_prompt_processing"] == pytest.approx(ours["prefill_tokens_per_s"] / 1100.0)
    for name in ("lookup", "autoregressive"):
        assert ours["decode_vs_generation"][name] == pytest.approx(report["results"][name]["tokens_per_s"] / 120.0)
        assert ours["decode_vs_lookup"][name] == pytest.approx(report["results"][name]["tokens_per_s"] / 130.0)
        assert ours["first_turn_decode_vs_lookup"][name] == pytest.approx(
            report["turns"][0]["tokens_per_s"][name] / 130.0)
    out = io.StringIO()
    chat.print_table(report, file=out)
    assert "turn 1 vs llama-lookup" in out.getvalue()


def test_a_failed_peer_leaves_our_report(chat_engine):
    text = words(300, seed=11)
    turns = chat.workload(text, quotes=1, open_count=0, seed=1)

    def peer(prompt_text, prompt_tokens):
        raise llama_cpp.PeerError("llama-bench failed (exit 1): no model")

    report = chat.run(chat_engine, text, turns, ["autoregressive"], SamplingConfig(), 4, say=lambda s: None, peer=peer)
    assert report["llama_cpp"] == {"error": "llama-bench failed (exit 1): no model"}
    assert report["results"]["autoregressive"]["new_tokens"] > 0


@pytest.mark.parametrize("target, message", [
    (None, "needs a GGUF target"), ("Qwen/Qwen2.5-0.5B-Instruct", "needs a GGUF target"),
    ("no/such/file.gguf", "GGUF file not found")])
def test_chat_refuses_the_peer_without_a_gguf_target(capsys, target, message):
    argv = ["--llama-cpp", "--quotes", "1", "--open", "0"] + (["--target", target] if target else [])
    assert chat.main(argv) == 2
    assert message in capsys.readouterr().err
