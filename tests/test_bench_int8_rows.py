"""`python -m bench.int8_rows`: the report of the products' modes over one matrix or several (so
the weights come from memory), the steps' order where AMX's integer tiles run, and its refusals."""

from __future__ import annotations

import pytest
from tests.helpers.native import built, needs_compiler

import triforce_core.models.native_layers as native_layers
from bench import int8_rows

pytestmark = needs_compiler


def test_the_report_has_every_mode_over_several_matrices(tmp_path):
    tiles = built(native_layers).int8.tiles()
    out = tmp_path / "rows.json"
    assert int8_rows.main(["--types", "Q4_K,Q8_0", "--rows", "1,7", "--shape", "32x512", "--matrices", "2",
                           "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report["matrices"] == 2 and report["shape"] == [32, 512]
    k = [r for r in report["results"] if r["type"] == "Q4_K"]
    assert [r["rows"] for r in k] == [1, 7]
    for r in k:
        assert r["int16_us"] > 0 and ("step_tiles_us" in r) == tiles
        if tiles:  # the same 16-bit activations: the same distance from the float path, to rounding
            assert abs(r["relative_difference_step_tiles"] - r["relative_difference_int16"]) < 1e-5
    assert all("int16_us" not in r and "step_tiles_us" not in r for r in report["results"] if r["type"] == "Q8_0")


@pytest.mark.parametrize("args", [["--matrices", "0"], ["--matrices", "1001"], ["--types", "F16"], ["--rows", "0"]])
def test_bad_settings_are_refused(args, capsys):
    with pytest.raises(SystemExit) as e:
        int8_rows.main(args)
    assert e.value.code == 2
