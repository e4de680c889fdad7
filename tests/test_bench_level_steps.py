"""bench.level_steps on the demo pair: every level and row count for each attention path asked
for (the integer kernel's reader among them), and refusals in one line."""

import json

from tests.helpers.native import needs_compiler

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
    assert "--attention takes distinct names of float, float-layers, integer" in capsys.readouterr().err


@needs_compiler
def test_the_retrieval_levels_rows_say_which_configuration_they_belong_to(tmp_path, capsys):
    # an int16 configuration keeps its retrieval level's tokens as float16: without the
    # configuration's name its rows would read as a second float16 row
    out = tmp_path / "steps.json"
    assert level_steps.main(["--context", "1100", "--repeats", "1", "--no-pytorch-layers", "--kv-dtypes",
                             "float16,int16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    retrieval = [(r["kv_dtype"], r.get("configured_kv_dtype")) for r in rows if r["level"] == "retrieval" and r["rows"] == 1]
    assert sorted(retrieval, key=str) == [("float16", "int16"), ("float16", None)]
    target = {(r["kv_dtype"], r.get("configured_kv_dtype")) for r in rows if r["level"] == "target"}
    assert target == {("float16", None), ("int16", None)}
    assert "float16 K/V (of the int16 configuration)" in capsys.readouterr().out


def test_the_integer_reader_is_refused_for_a_model_with_sliding_windows(tmp_path, capsys):
    from tests.helpers.models import make_hf, make_tokenizer, save_checkpoint

    hf = make_hf("gemma3")  # two sliding-window layers, then a full one
    target = save_checkpoint(tmp_path / "gemma3", hf, make_tokenizer(vocab=hf.config.vocab_size))
    capsys.readouterr()  # what saving it printed
    assert level_steps.main(["--target", target, "--context", "100", "--attention", "float,integer"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --attention integer reads every key of the int16 planes: a model with sliding-window "
                   "layers takes float")
