"""`serve --ray`'s flags, checked before any cluster starts or model loads (no Ray needed: these
run where Ray is absent, which is what the first one is about)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_main
from triforce_core.serving.cluster import ClusterSpec, passed_env


def test_without_ray_serve_ray_says_in_one_line_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: `import ray` fails
    code, out, err = run_main(["serve", "--ray", "--target", "/nonexistent"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "pip install '.[cluster]'" in err and "ray[serve]==2.60.0" in err


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--address", "auto"], "--address needs --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "exclude each other"),
])
def test_cluster_flags_that_contradict_are_refused_before_anything_starts(argv, needle):
    code, _, err = run_main(["serve", "--target", "/nonexistent", *argv])
    assert code == 2 and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("kw, needle", [
    (dict(replicas=0), "--replicas must be >= 1"),
    (dict(replicas=None, min_replicas=1), "both --min-replicas and --max-replicas"),
    (dict(replicas=None, min_replicas=3, max_replicas=2), "--min-replicas <= --max-replicas"),
    (dict(cpus_per_replica=0), "--cpus-per-replica must be > 0"),
])
def test_cluster_spec_refuses_counts_that_cannot_run(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        ClusterSpec(**kw)


def test_the_replica_count_or_autoscaling_reaches_the_deployment():
    assert ClusterSpec(replicas=3).scaling() == {"num_replicas": 3}
    auto = ClusterSpec(replicas=None, min_replicas=1, max_replicas=4).scaling()["autoscaling_config"]
    assert auto["min_replicas"] == 1 and auto["max_replicas"] == 4 and auto["target_ongoing_requests"] > 0


def test_replicas_get_the_offline_and_cache_settings_and_the_checkouts_code():
    env = passed_env({"HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": "/c", "TRIFORCE_INT8": "0", "SECRET_TOKEN": "x",
                      "PATH": "/bin", "TRIFORCE_API_KEY": "k"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["XDG_CACHE_HOME"] == "/c" and env["TRIFORCE_INT8"] == "0"
    assert "SECRET_TOKEN" not in env and "PATH" not in env and "TRIFORCE_API_KEY" not in env
    import triforce_core

    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(triforce_core.__file__).resolve().parents[1])


def test_joining_a_cluster_sends_rays_token_whenever_there_is_one(tmp_path, monkeypatch):
    """Ray starts clusters with token authentication but sends the token only in token mode:
    `serve --ray --address` turns that mode on where a token is found, never against a choice."""
    from triforce_core.serving.cluster import join_auth

    monkeypatch.setenv("HOME", str(tmp_path))
    assert join_auth({}) == {}  # no token anywhere
    assert join_auth({"RAY_AUTH_TOKEN": "t"}) == {"RAY_AUTH_MODE": "token"}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert join_auth({}) == {"RAY_AUTH_MODE": "token"}  # where `ray start --head` writes it
    assert join_auth({"RAY_AUTH_MODE": "disabled"}) == {}


def test_a_model_path_that_is_not_there_is_refused_before_a_cluster_starts(tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: serve --ray refuses before this check")
    code, _, err = run_main(["serve", "--ray", "--target", str(tmp_path / "missing")])
    assert code == 2 and err == f"error: --target {tmp_path / 'missing'}: no such file or folder\n"
