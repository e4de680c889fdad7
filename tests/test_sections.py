"""A book's sections: extracted with titles, levels and spans, picked by number, refused with
the numbers when they do not fit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tests.helpers.cli import run_main
from tests.helpers.models import words
from tests.helpers.documents import make_epub, make_pdf

from triforce_core.documents import Document, load_document
from triforce_core.documents.picking import (SectionError, merged_spans, parse_spec, selected_text, too_long_message,
                                    top_level)

BOOK_MD = """# Part One
intro text here
## Chapter A
alpha alpha
### Detail
deep
## Chapter B
beta beta
# Part Two
two two
"""


def outline(doc: Document) -> list[tuple[str, int, str]]:
    """(title, level, the section's text) for each section."""
    return [(s.title, s.level, doc.text[s.start : s.end]) for s in doc.sections]


def test_markdown_headings_nest_and_include_their_subsections(tmp_path):
    path = tmp_path / "book.md"
    path.write_text(BOOK_MD)
    doc = load_document(path, timeout_s=None)
    assert outline(doc) == [
        ("Part One", 1, BOOK_MD[: BOOK_MD.index("# Part Two")]),
        ("Chapter A", 2, "## Chapter A\nalpha alpha\n### Detail\ndeep\n"),
        ("Detail", 3, "### Detail\ndeep\n"),
        ("Chapter B", 2, "## Chapter B\nbeta beta\n"),
        ("Part Two", 1, "# Part Two\ntwo two\n"),
    ]
    assert doc.locate(doc.text.index("beta")) == "section: Chapter B"  # labels unchanged


def test_html_heading_levels(tmp_path):
    path = tmp_path / "page.html"
    path.write_text("<html><body><h1>Top</h1><p>one</p><h2>Sub</h2><p>two</p><h3>Deep</h3><p>three</p>"
                    "<h2>Other</h2><p>four</p><h1>Next</h1><p>five</p></body></html>")
    doc = load_document(path, timeout_s=None)
    got = [(t, lvl, " ".join(text.split())) for t, lvl, text in outline(doc)]
    assert got == [("Top", 1, "Top one Sub two Deep three Other four"), ("Sub", 2, "Sub two Deep three"),
                   ("Deep", 3, "Deep three"), ("Other", 2, "Other four"), ("Next", 1, "Next five")]


def test_epub_chapters_in_spine_order_with_their_headings(tmp_path):
    path = make_epub(tmp_path / "b.epub", [("First", "one one"), ("Second", "two two"), ("Third", "three")],
                     spine_order=[1, 0, 2])
    doc = load_document(path, timeout_s=None)
    assert [(t, lvl) for t, lvl, _ in outline(doc)] == [("Second", 1), ("First", 1), ("Third", 1)]
    assert "two two" in outline(doc)[0][2] and "one one" not in outline(doc)[0][2]
    assert outline(doc)[-1][2].rstrip().endswith("three")


BOOK_CHAPTERS = [("Part One", "part intro"), ("The Storm", 'storm text</p><h2 id="calm">After</h2><p>calm text'),
                 ("Part Two", "two text")]
NAV = """<?xml version="1.0" encoding="utf-8"?>
<html xmlns="http://www.w3.org/1999/xhtml" xmlns:epub="http://www.idpf.org/2007/ops"><head><title>Contents</title></head>
<body><nav epub:type="landmarks"><ol><li><a href="../text/ch2.xhtml">Landmark</a></li></ol></nav>
<nav epub:type="toc"><h1>Contents</h1><ol>
<li><a href="../text/ch0.xhtml">Part One</a><ol>
  <li><a href="../text/ch1.xhtml">The Storm</a><ol><li><a href="../text/ch1.xhtml#calm">The Calm</a></li></ol></li>
  <li><a href="../text/gone.xhtml">Missing</a></li></ol></li>
<li><a href="../text/ch2.xhtml">Part <b>Two</b></a></li></ol></nav></body></html>"""
NCX = """<?xml version="1.0" encoding="utf-8"?>
<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" version="2005-1"><head/><docTitle><text>Book</text></docTitle><navMap>
<navPoint id="a"><navLabel><text>Part One</text></navLabel><content src="text/ch0.xhtml"/>
  <navPoint id="b"><navLabel><text>The Storm</text></navLabel><content src="text/ch1.xhtml"/>
    <navPoint id="c"><navLabel><text>The Calm</text></navLabel><content src="text/ch1.xhtml#calm"/></navPoint>
  </navPoint></navPoint>
<navPoint id="d"><navLabel><text>Part Two</text></navLabel><content src="text/ch2.xhtml"/></navPoint></navMap></ncx>"""


@pytest.mark.parametrize("toc", ["nav", "ncx"])
def test_epub_table_of_contents_gives_titles_levels_and_fragments(tmp_path, toc):
    path = make_epub(tmp_path / "b.epub", BOOK_CHAPTERS, **{toc: NAV if toc == "nav" else NCX})
    doc = load_document(path, timeout_s=None)
    got = [(t, lvl, " ".join(text.split())) for t, lvl, text in outline(doc)]
    assert got == [  # the book's own titles and nesting, not the chapters' headings ("After")
        ("Part One", 1, "Part One part intro The Storm storm text After calm text"),
        ("The Storm", 2, "The Storm storm text After calm text"),
        ("The Calm", 3, "After calm text"),  # lands on the element its #calm names
        ("Part Two", 1, "Part Two two text"),
    ]
    assert doc.locate(doc.text.index("calm text")) == "chapter 1, section: The Calm"
    assert doc.locate(doc.text.index("two text")) == "chapter 2: Part Two"


def test_epub_without_a_readable_table_of_contents_uses_the_spine(tmp_path):
    for name, nav in (("none.epub", None), ("broken.epub", "<html><body><nav><ol><li><a href='x'>cut")):
        doc = load_document(make_epub(tmp_path / name, BOOK_CHAPTERS, nav=nav), timeout_s=None)
        assert [(t, lvl) for t, lvl, _ in outline(doc)] == [("Part One", 1), ("The Storm", 1), ("After", 2),
                                                            ("Part Two", 1)], name


def test_docx_heading_styles_give_levels(tmp_path):
    import docx

    d = docx.Document()
    d.add_heading("Report", level=0)  # the Title style
    d.add_heading("Intro", level=1)
    d.add_paragraph("intro body")
    d.add_heading("Detail", level=2)
    d.add_paragraph("detail body")
    d.add_heading("End", level=1)
    d.add_paragraph("end body")
    d.save(str(tmp_path / "r.docx"))
    doc = load_document(tmp_path / "r.docx", timeout_s=None)
    assert [(t, lvl) for t, lvl, _ in outline(doc)] == [("Report", 1), ("Intro", 1), ("Detail", 2), ("End", 1)]
    assert "detail body" in outline(doc)[1][2] and "end body" not in outline(doc)[1][2]


def test_pdf_outline_else_pages(tmp_path):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    for title, level, body in (("Chapter 1", 0, "first page"), ("Section 1.1", 1, "second page"),
                               ("Chapter 2", 0, "third page")):
        pdf.add_page()
        pdf.start_section(title, level=level)
        pdf.multi_cell(0, 6, body)
    pdf.output(str(tmp_path / "o.pdf"))
    doc = load_document(tmp_path / "o.pdf", timeout_s=None)
    got = [(t, lvl, " ".join(text.split())) for t, lvl, text in outline(doc)]
    assert got == [("Chapter 1", 1, "first page second page"), ("Section 1.1", 2, "second page"),
                   ("Chapter 2", 1, "third page")]
    plain = load_document(make_pdf(tmp_path / "p.pdf", ["one", "two"]), timeout_s=None)
    assert [(t, lvl) for t, lvl, _ in outline(plain)] == [("page 1", 1), ("page 2", 1)]


def test_pdf_outline_entries_start_at_their_printed_titles_mid_page(tmp_path):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    pdf.add_page()
    for title, level, printed, body in (("Chapter 1", 0, "Chapter 1", "first body, see Chapter 2 below."),
                                        ("Chapter 2", 0, "Chapter 2", "second body"),
                                        ("Detail", 1, "2.1 Detail", "detail body")):
        pdf.start_section(title, level=level)
        pdf.multi_cell(0, 6, printed, new_x="LMARGIN", new_y="NEXT")
        pdf.multi_cell(0, 6, body, new_x="LMARGIN", new_y="NEXT")
    pdf.add_page()
    pdf.start_section("Chapter 3", level=0)  # its title is not printed: the page's start
    pdf.multi_cell(0, 6, "third page")
    pdf.output(str(tmp_path / "m.pdf"))
    doc = load_document(tmp_path / "m.pdf", timeout_s=None)
    got = [(t, lvl, " ".join(text.split())) for t, lvl, text in outline(doc)]
    assert got == [("Chapter 1", 1, "Chapter 1 first body, see Chapter 2 below."),  # not cut at the mention
                   ("Chapter 2", 1, "Chapter 2 second body 2.1 Detail detail body"),
                   ("Detail", 2, "2.1 Detail detail body"), ("Chapter 3", 1, "third page")]
    assert doc.locate(doc.text.index("second body")) == "page 1: Chapter 2"


def test_parse_spec():
    assert parse_spec("3,5-7", 9) == [2, 4, 5, 6]
    assert parse_spec(" 2 , 1-2 ", 2) == [0, 1]
    for bad, why in (("", "empty"), ("3,,4", "empty"), ("x", "not a section"), ("4-2", "backwards"),
                     ("0", "does not exist"), ("10", "sections 1-9"), ("2-10", "sections 1-9")):
        with pytest.raises(SectionError, match=why):
            parse_spec(bad, 9)
    with pytest.raises(SectionError, match="no sections"):
        parse_spec("1", 0)


def test_a_picked_chapter_brings_its_subsections_once(tmp_path):
    path = tmp_path / "book.md"
    path.write_text(BOOK_MD)
    doc = load_document(path, timeout_s=None)
    assert [names for _, _, names in merged_spans(doc.sections, [1, 2, 4])] == [[1, 2], [4]]
    text = selected_text(doc, parse_spec("2-3,5", len(doc.sections)))
    assert text == ("[Section: Chapter A]\n## Chapter A\nalpha alpha\n### Detail\ndeep\n\n"
                    "[Section: Part Two]\n# Part Two\ntwo two\n")
    assert "beta" not in text and text.count("deep") == 1


def test_the_refusal_lists_the_outermost_sections_whatever_their_level(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("## Foreword\nf\n# Part\np\n## Inside\ni\n")  # no level-1 heading first
    doc = load_document(path, timeout_s=None)
    assert top_level(doc.sections) == [0, 1]  # Inside is within Part
    message = too_long_message(doc, 2000, 1024, [10, 20, 5], "the document", 6)
    assert message.startswith("the document is 2,000 tokens (+ 6 for the answer), over the target's context "
                              "window of 1,024; pick sections that fit with --sections")
    assert message.endswith(": 1 'Foreword' 10, 2 'Part' 20")
    plain = Document("just text\n", "txt")
    assert too_long_message(plain, 2000, 1024, None, "the document").endswith("(it has no sections to pick from)")


def _chat(tiny_pair_dir, *args) -> SimpleNamespace:
    """`chat` run in-process (each call loads the models afresh, as a new process would)."""
    code, out, err = run_main(["chat", "--target", tiny_pair_dir["target"], "--draft", tiny_pair_dir["draft"],
                               "--max-new-tokens", "6", "--ignore-eos", "--budget", "32", "--chunk-size", "4",
                               "--draft-window", "16", "--no-kv-cache", *args])
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_cli_chat_reads_the_picked_sections_and_refuses_what_does_not_fit(tiny_pair_dir, tmp_path):
    # Word-level test vocabulary: every word is one token; the tiny target's window is 1,024.
    parts = [("Alpha", 300), ("Beta", 620), ("Gamma", 400)]
    book = "".join(f"# {title}\n{words(n, i)}\n" for i, (title, n) in enumerate(parts))
    path = tmp_path / "book.md"
    path.write_text(book)
    code, out, err = run_main(["ingest", str(path), "--json"])
    assert code == 0, err
    sections = json.loads(out)["sections"]
    assert [(s["title"], s["level"]) for s in sections] == [("Alpha", 1), ("Beta", 1), ("Gamma", 1)]
    assert book[sections[1]["start"] : sections[1]["end"]].startswith("# Beta\n")

    whole = _chat(tiny_pair_dir, "--document", str(path), "--sections", "all", "--question", "w9")
    assert whole.returncode == 2
    line = whole.stderr.strip().splitlines()
    assert len(line) == 1 and "over the target's context window of 1,024" in line[0]
    assert "--sections" in line[0] and "1 'Alpha'" in line[0] and "2 'Beta'" in line[0]
    assert "[prefilled" not in whole.stderr  # refused before any prefill

    picked = _chat(tiny_pair_dir, "--document", str(path), "--sections", "1,3", "--question", "w9", "--json")
    assert picked.returncode == 0, picked.stderr
    doc = json.loads(picked.stdout)["document"]
    assert 700 <= doc["tokens"] < 1000  # Alpha and Gamma with their headings, not Beta
    too_many = _chat(tiny_pair_dir, "--document", str(path), "--sections", "2-3", "--question", "w9")
    assert too_many.returncode == 2 and "the selection (sections 2-3) is 1,0" in too_many.stderr
    assert "[prefilled" not in too_many.stderr
    bad = _chat(tiny_pair_dir, "--document", str(path), "--sections", "4", "--question", "w9")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --sections: section 4 does not exist: the document has sections 1-3"


def test_the_books_own_numbers_stay_in_its_titles_and_the_index_still_picks(tmp_path):
    """Headings that carry the book's numbers keep them ("7.1 Hash functions", never renumbered as
    the eighth section); `--sections` still numbers from 1 as listed, and the read names the book's."""
    from triforce_core.documents.picking import picked_titles
    from triforce_core.documents.reading import BookReader, token_starts
    from tests.helpers.models import make_tokenizer

    path = tmp_path / "manual.md"
    path.write_text("# Preface\nwhy\n# 7. Reference\nref\n## 7.1 Hash functions\nhash\n## 7.3 Compatibility functions\ncompat\n")
    doc = load_document(path, timeout_s=None)
    assert [s.title for s in doc.sections] == ["Preface", "7. Reference", "7.1 Hash functions",
                                               "7.3 Compatibility functions"]
    picked = parse_spec("3-4", len(doc.sections))  # the index: the third and fourth as listed
    assert picked == [2, 3] and picked_titles(doc, picked) == "7.1 Hash functions; 7.3 Compatibility functions"
    text = selected_text(doc, picked)
    assert text.startswith("[Section: 7.1 Hash functions]\n## 7.1 Hash functions") and "[Section: 7.3 Comp" in text
    reader = BookReader(doc, token_starts(make_tokenizer(), doc.text))
    read = reader.describe([2])
    assert read[0]["number"] == 3 and read[0]["name"] == read[0]["title"] == "7.1 Hash functions"
