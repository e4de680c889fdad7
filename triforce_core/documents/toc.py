"""An HTML page's own table of contents: nested lists of links, as sections with levels.

    links = TocLinks()                      # fed by the HTML parser, tag by tag
    sections = toc_sections(links.links, anchors, headings)   # () when the page has no usable one

What counts as a table of contents: a nested list (`ol`/`ul`) of links inside a `nav`, or in
an element whose id, class or role names one (`toc`, `contents`, `sidebar`, `chapter`), as
mdBook (`<nav id="sidebar"><ol class="chapter">`), Sphinx (`toctree-wrapper`), Pandoc
(`<nav id="TOC">`) and MediaWiki (`<div id="toc">`) write them. The nesting of the lists gives
the levels, so a chapter spans its sub-pages even where every page's title is an `<h1>`.

Where an entry lands: the element its `#fragment` names; else (a link to another page, as an
mdBook print page's sidebar has) the first heading after the previous entry whose text is the
link's, its number ("4.1.") aside. Entries that land nowhere are left out; a list that lands
fewer than three is not a table of contents. A section's title is the entry's as the book
writes it, its own number included ("4.1. What Is Ownership?"): the numbering a reader of the
book knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .sections import Section

_TOCISH = re.compile(r"toc|contents|sidebar|chapter|summary", re.I)
_CONTAINERS = {"nav", "div", "section", "aside", "header", "footer", "main", "article"}
_NUMBER = re.compile(r"^\s*(?:\d+(?:\.\d+)*\.?|[IVXLC]+\.|[A-Z]\.)\s+")
MIN_ENTRIES = 3


@dataclass(frozen=True)
class TocLink:
    list_id: int  # which outermost list it belongs to (one candidate table of contents each)
    depth: int  # lists open around it, 1 for the outermost
    href: str
    title: str
    tocish: bool  # inside a nav, or an element named like a table of contents


class TocLinks:
    """Collects the links of every nested list of a page, as the parser meets its tags."""

    def __init__(self) -> None:
        self.links: list[TocLink] = []
        self._containers: list[bool] = []  # one per open container: is it named like a table of contents?
        self._lists: list[bool] = []  # one per open ol/ul: likewise
        self._list_id = -1
        self._link: tuple[str, list[str]] | None = None  # the open <a>: its href and text so far

    def start(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _CONTAINERS or tag in ("ol", "ul"):
            named = tag == "nav" or any(k in ("id", "class", "role") and v and _TOCISH.search(v) for k, v in attrs)
            if tag in ("ol", "ul"):
                if not self._lists:
                    self._list_id += 1
                self._lists.append(named)
            else:
                self._containers.append(named)
        elif tag == "a" and self._lists:
            href = dict(attrs).get("href")
            self._link = (href, []) if href else None

    def end(self, tag: str) -> None:
        if tag in ("ol", "ul"):
            if self._lists:
                self._lists.pop()
        elif tag in _CONTAINERS:
            if self._containers:
                self._containers.pop()
        elif tag == "a" and self._link is not None:
            href, text = self._link
            self._link = None
            title = " ".join("".join(text).split())
            if title and self._lists:
                self.links.append(TocLink(self._list_id, len(self._lists), href, title,
                                          any(self._containers) or any(self._lists)))

    def data(self, text: str) -> None:
        if self._link is not None:
            self._link[1].append(text)


def plain_title(title: str) -> str:
    """A table-of-contents entry's title without its number: '4.1. What Is Ownership?' -> 'What Is Ownership?'."""
    return _NUMBER.sub("", title, count=1).strip() or title


def _key(title: str) -> str:
    return " ".join(plain_title(title).casefold().split())


def _resolve(links: list[TocLink], anchors: dict[str, int],
             headings: list[tuple[int, str, int]]) -> list[tuple[int, TocLink]]:
    """(offset, link) of the links that land in the page, in document order."""
    out: list[tuple[int, TocLink]] = []
    at, h = -1, 0  # the last landing and the next heading to search from
    for link in links:
        href = link.href.strip()
        if re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I):  # http:, mailto:, javascript: ...
            continue
        page, _, fragment = href.partition("#")
        where = anchors.get(fragment) if fragment else None
        if where is None and page:  # another page: its title as a heading, after the last entry
            want, k = _key(link.title), h
            while k < len(headings) and (headings[k][0] <= at or _key(headings[k][1]) != want):
                k += 1
            if k < len(headings):  # a title no heading has (renamed page) leaves the search where it was
                where, h = headings[k][0], k + 1
        if where is not None and where > at:
            out.append((where, link))
            at = where
    return out


def toc_sections(links: list[TocLink], anchors: dict[str, int],
                 headings: list[tuple[int, str, int]]) -> tuple[Section, ...]:
    """The page's table of contents as sections (levels from the lists' nesting), () if none.

    `anchors`: element id -> offset in the text; `headings`: (offset, text, level) in order.
    Of several candidate lists, the one landing the most entries wins.
    """
    best: list[tuple[int, TocLink]] = []
    for list_id in sorted({link.list_id for link in links}):
        group = [link for link in links if link.list_id == list_id]
        landed = _resolve(group, anchors, headings)
        tocish = any(link.tocish for link in group)
        # an unnamed list of in-page links is a table of contents only when it is a large one
        enough = len(landed) >= MIN_ENTRIES if tocish else len(landed) >= max(5, len(headings) // 2)
        if enough and len(landed) > len(best):
            best = landed
    if not best:
        return ()
    top = min(link.depth for _at, link in best)
    return tuple(Section(at, f"section: {link.title[:80]}", link.title[:200], link.depth - top + 1) for at, link in best)
