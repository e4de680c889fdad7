"""The price of a verification row (`triforce_core.decoding.row_cost`): measured once, kept on
disk under a key of everything it depends on, and measured again where the kept file is bad."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tests.helpers.models import make_hf, to_ours

from triforce_core.config import ConfigError, SpeculationConfig
from triforce_core.decoding import row_cost
from triforce_core.models import int8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return to_ours(make_hf("llama_gqa_llama3", seed=0))


@pytest.fixture
def timed(monkeypatch):
    """`measure` replaced by a fixed answer (1 row 10 ms, ROWS rows 22 ms: c = 0.3), counting calls."""
    calls = []

    def measure(model, kv_dtype, rows=row_cost.ROWS, repeats=row_cost.REPEATS):
        calls.append(kv_dtype)
        return 0.010, 0.010 * (1 + 0.3 * (rows - 1)), 100

    monkeypatch.setattr(row_cost, "measure", measure)
    monkeypatch.setattr(row_cost, "_measured", {})
    return calls


def test_the_price_is_the_extra_rows_time_over_a_steps_rounded():
    assert row_cost.row_cost_of(0.010, 0.022, 5) == pytest.approx(0.3)
    assert row_cost.row_cost_of(0.010, 0.0229, 5) == pytest.approx(0.3)  # 0.3225: to the nearest 0.05
    assert row_cost.row_cost_of(0.010, 0.0099, 5) == row_cost.LOWEST  # rows never free (noise)
    assert row_cost.row_cost_of(0.010, 1.0, 5) == row_cost.HIGHEST
    with pytest.raises(ValueError):
        row_cost.row_cost_of(0.0, 0.02, 5)


def test_a_real_measurement_gives_a_kept_price(model, tmp_path, monkeypatch):
    monkeypatch.setattr(row_cost, "_measured", {})
    one, wide, context = row_cost.measure(model, torch.float32, repeats=1)
    assert 0 < one and 0 < wide and 0 < context < model.spec.max_position_embeddings
    c = row_cost.measured_row_cost(model, torch.float32, tmp_path)
    assert row_cost.LOWEST <= c <= row_cost.HIGHEST
    kept = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert kept["row_cost"] == c and kept["kv_dtype"] == "float32"


def test_the_calibration_cache_is_drawn_a_layer_at_a_time(model, monkeypatch):
    """No float32 copy of the whole calibration cache: on a desktop-size model that was a
    gigabyte beside the cache at its first start."""
    drawn, randn = [], torch.randn

    def recorded(*args, **kwargs):
        out = randn(*args, **kwargs)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", recorded)
    _, _, context = row_cost.measure(model, torch.float16, repeats=1)
    s = model.spec
    layer = s.num_kv_heads * context * s.head_dim
    assert drawn and max(drawn) <= layer < s.num_layers * layer  # a layer's K or V, never the whole
    assert sum(drawn) >= 2 * s.num_layers * layer  # yet every layer's keys and values drawn


def test_measured_once_then_read_from_disk(model, tmp_path, timed, monkeypatch):
    assert row_cost.measured_row_cost(model, torch.float32, tmp_path) == pytest.approx(0.3)
    assert row_cost.measured_row_cost(model, torch.float32, tmp_path) == pytest.approx(0.3)
    assert len(timed) == 1  # the second call: this process's memory
    monkeypatch.setattr(row_cost, "_measured", {})  # another process: the file
    assert row_cost.measured_row_cost(model, torch.float32, tmp_path) == pytest.approx(0.3)
    assert len(timed) == 1 and len(list(tmp_path.glob("*.json"))) == 1


def test_the_key_names_kv_dtype_threads_products_and_shapes(model, tmp_path, timed, monkeypatch):
    base = row_cost.cost_key(model, torch.float32)
    assert row_cost.cost_key(model, torch.float32) == base
    assert row_cost.cost_key(model, torch.float16) != base
    own = model.arithmetic
    model.arithmetic = dataclasses.replace(own, products=0 if own.products else int8.WIDE)
    try:
        assert row_cost.cost_key(model, torch.float32) != base
    finally:
        model.arithmetic = own
    torch.set_num_threads(2)
    try:
        assert row_cost.cost_key(model, torch.float32) != base
    finally:
        torch.set_num_threads(1)
    other = to_ours(make_hf("llama_mha", seed=0))
    assert row_cost.cost_key(other, torch.float32) != base
    same_shapes = to_ours(make_hf("llama_gqa_llama3", seed=5))  # other weights, same arithmetic
    assert row_cost.cost_key(same_shapes, torch.float32) == base
    row_cost.measured_row_cost(model, torch.float32, tmp_path)
    row_cost.measured_row_cost(model, torch.float16, tmp_path)
    assert len(timed) == 2 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"row_cost": "fast"}', '{"row_cost": -1}',
                                     '{"row_cost": 1e9}', '{"row_cost": true}', '{"other": 0.3}', "\x00\xff"])
def test_a_bad_kept_file_is_measured_again_and_replaced(model, tmp_path, timed, content, caplog):
    path = tmp_path / f"{row_cost.cost_key(model, torch.float32)}.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape") if isinstance(content, str) else content)
    assert row_cost.measured_row_cost(model, torch.float32, tmp_path) == pytest.approx(0.3)
    assert len(timed) == 1
    assert json.loads(path.read_text())["row_cost"] == pytest.approx(0.3)
    assert "ignoring the row-cost file" in caplog.text


def test_a_folder_that_cannot_be_written_costs_a_measurement_not_a_crash(model, tmp_path, timed):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    assert row_cost.measured_row_cost(model, torch.float32, blocked / "row-cost") == pytest.approx(0.3)


def test_the_config_takes_a_price_or_none():
    assert SpeculationConfig().lookup_row_cost is None  # measured
    assert SpeculationConfig(lookup_row_cost=0.0).lookup_row_cost == 0.0  # rows free: every offered token
    with pytest.raises(ConfigError, match="lookup_row_cost"):
        SpeculationConfig(lookup_row_cost=-0.1)
