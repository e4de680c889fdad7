"""Where GGUF files are kept on this machine, and which paths a browser may name.

    folders = ModelFolders.default(models_dirs=["/data/models"])
    for found in folders.discover(): ...            # FoundModel(id, path, tool)
    path = folders.allowed("/data/models/qwen/q4.gguf")  # or raises PathRefused

Desktop tools keep models in known layouts:

- LM Studio: `~/.lmstudio/models/<publisher>/<repo>/<file>.gguf` (older versions:
  `~/.cache/lm-studio/models`); id `lmstudio/<publisher>/<repo>/<file>`.
- Ollama: `$OLLAMA_MODELS` or `~/.ollama/models` (the Linux service's
  `/usr/share/ollama/.ollama/models`): `manifests/<registry>/<namespace>/<model>/<tag>` is JSON
  whose layer of media type `application/vnd.ollama.image.model` names the weights'
  `blobs/sha256-<hex>` (a GGUF file without the extension); id `ollama/<model>:<tag>` (the
  namespace leads the model when it is not `library`, the registry when it is not Ollama's).
- The Hugging Face cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`: `models--<org>--<repo>/snapshots/<revision>/<file>.gguf`, itself
  a link into `blobs/`; id `hf/<org>/<repo>/<file>` (the newest revision's).
- Folders the server was started with (`--models-dir DIR`): any `.gguf` below; id the path
  below DIR without `.gguf`.

The browser may open only files below these folders (`allowed`): a path given as text is
refused, in one line that says no more than that, when it is relative, leaves the folders
lexically (`..`) or through a link, or is not a GGUF file. The same line answers every path
outside, existing or not, so the page cannot probe the server's disk. Scans are bounded
(depth and count) so a folder such as `/` cannot hang the server. No torch here.

A scan never blocks a request for long and never opens what is not a regular file: a FIFO
named `x.gguf` would wait forever on open, a device could be read without end. Each folder's
listing is kept until the folder's modification time changes, and each file's sniff (its
first four bytes) until its size, modification time or inode changes, so a repeated scan
reads only what changed; a scan that takes longer than `SCAN_WAIT_S` (a slow network mount)
goes on in the background while the caller gets the last complete result.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
MAX_DEPTH = 6  # folders below a root that a scan enters
MAX_FILES = 5000  # entries a scan looks at per root
MAX_MANIFEST_BYTES = 1 << 20  # an Ollama manifest is a few hundred bytes of JSON
SCAN_WAIT_S = 2.0  # how long a caller waits for a scan before taking the last complete one
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
# Split GGUF files ("-00001-of-00003.gguf") are one model in several parts: the loader reads one file.
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
TOOLS = ("lmstudio", "ollama", "hf", "models-dir")


class PathRefused(ValueError):
    """A path the browser may not open (one line)."""


@dataclass(frozen=True)
class FoundModel:
    id: str  # how the picker and `/v1/models` name it
    path: Path  # the GGUF file (links resolved)
    tool: str  # one of TOOLS: which folder it was found in


def is_gguf_file(path: str | os.PathLike) -> bool:
    """A regular file that begins with GGUF's magic (Ollama's blobs have no extension). Only a
    regular file is opened: opening a FIFO or a device would wait on it."""
    try:
        path = Path(os.path.expanduser(path))
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _home() -> Path:
    return Path(os.path.expanduser("~"))


def hf_hub_cache() -> Path:
    """The Hugging Face cache's hub folder, by huggingface_hub's own rules."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") else _home() / ".cache"
    return cache / "huggingface" / "hub"


