"""Offline English text for the embedded demo models, and the synthetic copy tasks.

Sources (both under the Python Software Foundation License, see assets/models/README.md):

* the reStructuredText sources of the Python 3.11 documentation, from Debian's
  ``python3.11-doc`` package (``/usr/share/doc/python3.11/html/_sources``), turned into plain
  text by :func:`rst_to_text`;
* the docstrings of this interpreter's standard library, read with :mod:`ast` (no import).

The tutorial and the FAQ are held out: they are never trained on, and provide the held-out
evaluation text and the app's sample document.
"""

from __future__ import annotations

import ast
import inspect
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
HELD_OUT_DIRS = ("tutorial", "faq")
DEBIAN_PACKAGE = "python3.11-doc"

# --------------------------------------------------------------------------------------
# reStructuredText -> plain text
# --------------------------------------------------------------------------------------
_ROLE = re.compile(r":[a-zA-Z:+-]+:`([^`]*)`")
_LITERAL = re.compile(r"``([^`]+)``")
_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`_{1,2}")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`_])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([a-zA-Z0-9_:-]+)::\s*(.*)$")
_DROP_BLOCK = {"index", "toctree", "highlight", "sectionauthor", "moduleauthor", "testsetup",
               "testcleanup", "raw", "only", "include", "tabularcolumns", "productionlist",
               "impl-detail", "audit-event", "availability", "seealso", "currentmodule"}
_LABELS = {"note": "Note:", "warning": "Warning:", "versionadded": "New in version",
           "versionchanged": "Changed in version", "deprecated": "Deprecated since version",
           "attention": "Attention:", "important": "Important:", "tip": "Tip:"}


def _role_text(match: re.Match) -> str:
    inner = match.group(1).strip()
    m = re.match(r"^(.*?)\s*<[^>]*>$", inner)
    if m and m.group(1):
        inner = m.group(1)
    inner = inner.lstrip("!")
    if inner.startswith("~"):
        inner = inner[1:].rsplit(".", 1)[-1]
    return inner


def rst_to_text(source: str) -> str:
    """Strip reStructuredText markup, keeping prose, code examples and directive arguments."""
    out: list[str] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _DIRECTIVE.match(line)
        if m:
            indent, name, arg = m.group(1), m.group(2).lower(), m.group(3).strip()
            if name in _DROP_BLOCK:
                i += 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
                    if not lines[i].strip() and i + 1 < len(lines) and lines[i + 1].strip() and \
                            len(lines[i + 1]) - len(lines[i + 1].lstrip()) <= len(indent):
                        break
                    i += 1
                continue
            label = _LABELS.get(name)
            text = f"{label} {arg}".strip() if label else arg
            if text:
                out.append(indent + text)
            i += 1
            continue
        stripped = line.strip()
        if stripped.startswith(".. ") or stripped == "..":  # comments and link targets
            i += 1
            while i < len(lines) and lines[i].startswith("   ") and stripped != "..":
                i += 1
            continue
        if _UNDERLINE.match(line):
            i += 1
            continue
        if stripped.startswith(":") and re.match(r"^:[a-zA-Z -]+:", stripped) and not _ROLE.match(stripped):
            i += 1  # field lists such as :synopsis: or :platform:
            continue
        text = _ROLE.sub(_role_text, line)
        text = _LITERAL.sub(r"\1", text)
        text = _LINK.sub(r"\1", text)
        text = _STRONG.sub(r"\1", text)
        if text.rstrip().endswith("::"):
            text = text.rstrip()[:-1]
            if not text.strip(" :"):
                i += 1
                continue
        out.append(text.rstrip())
        i += 1
    joined = "\n".join(out)
    joined = re.sub(r"\n{3,}", "\n\n", joined)
    return joined.strip() + "\n"


