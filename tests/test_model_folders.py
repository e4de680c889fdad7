"""Finding GGUF files where desktop tools keep them, the browser's path restriction, and the
served models (loaded once, per caller, a load error leaving what was loaded untouched).

The folder layouts are LM Studio's, Ollama's (manifest + blob) and the Hugging Face cache's
(snapshot links into blobs), built in temporary folders around tiny real GGUF files."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from tests.helpers.models import make_hf
from tests.helpers.gguf_files import write_gguf
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import ModelLoadError
from triforce_core.models.folders import ModelFolders, PathRefused, default_tool_folders
from triforce_core.serving.registry import DEMO_ID, ServedModels, UnknownModel

REFUSED = "refused: only GGUF files under the model folders can be opened"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> bytes:
    path = write_gguf(make_hf("llama_mha", seed=3), tmp_path_factory.mktemp("gguf") / "tiny.gguf", {})
    return path.read_bytes()


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def home(tmp_path, gguf):
    """A home folder as a user of LM Studio, Ollama and the Hugging Face hub has it, a models
    folder of one's own, and a secret file outside them all."""
    h = tmp_path / "home"
    put(h / ".lmstudio/models/someone/Tiny-GGUF/tiny-Q8_0.gguf", gguf)
    put(h / ".lmstudio/models/someone/Tiny-GGUF/notes.txt", b"not a model")
    ollama = h / ".ollama/models"
    digest = hashlib.sha256(gguf).hexdigest()
    put(ollama / f"blobs/sha256-{digest}", gguf)
    put(ollama / ("blobs/sha256-" + "0" * 64), b'{"template": "..."}')
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}
    put(ollama / "manifests/registry.ollama.ai/library/tiny/latest", json.dumps(manifest).encode())
    put(ollama / "manifests/registry.ollama.ai/someone/other/q8", json.dumps(manifest).encode())
    put(ollama / "manifests/registry.ollama.ai/library/broken/latest", b"{not json")
    hub = h / ".cache/huggingface/hub"
    repo = hub / "models--org--Tiny-GGUF"
    put(repo / "blobs/abc123", gguf)
    snap = repo / "snapshots/0123abcd"
    snap.mkdir(parents=True)
    (snap / "tiny.Q8_0.gguf").symlink_to("../../blobs/abc123")  # as huggingface_hub links them
    mine = tmp_path / "mine"
    put(mine / "nested/deeper/own.gguf", gguf)
    put(mine / "fake.gguf", b"this is not a GGUF file")
    put(mine / "big-00001-of-00002.gguf", gguf)  # one part of a split file: not a model alone
    secret = put(tmp_path / "outside/secret.gguf", gguf)
    (mine / "link-out.gguf").symlink_to(secret)  # inside by name, outside in fact
    return {"home": h, "mine": mine, "secret": secret, "tmp": tmp_path}


def folders_of(home, monkeypatch) -> ModelFolders:
    monkeypatch.setenv("HOME", str(home["home"]))
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return ModelFolders.default([str(home["mine"])])


def test_discovery_finds_each_tools_layout(home, monkeypatch):
    found = {m.id: m for m in folders_of(home, monkeypatch).discover()}
    assert sorted(found) == [
        "hf/org/Tiny-GGUF/tiny.Q8_0",
        "lmstudio/someone/Tiny-GGUF/tiny-Q8_0",
        "nested/deeper/own",
        "ollama/someone/other:q8",
        "ollama/tiny:latest",
    ]
    assert found["ollama/tiny:latest"].path.name.startswith("sha256-")  # named through the manifest
    assert found["hf/org/Tiny-GGUF/tiny.Q8_0"].path.name == "abc123"  # the snapshot's link resolved
    assert {m.tool for m in found.values()} == {"lmstudio", "ollama", "hf", "models-dir"}


def test_tool_folders_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "o"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    folders = dict((p, t) for t, p in default_tool_folders())
    assert folders[tmp_path / "o"] == "ollama" and folders[tmp_path / "hfhome" / "hub"] == "hf"
    assert folders[tmp_path / ".lmstudio" / "models"] == "lmstudio"
    with pytest.raises(ValueError, match="not a folder"):
        ModelFolders.default([str(tmp_path / "missing")])


