"""What the library's source may not say: environment switches of its paths, measured figures.

The arithmetic is chosen once per engine (`models.arithmetic.Arithmetic`): no environment
variable may pick a path or a result, so the only `TRIFORCE_*` names the code reads are the
security and connection settings. And comments and docstrings say what and why: measurements
go stale in code, so they live in docs/results.md and docs/benchmarks.md with their commands.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from tests.helpers import ROOT

SOURCES = [p for wing in ("triforce_core", "ui") for p in sorted((ROOT / wing).rglob("*"))
           if p.suffix in (".py", ".c", ".h")] + [ROOT / "app.py"]
# The settings that may keep an environment form: who may connect, with what key.
ALLOWED_ENV = {"TRIFORCE_API_KEY", "TRIFORCE_ALLOWED_HOSTS", "TRIFORCE_ALLOWED_ORIGINS", "TRIFORCE_ENGINE_KEY"}
ENV_NAME = re.compile(r"\bTRIFORCE_[A-Z0-9_]+\b")
# A measured ratio ("1.23x", "0.90×"), a speed ("45 tok/s", "12 GB/s") or a timing compared
# ("3.1 ms at", "5 ms against").
FIGURE = re.compile(r"\d\.\d+\s?[x×](?![0-9A-Za-z_])|\d\s?tok/s\b|\d\s?[GM]B/s\b|\d\s?ms (?:at|against)\b")


def environment_names(source: str) -> set[str]:
    """The TRIFORCE_* names a Python source mentions outside the allowed ones (C sources name
    only compile-time macros, which no environment sets)."""
    return set(ENV_NAME.findall(source)) - ALLOWED_ENV


def comments(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string of a Python or C source."""
    if path.suffix == ".py":
        out = []
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT or (
                    tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
                out.append((tok.start[0], tok.string))
        return out
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.S)]


def figures(path: Path, source: str) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {m.group()}"
            for line, text in comments(path, source) for m in FIGURE.finditer(text)]


def test_no_environment_variable_picks_a_path():
    found = {str(p.relative_to(ROOT)): names for p in SOURCES
             if p.suffix == ".py" and (names := environment_names(p.read_text()))}
    assert not found, f"environment switches named in the library: {found}"


def test_no_measured_figures_in_comments_or_docstrings():
    found = [f for p in SOURCES for f in figures(p, p.read_text())]
    assert not found, "measured figures belong in docs/results.md or docs/benchmarks.md:\n" + "\n".join(found)


def test_the_checks_see_a_switch_and_a_figure():
    # negative controls: what the two tests above look for is found where it stands
    assert environment_names('mode = os.environ.get("TRIFORCE_INT8", "0")  # TRIFORCE_API_KEY is fine') == {
        "TRIFORCE_INT8"}
    python = ROOT / "x.py"
    source = 'def f():\n    """A step 1.23x faster, 45 tok/s."""\n    return 1  # 3.1 ms at 8K\nS = "2.0x"\n'
    assert len(figures(python, source)) == 3  # the docstring's two and the comment's; a plain string is code
    assert len(figures(ROOT / "x.c", "/* 0.90× as long */ int x; // 21 GB/s\n")) == 2
    assert figures(python, '"""Chunks of 8 tokens, 16 x 16 tiles, Q4_K."""\n') == []
