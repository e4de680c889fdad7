"""Small documents built in tests: PDF pages (fpdf2) and EPUB books (zipped by hand)."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_pdf(path: Path, pages: list[str], user_password: str | None = None, owner_password: str | None = None,
             draw_only: bool = False) -> Path:
    """A PDF of `pages` (their text), encrypted when `owner_password` is given; `draw_only`: marks, no text."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    for text in pages:
        pdf.add_page()
        if draw_only:
            pdf.rect(20, 20, 120, 80, style="F")  # a "scan": marks, no text layer
        else:
            pdf.multi_cell(0, 6, text)
    if owner_password is not None:
        pdf.set_encryption(owner_password=owner_password, user_password=user_password or "")
    pdf.output(str(path))
    return path


def make_epub(path: Path, chapters: list[tuple[str, str]], spine_order: list[int] | None = None,
              extra: dict[str, bytes] | None = None, container: bytes | None = None,
              nav: str | None = None, ncx: str | None = None) -> Path:
    """A minimal EPUB 3: chapters as (title, body HTML) in files text/ch{i}.xhtml, read in
    spine_order; `nav` (an EPUB 3 navigation document, at nav/toc.xhtml) and `ncx` (an EPUB 2
    NCX, at toc.ncx) are the book's table of contents when given."""
    order = spine_order if spine_order is not None else list(range(len(chapters)))
    manifest = "".join(f'<item id="c{i}" href="text/ch{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(chapters)))
    manifest += '<item id="nav" href="nav/toc.xhtml" properties="nav" media-type="application/xhtml+xml"/>' if nav else ""
    manifest += '<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>' if ncx else ""
    spine = "".join(f'<itemref idref="c{i}"/>' for i in order)
    spine_toc = ' toc="ncx"' if ncx else ""
    opf = (
        '<?xml version="1.0" encoding="utf-8"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
        f'<metadata/><manifest>{manifest}</manifest><spine{spine_toc}>{spine}</spine></package>'
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            container
            or b'<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
            b'<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            b"</rootfiles></container>",
        )
        z.writestr("OEBPS/content.opf", opf)
        for i, (title, body) in enumerate(chapters):
            z.writestr(
                f"OEBPS/text/ch{i}.xhtml",
                f'<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml"><head>'
                f"<title>{title}</title><style>p {{ color: red }}</style></head><body><h1>{title}</h1>"
                f"<p>{body}</p><script>var hidden = 1;</script></body></html>",
            )
        for name, data in (("OEBPS/nav/toc.xhtml", nav), ("OEBPS/toc.ncx", ncx)):
            if data:
                z.writestr(name, data)
        for name, data in (extra or {}).items():
            z.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)
    return path
