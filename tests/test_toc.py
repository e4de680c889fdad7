"""An HTML page's own table of contents decides its sections' levels: a chapter spans its pages
even where every page's title is an <h1> (mdBook's print page), headings are the fallback; a
section's title is the entry's as the book writes it, its own number included."""

from __future__ import annotations

import json

from tests.helpers.cli import run_main

from triforce_core.documents import load_document


def mdbook_page(chapters: list[tuple[str, list[str]]], *, inline_toc: bool = True, renamed: str = "") -> str:
    """A one-page mdBook book (print.html): a sidebar list of links to the page files, then every
    page with its title as an <h1> and an <h2> inside. `inline_toc=False` writes the sidebar as
    today's mdBook does (filled by a script from toc.html, an iframe for no-script readers)."""
    toc, pages = [], []
    for c, (chapter, subs) in enumerate(chapters, 1):
        sub_items = "".join(f'<li class="chapter-item"><a href="ch{c:02d}-{s:02d}.html"><strong>{c}.{s}.</strong> {t}</a></li>'
                            for s, t in enumerate(subs, 1))
        title = renamed if renamed and c == 1 else chapter
        toc.append(f'<li class="chapter-item"><a href="ch{c:02d}-00.html"><strong>{c}.</strong> {title}</a></li>'
                   + (f'<li><ol class="section">{sub_items}</ol></li>' if subs else ""))
        for t in [chapter] + subs:
            slug = t.lower().replace(" ", "-")
            pages.append(f'<div style="break-before: page;"></div><h1 id="{slug}"><a class="header" href="#{slug}">{t}</a></h1>'
                         f"<p>The page {t} says {slug} words.</p><h2 id='{slug}-more'>More on {t}</h2><p>{slug} details.</p>")
    ol = f'<ol class="chapter">{"".join(toc)}</ol>'
    nav = (f'<nav id="sidebar" class="sidebar"><div class="sidebar-scrollbox">{ol}</div></nav>' if inline_toc else
           '<nav id="mdbook-sidebar" class="sidebar"><noscript><iframe src="toc.html"></iframe></noscript></nav>')
    return f"<!DOCTYPE html><html><head><title>Book</title></head><body>{nav}<main>{''.join(pages)}</main></body></html>"


CHAPTERS = [("Getting Started", ["Installation", "Hello World"]),
            ("Understanding Ownership", ["What Is Ownership?", "References and Borrowing", "The Slice Type"]),
            ("Appendix", [])]


def titles(doc) -> list[tuple[str, int]]:
    return [(s.title, s.level) for s in doc.sections]


def test_mdbook_sidebar_nests_pages_under_their_chapter(tmp_path):
    path = tmp_path / "print.html"
    path.write_text(mdbook_page(CHAPTERS))
    doc = load_document(path, timeout_s=None)
    # the book's own numbering kept: 2.1 is 2.1, not the fifth section
    assert titles(doc) == [("1. Getting Started", 1), ("1.1. Installation", 2), ("1.2. Hello World", 2),
                           ("2. Understanding Ownership", 1), ("2.1. What Is Ownership?", 2),
                           ("2.2. References and Borrowing", 2), ("2.3. The Slice Type", 2), ("3. Appendix", 1)]
    own = doc.sections[3]
    text = doc.text[own.start : own.end]
    # the chapter spans its three pages (and not the next chapter), each page's <h2> included
    assert text.startswith("Understanding Ownership") and "the-slice-type details" in text
    assert "More on References and Borrowing" in text and "Appendix" not in text


def test_without_a_table_of_contents_headings_decide(tmp_path):
    path = tmp_path / "print.html"
    page = mdbook_page(CHAPTERS)
    path.write_text(page[: page.index("<nav")] + page[page.index("</nav>") + 6 :])
    doc = load_document(path, timeout_s=None)
    # every page is an <h1>, so the chapter is only its own page (what the table of contents fixes)
    assert ("Understanding Ownership", 1) in titles(doc) and ("More on Installation", 2) in titles(doc)
    own = next(s for s in doc.sections if s.title == "Understanding Ownership")
    assert "Slice" not in doc.text[own.start : own.end]


def test_a_renamed_entry_is_skipped_and_the_rest_still_land(tmp_path):
    path = tmp_path / "print.html"
    path.write_text(mdbook_page(CHAPTERS, renamed="Start Here"))
    doc = load_document(path, timeout_s=None)
    assert [t for t, _ in titles(doc)][:2] == ["1.1. Installation", "1.2. Hello World"]
    assert ("2. Understanding Ownership", 1) in titles(doc) and ("3. Appendix", 1) in titles(doc)


def test_pandoc_nav_of_anchor_links(tmp_path):
    path = tmp_path / "doc.html"
    path.write_text('<html><body><nav id="TOC" role="doc-toc"><ul><li><a href="#intro">1 Intro</a></li>'
                    '<li><a href="#method">2 Method</a><ul><li><a href="#data">2.1 Data</a></li></ul></li>'
                    '<li><a href="#end">3 End</a></li></ul></nav>'
                    '<section id="intro"><h1>Intro</h1><p>aaa</p></section>'
                    '<section id="method"><h1>Method</h1><p>bbb</p>'
                    '<section id="data"><h2>Data</h2><p>ccc</p></section></section>'
                    '<section id="end"><h1>End</h1><p>ddd</p></section></body></html>')
    doc = load_document(path, timeout_s=None)
    assert titles(doc) == [("1 Intro", 1), ("2 Method", 1), ("2.1 Data", 2), ("3 End", 1)]
    method = doc.sections[1]
    assert " ".join(doc.text[method.start : method.end].split()) == "Method bbb Data ccc"


def test_a_short_list_of_links_in_the_text_is_not_a_table_of_contents(tmp_path):
    path = tmp_path / "doc.html"
    path.write_text("<html><body><h1 id='a'>Alpha</h1><p>see</p><ul><li><a href='#a'>Alpha</a></li>"
                    "<li><a href='#b'>Beta</a></li><li><a href='#c'>Gamma</a></li></ul>"
                    "<h2 id='b'>Beta</h2><p>b</p><h2 id='c'>Gamma</h2><p>c</p><h1>Delta</h1><p>d</p></body></html>")
    doc = load_document(path, timeout_s=None)
    assert titles(doc) == [("Alpha", 1), ("Beta", 2), ("Gamma", 2), ("Delta", 1)]


def test_mdbook_toc_beside_the_page_is_read_by_the_command_line(tmp_path):
    folder = tmp_path / "book"
    folder.mkdir()
    (folder / "print.html").write_text(mdbook_page(CHAPTERS, inline_toc=False))
    inline = mdbook_page(CHAPTERS)
    (folder / "toc.html").write_text(inline[inline.index("<ol"): inline.index("</ol></div>") + 5])
    path = folder / "print.html"
    # the library reads one file unless asked (the app never reads beside an upload) ...
    assert ("What Is Ownership?", 1) in titles(load_document(path, timeout_s=None))
    assert ("2.1. What Is Ownership?", 2) in titles(load_document(path, timeout_s=None, companion_toc=True))
    # ... and the command line asks
    code, out, _err = run_main(["ingest", "--json", str(path)])
    assert code == 0
    sections = json.loads(out)["sections"]
    own = next(s for s in sections if s["title"] == "2. Understanding Ownership")
    assert own["level"] == 1 and sum(1 for s in sections if s["level"] == 2) == 5
