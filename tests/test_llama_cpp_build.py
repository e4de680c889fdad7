"""The llama.cpp peer's build options (`bench/instruction_sets.py`, `bench/llama_cpp.py`).

Nothing here builds llama.cpp: the options are a pure function of the probe's results. One
test compiles and runs the tiny probe programs (about a second), and skips without a C compiler.
"""

from __future__ import annotations

import json
import shutil

import pytest

from bench import instruction_sets, llama_cpp

EVERYTHING = {name: True for name in instruction_sets.SETS}


def option(options: list[str], name: str) -> str:
    return next(o.split("=")[1] for o in options if o.startswith(f"-DGGML_{name}="))


def test_every_set_is_named_on_or_off_and_native_is_off():
    options, built = instruction_sets.select({"AVX": True, "AVX2": True, "FMA": True, "F16C": True})
    assert options[0] == "-DGGML_NATIVE=OFF"
    # ggml turns SSE42, AVX, AVX2, BMI2, FMA and F16C on by default without GGML_NATIVE: each is named
    assert {o.split("=")[0] for o in options[1:]} == {f"-DGGML_{n}" for n in instruction_sets.SETS}
    assert built == ["AVX", "AVX2", "FMA", "F16C"]
    assert option(options, "SSE42") == "OFF" and option(options, "BMI2") == "OFF" and option(options, "AVX2") == "ON"


def test_amx_is_never_built_even_where_its_probe_passes():
    options, built = instruction_sets.select(EVERYTHING)
    assert not any(n.startswith("AMX") for n in built)
    assert all(option(options, n) == "OFF" for n in ("AMX_TILE", "AMX_INT8", "AMX_BF16"))
    assert option(options, "AVX512_BF16") == "ON" and option(options, "AVX_VNNI") == "ON"  # the control: the rest is


def test_a_set_is_left_out_without_the_sets_it_builds_on():
    # AVX512's extensions without AVX512F itself (a probe failed): none of them
    _, built = instruction_sets.select({**EVERYTHING, "AVX512": False})
    assert "AVX512_VNNI" not in built and "AVX512_VBMI" not in built and "AVX2" in built
    _, built = instruction_sets.select({**EVERYTHING, "AVX": False})
    assert built == ["SSE42", "BMI2"]
    assert instruction_sets.select({})[1] == []


def test_the_cache_folder_changes_with_the_sets(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    avx2 = instruction_sets.select({"AVX": True, "AVX2": True, "FMA": True, "F16C": True})[1]
    avx512 = instruction_sets.select({**EVERYTHING, "AVX_VNNI": False})[1]
    folders = {llama_cpp.build_folder(b) for b in (avx2, avx512, [])}
    assert len(folders) == 3
    assert all(f.name.startswith(f"{llama_cpp.LLAMA_CPP_PYTHON}-") for f in folders)
    assert llama_cpp.build_folder(avx2).name == f"{llama_cpp.LLAMA_CPP_PYTHON}-avx-avx2-fma-f16c"
    assert llama_cpp.build_folder([]).name.endswith("-generic")


def test_reports_name_the_sets_built_with(tmp_path):
    for tool in llama_cpp.TOOLS:
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    tools = llama_cpp.find_or_build(tmp_path)
    assert llama_cpp.build_info(tools)["built_with"] is None  # ready binaries without build.json
    (tmp_path / llama_cpp.BUILD_INFO).write_text(json.dumps({"built_with": ["AVX", "AVX2"]}))
    assert llama_cpp.build_info(tools)["built_with"] == ["AVX", "AVX2"]
    assert "built with AVX, AVX2" in llama_cpp.format_table(_report(["AVX", "AVX2"]))
    assert "unknown instruction sets" in llama_cpp.format_table(_report(None))


def _report(built_with) -> dict:
    off_on = {"flash_attn_off": 1.0, "flash_attn_on": 2.0, "best": 2.0, "best_flash_attn": True}
    return {"llama_cpp": {"source": "test", "built_with": built_with}, "machine": {"cpu": "Some CPU"},
            "model_type": "llama", "threads": 2, "prompt_tokens": 10, "depth_tokens": 10, "new_tokens": 4,
            "prompt_processing": off_on, "generation": off_on, "lookup": None}


def test_no_compiler_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(instruction_sets.ProbeError, match="needs a C compiler") as e:
        instruction_sets.find_compiler()
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not instruction_sets.is_x86() or shutil.which("cc") is None, reason="needs x86 and a C compiler")
def test_the_probes_compile_and_the_baseline_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(instruction_sets, "SETS", ("SSE42", "AVX512_BF16"))  # two compiles, not fourteen
    results = instruction_sets.executable_sets()
    assert set(results) == {"SSE42", "AVX512_BF16"}
    assert results["SSE42"]  # every x86-64 processor of the last 15 years runs SSE4.2
    assert instruction_sets.executable_sets() == results  # from the cache file now
    assert list((tmp_path / "triforce-studio" / "llama.cpp").glob("instruction-sets-*.json"))
