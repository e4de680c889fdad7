"""The extracted document: its text, format and sections, and the error every reader raises."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .sections import Section


class DocumentError(ValueError):
    """A document could not be read; the message is one line meant for the user."""


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
