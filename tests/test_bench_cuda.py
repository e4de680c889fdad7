"""The GPU benchmarks (`bench.cuda_levels`, `bench.cuda_exactness`) run here on the CPU: the same
code on small models, so that they still run when a GPU is lent. Their GPU numbers are in
docs/results.md; nothing here depends on a timing."""

from __future__ import annotations

import json

import pytest
import torch

from bench import cuda_exactness, cuda_levels
from triforce_core.config import SpeculationConfig


def test_cuda_levels_reports_every_level_with_its_floor(tmp_path):
    out = tmp_path / "levels.json"
    assert cuda_levels.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "600,1500",
                             "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["context"], r["level"], r["rows"]) for r in report["results"]}
    lookup_rows = SpeculationConfig().lookup_max + 1
    for T in (600, 1500):
        assert {(T, "target", 1), (T, "target", 7), (T, "target", lookup_rows), (T, "retrieval", 1), (T, "retrieval", 3),
                (T, "draft", 1)} <= rows
    for r in report["results"]:
        assert r["ms"]["ours"] > 0 and r["floor_ms"] > 0 and r["host_ms"]["ours"] > 0
        extra = {"target": r["rows"], "retrieval": r["rows"], "draft": r["rows"]}[r["level"]]
        assert r["keys"] == {"target": r["context"], "retrieval": min(r["context"], 4096),
                             "draft": 256}[r["level"]] + extra
    assert {p["matrix"] for p in report["projections"]} == {"qkv", "o", "gate_up", "down"}


def test_the_random_target_has_the_shape_asked_for():
    model = cuda_levels.random_model(cuda_levels.SHAPES["tiny"][0], torch.device("cpu"), torch.float32, seed=1)
    s = model.spec
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.vocab_size) == (2, 128, 4, 2, 512)
    assert model.lm_head is not model.embed  # untied, as Llama-3-8B


@pytest.mark.parametrize("argv", [["--context", "x"], ["--paths", "cudnn"], ["--shape", "tiny", "--context", "9000"]])
def test_cuda_levels_bad_input_exits_2(argv, capsys):
    assert cuda_levels.main(["--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_cuda_exactness_on_the_cpu_in_float32_finds_every_mode_exact(tmp_path):
    """On the CPU in float32 a verification's rows are a step's bit for bit, so every mode gives
    the autoregressive answer, and that answer is Hugging Face's: the report must say so."""
    out = tmp_path / "exact.json"
    assert cuda_exactness.main(["--device", "cpu", "--dtypes", "float32", "--cases", "llama-small,qwen2-tied-small",
                                "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 2
    for r in results:
        assert r["rows"] == {"max_abs_diff": 0.0, "bit_equal": True, "argmax_equal": True}
        assert r["hf"]["first_difference"] is None
        assert set(r["modes"]) == set(cuda_exactness.MODES)
        assert all(m["first_difference"] is None for m in r["modes"].values())


def test_first_difference():
    assert cuda_exactness._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert cuda_exactness._first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert cuda_exactness._first_difference([1, 2], [1, 2, 3]) == 2
