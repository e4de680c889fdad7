"""The documents wing: files to text, and reading a book by the parts a question needs.

Formats (.txt/.md/.html/.pdf/.epub/.docx -> text plus a map back to pages and sections), the
table of contents, `picking` (the sections a user names), `reading` (BM25 ranking of a book's
parts within a budget) and `citations` (the passages an answer drew on). May import the engine
and every wing below it; never serving, the command line or the app.

Document ingestion: .txt/.md/.html/.pdf/.epub/.docx -> text plus a map back to pages/sections.

    doc = load_document("book.epub")          # size limit, magic-byte check, time limit
    doc.text, doc.format, doc.pages
    doc.sections                              # title, level, start, end (a chapter spans its pages)
    doc.locate(12345)                         # -> "chapter 3: The Tale" / "page 137" / "line 88"

Every failure is a `DocumentError` whose message is one line and names the problem (empty
file, binary content, malformed or encrypted PDF, no text layer, archive over its limits,
XML with entity declarations, file too large, extension that disagrees with the content,
time limit). Extraction runs in a separate process with a time and memory limit, so a
hostile file can neither hang nor bloat the app; nothing is ever written to disk and
archives are read entry by entry with caps (never ``extractall``).

Sections come from the document's own table of contents where it has one (an HTML page's
navigation list, EPUB's nav document or NCX, a PDF's outline), its nesting giving the
levels; else from headings (HTML h1-h3, Markdown #-###, DOCX heading styles), EPUB chapters
or PDF pages.

One module per format (`text`, `html`, `pdf`, `epub`, `docx`), plus `formats` (which format
a file is), `archive` (capped ZIP and safe XML), `sections` and `toc` (sections and where a
table of contents puts them), `extract` (the extraction process). This package imports only
the standard library at import time; the parsers (pypdf, charset-normalizer, defusedxml)
load when needed.
"""

from .document import Document, DocumentError
from .extract import (DEFAULT_MAX_BYTES, DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S, MB, extract_bytes,
                      load_document)
from .formats import EXTENSIONS, FORMAT_NAMES, FORMATS, detect_format
from .html import html_to_text
from .sections import Section

__all__ = [
    "DEFAULT_MAX_BYTES", "DEFAULT_MEMORY_BYTES", "DEFAULT_TIMEOUT_S", "Document", "DocumentError", "EXTENSIONS",
    "FORMATS", "FORMAT_NAMES", "MB", "Section", "detect_format", "extract_bytes", "html_to_text", "load_document",
]
