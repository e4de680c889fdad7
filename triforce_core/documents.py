"""Document ingestion: .txt/.md/.html/.pdf/.epub/.docx -> text plus a map back to pages/sections.

    doc = load_document("book.epub")          # size limit, magic-byte check, time limit
    doc.text, doc.format, doc.pages
    doc.locate(12345)                         # -> "chapter 3: The Tale" / "page 137" / "line 88"

Every failure is a `DocumentError` whose message is one line and names the problem (empty
file, binary content, malformed or encrypted PDF, no text layer, archive over its limits,
XML with entity declarations, file too large, extension that disagrees with the content,
time limit). Extraction runs in a separate process with a time and memory limit, so a
hostile file can neither hang nor bloat the app; nothing is ever written to disk and
archives are read entry by entry with caps (never ``extractall``).

This module imports only the standard library at import time; the parsers (pypdf,
charset-normalizer, defusedxml) load when needed.
"""

from __future__ import annotations

import bisect
import io
import os
import posixpath
import re
import zipfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

MB = 1_000_000
DEFAULT_MAX_BYTES = 50 * MB  # largest file accepted
DEFAULT_TIMEOUT_S = 60.0  # wall-clock limit for one extraction
DEFAULT_MEMORY_BYTES = 2 * 1024 * MB  # address-space limit of the extraction process (Linux)
ZIP_MAX_ENTRIES = 5_000
ZIP_MAX_TOTAL = 200 * MB  # total uncompressed bytes read from one archive
ZIP_MAX_ENTRY = 50 * MB  # uncompressed bytes of one entry
ZIP_MAX_RATIO = 100  # uncompressed / compressed, for entries above 1 MB

FORMATS = ("txt", "md", "html", "pdf", "epub", "docx")
EXTENSIONS = {
    ".txt": "txt", ".text": "txt", ".md": "md", ".markdown": "md", ".html": "html", ".htm": "html",
    ".xhtml": "html", ".pdf": "pdf", ".epub": "epub", ".docx": "docx",
}
FORMAT_NAMES = {"txt": "text", "md": "Markdown", "html": "HTML", "pdf": "PDF", "epub": "EPUB", "docx": "DOCX"}


class DocumentError(ValueError):
    """A document could not be read; the message is one line meant for the user."""


@dataclass(frozen=True)
class Section:
    start: int  # character offset in Document.text where this page/section begins
    label: str  # "page 3", "chapter 2: Title", "section: Heading"
    title: str = ""  # the heading's text ("page 3" for a page)
    level: int = 1  # 1: top (a chapter, an h1, a page); deeper headings 2, 3, ...
    end: int = 0  # where it ends: the next section at the same or a higher level, or the text's end

    def as_json(self) -> dict:
        return {"title": self.title, "level": self.level, "start": self.start, "end": self.end}


def _spans(sections, length: int) -> tuple[Section, ...]:
    """Sections in document order, each ending where the next one at its level or above
    begins (so a section includes its subsections), the last ones at `length`."""
    ordered = sorted(sections, key=lambda s: s.start)
    out = []
    for i, s in enumerate(ordered):
        end = next((t.start for t in ordered[i + 1 :] if t.level <= s.level and t.start > s.start), length)
        title = s.title or s.label.split(": ", 1)[-1]
        out.append(Section(s.start, s.label, title, s.level, max(s.start, min(end, length))))
    return tuple(out)


@dataclass(frozen=True)
class Document:
    text: str
    format: str
    name: str = ""
    sections: tuple[Section, ...] = field(default_factory=tuple)
    pages: int | None = None  # PDF pages (None for formats without pages)

    @property
    def chars(self) -> int:
        return len(self.text)

    def locate(self, offset: int) -> str:
        """Where a character offset lies: the page/section label, else the line number."""
        offset = max(0, min(int(offset), len(self.text)))
        if self.sections:
            i = bisect.bisect_right([s.start for s in self.sections], offset) - 1
            if i >= 0:
                return self.sections[i].label
        return f"line {self.text.count(chr(10), 0, offset) + 1}"

    def as_json(self) -> dict:
        return {"text": self.text, "format": self.format, "chars": self.chars, "pages": self.pages,
                "sections": [s.as_json() for s in self.sections]}


