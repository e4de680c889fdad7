"""Document ingestion on real files built here (fpdf2 PDFs, zipfile EPUBs, python-docx DOCX) and a bad-input corpus."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers.documents import make_epub, make_pdf
from triforce_core.documents import DocumentError, extract_bytes, load_document

REPO_ROOT = Path(__file__).resolve().parent.parent


def live_children() -> list[int]:
    """Extraction processes (children of this process running `triforce_core.documents`) that
    still exist (Linux /proc). Other children, such as an app server another test module of
    the same pytest worker started, do not count."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (int(x) for x in (task / "children").read_text().split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"triforce_core.documents" in cmdline or b"documents import _child_main" in cmdline:
                pids.append(pid)
    return pids

PARAGRAPH = "The quick brown fox jumps over the lazy dog while the river keeps running to the sea. "


# --------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------
def make_docx(path: Path) -> Path:
    import docx

    d = docx.Document()
    d.add_heading("Introduction", level=1)
    d.add_paragraph("First paragraph of the report. " * 3)
    d.add_heading("Results", level=1)
    d.add_paragraph("The measured value was forty-two.")
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text = "cell A"
    table.rows[0].cells[1].text = "cell B"
    d.save(str(path))
    return path


def rewrite_zip_entry(src: Path, dst: Path, name: str, data: bytes) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, data if info.filename == name else zin.read(info.filename))
    return dst


BILLION_LAUGHS = (
    b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    + b"".join(b'<!ENTITY lol%d "%s">' % (i, (b"&lol%d;" % (i - 1) if i > 1 else b"&lol;") * 10) for i in range(1, 10))
    + b']><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p><w:r>'
    b"<w:t>&lol9;</w:t></w:r></w:p></w:body></w:document>"
)


# --------------------------------------------------------------------------------------
# good files
# --------------------------------------------------------------------------------------
def test_pdf_pages_and_page_map(tmp_path):
    path = make_pdf(tmp_path / "book.pdf", [f"Page one. {PARAGRAPH}", f"Second page here. {PARAGRAPH}", "Third and last."])
    doc = load_document(path)
    assert doc.format == "pdf" and doc.pages == 3
    assert "Second page here." in doc.text and "Third and last." in doc.text
    assert doc.locate(doc.text.index("Second page")) == "page 2"
    assert doc.locate(doc.text.index("Third and last")) == "page 3"
    starts = [doc.text.index(t) for t in ("Page one", "Second page", "Third and last")]
    assert doc.as_json() == {"text": doc.text, "format": "pdf", "chars": len(doc.text), "pages": 3, "sections": [
        {"title": f"page {i + 1}", "level": 1, "start": a, "end": b}
        for i, (a, b) in enumerate(zip(starts, [*starts[1:], len(doc.text)]))]}


def test_pdf_encrypted_with_empty_user_password_opens(tmp_path):
    path = make_pdf(tmp_path / "locked.pdf", ["Readable without a password."], owner_password="owner")
    assert "Readable without a password." in load_document(path).text


def test_epub_reads_in_spine_order_with_chapter_labels(tmp_path):
    chapters = [("Alpha", "First written. " * 5), ("Beta", "Second written. " * 5), ("Gamma", "Third written. " * 5)]
    path = make_epub(tmp_path / "novel.epub", chapters, spine_order=[2, 0, 1])
    doc = load_document(path)
    assert doc.format == "epub"
    assert doc.text.index("Third written") < doc.text.index("First written") < doc.text.index("Second written")
    assert "var hidden" not in doc.text and "color: red" not in doc.text
    assert doc.locate(doc.text.index("First written")) == "chapter 2: Alpha"
    assert doc.locate(0) == "chapter 1: Gamma"


def test_docx_paragraphs_tables_and_headings(tmp_path):
    doc = load_document(make_docx(tmp_path / "report.docx"))
    assert doc.format == "docx"
    assert "The measured value was forty-two." in doc.text and "cell A" in doc.text and "cell B" in doc.text
    assert doc.locate(doc.text.index("forty-two")) == "section: Results"


