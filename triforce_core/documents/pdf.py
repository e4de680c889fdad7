"""PDF: the text page by page; sections from the outline (bookmarks), else the pages."""

from __future__ import annotations

import io
import re

from ..config import one_line
from .document import Document, DocumentError
from .sections import Section


def read_pdf(data: bytes) -> Document:
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
                raise DocumentError(f"the PDF is encrypted with a method this installation cannot open ({one_line(e, 200)})") from None
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
        raise DocumentError(f"malformed or truncated PDF ({one_line(e, 200)})") from None
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