# --------------------------------------------------------------------------------------
# collection
# --------------------------------------------------------------------------------------
def ensure_docs() -> Path:
    """Make sure the Python documentation sources are on disk, installing the Debian package if we may."""
    if DOC_ROOT.is_dir():
        return DOC_ROOT
    if shutil.which("apt-get") and hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0:
        print(f"installing Debian package {DEBIAN_PACKAGE} ...", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", DEBIAN_PACKAGE], check=False)
    if not DOC_ROOT.is_dir():
        raise SystemExit(
            f"error: {DOC_ROOT} not found; install the Debian package {DEBIAN_PACKAGE} "
            "(apt-get install python3.11-doc) and run again"
        )
    return DOC_ROOT


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def doc_documents(root: Path) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents from the documentation sources, in a fixed order."""
    train, held = [], []
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        text = rst_to_text(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) < 200:
            continue
        (held if rel.split("/")[0] in HELD_OUT_DIRS else train).append(Document(rel, text))
    return train, held


def docstring_documents() -> list[Document]:
    """Module, class and function docstrings of the standard library, one document per module."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith(("test/", "idlelib/idle_test", "lib2to3/tests", "site-packages/")) or "/test" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 40:
                    head = "" if isinstance(node, ast.Module) else f"{node.name}\n"
                    parts.append(head + inspect.cleandoc(doc))
        if parts:
            docs.append(Document("stdlib/" + rel, "\n\n".join(dict.fromkeys(parts)) + "\n"))
    return docs


def build_corpus() -> tuple[list[Document], list[Document]]:
    root = ensure_docs()
    train, held = doc_documents(root)
    return train + docstring_documents(), held


def save_corpus(path: Path, train: list[Document], held: list[Document]) -> None:
    """Write the corpus to one gzipped JSON-lines file (a few MB), so that training can run
    where neither the Debian package nor this interpreter's standard library is at hand
    (a lent GPU machine) on exactly the same text."""
    import gzip
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for held_out, docs in ((False, train), (True, held)):
            for d in docs:
                f.write(json.dumps({"name": d.name, "held_out": held_out, "text": d.text}, ensure_ascii=False) + "\n")


def load_corpus(path: Path) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents from a file written by save_corpus, in the saved order."""
    import gzip
    import json

    train, held = [], []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for k, line in enumerate(f, 1):
                row = json.loads(line)
                if not (isinstance(row, dict) and isinstance(row.get("name"), str) and isinstance(row.get("text"), str)):
                    raise ValueError(f"line {k}: expected an object with a name and a text")
                (held if row.get("held_out") else train).append(Document(row["name"], row["text"]))
    except (OSError, EOFError, ValueError) as e:
        raise SystemExit(f"error: {path} is not a corpus file written by --export-corpus ({e})") from None
    if not train:
        raise SystemExit(f"error: {path} holds no training documents")
    return train, held


# --------------------------------------------------------------------------------------
# copy tasks
# --------------------------------------------------------------------------------------
QUESTIONS = (
    "What follows «{q}»?",
    "What comes after «{q}»?",
    "Quote the passage that follows «{q}».",
    "Continue the text after «{q}».",
)


def copy_answer(quote: str, continuation: str) -> str:
    """The answer to a copy question: the passage quoted from the phrase on.

    The answer repeats the phrase before continuing. Repeating it is a short copy from the
    question; the continuation is then an ordinary induction step (the last tokens written
    recur in the document, and what followed them there comes next). Without the repeat the
    first answer token needs a two-step lookup (question -> phrase -> document), which the
    4 x 256 target got right in 6 of 20 trials at 16K tokens against 18 of 20 with it.
    """
    return quote + continuation


def word_spans(text: str) -> list[int]:
    """Offsets where a word begins right after whitespace (byte-level BPE never merges across them)."""
    return [m.start() for m in re.finditer(r"(?<=\s)\S", text)]


def pick_passage(text: str, rng: random.Random, quote_words=(5, 9), answer_chars=(120, 220),
                 lo: int = 0, hi: int | None = None):
    """A quoted phrase and the passage following it, both cut at word starts.

    Returns (quote, continuation) where the continuation starts with the whitespace that
    follows the quote, exactly as in the text, or None when no unique phrase was found.
    """
    starts = word_spans(text)
    hi = len(text) if hi is None else hi
    candidates = [s for s in starts if lo <= s < hi]
    for _ in range(20):
        if len(candidates) < 2:
            return None
        k = rng.randrange(len(candidates))
        a = candidates[k]
        i = starts.index(a)
        n = rng.randint(*quote_words)
        if i + n >= len(starts):
            continue
        b_word = starts[i + n]
        quote = text[a:b_word].rstrip()
        b = a + len(quote)
        if "\n\n" in quote or "«" in quote or "»" in quote or len(quote) < 12:
            continue
        if text.count(quote) != 1:
            continue
        end = b + rng.randint(*answer_chars)
        later = [s for s in starts if s >= end]
        c = later[0] if later else len(text)
        cont = text[b:c].rstrip()
        if len(cont.strip()) < 40:
            continue
        return quote, cont
    return None


def ambiguity(text: str, quote: str, continuation: str, context_chars: int = 8) -> int:
    """How many places in a passage a short-suffix copier could go wrong at.

    Counts the word starts from the end of the quote through the continuation whose
    preceding `context_chars` characters (two or three tokens) occur elsewhere in `text` too.
    At such a place the last few tokens written do not say where in the document the copy
    is: a copier that matches only them may jump to the other occurrence. These were every
    one of the 16K-token copy failures of the 4 x 256 target (12 of 800 tokens, teacher-forced).
    """
    a = text.index(quote)
    b = a + len(quote)
    end = b + len(continuation)
    places = [b] + [b + s for s in word_spans(text[b:end]) if s > 0]
    count = 0
    for s in places:
        key = text[max(a, s - context_chars):s]
        if len(key) == context_chars and text.count(key) > 1:
            count += 1
    return count


def pick_hard_passage(text: str, rng: random.Random, candidates: int, **kw):
    """Of `candidates` passages picked by :func:`pick_passage`, the one a short-suffix copier
    finds hardest (:func:`ambiguity`), ties to the first. One candidate: a plain pick."""
    if candidates <= 1:
        return pick_passage(text, rng, **kw)
    best, best_score = None, -1
    for _ in range(candidates):
        picked = pick_passage(text, rng, **kw)
        if picked is None:
            continue
        score = ambiguity(text, *picked)
        if score > best_score:
            best, best_score = picked, score
    return best


def insert_distractors(text: str, picks: list[tuple[str, str]], rng: random.Random, share: float,
                       tail_words=(2, 4), insert_chars=(40, 120)) -> str:
    """The document with decoys for a share of the copy questions `picks` ((quote, continuation)).

    A decoy is the quote's last 2-4 words followed by other text of the document, inserted at
    a line start outside every picked passage. After writing the quote, the last tokens then
    occur twice in the document, and only the whole phrase says which place the passage
    continues from: a copier that matches short suffixes fails there, which is how the
    4 x 256 target missed at 16K tokens. Quotes stay unique: a decoy never holds a whole quote.
    """
    original = text
    spans = []
    for quote, cont in picks:
        a = text.index(quote)
        spans.append((a, a + len(quote) + len(cont)))
    # line starts outside every picked passage (where decoys go), and word starts (where filler comes from)
    lines = [m.start() + 1 for m in re.finditer(r"\n(?=\S)", text)]
    lines = [p for p in lines if not any(a <= p <= b for a, b in spans)]
    words = word_spans(text)
    if not lines or len(words) < 2:
        return text
    inserts = []
    for quote, _ in picks:
        if rng.random() >= share:
            continue
        starts = [0] + word_spans(quote)
        k = rng.randint(*tail_words)
        if len(starts) <= k:
            continue
        tail = quote[starts[-k]:]
        at = rng.choice(lines)
        s = rng.choice(words)
        filler = text[s:s + rng.randint(*insert_chars)]
        filler = filler[: filler.rfind(" ")] if " " in filler else filler
        decoy = f"{tail} {filler.strip()}\n"
        if any(q in decoy for q, _ in picks) or "\n\n" in decoy[:-1]:
            continue
        inserts.append((at, decoy))
    for at, decoy in sorted(inserts, reverse=True):
        text = text[:at] + decoy + text[at:]
    if any(text.count(quote) != 1 for quote, _ in picks):
        return original  # a decoy made a quote ambiguous after all (very rare): no decoys
    return text
