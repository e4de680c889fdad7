#!/usr/bin/env python3
"""Write the app's bundled sample document: the "Classes" chapter of the Python tutorial.

The chapter comes from the reStructuredText sources in Debian's python3.11-doc package,
turned into plain text the same way as the training text. The tutorial is held out of the
demo models' training data, so answers about it come from the document, not from memory.

    python scripts/make_sample_document.py [--out assets/sample/python-tutorial-classes.txt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "tutorial/classes.rst.txt"
HEADER = (
    "The Python Tutorial, chapter 9: Classes\n"
    "From the Python 3.11 documentation. Copyright (c) 2001-2023 Python Software Foundation;\n"
    "distributed under the PSF License Version 2 (see assets/sample/README.md).\n\n"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "sample" / "python-tutorial-classes.txt")
    a = p.parse_args(argv)
    root = demo_corpus.ensure_docs()
    text = demo_corpus.rst_to_text((root / CHAPTER).read_text(encoding="utf-8"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(HEADER + text, encoding="utf-8")
    print(f"wrote {a.out} ({len(HEADER + text)} characters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
