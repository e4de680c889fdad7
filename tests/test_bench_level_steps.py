"""bench.level_steps on the demo pair: every level and row count for each attention path asked
for (the integer kernel's reader among them), and refusals in one line."""

import json

from conftest import needs_compiler

from bench import level_steps


@needs_compiler
def test_each_level_is_timed_on_each_attention_path(tmp_path):
    out = tmp_path / "steps.json"
    assert level_steps.main(["--context", "1100", "--repeats", "1", "--no-pytorch-layers", "--attention",
                             "float,float-layers,integer", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    levels = {(r["level"], r["rows"]) for r in rows}
    assert {("target", 1), ("target", 7), ("retrieval", 1)} <= levels
    for level in levels:
        assert sorted(r["attention"] for r in rows if (r["level"], r["rows"]) == level) == \
            ["float", "float-layers", "integer"]
    assert all(r["ms"]["native"] > 0 for r in rows)


def test_an_unknown_attention_path_is_refused(capsys):
    assert level_steps.main(["--context", "1100", "--attention", "float,gpu"]) == 2
    assert "--attention takes distinct names of tiles, float, float-layers, integer" in capsys.readouterr().err
