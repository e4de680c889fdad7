"""DOCX: paragraphs in reading order; sections from the Title/Heading paragraph styles."""

from __future__ import annotations

from .archive import Archive, parse_xml
from .document import Document
from .sections import Section

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


def read_docx(data: bytes) -> Document:
    arc = Archive(data, "DOCX")
    root = parse_xml(arc.read("word/document.xml"), "word/document.xml")
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