TEXT_BOX = (
    '<mc:AlternateContent xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006" '
    'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" '
    'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape" '
    'xmlns:v="urn:schemas-microsoft-com:vml">'
    '<mc:Choice Requires="wps"><w:drawing><wps:wsp><wps:txbx><w:txbxContent>'
    '<w:p><w:r><w:t>Boxed remark in the margin.</w:t></w:r></w:p>'
    '</w:txbxContent></wps:txbx></wps:wsp></w:drawing></mc:Choice>'
    '<mc:Fallback><w:pict><v:shape><v:textbox><w:txbxContent>'
    '<w:p><w:r><w:t>Boxed remark in the margin.</w:t></w:r></w:p>'
    '</w:txbxContent></v:textbox></v:shape></w:pict></mc:Fallback>'
    '</mc:AlternateContent>'
)


def test_docx_text_box_table_and_headings_each_read_once_in_order(tmp_path):
    """How Word saves a text box: inside a run of its anchor paragraph, twice (DrawingML in
    mc:Choice, VML in mc:Fallback), its paragraphs nested in the anchor's. Each paragraph's text
    must come out exactly once, in order; python-docx gives the body paragraphs and the cells."""
    import docx
    from docx.oxml import parse_xml

    d = docx.Document()
    d.add_heading("Overview", level=1)
    anchor = d.add_paragraph("The anchor paragraph holds a text box.")
    run = anchor.add_run()
    run._r.append(parse_xml(TEXT_BOX))
    table = d.add_table(rows=2, cols=2)
    for r, row in enumerate(table.rows):
        for c, cell in enumerate(row.cells):
            cell.text = f"cell {r}{c}"
    d.add_heading("Details", level=2)
    d.add_paragraph("Closing words.")
    path = tmp_path / "boxed.docx"
    d.save(str(path))

    doc = load_document(path)
    assert doc.text.count("Boxed remark in the margin.") == 1
    ref = docx.Document(str(path))
    body = [p.text for p in ref.paragraphs if p.text.strip()]
    cells = [cell.text for row in ref.tables[0].rows for cell in row.cells]
    for piece in body + cells:
        assert doc.text.count(piece) == 1, piece
    order = ["Overview", "The anchor paragraph", "Boxed remark", "cell 00", "cell 01", "cell 10", "cell 11",
             "Details", "Closing words."]
    at = [doc.text.index(piece) for piece in order]
    assert at == sorted(at), doc.text
    assert doc.locate(doc.text.index("cell 11")) == "section: Overview"
    assert doc.locate(doc.text.index("Closing")) == "section: Details"


