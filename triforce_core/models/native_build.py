"""Native kernels compiled at first use: one C source, one shared library, loaded once.

A library is compiled with the machine's C compiler and flags for the machine's own vector
instructions into the user's cache folder (`config.cache_home()/native`), keyed by the source,
the flags and the processor. Without a compiler it is logged once and the model keeps PyTorch's
path; where it builds it runs (a model that must take PyTorch's path says so in its
`arithmetic.Arithmetic`).

-fopenmp: a kernel's threads come from the OpenMP runtime, which in a process that has loaded
PyTorch is PyTorch's own (the same soname, libgomp.so.1, is loaded once): threads of a second
pool would compete for the cores with PyTorch's, which spin a while after each operator.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

from ..config import cache_home

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

K = TypeVar("K")


def _processor() -> str:
    """What -march=native compiles for: the model name and the instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _source_text(source: Path) -> bytes:
    """The source and the files it includes from its own folder (`#include "name"`, one level):
    what the library's key must cover, so an edit of an included file rebuilds it."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):
        text += (source.parent / name.decode()).read_bytes()
    return text


def library_key(source: Path, flags: tuple[str, ...] = FLAGS) -> str:
    """What a library's arithmetic follows from: its source, its flags and the processor
    -march=native compiles for (its vector instructions decide the order of a sum)."""
    return hashlib.sha256(_source_text(source) + " ".join(flags).encode() + _processor().encode()).hexdigest()[:16]


def build(source: Path, flags: tuple[str, ...] = FLAGS, folder: Path | None = None) -> Path:
    """Compile `source` (once per source, flags and processor); the path of the library.

    Written to a temporary name and renamed, so a concurrent or interrupted build never
    leaves a partial library under the final name. Raises OSError or CalledProcessError."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on the PATH")
    key = library_key(source, flags)
    folder = folder or cache_home() / "native"
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Loader(Generic[K]):
    """Builds and wraps one library at the first `get()`; None where it cannot be built (logged
    once)."""

    def __init__(self, what: str, source: Path, flags: tuple[str, ...], wrap: Callable[[ctypes.CDLL], K]):
        self.what, self.source, self.flags, self.wrap = what, source, flags, wrap
        self._lock = threading.Lock()
        self._loaded: K | None = None
        self._tried = False

    def build(self, folder: Path | None = None) -> Path:
        return build(self.source, self.flags, folder)

    def get(self) -> K | None:
        if self._tried:  # asked per layer of every forward: no lock once decided
            return self._loaded
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._loaded = self.wrap(ctypes.CDLL(str(self.build())))
                except (OSError, subprocess.CalledProcessError) as e:
                    detail = getattr(e, "stderr", "") or str(e)
                    log.warning("native %s unavailable (%s); using PyTorch's", self.what, detail.strip()[:300])
        return self._loaded
