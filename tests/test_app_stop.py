"""Stopping the app: SIGTERM (what Ctrl-C's SIGINT does too) while a page holds an answer in step
mode and an HTTP API stream runs ends `python app.py --target demo` within a bounded time, with
exit code 0, one line saying so, and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.page import SAMPLE, open_page, wait_status
from tests.helpers.servers import free_port, wait_until_up

ROOT = Path(__file__).resolve().parent.parent
STOP_S = 30  # well under uvicorn's graceful wait plus the worker's join, were either to hang


def stream_answer(url: str, lines: list[str], started: threading.Event) -> None:
    """An answer streamed from /v1/chat/completions; its lines kept in `lines` (ends with the
    server's stop: a closed stream is fine, the test reads the server's side)."""
    body = {"model": "triforce-demo", "stream": True, "max_tokens": 2000,
            "messages": [{"role": "user", "content": SAMPLE.read_text(encoding="utf-8")[:3000] + "\n\nGo on."}]}
    request = urllib.request.Request(url + "v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                lines.append(line.decode())
                started.set()
    except OSError as e:
        lines.append(f"closed: {e}")
    finally:
        started.set()


def test_sigterm_with_a_page_mid_answer_and_a_stream_stops_the_app_in_one_line(tmp_path, playwright_api):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "app.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    cmd = [sys.executable, str(ROOT / "app.py"), "--target", "demo", "--port", str(port), "--max-new-tokens", "2000",
           "--data-dir", str(tmp_path / "data")]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(proc, lambda: urllib.request.urlopen(url, timeout=2), log, "the app")
        browser, page = open_page(playwright_api, url, 240_000)
        try:
            page.click("#tf-sample")
            page.wait_for_selector("#tf-docinfo:has-text('python-tutorial-classes.txt')")
            page.check("#tf-stepmode input")  # the answer waits for Step: mid-answer until the stop
            page.fill("#tf-message textarea", "What is a namespace?")
            page.click("#tf-send")
            wait_status(page, "Press Step")
            lines: list[str] = []
            started = threading.Event()
            threading.Thread(target=stream_answer, args=(url, lines, started), daemon=True).start()
            assert started.wait(120) and lines and not lines[0].startswith("closed"), lines
            health = json.load(urllib.request.urlopen(url + "v1/health", timeout=30))
            assert health["jobs"] >= 1, health  # the page's answer (and the stream's) still runs
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=STOP_S)
        finally:
            browser.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "CancelledError" not in text and "ERROR" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1] == "TriForce Studio stopped.", text[-3000:]
