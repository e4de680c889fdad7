"""Plain text and Markdown: decoding any encoding, and Markdown's headings as sections."""

from __future__ import annotations

import re

from .document import DocumentError
from .sections import Section


def decode_text(data: bytes) -> str:
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


def markdown_sections(text: str) -> tuple[Section, ...]:
    out = []
    for m in re.finditer(r"(?m)^(#{1,3})\s+(.+?)\s*#*\s*$", text):
        out.append(Section(m.start(), f"section: {m.group(2)[:80]}", m.group(2)[:200], len(m.group(1))))
    return tuple(out)

