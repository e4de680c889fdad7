"""Reading a book by its sections: which ones to read, and the text they make.

    picked = parse_spec("3,5-7", len(doc.sections))        # [2, 4, 5, 6] (0-based)
    text = selected_text(doc, picked)                        # what the conversation reads

Sections are numbered from 1 in document order, as `ingest --json` lists them; a section's
span includes its subsections (`Section.end`), so picking a chapter picks its sections too and
picking both reads each character once. The picked spans are read in document order, each
after a line naming it by its title as the book writes it ("[Section: 7.1 Hash functions]",
`sections.part_line`), so the model (and the reader of a transcript) sees where a gap is. The
index picks; the book's own number, part of its title, is what is shown.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .document import Document
from .sections import Section, part_line


class SectionError(ValueError):
    """A selection that cannot be read: a bad spec, or one that does not fit (one line)."""


def parse_spec(spec: str, count: int) -> list[int]:
    """'3,5-7' -> [2, 4, 5, 6]: 0-based indices of sections numbered 1..count, sorted, unique."""
    if count == 0:
        raise SectionError("the document has no sections to pick from")
    picked: set[int] = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            raise SectionError(f"empty item in the section list {spec!r} (expected e.g. 3,5-7)")
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise SectionError(f"{part!r} is not a section number or a range like 5-7") from None
        if a > b:
            raise SectionError(f"the range {part!r} runs backwards")
        if a < 1 or b > count:
            raise SectionError(f"section {a if a < 1 else b} does not exist: the document has sections 1-{count}")
        picked.update(range(a - 1, b))
    return sorted(picked)


def merged_spans(sections: Sequence[Section], picked: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """The character spans the picked sections cover, overlaps merged: (start, end, the picked
    sections that start in it), in document order."""
    spans: list[tuple[int, int, list[int]]] = []
    for i in sorted(picked, key=lambda i: (sections[i].start, -sections[i].end)):
        s = sections[i]
        if spans and s.start < spans[-1][1]:  # inside (or overlapping) the previous span
            a, b, names = spans[-1]
            spans[-1] = (a, max(b, s.end), names + [i])
        else:
            spans.append((s.start, s.end, [i]))
    return spans


def selected_text(doc: Document, picked: Sequence[int]) -> str:
    """The text of the picked sections, each span after a line naming its first section."""
    parts = []
    for a, b, names in merged_spans(doc.sections, picked):
        head = doc.sections[names[0]]
        parts.append(part_line(head.title) + "\n" + doc.text[a:b].strip())
    return "\n\n".join(parts) + "\n"


def picked_titles(doc: Document, picked: Sequence[int]) -> str:
    """The picked sections by the book's titles, one per span read (a chapter picked with its
    subsections is named once): '7.1 Hash functions; 7.3 Compatibility functions'."""
    return "; ".join(doc.sections[names[0]].title for _a, _b, names in merged_spans(doc.sections, picked))


def section_tokens(doc: Document, count_tokens: Callable[[str], int]) -> list[int]:
    """Tokens of each section's own span (its subsections included)."""
    return [count_tokens(doc.text[s.start : s.end]) for s in doc.sections]


def top_level(sections: Sequence[Section]) -> list[int]:
    """The sections no earlier one contains: level 1 in a tidy outline, but also a Markdown file
    whose headings start at ##, or a foreword before the first part. Their spans do not overlap,
    so their sizes add up to the book's."""
    out, end = [], -1
    for i, s in enumerate(sections):
        if s.start >= end:
            out.append(i)
            end = s.end
    return out


def over_window(what: str, tokens: int, window: int, answer: int = 0) -> str:
    """'the document is 1,320 tokens (+ 6 for the answer), over the target's context window of 1,024'."""
    plus = f" (+ {answer:,} for the answer)" if answer else ""
    return f"{what} is {tokens:,} tokens{plus}, over the target's context window of {window:,}"


def too_long_message(doc: Document, tokens: int, window: int, sizes: Sequence[int] | None, what: str,
                     answer: int = 0) -> str:
    """One line for the command line: the numbers, and how to pick what fits (the top-level
    sections listed with their sizes)."""
    line = over_window(what, tokens, window, answer)
    if not doc.sections or sizes is None:
        return line + " (it has no sections to pick from)"
    top = [f"{i + 1} {doc.sections[i].title[:40]!r} {sizes[i]:,}" for i in top_level(doc.sections)]
    return (f"{line}; pick sections that fit with --sections (e.g. 3,5-7; `ingest --json FILE` lists all "
            f"{len(doc.sections)}): " + ", ".join(top[:8]) + (", ..." if len(top) > 8 else ""))