# --------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------
def load_document(
    path: str | os.PathLike,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    name: str | None = None,
) -> Document:
    """Read and extract a file. ``timeout_s=None`` extracts in this process (no time limit)."""
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
    return extract_bytes(data, shown, timeout_s=timeout_s, memory_bytes=memory_bytes)


def extract_bytes(
    data: bytes,
    name: str,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
) -> Document:
    """Extract the text of ``data`` (named ``name``, whose extension is a claim to check)."""
    if not data:
        raise DocumentError("the file is empty")
    if timeout_s is None:
        return _extract(data, name)
    return _in_child(data, name, timeout_s, memory_bytes)


def detect_format(data: bytes, name: str) -> str:
    """The format from the content (magic bytes), checked against the name's extension."""
    ext = Path(name).suffix.lower()
    claimed = EXTENSIONS.get(ext)
    if ext and claimed is None:
        raise DocumentError(f"unsupported file type {ext!r} (supported: {', '.join(sorted(EXTENSIONS))})")
    actual = _sniff(data)
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


# --------------------------------------------------------------------------------------
# the extraction process
# --------------------------------------------------------------------------------------
def _child_main() -> None:
    """Entry point of the extraction process: a pickled request on stdin, a pickled reply on stdout."""
    import pickle
    import sys

    data, name, memory_bytes = pickle.loads(sys.stdin.buffer.read())
    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    try:
        reply = ("ok", _extract(data, name))
    except DocumentError as e:
        reply = ("error", str(e))
    except MemoryError:
        reply = ("error", "the document needs too much memory to extract")
    except RecursionError:
        reply = ("error", "the document is nested too deeply to extract")
    except Exception as e:  # an unexpected parser failure is still the file's fault
        reply = ("error", f"could not extract text ({type(e).__name__}: {_one_line(e)})")
    sys.stdout.buffer.write(pickle.dumps(reply))
    sys.stdout.flush()


_CHILD_CODE = "from triforce_core.documents import _child_main; _child_main()"
# The folder holding this copy of `triforce_core`: a checkout's root, or site-packages.
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def _child_env() -> dict[str, str]:
    """The child imports this very copy of the package, installed or not: it runs in the
    package's parent folder (first on a `-c` interpreter's path), which also leads its
    PYTHONPATH (for PYTHONSAFEPATH, which drops the working directory)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    return env


def _in_child(data: bytes, name: str, timeout_s: float, memory_bytes: int | None) -> Document:
    """Extract in a fresh interpreter (not multiprocessing: no re-import of the caller's __main__)."""
    import pickle
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD_CODE],
            input=pickle.dumps((data, name, memory_bytes)), capture_output=True, timeout=timeout_s, check=False,
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


def _extract(data: bytes, name: str) -> Document:
    fmt = detect_format(data, name)
    if fmt == "pdf":
        doc = _pdf(data)
    elif fmt == "epub":
        doc = _epub(data)
    elif fmt == "docx":
        doc = _docx(data)
    elif fmt == "html":
        text, sections = html_to_text(_decode_text(data))
        doc = Document(text, "html", sections=sections)
    else:
        text = _decode_text(data)
        doc = Document(text, fmt, sections=_markdown_sections(text) if fmt == "md" else ())
    if not doc.text.strip():
        raise DocumentError("no extractable text" + (" (a scanned PDF? it needs OCR first)" if fmt == "pdf" else ""))
    return Document(doc.text, doc.format, name, _spans(doc.sections, len(doc.text)), doc.pages)


# --------------------------------------------------------------------------------------
# sniffing and text
# --------------------------------------------------------------------------------------
def _sniff(data: bytes) -> str:
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


