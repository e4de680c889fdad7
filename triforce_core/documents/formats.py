"""Which format a file is: its magic bytes, checked against the extension its name claims."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from .document import DocumentError

FORMATS = ("txt", "md", "html", "pdf", "epub", "docx")
EXTENSIONS = {
    ".txt": "txt", ".text": "txt", ".md": "md", ".markdown": "md", ".html": "html", ".htm": "html",
    ".xhtml": "html", ".pdf": "pdf", ".epub": "epub", ".docx": "docx",
}
FORMAT_NAMES = {"txt": "text", "md": "Markdown", "html": "HTML", "pdf": "PDF", "epub": "EPUB", "docx": "DOCX"}


def detect_format(data: bytes, name: str) -> str:
    """The format from the content (magic bytes), checked against the name's extension."""
    ext = Path(name).suffix.lower()
    claimed = EXTENSIONS.get(ext)
    if ext and claimed is None:
        raise DocumentError(f"unsupported file type {ext!r} (supported: {', '.join(sorted(EXTENSIONS))})")
    actual = sniff(data)
    if actual == "zip" and claimed in ("epub", "docx"):
        return claimed  # an archive we cannot classify: the parser says what is wrong with it
    if actual in ("pdf", "epub", "docx", "zip"):
        if claimed in ("pdf", "epub", "docx") and claimed == actual:
            return actual
        what = "a ZIP archive that is neither EPUB nor DOCX" if actual == "zip" else f"a {FORMAT_NAMES[actual]} file"
        if claimed is None and actual != "zip":
            return actual
        raise DocumentError(f"the name says {FORMAT_NAMES.get(claimed, claimed)} but the content is {what}")
    if claimed in ("pdf", "epub", "docx"):
        raise DocumentError(f"not a {FORMAT_NAMES[claimed]} file (its content does not start like one; truncated or renamed?)")
    if actual == "binary":
        raise DocumentError("binary content, not text (is this really a text file?)")
    if claimed is None:
        return "html" if actual == "html" else "txt"
    return claimed



def sniff(data: bytes) -> str:
    head = data[:1024]
    if b"%PDF-" in head:
        return "pdf"
    if data[:4] == b"PK\x03\x04":
        try:
            names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
        except (zipfile.BadZipFile, ValueError, OSError):
            return "zip"
        if "META-INF/container.xml" in names or "mimetype" in names and any(n.endswith(".opf") for n in names):
            return "epub"
        if "word/document.xml" in names:
            return "docx"
        return "zip"
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or data[:3] == b"\xef\xbb\xbf":
        return "text"
    sample = data[:8192]
    if b"\x00" in sample:
        return "binary"
    controls = sum(1 for b in sample if b < 9 or 13 < b < 32)
    if controls > max(8, len(sample) // 100):
        return "binary"
    low = sample[:512].lstrip().lower()
    if low.startswith((b"<!doctype html", b"<html")):
        return "html"
    return "text"