def test_only_gguf_files_under_the_folders_can_be_opened(home, monkeypatch):
    folders = folders_of(home, monkeypatch)
    own = home["mine"] / "nested/deeper/own.gguf"
    assert folders.allowed(str(own)) == own.resolve()
    blob = next(folders.discover()[i].path for i, m in enumerate(folders.discover()) if m.id == "ollama/tiny:latest")
    assert folders.allowed(str(blob)) == blob
    outside = [
        str(home["secret"]),  # exists, outside
        str(home["tmp"] / "outside/none.gguf"),  # does not exist, outside: the same answer
        "/etc/passwd",
        f"{home['mine']}/../outside/secret.gguf",  # traversal
        f"{home['mine']}/nested/../../outside/secret.gguf",
        str(home["mine"] / "link-out.gguf"),  # a link inside pointing out
        "nested/deeper/own.gguf",  # relative
        "~/.lmstudio/models/someone/Tiny-GGUF/tiny-Q8_0.gguf",  # not expanded: relative
        "",
        f"{own}\x00",
    ]
    messages = set()
    for text in outside:
        with pytest.raises(PathRefused) as e:
            folders.allowed(text)
        messages.add(str(e.value))
    assert len(messages) == 1 and next(iter(messages)).startswith(REFUSED)
    assert "\n" not in next(iter(messages)) and str(home["tmp"]) not in next(iter(messages))
    with pytest.raises(PathRefused, match="not a GGUF file"):
        folders.allowed(str(home["mine"] / "fake.gguf"))
    with pytest.raises(PathRefused, match="no such file"):
        folders.allowed(str(home["mine"] / "gone.gguf"))


def loader(counts: dict):
    def load(choice):
        counts[choice.id] = counts.get(choice.id, 0) + 1
        return TriForceEngine.from_pretrained(choice.target, choice.draft, device="cpu")
    return load


