"""bench.memory's first start: a child that finds this user's caches but no kept row price."""

import os

from bench.memory import first_start_env
from triforce_core.config import cache_home


def test_a_first_start_finds_every_cache_but_the_row_prices(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    home = cache_home()
    for name in ("kv", "row-cost", "gguf"):
        (home / name).mkdir(parents=True)
    (home / "row-cost" / "price.json").write_text("{}")
    env = first_start_env(tmp_path / "first")
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    child_home = cache_home()
    assert child_home != home and child_home.parent == tmp_path / "first"
    assert sorted(p.name for p in child_home.iterdir()) == ["gguf", "kv"]
    assert all(os.path.realpath(child_home / n) == str(home / n) for n in ("gguf", "kv"))
    assert not (child_home / "row-cost").exists()  # the price is measured again there


def test_a_user_without_caches_starts_with_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "nobody"))
    env = first_start_env(tmp_path / "first")
    assert list((tmp_path / "first" / "triforce-studio").iterdir()) == []
    assert env == {"XDG_CACHE_HOME": str(tmp_path / "first")}