def test_html_visible_text_only(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(
        "<!DOCTYPE html><html><head><title>T</title><style>body{x:1}</style><script>alert('no')</script></head>"
        "<body><h1>Heading One</h1><p>Hello &amp; welcome.</p><noscript>enable js</noscript>"
        "<h2>Part Two</h2><p>Bye&nbsp;now.</p></body></html>",
        encoding="utf-8",
    )
    doc = load_document(page)
    assert doc.format == "html"
    assert "Hello & welcome." in doc.text and "Bye now." in doc.text
    assert "alert" not in doc.text and "x:1" not in doc.text and "enable js" not in doc.text
    assert doc.locate(doc.text.index("Bye")) == "section: Part Two"


def test_html_headings_lose_their_permalink_signs():
    """Sphinx, MkDocs and docutils end each heading with an in-page link showing "¶" (or "§",
    "#"): it is no part of the text, nor of the section titles a citation names. In-page links
    with words (a table of contents, a footnote, mdBook's heading links) and a "¶" in prose stay."""
    from triforce_core.documents.html import read_html

    page = ('<html><body><h1><a class="header" href="#intro">Intro</a></h1><p>See <a href="#fn1">1</a> ¶ here.</p>'
            '<h2 id="inst">Installation<a class="headerlink" href="#inst" title="Link to this heading">¶</a></h2>'
            '<p>Modules go in <b>dist-packages</b>.</p>'
            '<h2 id="deps">Dependencies <a href="#deps">§</a></h2><p>Depends on <a href="#inst">Installation</a>.</p>'
            '<h3 id="x">Extra<a class="anchor" href="#x"> # </a></h3><p>Last.</p></body></html>')
    doc = read_html(page)
    assert [s.title for s in doc.sections] == ["Intro", "Installation", "Dependencies", "Extra"]
    lines = [line for line in doc.text.split("\n") if line]
    assert lines == ["Intro", "See 1 ¶ here.", "Installation", "Modules go in dist-packages.", "Dependencies",
                     "Depends on Installation.", "Extra", "Last."]
    assert doc.text[doc.sections[1].start:].startswith("Installation\n")


@pytest.mark.parametrize(
    "encoding, text",
    [
        ("utf-8", "Ünïcödé text — with “quotes” and 日本語.\n" * 20),
        ("latin-1", "Le cœur a ses raisons que la raison ne connaît point. Où est la sérénité ? " * 20),
        ("cp1252", "Smart “quotes” and an em dash — and the euro sign € appear here. " * 20),
        ("utf-16", "Wide characters with a byte-order mark: café, naïve, façade. " * 20),
    ],
)
def test_text_in_any_encoding(tmp_path, encoding, text):
    if encoding == "latin-1":
        text = text.replace("œ", "oe")
    path = tmp_path / "notes.txt"
    path.write_bytes(text.encode(encoding))
    doc = load_document(path)
    assert doc.format == "txt"
    assert doc.text.strip() == text.strip()


def test_markdown_sections_and_line_numbers(tmp_path):
    md = tmp_path / "readme.md"
    md.write_text("# Title\n\nintro\n\n## Usage\n\nrun it\n", encoding="utf-8")
    doc = load_document(md)
    assert doc.format == "md" and doc.locate(doc.text.index("run it")) == "section: Usage"
    txt = tmp_path / "plain.txt"
    txt.write_text("one\ntwo\nthree\n", encoding="utf-8")
    plain = load_document(txt)
    assert plain.locate(plain.text.index("three")) == "line 3"


# --------------------------------------------------------------------------------------
# the bad-input corpus: (builder, expected fragment of the one-line error)
# --------------------------------------------------------------------------------------
def _bad_corpus(tmp: Path) -> dict[str, tuple[Path, str]]:
    good_pdf = make_pdf(tmp / "good.pdf", [PARAGRAPH * 5, PARAGRAPH * 5])
    data = good_pdf.read_bytes()
    corpus = {}

    def put(name, content: bytes, expect: str):
        p = tmp / name
        p.write_bytes(content)
        corpus[name] = (p, expect)

    put("empty.txt", b"", "the file is empty")
    put("binary.txt", bytes(range(256)) * 64, "binary content")
    put("truncated.pdf", data[: len(data) // 3], "malformed or truncated PDF")
    put("garbage.pdf", b"%PDF-1.7\n" + bytes(range(256)) * 40, "PDF")
    corpus["encrypted.pdf"] = (make_pdf(tmp / "encrypted.pdf", ["secret"], user_password="pw", owner_password="own"),
                               "encrypted and needs a password")
    corpus["scanned.pdf"] = (make_pdf(tmp / "scanned.pdf", ["", ""], draw_only=True), "no extractable text")
    # a zip bomb: 60 MB of zeros in one entry
    corpus["bomb.epub"] = (make_epub(tmp / "bomb.epub", [("A", "a")], extra={"OEBPS/huge.bin": b"\0" * 60_000_000}),
                           "over the 50 MB limit")
    corpus["ratio.epub"] = (make_epub(tmp / "ratio.epub", [("A", "a")], extra={"OEBPS/big.bin": b"\0" * 5_000_000}),
                            "a zip bomb?")
    corpus["entries.epub"] = (make_epub(tmp / "entries.epub", [("A", "a")],
                                        extra={f"OEBPS/x{i}.txt": b"x" for i in range(5100)}), "entries, over the limit")
    corpus["entities.docx"] = (rewrite_zip_entry(make_docx(tmp / "base.docx"), tmp / "entities.docx",
                                                 "word/document.xml", BILLION_LAUGHS), "entity declarations are not allowed")
    corpus["entities.epub"] = (make_epub(tmp / "entities.epub", [("A", "a")], container=BILLION_LAUGHS),
                               "entity declarations are not allowed")
    corpus["broken.epub"] = (tmp / "broken.epub", "malformed EPUB")
    (tmp / "broken.epub").write_bytes(make_epub(tmp / "whole.epub", [("A", "text")]).read_bytes()[:300])
    put("renamed.docx", data, "the name says DOCX but the content is a PDF file")
    put("notreally.pdf", b"Just some words in a text file.\n" * 10, "not a PDF file")
    put("program.exe", b"MZ\x90\x00", "unsupported file type '.exe'")
    put("page.pdf", make_docx(tmp / "d.docx").read_bytes(), "the name says PDF but the content is a DOCX file")
    return corpus


BAD_NAMES = [
    "empty.txt", "binary.txt", "truncated.pdf", "garbage.pdf", "encrypted.pdf", "scanned.pdf", "bomb.epub",
    "ratio.epub", "entries.epub", "entities.docx", "entities.epub", "broken.epub", "renamed.docx",
    "notreally.pdf", "program.exe", "page.pdf",
]


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory):
    return _bad_corpus(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input_gives_one_clear_line(bad_corpus, name):
    path, expect = bad_corpus[name]
    t0 = time.monotonic()
    with pytest.raises(DocumentError) as err:
        load_document(path, timeout_s=30)
    message = str(err.value)
    assert expect in message, message
    assert "\n" not in message and len(message) < 300
    assert time.monotonic() - t0 < 30


def test_size_limit_is_checked_before_reading(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"word " * 3000)
    with pytest.raises(DocumentError, match=r"over the 0 MB limit|over the .* MB limit"):
        load_document(path, max_bytes=10_000)


def test_time_limit_stops_a_slow_extraction(tmp_path):
    path = make_pdf(tmp_path / "slow.pdf", [PARAGRAPH * 30] * 5)
    with pytest.raises(DocumentError, match="took longer than"):
        load_document(path, timeout_s=0.001)
    assert not live_children()


def test_memory_limit_turns_a_blow_up_into_an_error(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text(("Grüße aus der Ferne. " * 1000 + "\n") * 1500, encoding="utf-8")  # 33 MB
    with pytest.raises(DocumentError, match="needs too much memory"):
        load_document(path, memory_bytes=100 * 2**20)
    assert len(load_document(path).text) > 30_000_000  # the default limit is ample


def test_bad_inputs_leak_neither_memory_nor_processes(bad_corpus):
    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    for name in BAD_NAMES[:6]:  # warm up imports
        with pytest.raises(DocumentError):
            load_document(bad_corpus[name][0])
    before = rss_mb()
    for _ in range(2):
        for name in BAD_NAMES:
            with pytest.raises(DocumentError):
                load_document(bad_corpus[name][0])
    assert rss_mb() - before < 30, "the app process grew while rejecting bad files"
    assert not live_children()


def test_in_process_extraction_gives_the_same_result(tmp_path):
    path = make_pdf(tmp_path / "same.pdf", ["Alpha page.", "Beta page."])
    assert extract_bytes(path.read_bytes(), "same.pdf", timeout_s=None) == load_document(path)


# --------------------------------------------------------------------------------------
# the command line contract
# --------------------------------------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "triforce_core", "ingest", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120, check=False)


def test_cli_ingest_json(tmp_path):
    path = make_pdf(tmp_path / "two.pdf", ["Hello page one.", "Hello page two."])
    out = _cli(str(path), "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert set(payload) == {"text", "format", "chars", "pages", "sections"}
    assert [s["title"] for s in payload["sections"]] == ["page 1", "page 2"]
    assert payload["format"] == "pdf" and payload["pages"] == 2 and payload["chars"] == len(payload["text"])
    plain = _cli(str(path))
    assert plain.returncode == 0 and "Hello page two." in plain.stdout


def test_cli_ingest_error_is_one_line(bad_corpus):
    path, expect = bad_corpus["encrypted.pdf"]
    out = _cli(str(path))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: {path}: the PDF is encrypted and needs a password"
