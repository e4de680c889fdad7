"""`ingest`: a document's extracted text, or with --json its text and sections. Needs no torch."""

from __future__ import annotations

import json
import sys

from .flags import UsageError


def add_parser(sub) -> None:
    """The `ingest` subcommand and its flags."""
    i = sub.add_parser(
        "ingest",
        help="extract the text of a document (txt, md, html, pdf, epub, docx)",
        description=(
            "Extract the text of a document: .txt/.md (any encoding), .html (visible text), .pdf "
            "(page by page), .epub (spine order), .docx. The content is checked against the "
            "extension, archives are read with size caps, and extraction runs in a separate "
            "process with a time limit. Its sections (HTML: its own table of contents, a nav or nested "
            "list of links, or mdBook's toc.html beside the page, else headings; Markdown: headings; EPUB: the "
            "table of contents, else the spine; PDF: the outline, else the pages; DOCX: Title/Heading styles) "
            "come with --json."
        ),
        epilog="On failure: exit code 2 and one line `error: FILE: reason` on stderr.",
    )
    i.add_argument("file", metavar="FILE")
    i.add_argument("--json", action="store_true",
                   help='print {"text", "format", "chars", "pages", "sections": [{"title", "level", "start", "end"}]} '
                   "as JSON (sections numbered from 1 in this order for chat --sections; start/end: character "
                   "offsets into text, a section including its subsections)")
    i.add_argument("--max-mb", type=float, default=50.0, help="largest file accepted, in MB (default 50)")
    i.add_argument("--timeout", type=float, default=60.0, help="time limit for extraction in seconds (default 60)")


def cmd_ingest(args) -> int:
    from ..documents import DocumentError, load_document

    if args.max_mb <= 0 or args.timeout <= 0:
        raise UsageError("--max-mb and --timeout must be positive")
    try:
        doc = load_document(args.file, max_bytes=int(args.max_mb * 1_000_000), timeout_s=args.timeout,
                            companion_toc=True)
    except DocumentError as e:
        raise UsageError(f"{args.file}: {e}") from None
    if args.json:
        print(json.dumps(doc.as_json(), ensure_ascii=False))
    else:
        sys.stdout.write(doc.text if doc.text.endswith("\n") else doc.text + "\n")
    return 0
