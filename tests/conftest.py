"""Fixtures and settings every test shares: an offline, private environment, one thread per op,
the tiny checkpoints saved to disk and an engine over them (the plain helpers: tests/helpers)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The app and the CLI keep prefilled K/V under $XDG_CACHE_HOME by default: tests (and the servers
# they start, which inherit this) write into a folder of their own, never the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="triforce-tests-xdg-")

import pytest
import torch

from tests.helpers.models import CHAT_TEMPLATE, DRAFT_OVERRIDES, make_hf, make_tokenizer, perturbed, save_checkpoint, to_ours

# The test models are tiny: one thread per op beats spreading microsecond kernels over cores.
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under `--dist loadgroup`, tests marked `xdist_group` must really share a worker.

    pytest-xdist groups them by appending "@group" to their node ids; a pytest that ignores
    that (9.2 does) spreads the browser tests over both workers, each starting its own app and
    Chromium, and they turn slow and flaky instead of failing. Fail them here, saying why.
    """
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group"):
        if "@" not in item.nodeid:
            pytest.fail(
                f"pytest {pytest.__version__} ignores pytest-xdist's xdist_group marks, so these tests "
                "would not share one worker; install the versions pinned in requirements-dev.txt",
                pytrace=False,
            )


@pytest.fixture(scope="session")
def playwright_api():
    """One Playwright (sync API) per test process, for every browser test in it: the sync API
    refuses to start a second one while another runs its event loop on the same thread, and a
    session's page (tests/test_app.py) keeps its own open, so the browser tests of every module a
    worker runs launch their Chromium from this one. Skips without Playwright or Debian's chromium."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.helpers.page import CHROMIUM

    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A saved GQA Llama target + one-layer draft sharing a word-level tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer()
    target = save_checkpoint(root / "target", make_hf("llama_gqa_llama3", seed=0), tok)
    draft = save_checkpoint(root / "draft", make_hf("llama_gqa_llama3", seed=1, **DRAFT_OVERRIDES), tok)
    other = save_checkpoint(
        root / "other_vocab", make_hf("llama_gqa_llama3", seed=2, **DRAFT_OVERRIDES), make_tokenizer("x")
    )
    return {"target": target, "draft": draft, "other_vocab": other, "root": str(root)}


@pytest.fixture(scope="module")
def chat_engine():
    """A GQA target, a 2%-perturbed draft and the word-level tokenizer with a chat template."""
    from triforce_core.engine import TriForceEngine

    torch.set_num_threads(1)
    hf = make_hf("llama_gqa_llama3", seed=0)
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return TriForceEngine(to_ours(hf), to_ours(perturbed(hf, 0.02)), tok, eos_token_ids=[2])


@pytest.fixture(scope="module")
def kernels():
    """The native layers' quantized products (`triforce_core.models.int8`), built."""
    import triforce_core.models.native_layers as native_layers
    from tests.helpers.native import built

    return built(native_layers).int8


@pytest.fixture
def tiles(kernels):
    """`kernels` where AMX's integer tiles run; the test skips elsewhere."""
    if not kernels.tiles():
        pytest.skip("AMX's integer tiles do not run on this machine")
    return kernels


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add hand-off overhead on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

