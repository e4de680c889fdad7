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
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
MAX_DEPTH = 6  # folders below a root that a scan enters
MAX_FILES = 5000  # entries a scan looks at per root
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


def _walk_gguf(root: Path) -> list[Path]:
    """`.gguf` files below `root` (not following links into folders), bounded in depth and count."""
    out: list[Path] = []
    seen = 0
    base = len(root.parts)
    for folder, dirs, files in os.walk(root):
        depth = len(Path(folder).parts) - base
        if depth >= MAX_DEPTH:
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            seen += 1
            if seen > MAX_FILES:
                return out
            if name.lower().endswith(".gguf") and not _SPLIT_PART.search(name):
                out.append(Path(folder) / name)
    return out


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
    def discover(self) -> list[FoundModel]:
        """Every GGUF file in the folders, one entry per id (the first folder's wins)."""
        found: dict[str, FoundModel] = {}
        for tool, root in self.existing():
            scan = {"lmstudio": _lmstudio, "ollama": _ollama, "hf": _hf_cache, "models-dir": _models_dir}[tool]
            for model_id, path in scan(root):
                real = path.resolve()
                if model_id not in found and _below(real, root) and is_gguf_file(real):
                    found[model_id] = FoundModel(model_id, real, tool)
        return sorted(found.values(), key=lambda m: m.id)

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
def _lmstudio(root: Path):
    for p in _walk_gguf(root):
        yield "lmstudio/" + p.relative_to(root).as_posix()[: -len(".gguf")], p


def _models_dir(root: Path):
    for p in _walk_gguf(root):
        yield p.relative_to(root).as_posix()[: -len(".gguf")], p


def _hf_cache(root: Path):
    """models--org--repo/snapshots/<rev>/...gguf, newest revision first (by modification time)."""
    try:
        repos = sorted(d for d in root.iterdir() if d.name.startswith("models--") and d.is_dir())
    except OSError:
        return
    for repo in repos[:MAX_FILES]:
        name = repo.name.removeprefix("models--").replace("--", "/")
        snapshots = repo / "snapshots"
        try:
            revisions = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: -d.stat().st_mtime)
        except OSError:
            continue
        for rev in revisions:
            for p in _walk_gguf(rev):
                yield f"hf/{name}/" + p.relative_to(rev).as_posix()[: -len(".gguf")], p


def _ollama(root: Path):
    """Each manifest's model layer: manifests/<registry>/<namespace>/<model>/<tag> -> blobs/sha256-<hex>."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for folder, dirs, files in os.walk(manifests):
        rel = Path(folder).relative_to(manifests).parts
        if len(rel) >= 3:
            dirs[:] = []
        if len(rel) != 3:
            continue
        registry, namespace, model = rel
        for tag in sorted(files):
            try:
                manifest = json.loads((Path(folder) / tag).read_text(encoding="utf-8"))
                digest = next(layer["digest"] for layer in manifest.get("layers", [])
                              if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
            except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
                continue  # not a manifest of a model with weights
            if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                continue
            name = model if namespace == "library" else f"{namespace}/{model}"
            name = name if registry == OLLAMA_REGISTRY else f"{registry}/{name}"
            yield f"ollama/{name}:{tag}", root / "blobs" / digest.replace(":", "-")
