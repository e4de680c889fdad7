"""HTML (and the XHTML of EPUB chapters): the visible text, its headings and its anchors."""

from __future__ import annotations

import bisect
import re
from html.parser import HTMLParser

from ..config import one_line
from .document import Document, DocumentError
from .sections import Section
from .toc import TocLinks, toc_sections

_BLOCK = {"p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header", "footer",
          "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "dd", "dt", "dl", "hr", "figure",
          "figcaption", "nav", "aside", "main", "td", "th", "title"}
_HIDDEN = {"script", "style", "noscript", "template", "head", "svg", "math", "iframe", "object"}
_HEADINGS = {"h1", "h2", "h3"}
# What a heading's permalink shows (Sphinx and MkDocs "¶", docutils "§", others "#" or a link
# sign): an in-page link with only this for text is the page's furniture, not its text.
_PERMALINKS = {"¶", "§", "#", "🔗"}


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
        self.toc = TocLinks()  # every nested list's links: the page's own table of contents, if it has one
        self.link: list[str] | None = None  # the text so far of an in-page link, held until it ends

    def _emit(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def _text(self, data: str) -> None:
        """Visible text: in the document, and in the heading being read."""
        self._emit(data)
        if self.heading is not None:
            self.heading.append(data)

    def _end_link(self, drop: bool) -> None:
        """An in-page link's text, held back: dropped when it is only a permalink sign."""
        held, self.link = "".join(self.link or ()), None
        if held and not (drop and held.strip() in _PERMALINKS):
            self._text(held)

    def handle_starttag(self, tag, attrs):
        if self.link is not None:  # an element inside the link: its text so far is text
            self._end_link(drop=False)
        self.toc.start(tag, attrs)
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
        if tag == "a" and not self.hidden and (dict(attrs).get("href") or "").startswith("#"):
            self.link = []

    def handle_startendtag(self, tag, attrs):
        if self.link is not None:
            self._end_link(drop=False)
        if tag in ("br", "hr"):
            self._emit("\n")

    def handle_endtag(self, tag):
        if self.link is not None:
            self._end_link(drop=tag == "a")
        self.toc.end(tag)
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
        self.toc.data(data)
        if self.title is not None:
            self.title.append(data)
        if self.hidden:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
        if self.link is not None:
            self.link.append(data)
        else:
            self._text(data)

    def close(self):
        super().close()
        if self.link is not None:  # a link left open at the end of the page
            self._end_link(drop=False)


def read_html(source: str, toc_source: str | None = None) -> Document:
    """An HTML page: its visible text; sections from its own table of contents, else from the
    one in `toc_source` (a separate page of links, as mdBook's toc.html), else its headings."""
    text, headings, anchors, toc = _parse(source)
    if not toc and toc_source:
        companion = _TextParser()
        try:
            companion.feed(toc_source)
            companion.close()
        except (AssertionError, ValueError):  # a broken companion is no reason to refuse the page
            companion = None
        if companion is not None:
            toc = toc_sections(companion.toc.links, anchors, [(s.start, s.title, s.level) for s in headings])
    return Document(text, "html", sections=toc or headings)


def html_to_text(source: str) -> tuple[str, tuple[Section, ...]]:
    """Visible text of an HTML page and its h1-h3 headings as sections."""
    text, sections, _anchors = parse_html(source)
    return text, sections


def parse_html(source: str) -> tuple[str, tuple[Section, ...], dict[str, int]]:
    """html_to_text, plus where each element id lands in the text (the start of its line)."""
    text, headings, anchors, _toc = _parse(source)
    return text, headings, anchors


def _parse(source: str) -> tuple[str, tuple[Section, ...], dict[str, int], tuple[Section, ...]]:
    """(text, heading sections, anchors, table-of-contents sections) of a page."""
    parser = _TextParser()
    try:
        parser.feed(source)
        parser.close()
    except (AssertionError, ValueError) as e:
        raise DocumentError(f"malformed HTML ({one_line(e, 200)})") from None
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

    anchors = {name: tidied(at) for name, at in parser.anchors.items()}
    headings = [(tidied(at), title, level) for at, title, level in parser.headings]
    for at, title, level in headings:
        starts.append(Section(at, f"section: {title[:80]}", title[:200], level))
    return joined, tuple(starts), anchors, toc_sections(parser.toc.links, anchors, headings)

