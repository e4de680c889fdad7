"""Tiny random Hugging Face checkpoints built from configs (no downloads, CPU only)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The app and the CLI keep prefilled K/V under $XDG_CACHE_HOME by default: tests (and the servers
# they start, which inherit this) write into a folder of their own, never the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="triforce-tests-xdg-")

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from triforce_core.models.transformer import Transformer

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
# The test models are tiny: one thread per op beats spreading microsecond kernels over cores.
torch.set_num_threads(1)
VOCAB = 97
# A larger init than the default 0.02 keeps random logits far from ties, so greedy
# comparisons are meaningful; 2 layers keep everything fast on 2 cores.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

KINDS = {
    # name: (config class, model class, overrides)
    "llama_gqa_llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama_linear": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama_dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(max_position_embeddings=64, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    "llama_yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
    ),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=48)),
}
# A small draft: one layer, narrower, same vocabulary.
DRAFT_OVERRIDES = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


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


# The native libraries (`native_attention`, `native_layers`) are compiled at first use: their
# tests need a C compiler, and fail, saying where to look, when one is there but the build failed.
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the native libraries cannot be built here")


def built(library):
    """`library.kernel()`, which must have built and loaded."""
    k = library.kernel()
    assert k is not None, f"{library.__name__} did not build (see the warning logged)"
    return k


def make_hf(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls, kind_overrides = KINDS[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **kind_overrides, **overrides})
    return model_cls(config).eval()


# Where `to_ours` puts our models: the CPU, or with TRIFORCE_TEST_DEVICE=cuda a GPU, where the
# exactness tests check the CUDA path against Hugging Face's model on the CPU (docs/results.md's
# GPU section says which files were run there). CI runs everything on the CPU.
OURS = torch.device(os.environ.get("TRIFORCE_TEST_DEVICE", "cpu"))


def to_ours(hf) -> Transformer:
    return Transformer(hf.config, hf.state_dict(), OURS, torch.float32)


def perturbed(hf, scale: float, seed: int = 1):
    """A copy of `hf` with Gaussian noise on every weight: a draft that agrees only partly."""
    clone = type(hf)(hf.config).eval()
    clone.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return clone


def assert_verification_rows_equal_steps(model, ids: list[int], kv_dtype: torch.dtype | None = None,
                                         rows: int = 7) -> None:
    """`rows` new tokens after `ids` in one forward give, row by row, the logits of as many 1-token
    steps bit for bit (the few-row paths sum in one order whatever the rows beside)."""
    from bench.cuda_exactness import rows_against_steps

    rows = rows_against_steps(model, ids, kv_dtype, rows)
    assert rows["bit_equal"], f"a verification's logits differ from steps' by up to {rows['max_abs_diff']:.3g}"


def make_tokenizer(words_prefix: str = "w", vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: <unk>=0, <s>=1, </s>=2, then '{prefix}3' ... ; whitespace split."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        vocab_map[f"{words_prefix}{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def save_checkpoint(path, hf, tokenizer=None) -> str:
    hf.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


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


# A chat template whose role markers are ordinary words of the word-level test vocabulary,
# so every token of a rendered conversation is known.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w3 {% elif m['role'] == 'user' %}w4 "
    "{% else %}w5 {% endif %}{{ m['content'] }} w6 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def words(n: int, seed: int) -> str:
    """n random words of the test vocabulary (w7 .. w96)."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(7, 97)}" for _ in range(n))


@pytest.fixture(scope="module")
def chat_engine():
    """A GQA target, a 2%-perturbed draft and the word-level tokenizer with a chat template."""
    from triforce_core.engine import TriForceEngine

    torch.set_num_threads(1)
    hf = make_hf("llama_gqa_llama3", seed=0)
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return TriForceEngine(to_ours(hf), to_ours(perturbed(hf, 0.02)), tok, eos_token_ids=[2])


# Small caches for the tiny models on the command line (their context window is 1024 tokens).
SMALL_CACHE_FLAGS = ["--budget", "32", "--chunk-size", "4", "--draft-window", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add hand-off overhead on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def chat_pair(root, name: str) -> tuple[str, str]:
    """A tiny Llama 3 target saved as `root/name` and a draft that agrees with it only partly
    (`root/chat-draft`), both with a chat template: their folders."""
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    hf = make_hf("llama_gqa_llama3", seed=0)
    return save_checkpoint(root / name, hf, tok), save_checkpoint(root / "chat-draft", perturbed(hf, 0.02), tok)


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


def run_main(argv):
    """The command line's main(argv) in-process -> (exit code, stdout, stderr)."""
    import io

    from triforce_core.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


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
