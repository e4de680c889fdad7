"""Servers a test starts (the app, `python -m triforce_core serve`): a free port, started and
stopped around a block, their health and metrics read; calls made at the same time."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.servers import stop
from tests.helpers import ROOT

def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], log, probe, env: dict, what: str = "the server", timeout: float = 180):
    """Start `cmd` (output to `log`), wait until `probe()` answers (see wait_until_up), yield the
    process, and stop it however the block ends."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(proc, probe, log, what, timeout)
        yield proc
    finally:
        stop(proc, timeout_s=20)


@contextlib.contextmanager
def served_pair(models: dict, folder, key: str, args: list[str], env: dict | None = None):
    """`python -m triforce_core serve` of models["target"] and ["draft"] on a free port with API
    key `key` and `args`, in an empty home (no LM Studio, Ollama or Hugging Face models of this
    machine's), offline; `env` adds to its environment. Yields {"base", "proc", "log"} once
    /v1/health answers; stops it however the block ends."""
    import httpx

    port = free_port()
    log = Path(folder) / "serve.log"
    run_env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE")}
    run_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRIFORCE_API_KEY=key, HOME=str(models["home"]), **(env or {}))
    cmd = [sys.executable, "-m", "triforce_core", "serve", "--target", models["target"], "--draft", models["draft"],
           "--device", "cpu", "--port", str(port), *args]
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    probe = lambda: httpx.get(f"{base}/v1/health", headers=auth, timeout=2).status_code == 200  # noqa: E731
    with running_server(cmd, log, probe, run_env) as proc:
        yield {"base": base, "proc": proc, "log": log}



def served_health(server: dict, key: str) -> dict:
    """A served pair's /v1/health (served_pair's dict)."""
    import httpx

    return httpx.get(server["base"] + "/v1/health", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()


def served_idle(server: dict, key: str, timeout: float = 60) -> dict:
    """/v1/health once no job runs and no slot is lent (or after `timeout` seconds: the caller asserts)."""
    import time

    deadline = time.time() + timeout
    while True:
        h = served_health(server, key)
        if (h["jobs"] == 0 and h["slots"]["lent"] == 0) or time.time() > deadline:
            return h
        time.sleep(0.2)


def wait_until_up(proc, probe, log, what: str = "the server", timeout: float = 180) -> None:
    """Poll `probe()` (True once the server answers) until it does; fail with the log's tail if
    the process exits or `timeout` seconds pass."""
    import time

    deadline = time.time() + timeout
    while True:
        try:
            if probe():
                return
        except Exception:  # noqa: BLE001 - not listening yet (urllib or httpx errors)
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"{what} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def scrape_metrics(base: str, model: str, headers: dict | None = None) -> dict[tuple, float]:
    """A server's `GET /metrics`, parsed: {(sample name, sorted labels but model_name): value}
    of the samples of `model`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", headers=headers or {}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version="), r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.labels.get("model_name") == model:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
    return out



def at_once(calls) -> tuple[list, list[BaseException]]:
    """Run the zero-argument `calls` in threads at the same time: (results in order, errors)."""
    import threading

    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results, errors
