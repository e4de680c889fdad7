"""Reading a file: size checks, then extraction in a separate process with time and memory limits."""

from __future__ import annotations

import os
from pathlib import Path

from ..config import one_line
from .document import Document, DocumentError
from .formats import detect_format
from .sections import with_ends

# The readers are imported when a file is read (`_extract`): importing this package stays
# cheap and pulls in no parser.

MB = 1_000_000
DEFAULT_MAX_BYTES = 50 * MB  # largest file accepted
DEFAULT_TIMEOUT_S = 60.0  # wall-clock limit for one extraction
DEFAULT_MEMORY_BYTES = 2 * 1024 * MB  # address-space limit of the extraction process (Linux)


def load_document(
    path: str | os.PathLike,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    name: str | None = None,
    companion_toc: bool = False,
) -> Document:
    """Read and extract a file. ``timeout_s=None`` extracts in this process (no time limit).

    With ``companion_toc``, an HTML page whose navigation loads its table of contents from a
    file beside it (mdBook's print page: ``<nav><iframe src="toc.html">``, filled by a script)
    is read with that file's table of contents; off by default, since it reads a second file.
    """
    p = Path(path)
    shown = name or p.name
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise DocumentError("no such file") from None
    except OSError as e:
        raise DocumentError(f"cannot read the file ({e.strerror or e})") from None
    if not p.is_file():
        raise DocumentError("not a regular file")
    if size == 0:
        raise DocumentError("the file is empty")
    if size > max_bytes:
        raise DocumentError(f"the file is {size / MB:.1f} MB, over the {max_bytes / MB:.0f} MB limit")
    data = p.read_bytes()
    toc = _companion_toc(p, data) if companion_toc else None
    return extract_bytes(data, shown, timeout_s=timeout_s, memory_bytes=memory_bytes, toc=toc)


COMPANION_MAX_BYTES = 5 * MB


def _companion_toc(path: Path, data: bytes) -> bytes | None:
    """The table-of-contents file an HTML page's navigation names, read from beside the page.

    Only a plain file name in the same folder (no folders, no '..'), only inside a `nav`, and
    only a regular file under COMPANION_MAX_BYTES; anything else is None (headings then).
    """
    import re

    nav = re.search(rb"(?is)<nav\b[^>]*>(.*?)</nav>", data[: 4 * MB])
    found = re.search(rb"""(?i)<iframe\b[^>]*\bsrc=["']([A-Za-z0-9_.-]+\.x?html?)["']""", nav.group(1)) if nav else None
    if found is None:
        return None
    other = path.parent / found.group(1).decode("ascii")
    try:
        if other.is_file() and not other.samefile(path) and other.stat().st_size <= COMPANION_MAX_BYTES:
            return other.read_bytes()
    except OSError:
        return None
    return None


def extract_bytes(
    data: bytes,
    name: str,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    toc: bytes | None = None,
) -> Document:
    """Extract the text of ``data`` (named ``name``, whose extension is a claim to check).

    ``toc``: for an HTML page, a separate HTML file holding its table of contents (see
    `load_document`'s ``companion_toc``); used where the page has none of its own.
    """
    if not data:
        raise DocumentError("the file is empty")
    if timeout_s is None:
        return _extract(data, name, toc)
    return _in_child(data, name, timeout_s, memory_bytes, toc)



def _child_main() -> None:
    """Entry point of the extraction process: a pickled request on stdin, a pickled reply on stdout."""
    import pickle
    import sys

    data, name, memory_bytes, toc = pickle.loads(sys.stdin.buffer.read())
    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    try:
        reply = ("ok", _extract(data, name, toc))
    except DocumentError as e:
        reply = ("error", str(e))
    except MemoryError:
        reply = ("error", "the document needs too much memory to extract")
    except RecursionError:
        reply = ("error", "the document is nested too deeply to extract")
    except Exception as e:  # an unexpected parser failure is still the file's fault
        reply = ("error", f"could not extract text ({type(e).__name__}: {one_line(e, 200)})")
    sys.stdout.buffer.write(pickle.dumps(reply))
    sys.stdout.flush()


_CHILD_CODE = "from triforce_core.documents.extract import _child_main; _child_main()"
# The folder holding this copy of `triforce_core`: a checkout's root, or site-packages.
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)


def _child_env() -> dict[str, str]:
    """The child imports this very copy of the package, installed or not: it runs in the
    package's parent folder (first on a `-c` interpreter's path), which also leads its
    PYTHONPATH (for PYTHONSAFEPATH, which drops the working directory)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    return env


def _in_child(data: bytes, name: str, timeout_s: float, memory_bytes: int | None,
              toc: bytes | None = None) -> Document:
    """Extract in a fresh interpreter (not multiprocessing: no re-import of the caller's __main__)."""
    import pickle
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD_CODE],
            input=pickle.dumps((data, name, memory_bytes, toc)), capture_output=True, timeout=timeout_s, check=False,
            cwd=_PACKAGE_PARENT, env=_child_env(),
        )
    except subprocess.TimeoutExpired:
        raise DocumentError(f"extraction took longer than {timeout_s:g} s and was stopped") from None
    except OSError as e:
        raise DocumentError(f"could not start the extraction process ({e})") from None
    try:
        status, payload = pickle.loads(proc.stdout)
    except Exception:
        last = (proc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        if last and "MemoryError" in last[-1]:
            raise DocumentError("the document needs too much memory to extract") from None
        raise DocumentError(f"the extraction process failed (exit code {proc.returncode})") from None
    if status == "error":
        raise DocumentError(payload)
    return payload


def _extract(data: bytes, name: str, toc: bytes | None = None) -> Document:
    fmt = detect_format(data, name)
    from .text import decode_text, markdown_sections

    if fmt == "pdf":
        from .pdf import read_pdf


        doc = read_pdf(data)
    elif fmt == "epub":
        from .epub import read_epub

        doc = read_epub(data)
    elif fmt == "docx":
        from .docx import read_docx

        doc = read_docx(data)
    elif fmt == "html":
        from .html import read_html

        doc = read_html(decode_text(data), decode_text(toc) if toc else None)
    else:
        text = decode_text(data)
        doc = Document(text, fmt, sections=markdown_sections(text) if fmt == "md" else ())
    if not doc.text.strip():
        raise DocumentError("no extractable text" + (" (a scanned PDF? it needs OCR first)" if fmt == "pdf" else ""))
    return Document(doc.text, doc.format, name, with_ends(doc.sections, len(doc.text)), doc.pages)