def default_tool_folders() -> list[tuple[str, Path]]:
    """(tool, folder) where desktop tools keep models on this machine, existing or not."""
    home = _home()
    ollama = [Path(os.environ["OLLAMA_MODELS"]).expanduser()] if os.environ.get("OLLAMA_MODELS") else [
        home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return ([("lmstudio", home / ".lmstudio" / "models"), ("lmstudio", home / ".cache" / "lm-studio" / "models")]
            + [("ollama", p) for p in ollama] + [("hf", hf_hub_cache())])


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _Scanner:
    """Folder listings and file sniffs, each kept while what it was read from is unchanged."""

    def __init__(self):
        self._listings: dict[str, tuple[tuple, list[str], list[str]]] = {}
        self._sniffs: dict[str, tuple[tuple, object]] = {}
        self._lock = threading.Lock()

    def entries(self, folder: Path) -> tuple[list[str], list[str]]:
        """(sub-folders, other names) of `folder`, sorted; links to folders are not followed.
        Empty when it cannot be read."""
        try:
            st = os.stat(folder)
        except OSError:
            return [], []
        key = _identity(st)
        with self._lock:
            kept = self._listings.get(str(folder))
        if kept is not None and kept[0] == key:
            return kept[1], kept[2]
        dirs, files = [], []
        try:
            with os.scandir(folder) as it:
                for i, entry in enumerate(it):
                    if i >= MAX_FILES:
                        break
                    try:
                        (dirs if entry.is_dir(follow_symlinks=False) else files).append(entry.name)
                    except OSError:
                        continue
        except OSError:
            return [], []
        dirs.sort()
        files.sort()
        with self._lock:
            self._listings[str(folder)] = (key, dirs, files)
        return dirs, files

    def _read(self, path: Path, read):
        """`read(path)` for a regular file, kept while the file is unchanged; None otherwise."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        key = _identity(st)
        with self._lock:
            kept = self._sniffs.get(str(path))
        if kept is not None and kept[0] == key:
            return kept[1]
        value = read(path, st)
        with self._lock:
            self._sniffs[str(path)] = (key, value)
        return value

    def is_gguf(self, path: Path) -> bool:
        return bool(self._read(path, lambda p, _st: is_gguf_file(p)))

    def manifest_digest(self, path: Path) -> str | None:
        """The model layer's digest of an Ollama manifest, or None."""
        return self._read(path, _manifest_digest)

    def walk_gguf(self, root: Path) -> list[Path]:
        """`.gguf` files below `root` (not following links into folders), bounded in depth and count."""
        out: list[Path] = []
        seen = 0
        stack = [(root, 0)]
        while stack:
            folder, depth = stack.pop(0)
            dirs, files = self.entries(folder)
            for name in files:
                seen += 1
                if seen > MAX_FILES:
                    return out
                if name.lower().endswith(".gguf") and not _SPLIT_PART.search(name):
                    out.append(folder / name)
            if depth + 1 < MAX_DEPTH:
                stack[0:0] = [(folder / d, depth + 1) for d in dirs if not d.startswith(".")]
        return out


def _manifest_digest(path: Path, st: os.stat_result) -> str | None:
    if st.st_size > MAX_MANIFEST_BYTES:
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        digest = next(layer["digest"] for layer in manifest.get("layers", [])
                      if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return None  # not a manifest of a model with weights
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        return None
    return digest


def _below(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class ModelFolders:
    """The folders models are found in and may be opened from (see the module docstring)."""

    def __init__(self, tool_folders: list[tuple[str, Path]], models_dirs: list[Path] = ()):
        for d in models_dirs:
            if not Path(d).is_dir():
                raise ValueError(f"--models-dir {d}: not a folder")
        self.roots: list[tuple[str, Path]] = [(t, Path(p)) for t, p in tool_folders] + [
            ("models-dir", Path(d).expanduser()) for d in models_dirs]
        self._scanner = _Scanner()
        self._last: list[FoundModel] = []  # the last complete scan
        self._scan: threading.Thread | None = None
        self._scan_lock = threading.Lock()

    @classmethod
    def default(cls, models_dirs: list[str] | None = None) -> "ModelFolders":
        return cls(default_tool_folders(), [Path(d) for d in models_dirs or ()])

    def existing(self) -> list[tuple[str, Path]]:
        """(tool, folder) for the folders that exist, links resolved, each once."""
        out, seen = [], set()
        for tool, root in self.roots:
            try:
                real = root.resolve(strict=True)
            except OSError:
                continue
            if real.is_dir() and (tool, real) not in seen:
                seen.add((tool, real))
                out.append((tool, real))
        return out

    # -- discovery ------------------------------------------------------------------------
    def discover(self, wait_s: float = SCAN_WAIT_S) -> list[FoundModel]:
        """Every GGUF file in the folders, one entry per id (the first folder's wins): a fresh
        scan, or the last complete one when this one takes longer than `wait_s` (it goes on)."""
        with self._scan_lock:
            if self._scan is None or not self._scan.is_alive():
                self._scan = threading.Thread(target=self._scan_now, name="model-folders-scan", daemon=True)
                self._scan.start()
            scan = self._scan
        scan.join(wait_s)
        return list(self._last)

    def _scan_now(self) -> None:
        found: dict[str, FoundModel] = {}
        scanner = self._scanner
        for tool, root in self.existing():
            scan = {"lmstudio": _lmstudio, "ollama": _ollama, "hf": _hf_cache, "models-dir": _models_dir}[tool]
            for model_id, path in scan(scanner, root):
                try:
                    real = path.resolve()
                except (OSError, RuntimeError):
                    continue
                if model_id not in found and _below(real, root) and scanner.is_gguf(real):
                    found[model_id] = FoundModel(model_id, real, tool)
        self._last = sorted(found.values(), key=lambda m: m.id)

    # -- the browser's paths ----------------------------------------------------------------
    def allowed(self, text: str) -> Path:
        """The GGUF file `text` names, when it lies below one of the folders; else PathRefused.

        Checked twice: lexically (`..` folded, before touching the disk, so nothing about a
        path outside is revealed) and after resolving links (a link inside may point out)."""
        refused = PathRefused("refused: only GGUF files under the model folders can be opened (the server's "
                              "--models-dir, LM Studio's, Ollama's, the Hugging Face cache)")
        text = (text or "").strip()
        if not text or "\x00" in text or not os.path.isabs(text):
            raise refused
        lexical = Path(os.path.normpath(text))
        roots = self.existing()
        plain = [Path(os.path.normpath(os.path.abspath(r))) for _t, r in self.roots]
        if not any(_below(lexical, r) for r in plain + [r for _t, r in roots]):
            raise refused
        try:
            real = lexical.resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a loop of links
            raise PathRefused(f"refused: no such file under the model folders: {text}") from None
        if not any(_below(real, r) for _t, r in roots):
            raise refused
        if not is_gguf_file(real):
            raise PathRefused(f"refused: not a GGUF file: {text}")
        return real

    def id_for(self, path: Path) -> str:
        """The id a file opened by path goes by: its discovered id, else `file/<name>`."""
        real = path.resolve()
        for m in self.discover():
            if m.path == real:
                return m.id
        return f"file/{real.stem}"


# -- one scan per layout --------------------------------------------------------------------------
def _lmstudio(scanner: _Scanner, root: Path):
    for p in scanner.walk_gguf(root):
        yield "lmstudio/" + p.relative_to(root).as_posix()[: -len(".gguf")], p


def _models_dir(scanner: _Scanner, root: Path):
    for p in scanner.walk_gguf(root):
        yield p.relative_to(root).as_posix()[: -len(".gguf")], p


def _hf_cache(scanner: _Scanner, root: Path):
    """models--org--repo/snapshots/<rev>/...gguf, newest revision first (by modification time)."""
    repos = [d for d in scanner.entries(root)[0] if d.startswith("models--")]
    for repo in repos[:MAX_FILES]:
        name = repo.removeprefix("models--").replace("--", "/")
        snapshots = root / repo / "snapshots"

        def newest_first(rev: str) -> float:
            try:
                return -(snapshots / rev).stat().st_mtime
            except OSError:
                return 0.0

        for rev in sorted(scanner.entries(snapshots)[0], key=newest_first):
            for p in scanner.walk_gguf(snapshots / rev):
                yield f"hf/{name}/" + p.relative_to(snapshots / rev).as_posix()[: -len(".gguf")], p


def _ollama(scanner: _Scanner, root: Path):
    """Each manifest's model layer: manifests/<registry>/<namespace>/<model>/<tag> -> blobs/sha256-<hex>."""
    manifests = root / "manifests"
    for registry in scanner.entries(manifests)[0]:
        for namespace in scanner.entries(manifests / registry)[0]:
            for model in scanner.entries(manifests / registry / namespace)[0]:
                folder = manifests / registry / namespace / model
                for tag in scanner.entries(folder)[1]:
                    digest = scanner.manifest_digest(folder / tag)
                    if digest is None:
                        continue
                    name = model if namespace == "library" else f"{namespace}/{model}"
                    name = name if registry == OLLAMA_REGISTRY else f"{registry}/{name}"
                    yield f"ollama/{name}:{tag}", root / "blobs" / digest.replace(":", "-")
