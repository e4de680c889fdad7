"""A document's sections: where each begins, its level, and where it ends.

Every reader (headings, a table of contents, an outline, pages) produces `Section`s with a
start and a level; `with_ends` then gives each its end, so that a section spans its
subsections (a chapter spans its pages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    start: int  # character offset in Document.text where this page/section begins
    label: str  # "page 3", "chapter 2: Title", "section: Heading"
    title: str = ""  # the heading's text ("page 3" for a page)
    level: int = 1  # 1: top (a chapter, an h1, a page); deeper headings 2, 3, ...
    end: int = 0  # where it ends: the next section at the same or a higher level, or the text's end

    def as_json(self) -> dict:
        return {"title": self.title, "level": self.level, "start": self.start, "end": self.end}


def with_ends(sections, length: int) -> tuple[Section, ...]:
    """Sections in document order, each ending where the next one at its level or above
    begins (so a section includes its subsections), the last ones at `length`."""
    ordered = sorted(sections, key=lambda s: s.start)
    out = []
    for i, s in enumerate(ordered):
        end = next((t.start for t in ordered[i + 1 :] if t.level <= s.level and t.start > s.start), length)
        title = s.title or s.label.split(": ", 1)[-1]
        out.append(Section(s.start, s.label, title, s.level, max(s.start, min(end, length))))
    return tuple(out)