def test_served_models_load_once_per_model_and_a_bad_file_leaves_the_others(home, monkeypatch, gguf):
    folders = folders_of(home, monkeypatch)
    put(home["mine"] / "corrupt.gguf", b"GGUF" + os.urandom(200))
    counts: dict = {}
    own = home["mine"] / "nested/deeper/own.gguf"  # started with a tiny model (the demo pair is heavier)
    models = ServedModels(loader(counts), folders, started=(str(own), None), keep=1)
    ids = [c.id for c in models.choices()]
    assert ids[0] == "own" and DEMO_ID in ids and "ollama/tiny:latest" in ids and "corrupt" in ids
    assert "nested/deeper/own" not in ids  # the started file, listed once

    first = models.default()
    results, errors = [], []
    threads = [threading.Thread(target=lambda: results.append(models.get("ollama/tiny:latest"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({id(r) for r in results}) == 1 and counts["ollama/tiny:latest"] == 1
    assert results[0].engine is not first.engine and results[0].engine.context_window == 1024

    with pytest.raises(ModelLoadError) as e:
        models.get("corrupt")
    assert "\n" not in str(e.value) and "corrupt" in str(e.value)
    assert models.default() is first and models.loaded("ollama/tiny:latest") is results[0]
    with pytest.raises(UnknownModel, match="no model 'nope'"):
        models.get("nope")

    # Beyond `keep`, a model nobody holds is freed; one somebody holds stays (and is not loaded twice).
    held = models.get("hf/org/Tiny-GGUF/tiny.Q8_0")
    results.clear()
    gc.collect()
    assert models.loaded("ollama/tiny:latest") is None  # let go: freed
    models.get("lmstudio/someone/Tiny-GGUF/tiny-Q8_0")
    gc.collect()
    assert models.get("hf/org/Tiny-GGUF/tiny.Q8_0") is held and counts["hf/org/Tiny-GGUF/tiny.Q8_0"] == 1


def test_a_path_opens_a_file_under_the_folders_only(home, monkeypatch):
    models = ServedModels(loader({}), folders_of(home, monkeypatch), started=("x", None))
    assert models.open_path(str(home["mine"] / "nested/deeper/own.gguf")).id == "nested/deeper/own"
    with pytest.raises(PathRefused, match=REFUSED):
        models.open_path(str(home["secret"]))


def test_a_fifo_or_a_folder_named_gguf_is_never_opened(home, monkeypatch):
    """A FIFO waits forever on open: a scan that opened one would hang every request. Both it
    and a folder named `.gguf` are skipped; the real files are still found. (Run in a thread
    with a bound, so a regression fails the test instead of hanging it.)"""
    mine = home["mine"]
    os.mkfifo(mine / "pipe.gguf")
    os.mkfifo(home["home"] / ".ollama/models/manifests/registry.ollama.ai/library/tiny/piped")
    (mine / "folder.gguf").mkdir()
    folders = folders_of(home, monkeypatch)
    result: list = []
    t = threading.Thread(target=lambda: result.append(folders.discover(wait_s=60)), daemon=True)
    t.start()
    t.join(120)
    assert result, "the scan hung on a FIFO"
    ids = {m.id for m in result[0]}
    assert "own" not in ids and "nested/deeper/own" in ids and "ollama/tiny:latest" in ids
    assert not {"pipe", "folder"} & ids
    with pytest.raises(PathRefused):
        folders.allowed(str(mine / "pipe.gguf"))


def test_a_repeated_scan_reads_only_what_changed(home, monkeypatch):
    """Each file's first bytes are read once while it is unchanged; a changed file is read again."""
    import triforce_core.models.folders as module

    opened: list[str] = []
    sniff = module.is_gguf_file
    monkeypatch.setattr(module, "is_gguf_file", lambda p: opened.append(str(p)) or sniff(p))
    folders = folders_of(home, monkeypatch)
    first = folders.discover(wait_s=60)
    assert opened and len(opened) == len(set(opened))
    opened.clear()
    assert folders.discover(wait_s=60) == first and opened == []  # nothing read again
    own = home["mine"] / "nested/deeper/own.gguf"
    own.write_bytes(b"no longer a model")
    again = {m.id for m in folders.discover(wait_s=60)}
    assert opened == [str(own.resolve())] and "nested/deeper/own" not in again


def test_a_slow_scan_does_not_block_the_caller(home, monkeypatch):
    """A scan held up (a slow network mount, here an event that is not yet set) leaves the caller
    with the last complete result after `wait_s`; the scan finishes in the background."""
    import triforce_core.models.folders as module

    folders = folders_of(home, monkeypatch)
    first = folders.discover(wait_s=60)
    release = threading.Event()
    entries = module._Scanner.entries
    monkeypatch.setattr(module._Scanner, "entries", lambda self, folder: release.wait() and entries(self, folder))
    (home["mine"] / "new.gguf").write_bytes((home["mine"] / "nested/deeper/own.gguf").read_bytes())
    assert folders.discover(wait_s=0.05) == first  # the held scan's caller gets the last result
    release.set()
    folders._scan.join(60)
    assert "new" in {m.id for m in folders.discover(wait_s=60)}


def test_loads_stay_within_the_limits(home, monkeypatch):
    """At most `max_loaded` models in memory: a switch first lets go of a model only the registry
    keeps, and when every loaded model is held by a caller, the load is refused in one line with
    the numbers (nothing is loaded). The started model is never let go. A byte limit the
    started model alone fills refuses any other model the same way."""
    counts: dict = {}
    own = home["mine"] / "nested/deeper/own.gguf"
    models = ServedModels(loader(counts), folders_of(home, monkeypatch), started=(str(own), None), keep=1,
                          max_loaded=2)
    started = models.default()
    models.get("ollama/tiny:latest")  # kept by the registry only (keep=1)
    held = models.get("hf/org/Tiny-GGUF/tiny.Q8_0")  # lets go of ollama's: 2 loaded, both held
    gc.collect()
    assert models.loaded("ollama/tiny:latest") is None
    assert set(models.memory()["models"]) == {"own", "hf/org/Tiny-GGUF/tiny.Q8_0"}
    models._recent.clear()  # `held` is now held by its caller alone
    with pytest.raises(ModelLoadError) as e:
        models.get("lmstudio/someone/Tiny-GGUF/tiny-Q8_0")
    line = str(e.value)
    assert "\n" not in line and "2 models" in line and "--max-loaded-models" in line
    assert "lmstudio/someone/Tiny-GGUF/tiny-Q8_0" not in counts  # refused before loading
    del held
    gc.collect()
    assert models.get("lmstudio/someone/Tiny-GGUF/tiny-Q8_0").engine is not None  # room once it was let go
    assert models.default() is started

    tight = ServedModels(loader({}), folders_of(home, monkeypatch), started=(str(own), None),
                         max_bytes=own.stat().st_size + 1)
    tight.default()
    with pytest.raises(ModelLoadError, match="--max-model-gb"):
        tight.get("ollama/tiny:latest")
    with pytest.raises(ValueError, match="--max-loaded-models"):
        ServedModels(loader({}), folders_of(home, monkeypatch), started=(str(own), None), max_loaded=0)


@pytest.mark.parametrize("exact", [True, False])
def test_served_models_carry_exact_to_every_engine_they_load(home, monkeypatch, exact):
    """`--exact` reaches the started model and every one a request or the picker switches to:
    float32 K/V; without it a GGUF file's K/V are float16 (the control)."""
    import torch

    import app
    from triforce_core.cli.flags import served_models
    from triforce_core.config import GenerationConfig

    folders_of(home, monkeypatch)
    args = app.parse_args(["--device", "cpu", "--no-kv-cache", "--models-dir", str(home["mine"]),
                           *(["--exact"] if exact else [])])
    models = served_models(args, str(home["mine"] / "nested/deeper/own.gguf"), None, slots=0)
    for served in (models.default(), models.get("ollama/tiny:latest")):
        engine = served.engine
        assert engine.exact is exact and engine.target.quantized
        assert engine.kv_dtype_for(GenerationConfig()) == (torch.float32 if exact else torch.float16)
