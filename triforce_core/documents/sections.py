"""A document's sections: where each begins, its level, and where it ends.

Every reader (headings, a table of contents, an outline, pages) produces `Section`s with a
start and a level; `with_ends` then gives each its end, so that a section spans its
subsections (a chapter spans its pages). A section's title is the book's, as the book writes
it: its own number ("7.1 Hash functions") stays in it, since that is the numbering a reader
knows (the index, numbered from 1 in document order, is only what `--sections` picks by).

The line naming a part of a book before its text, where a conversation reads some parts of
one (`picking`, `reading`), is "[Section: 7.1 Hash functions]", or for text without headings
"[Text from «It was the best of times…»]" (a part named by where it starts); `part_names`
reads them back (the citations' section of a passage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PART_LINE = re.compile(r"\[(?:Section: ([^\]\n]+)|(Text from «[^»\]\n]*»))\](?:\s|$)")


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



def first_words(text: str, words: int = 6, chars: int = 40) -> str:
    """Where a text starts, to name it by: its first words, 'It was the best of times…'
    (no brackets or guillemets, which the line naming a part uses)."""
    flat = [w for w in text.translate({ord(c): " " for c in "[]«»"}).split()]
    out = ""
    for w in flat[:words]:
        if out and len(out) + 1 + len(w) > chars:
            break
        out = f"{out} {w}" if out else w[:chars]
    return out + ("…" if len(flat) > len(out.split()) else "")


def part_line(name: str) -> str:
    """The line before a part's text: '[Section: 7.1 Hash functions]'; a name starting
    'Text from «' (text without headings) stands alone: '[Text from «It was…»]'."""
    return f"[{name}]" if name.startswith("Text from «") else f"[Section: {name}]"


def part_names(text: str) -> list[str]:
    """The names in the lines `part_line` wrote in `text`, in order."""
    return [a or b for a, b in _PART_LINE.findall(text)]


def without_part_lines(text: str) -> str:
    """`text` with the lines `part_line` wrote replaced by a space."""
    return _PART_LINE.sub(" ", text)


def split_at_part_lines(text: str) -> list[str]:
    """The stretches of `text` between the lines `part_line` wrote."""
    out, at = [], 0
    for m in _PART_LINE.finditer(text):
        out.append(text[at : m.start()])
        at = m.end()
    return [piece for piece in out + [text[at:]] if piece]
