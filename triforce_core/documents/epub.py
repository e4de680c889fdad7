"""EPUB: the spine's chapters in order; sections from the nav document or NCX, else the chapters."""

from __future__ import annotations

import posixpath

from .archive import Archive, local_name, parse_xml
from .document import Document, DocumentError
from .html import parse_html
from .sections import Section
from .text import decode_text


def read_epub(data: bytes) -> Document:
    arc = Archive(data, "EPUB")
    container = parse_xml(arc.read("META-INF/container.xml"), "META-INF/container.xml")
    rootfile = next((el.get("full-path") for el in container.iter() if local_name(el.tag) == "rootfile"), None)
    if not rootfile:
        raise DocumentError("malformed EPUB (container.xml names no package file)")
    opf = parse_xml(arc.read(rootfile), rootfile)
    base = posixpath.dirname(rootfile)
    manifest = {}
    for el in opf.iter():
        if local_name(el.tag) == "item" and el.get("id") and el.get("href"):
            manifest[el.get("id")] = el
    spine = [el.get("idref") for el in opf.iter() if local_name(el.tag) == "itemref"]
    if not spine:
        raise DocumentError("malformed EPUB (its spine lists no chapters)")
    parts, sections, at, chapter = [], [], 0, 0
    read: dict[str, tuple[int, dict[str, int]]] = {}  # chapter file -> (its offset in the text, its anchors)
    for idref in spine:
        item = manifest.get(idref)
        if item is None:
            continue
        media = item.get("media-type", "")
        if media and "html" not in media and "xml" not in media:
            continue
        path, _ = _epub_href(base, item.get("href"))
        if not arc.has(path):
            continue
        raw = arc.read(path)
        if b"<!ENTITY" in raw[:4096].upper():
            raise DocumentError(f"unsafe XML in {path} (entity declarations are not allowed)")
        text, heads, anchors = parse_html(decode_text(raw))
        if not text.strip():
            continue
        read.setdefault(path, (at, anchors))
        chapter += 1
        title = heads[0].label.split(": ", 1)[-1] if heads else ""
        sections.append(Section(at, f"chapter {chapter}" + (f": {title}" if title else ""),
                                title or f"chapter {chapter}", 1))
        for h in heads[1:]:  # nested in the chapter, one level per heading level below its first
            level = 1 + max(1, h.level - heads[0].level)
            sections.append(Section(at + h.start, f"chapter {chapter}, {h.label}", h.title, level))
        chunk = text.strip() + "\n\n"
        parts.append(chunk)
        at += len(chunk)
    toc = _epub_toc_sections(arc, opf, manifest, base, read)
    return Document("".join(parts).rstrip() + "\n" if parts else "", "epub", sections=toc or tuple(sections))


def _epub_href(folder: str, href: str) -> tuple[str, str]:
    """(archive path, fragment) of a link written in a file of `folder`."""
    from urllib.parse import unquote

    target, _, fragment = href.partition("#")
    return posixpath.normpath(posixpath.join(folder, unquote(target))), unquote(fragment)


def _epub_toc_sections(arc: Archive, opf, manifest: dict, base: str,
                       read: dict[str, tuple[int, dict[str, int]]]) -> tuple[Section, ...]:
    """The book's own table of contents as sections: the EPUB 3 navigation document, else the
    EPUB 2 NCX; levels from its nesting. An entry lands where its link does (the chapter's
    start, or the element its #fragment names). () when there is none, it cannot be read or
    none of its links reach the text read (the spine's chapters are the sections then)."""
    nav = next((el for el in manifest.values() if "nav" in (el.get("properties") or "").split()), None)
    spine = next((el for el in opf.iter() if local_name(el.tag) == "spine"), None)
    ncx = manifest.get(spine.get("toc") if spine is not None else None) or next(
        (el for el in manifest.values() if el.get("media-type") == "application/x-dtbncx+xml"), None)
    entries: list[tuple[str, str, str, int]] = []  # (path, fragment, title, level)
    for item, walk in ((nav, _nav_entries), (ncx, _ncx_entries)):
        if item is None or entries:
            continue
        path, _ = _epub_href(base, item.get("href"))
        try:
            if arc.has(path):
                walk(parse_xml(arc.read(path), path), posixpath.dirname(path), entries)
        except (DocumentError, RecursionError):  # an unreadable table of contents is no reason to refuse the book
            entries.clear()
    out, chapter = [], 0
    for path, fragment, title, level in entries:
        if path not in read:
            continue
        at, anchors = read[path]
        chapter += level == 1
        label = f"chapter {chapter}: {title[:80]}" if level == 1 else f"chapter {max(chapter, 1)}, section: {title[:80]}"
        out.append(Section(at + anchors.get(fragment, 0), label, title[:200], level))
    return tuple(out)


def _text_of(el) -> str:
    return " ".join("".join(el.itertext()).split())


def _nav_entries(root, folder: str, out: list) -> None:
    """EPUB 3: <nav epub:type="toc"><ol><li><a href>Title</a><ol>...</ol></li></ol></nav>."""
    navs = [el for el in root.iter() if local_name(el.tag) == "nav"]
    toc = next((n for n in navs if "toc" in (n.get("{http://www.idpf.org/2007/ops}type") or "").split()),
               navs[0] if navs else None)
    top = next((el for el in toc.iter() if local_name(el.tag) == "ol"), None) if toc is not None else None

    def walk(ol, level: int) -> None:
        for li in (c for c in ol if local_name(c.tag) == "li"):
            link = next((c for c in li if local_name(c.tag) == "a"), None)
            if link is not None and link.get("href") and _text_of(link):
                out.append((*_epub_href(folder, link.get("href")), _text_of(link), level))
            for sub in (c for c in li if local_name(c.tag) == "ol"):
                walk(sub, level + 1)

    if top is not None:
        walk(top, 1)


def _ncx_entries(root, folder: str, out: list) -> None:
    """EPUB 2: <navMap><navPoint><navLabel><text>Title</text></navLabel><content src/>
    <navPoint>...</navPoint></navPoint></navMap>."""
    nav_map = next((el for el in root.iter() if local_name(el.tag) == "navMap"), None)

    def walk(parent, level: int) -> None:
        for point in (c for c in parent if local_name(c.tag) == "navPoint"):
            label = next((c for c in point if local_name(c.tag) == "navLabel"), None)
            content = next((c for c in point if local_name(c.tag) == "content"), None)
            title = _text_of(label) if label is not None else ""
            if title and content is not None and content.get("src"):
                out.append((*_epub_href(folder, content.get("src")), title, level))
            walk(point, level + 1)

    if nav_map is not None:
        walk(nav_map, 1)