def _decode_text(data: bytes) -> str:
    for bom, codec in ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")):
        if data.startswith(bom):
            return _normalise(data.decode(codec, errors="replace"))
    try:
        return _normalise(data.decode("utf-8"))
    except UnicodeDecodeError:
        pass
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is None:
        raise DocumentError("binary content, not text (no text encoding fits it)")
    # Single-byte code pages often tie; then prefer the most common Western ones.
    ties = {m.encoding: m for m in matches if m.chaos == best.chaos and m.coherence == best.coherence}
    for preferred in ("cp1252", "latin_1", "iso8859_15"):
        if preferred in ties:
            best = ties[preferred]
            break
    return _normalise(str(best))


def _normalise(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    return text


def _markdown_sections(text: str) -> tuple[Section, ...]:
    out = []
    for m in re.finditer(r"(?m)^(#{1,3})\s+(.+?)\s*#*\s*$", text):
        out.append(Section(m.start(), f"section: {m.group(2)[:80]}", m.group(2)[:200], len(m.group(1))))
    return tuple(out)


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


# --------------------------------------------------------------------------------------
# HTML (and the XHTML of EPUB chapters)
# --------------------------------------------------------------------------------------
_BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header", "footer",
          "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "dd", "dt", "dl", "hr", "figure",
          "figcaption", "nav", "aside", "main", "td", "th", "title"}
_HIDDEN = {"script", "style", "noscript", "template", "head", "svg", "math", "iframe", "object"}
_HEADINGS = {"h1", "h2", "h3"}


