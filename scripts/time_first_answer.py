"""Time a newcomer's first answer in the app, as a person sees it, and the same after a restart.

Starts `python app.py` (its default model unless `--app-args` say otherwise) with an empty
disk cache, opens the page in headless Chromium, clicks **Use the sample document**, asks the
question, and times the first token on screen and the end of the answer. Then stops the app,
starts it again on the same disk cache (the second opening) and does the same. Prints one
JSON object: per opening, the app's start-up, the seconds to the first token and to the end,
the status line (the engine's prefill and speed figures), the answer, and whether it loops
(an 8-gram of words repeated 3 times).

    python -m scripts.time_first_answer [--question "What is a class in Python?"] [--app-args "--target demo"]
                                        [--screenshot PATH]

`--screenshot PATH` saves the whole page as PNG once the second opening's answer has ended
(docs/app.md's picture).

Needs Playwright and Debian's chromium (the browser tests' set-up: `make test` installs it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.servers import stop

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"


def loops(text: str, n: int = 8, times: int = 3) -> bool:
    """Whether some n-gram of words occurs `times` times or more."""
    words = text.split()
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return any(c >= times for c in grams.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the app did not answer at {url} within {timeout:.0f} s")


def one_opening(question: str, cache_dir: Path, app_args: list[str], log: Path, screenshot: Path | None = None) -> dict:
    from playwright.sync_api import sync_playwright

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    t_start = time.perf_counter()
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--kv-cache-dir",
                                 str(cache_dir), "--data-dir", tempfile.mkdtemp(prefix="triforce-first-answer-data-"),
                                 *app_args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_up(proc, url)
        started_s = time.perf_counter() - t_start
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(600_000)
            page.goto(url)
            page.wait_for_selector("#tf-send")
            model = page.inner_text("#tf-model-info")
            t0 = time.perf_counter()
            page.click("#tf-sample")
            page.wait_for_selector("#tf-docinfo:has-text('python-tutorial-classes.txt')")
            loaded_s = time.perf_counter() - t0
            page.fill("#tf-message textarea", question)
            t0 = time.perf_counter()
            page.click("#tf-send")
            page.wait_for_selector(".tf-assistant .tf-tok", state="attached")
            first_s = time.perf_counter() - t0
            page.wait_for_function("document.querySelector('#tf-status').innerText.match(/tok\\/s|rror|Stopped/)")
            done_s = time.perf_counter() - t0
            status = page.inner_text("#tf-status").strip()
            answer = page.locator(".tf-assistant").last.locator(".tf-tok").all_inner_texts()
            if screenshot is not None:
                page.wait_for_timeout(1500)  # the plots drawn after the last event
                page.screenshot(path=str(screenshot), full_page=True)
            browser.close()
    finally:
        stop(proc, timeout_s=30)
    text = "".join(answer)
    return {"model": model.strip(), "app_started_s": round(started_s, 1), "sample_loaded_s": round(loaded_s, 1),
            "first_token_s": round(first_s, 1), "answer_done_s": round(done_s, 1), "status": status,
            "answer": text, "loops": loops(text)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--question", default="What is a class in Python?")
    p.add_argument("--app-args", default="", help="more flags for app.py, e.g. \"--target demo\"")
    p.add_argument("--screenshot", type=Path, help="save the page as PNG after the second opening's answer")
    args = p.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"error: {CHROMIUM} is missing: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cache, log = Path(tmp) / "kv", Path(tmp) / "app.log"
        try:
            runs = {name: one_opening(args.question, cache, shlex.split(args.app_args), log,
                                      args.screenshot if name == "second_opening" else None)
                    for name in ("first_opening", "second_opening")}
        except RuntimeError as e:
            print(f"error: {e}\n{log.read_text()[-3000:]}", file=sys.stderr)
            return 1
    print(json.dumps({"question": args.question, "app_args": args.app_args, **runs}, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
