"""Write the app's bundled sample document: the "Classes" chapter of the Python tutorial.

The chapter comes from the reStructuredText sources in Debian's python3.11-doc package,
turned into plain text the same way as the training text. The tutorial is held out of the
demo models' training data, so answers about it come from the document, not from memory.

    python -m scripts.make_sample_document [--out assets/sample/python-tutorial-classes.txt]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import demo_corpus

ROOT = Path(__file__).resolve().parent.parent
HEADER = (
    "The Python Tutorial, chapter 9: Classes\n"
    "From the Python 3.11 documentation. Copyright (c) 2001-2023 Python Software Foundation;\n"
    "distributed under the PSF License Version 2 (see assets/sample/README.md).\n\n"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "sample" / "python-tutorial-classes.txt")
    p.add_argument("--chapters", nargs="+", default=["classes"],
                   help="tutorial chapters to concatenate (default: classes), e.g. classes controlflow")
    p.add_argument("--max-chars", type=int, default=None, help="cut the text at a paragraph before this many characters")
    a = p.parse_args(argv)
    root = demo_corpus.ensure_docs()
    parts = []
    for chapter in a.chapters:
        path = root / "tutorial" / f"{chapter}.rst.txt"
        if not path.is_file():
            raise SystemExit(f"error: no tutorial chapter {chapter!r} ({path})")
        parts.append(demo_corpus.rst_to_text(path.read_text(encoding="utf-8")))
    text = "\n".join(parts)
    if a.max_chars is not None and len(text) > a.max_chars:
        text = text[: text.rfind("\n\n", 0, a.max_chars)] + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    header = HEADER if a.chapters == ["classes"] else HEADER.replace("chapter 9: Classes", "chapters: " + ", ".join(a.chapters))
    a.out.write_text(header + text, encoding="utf-8")
    print(f"wrote {a.out} ({len(header + text)} characters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