class _TextParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.length = 0  # of the parts so far (summing them per heading or anchor would be quadratic)
        self.anchors: dict[str, int] = {}  # id -> offset in the raw text (where a TOC link lands)
        self.hidden = 0
        self.pre = 0
        self.heading: list[str] | None = None
        self.heading_at = 0
        self.heading_level = 1
        self.headings: list[tuple[int, str]] = []
        self.title: list[str] | None = None
        self.title_text = ""

    def _emit(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self.title = []
        if tag in _HIDDEN:
            self.hidden += 1
        elif tag in _BLOCK:
            self._emit("\n")
        for key, value in attrs:
            if value and (key == "id" or key == "name" and tag == "a"):
                self.anchors.setdefault(value, self.length)
        if tag == "pre":
            self.pre += 1
        if tag in _HEADINGS and not self.hidden:
            self.heading, self.heading_at, self.heading_level = [], self.length, int(tag[1])
        if tag in ("img",) and not self.hidden:
            alt = dict(attrs).get("alt")
            if alt:
                self._emit(f" {alt} ")

    def handle_startendtag(self, tag, attrs):
        if tag in ("br", "hr"):
            self._emit("\n")

    def handle_endtag(self, tag):
        if tag == "title" and self.title is not None:
            self.title_text = " ".join("".join(self.title).split())
            self.title = None
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in _BLOCK:
            self._emit("\n")
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _HEADINGS and self.heading is not None:
            title = " ".join("".join(self.heading).split())
            if title:
                self.headings.append((self.heading_at, title, self.heading_level))
            self.heading = None

    def handle_data(self, data):
        if self.title is not None:
            self.title.append(data)
        if self.hidden:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
        self._emit(data)
        if self.heading is not None:
            self.heading.append(data)


def html_to_text(source: str) -> tuple[str, tuple[Section, ...]]:
    """Visible text of an HTML page and its h1-h3 headings as sections."""
    text, sections, _anchors = _html(source)
    return text, sections


def _html(source: str) -> tuple[str, tuple[Section, ...], dict[str, int]]:
    """html_to_text, plus where each element id lands in the text (the start of its line)."""
    parser = _TextParser()
    try:
        parser.feed(source)
        parser.close()
    except (AssertionError, ValueError) as e:
        raise DocumentError(f"malformed HTML ({_one_line(e)})") from None
    raw = "".join(parser.parts)
    # tidy whitespace while mapping heading offsets to the tidied text
    text, starts, j = [], [], 0
    mapping = []
    out_len = 0
    for line in raw.split("\n"):
        cleaned = line.strip()
        mapping.append((j, out_len))
        j += len(line) + 1
        if cleaned:
            text.append(cleaned)
            out_len += len(cleaned) + 1
        elif text and text[-1] != "":
            text.append("")
            out_len += 1
    joined = "\n".join(text).strip("\n")
    line_starts = [m[0] for m in mapping]

    def tidied(at: int) -> int:
        return min(mapping[max(bisect.bisect_right(line_starts, at) - 1, 0)][1], len(joined))

    for at, title, level in parser.headings:
        starts.append(Section(tidied(at), f"section: {title[:80]}", title[:200], level))
    return joined, tuple(starts), {name: tidied(at) for name, at in parser.anchors.items()}


# --------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------
def _pdf(data: bytes) -> Document:
    import logging

    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError, PdfStreamError

    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            try:
                ok = reader.decrypt("")
            except (DependencyError, NotImplementedError) as e:
                raise DocumentError(f"the PDF is encrypted with a method this installation cannot open ({_one_line(e)})") from None
            if not ok:
                raise DocumentError("the PDF is encrypted and needs a password")
        pages = reader.pages
        n = len(pages)
        parts, sections, at = [], [], 0
        for i in range(n):
            text = (pages[i].extract_text() or "").replace("\x00", "").strip()
            sections.append(Section(at, f"page {i + 1}", f"page {i + 1}", 1))
            chunk = text + "\n\n"
            parts.append(chunk)
            at += len(chunk)
        outline = _pdf_outline(reader, "".join(parts), [s.start for s in sections])
    except DocumentError:
        raise
    except FileNotDecryptedError:
        raise DocumentError("the PDF is encrypted and needs a password") from None
    except (PdfReadError, PdfStreamError, EOFError, KeyError, ValueError, TypeError, AttributeError,
            IndexError, OSError, AssertionError) as e:
        raise DocumentError(f"malformed or truncated PDF ({_one_line(e)})") from None
    if n == 0:
        raise DocumentError("malformed PDF (it has no pages)")
    return Document("".join(parts).rstrip() + "\n", "pdf", sections=outline or tuple(sections), pages=n)


def _pdf_outline(reader, text: str, page_starts: list[int]) -> tuple[Section, ...]:
    """The PDF's outline (bookmarks) as sections, each starting at the line of its page where
    its title is printed (a chapter may begin mid-page), else where the page's text does;
    () when there is none or it cannot be read (the pages are the sections then)."""
    out: list[Section] = []
    bounds = page_starts[1:] + [len(text)]

    def start_of(title: str, page: int) -> int:
        lo, hi = page_starts[page], bounds[page]
        if out and lo <= out[-1].start < hi:  # after the entry before it on the same page
            lo = out[-1].start + 1
        # The title beginning a line (after a section number, if any): a mention of it in a
        # sentence, or a line it shares with the entry before, is not where a section begins.
        heading = r"\s+".join(map(re.escape, title.split()))
        found = re.compile(rf"(?m)^[^\S\n]*(?:[\dIVXivx.]+[^\S\n]+)?{heading}").search(text, lo, hi)
        return page_starts[page] if found is None else found.start()

    def walk(items, level: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, level + 1)
                continue
            page = reader.get_destination_page_number(item)
            title = " ".join(str(getattr(item, "title", "") or "").split())
            if page is not None and 0 <= page < len(page_starts) and title:
                out.append(Section(start_of(title, page), f"page {page + 1}: {title[:80]}", title[:200], level))

    try:
        walk(reader.outline, 1)
    except Exception:  # noqa: BLE001 - a broken outline is no reason to refuse the text
        return ()
    return tuple(out)


# --------------------------------------------------------------------------------------
# ZIP-based formats: EPUB and DOCX
# --------------------------------------------------------------------------------------
class _Archive:
    """Capped, entry-by-entry access to a ZIP archive held in memory."""

    def __init__(self, data: bytes, kind: str):
        self.kind = kind
        try:
            self.zf = zipfile.ZipFile(io.BytesIO(data))
            infos = self.zf.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as e:
            raise DocumentError(f"malformed {kind} (bad ZIP archive: {_one_line(e)})") from None
        if len(infos) > ZIP_MAX_ENTRIES:
            raise DocumentError(f"the {kind} has {len(infos)} entries, over the limit of {ZIP_MAX_ENTRIES}")
        declared = sum(i.file_size for i in infos)
        if declared > ZIP_MAX_TOTAL:
            raise DocumentError(f"the {kind} would unpack to {declared / MB:.0f} MB, over the {ZIP_MAX_TOTAL / MB:.0f} MB limit")
        for i in infos:
            self._check(i)
        self.infos = {i.filename: i for i in infos}
        self.read_total = 0

    def _check(self, info: zipfile.ZipInfo) -> None:
        if info.file_size > ZIP_MAX_ENTRY:
            raise DocumentError(f"{self.kind} entry {info.filename!r} unpacks to {info.file_size / MB:.0f} MB, over the {ZIP_MAX_ENTRY / MB:.0f} MB limit")
        if info.file_size > MB and info.file_size > ZIP_MAX_RATIO * max(1, info.compress_size):
            raise DocumentError(f"{self.kind} entry {info.filename!r} is compressed {info.file_size // max(1, info.compress_size)}:1 (a zip bomb?)")

    def has(self, name: str) -> bool:
        return name in self.infos

    def read(self, name: str) -> bytes:
        info = self.infos.get(name)
        if info is None:
            raise DocumentError(f"malformed {self.kind} (missing entry {name!r})")
        if info.flag_bits & 0x1:
            raise DocumentError(f"the {self.kind} is encrypted")
        limit = min(ZIP_MAX_ENTRY, ZIP_MAX_TOTAL - self.read_total)
        try:
            with self.zf.open(info) as f:
                data = f.read(limit + 1)  # never trust the declared size
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
            raise DocumentError(f"malformed {self.kind} (entry {name!r}: {_one_line(e)})") from None
        if len(data) > limit:
            raise DocumentError(f"the {self.kind} unpacks to more than its declared size (a zip bomb?)")
        self.read_total += len(data)
        return data


def _xml(data: bytes, what: str):
    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import fromstring
    from xml.etree.ElementTree import ParseError

    try:
        return fromstring(data, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except DefusedXmlException:
        raise DocumentError(f"unsafe XML in {what} (entity declarations are not allowed)") from None
    except ParseError as e:
        raise DocumentError(f"malformed XML in {what} ({_one_line(e)})") from None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _epub(data: bytes) -> Document:
    arc = _Archive(data, "EPUB")
    container = _xml(arc.read("META-INF/container.xml"), "META-INF/container.xml")
    rootfile = next((el.get("full-path") for el in container.iter() if _local(el.tag) == "rootfile"), None)
    if not rootfile:
        raise DocumentError("malformed EPUB (container.xml names no package file)")
    opf = _xml(arc.read(rootfile), rootfile)
    base = posixpath.dirname(rootfile)
    manifest = {}
    for el in opf.iter():
        if _local(el.tag) == "item" and el.get("id") and el.get("href"):
            manifest[el.get("id")] = el
    spine = [el.get("idref") for el in opf.iter() if _local(el.tag) == "itemref"]
    if not spine:
        raise DocumentError("malformed EPUB (its spine lists no chapters)")
    parts, sections, at, chapter = [], [], 0, 0
    read: dict[str, tuple[int, dict[str, int]]] = {}  # chapter file -> (its offset in the text, its anchors)
    for idref in spine:
        item = manifest.get(idref)
        if item is None:
            continue
        media = item.get("media-type", "")
        if media and "html" not in media and "xml" not in media:
            continue
        path, _ = _epub_href(base, item.get("href"))
        if not arc.has(path):
            continue
        raw = arc.read(path)
        if b"<!ENTITY" in raw[:4096].upper():
            raise DocumentError(f"unsafe XML in {path} (entity declarations are not allowed)")
        text, heads, anchors = _html(_decode_text(raw))
        if not text.strip():
            continue
        read.setdefault(path, (at, anchors))
        chapter += 1
        title = heads[0].label.split(": ", 1)[-1] if heads else ""
        sections.append(Section(at, f"chapter {chapter}" + (f": {title}" if title else ""),
                                title or f"chapter {chapter}", 1))
        for h in heads[1:]:  # nested in the chapter, one level per heading level below its first
            level = 1 + max(1, h.level - heads[0].level)
            sections.append(Section(at + h.start, f"chapter {chapter}, {h.label}", h.title, level))
        chunk = text.strip() + "\n\n"
        parts.append(chunk)
        at += len(chunk)
    toc = _epub_toc_sections(arc, opf, manifest, base, read)
    return Document("".join(parts).rstrip() + "\n" if parts else "", "epub", sections=toc or tuple(sections))


def _epub_href(folder: str, href: str) -> tuple[str, str]:
    """(archive path, fragment) of a link written in a file of `folder`."""
    from urllib.parse import unquote

    target, _, fragment = href.partition("#")
    return posixpath.normpath(posixpath.join(folder, unquote(target))), unquote(fragment)


def _epub_toc_sections(arc: _Archive, opf, manifest: dict, base: str,
                       read: dict[str, tuple[int, dict[str, int]]]) -> tuple[Section, ...]:
    """The book's own table of contents as sections: the EPUB 3 navigation document, else the
    EPUB 2 NCX; levels from its nesting. An entry lands where its link does (the chapter's
    start, or the element its #fragment names). () when there is none, it cannot be read or
    none of its links reach the text read (the spine's chapters are the sections then)."""
    nav = next((el for el in manifest.values() if "nav" in (el.get("properties") or "").split()), None)
    spine = next((el for el in opf.iter() if _local(el.tag) == "spine"), None)
    ncx = manifest.get(spine.get("toc") if spine is not None else None) or next(
        (el for el in manifest.values() if el.get("media-type") == "application/x-dtbncx+xml"), None)
    entries: list[tuple[str, str, str, int]] = []  # (path, fragment, title, level)
    for item, walk in ((nav, _nav_entries), (ncx, _ncx_entries)):
        if item is None or entries:
            continue
        path, _ = _epub_href(base, item.get("href"))
        try:
            if arc.has(path):
                walk(_xml(arc.read(path), path), posixpath.dirname(path), entries)
        except (DocumentError, RecursionError):  # an unreadable table of contents is no reason to refuse the book
            entries.clear()
    out, chapter = [], 0
    for path, fragment, title, level in entries:
        if path not in read:
            continue
        at, anchors = read[path]
        chapter += level == 1
        label = f"chapter {chapter}: {title[:80]}" if level == 1 else f"chapter {max(chapter, 1)}, section: {title[:80]}"
        out.append(Section(at + anchors.get(fragment, 0), label, title[:200], level))
    return tuple(out)


def _text_of(el) -> str:
    return " ".join("".join(el.itertext()).split())


def _nav_entries(root, folder: str, out: list) -> None:
    """EPUB 3: <nav epub:type="toc"><ol><li><a href>Title</a><ol>...</ol></li></ol></nav>."""
    navs = [el for el in root.iter() if _local(el.tag) == "nav"]
    toc = next((n for n in navs if "toc" in (n.get("{http://www.idpf.org/2007/ops}type") or "").split()),
               navs[0] if navs else None)
    top = next((el for el in toc.iter() if _local(el.tag) == "ol"), None) if toc is not None else None

    def walk(ol, level: int) -> None:
        for li in (c for c in ol if _local(c.tag) == "li"):
            link = next((c for c in li if _local(c.tag) == "a"), None)
            if link is not None and link.get("href") and _text_of(link):
                out.append((*_epub_href(folder, link.get("href")), _text_of(link), level))
            for sub in (c for c in li if _local(c.tag) == "ol"):
                walk(sub, level + 1)

    if top is not None:
        walk(top, 1)


def _ncx_entries(root, folder: str, out: list) -> None:
    """EPUB 2: <navMap><navPoint><navLabel><text>Title</text></navLabel><content src/>
    <navPoint>...</navPoint></navPoint></navMap>."""
    nav_map = next((el for el in root.iter() if _local(el.tag) == "navMap"), None)

    def walk(parent, level: int) -> None:
        for point in (c for c in parent if _local(c.tag) == "navPoint"):
            label = next((c for c in point if _local(c.tag) == "navLabel"), None)
            content = next((c for c in point if _local(c.tag) == "content"), None)
            title = _text_of(label) if label is not None else ""
            if title and content is not None and content.get("src"):
                out.append((*_epub_href(folder, content.get("src")), title, level))
            walk(point, level + 1)

    if nav_map is not None:
        walk(nav_map, 1)


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_MC = "{http://schemas.openxmlformats.org/markup-compatibility/2006}"


def _one_alternative(alt):
    """The one branch of an mc:AlternateContent to read: Word writes the same content twice
    (a text box as DrawingML in mc:Choice and as VML in mc:Fallback)."""
    for branch in (f"{_MC}Choice", f"{_MC}Fallback"):
        for child in alt:
            if child.tag == branch:
                return child
    return None


def _docx_paragraphs(root) -> list[tuple[str, str]]:
    """(style, text) of every paragraph, each once, in reading order.

    A paragraph's text is its own runs' text; a paragraph nested in it (the content of a text
    box anchored there) is read after it as a paragraph of its own; of each
    mc:AlternateContent only one branch is read. Table cells are read row by row.
    """
    out: list[tuple[str, str]] = []

    def paragraph(p) -> None:
        style, runs, nested = "", [], []

        def inside(el) -> None:
            nonlocal style
            for c in el:
                tag = c.tag
                if tag == f"{_MC}AlternateContent":
                    branch = _one_alternative(c)
                    if branch is not None:
                        inside(branch)
                elif tag == f"{_W}p":
                    nested.append(c)
                elif tag == f"{_W}pStyle":
                    style = style or c.get(f"{_W}val", "") or ""
                elif tag == f"{_W}t":
                    runs.append(c.text or "")
                elif tag == f"{_W}tab":
                    runs.append("\t")
                elif tag in (f"{_W}br", f"{_W}cr"):
                    runs.append("\n")
                else:
                    inside(c)

        inside(p)
        out.append((style, "".join(runs)))
        for n in nested:
            paragraph(n)

    def blocks(el) -> None:
        for c in el:
            if c.tag == f"{_W}p":
                paragraph(c)
            elif c.tag == f"{_MC}AlternateContent":
                branch = _one_alternative(c)
                if branch is not None:
                    blocks(branch)
            else:
                blocks(c)

    blocks(root)
    return out


def _docx(data: bytes) -> Document:
    arc = _Archive(data, "DOCX")
    root = _xml(arc.read("word/document.xml"), "word/document.xml")
    parts, sections, at = [], [], 0
    for style, text in _docx_paragraphs(root):
        line = text.strip()
        if not line:
            continue
        if style.lower().startswith(("heading", "title")):
            digits = "".join(c for c in style if c.isdigit())
            level = int(digits) if digits and style.lower().startswith("heading") else 1
            sections.append(Section(at, f"section: {line[:80]}", line[:200], max(1, level)))
        chunk = line + "\n\n"
        parts.append(chunk)
        at += len(chunk)
    return Document("".join(parts).rstrip() + "\n" if parts else "", "docx", sections=tuple(sections))
