"""The package's layout is its architecture: imports flow one way through the wings.

    ui, cli -> serving -> documents -> engine -> decoding -> kv -> models -> base modules

Each test reads every import of every module (at the top or inside a function) with `ast`,
so a lazy import that runs back up counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "triforce_core"
BASE = ("config", "prompting", "detokenize", "resources")
# lowest first; a module may import its own wing and any wing below it
RANKS = {**{name: 0 for name in BASE}, "models": 1, "kv": 2, "decoding": 3, "engine": 4, "documents": 5,
         "serving": 6, "cli": 7}
TOP_FILES = {"__init__", "__main__", "engine", *BASE}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, text: str | None = None) -> set[str]:
    """Absolute names of the triforce_core modules (or packages) that `path` imports (its
    source, or `text` read as if it were at `path`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    source = path.read_text(encoding="utf-8") if text is None else text
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("triforce_core")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("triforce_core"):
                continue
            for alias in node.names:  # `from . import x` names a module when x is one
                sub = f"{target}.{alias.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (ROOT / sub.replace(".", "/") / "__init__.py").exists()
                found.add(sub if is_module else target)
    return found


def wing(module: str) -> str | None:
    """The wing of a module: its first name under triforce_core (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_top_holds_only_the_facade_and_the_base_modules():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == TOP_FILES, f"modules outside a wing: {sorted(top - TOP_FILES)}"
    wings = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert wings == {w for w, r in RANKS.items() if r > 0 and w != "engine"}


def upward(path: Path, text: str | None = None) -> list[str]:
    """The imports of `path` that run back up (to a wing above its own)."""
    source = module_name(path)
    if wing(source) in (None, "__main__"):
        return []  # the package's lazy exports and `python -m` sit above every wing
    found = []
    for target in imports(path, text):
        if wing(target) is None:
            found.append(f"{source} -> {target} (the package itself)")
        elif RANKS[wing(target)] > RANKS[wing(source)]:
            found.append(f"{source} -> {target}")
        elif RANKS[wing(target)] == RANKS[wing(source)] == 0 and wing(target) != wing(source):
            found.append(f"{source} -> {target} (base modules import nothing of the package)")
    return found


def test_no_wing_imports_one_above_it():
    found = [line for path in modules() for line in upward(path)]
    assert not found, "imports that run back up:\n" + "\n".join(sorted(found))


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges`, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles_between_modules():
    graph = {module_name(p): {t for t in imports(p) if t != module_name(p)} for p in modules()}
    packages = {module_name(p) for p in modules() if p.name == "__init__.py"}
    # a package's __init__ re-exports its modules: an import of the package is not followed
    # into them, or every module importing a sibling package would close a loop through it
    edges = {m: {t for t in ts if t in graph and t not in packages} for m, ts in graph.items()}
    cycle = cycle_in(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_an_upward_import_and_a_cycle():
    """Negative controls: the same checks on a module of `models` that imports the decoding
    loop, lazily inside a function, and on a two-module loop."""
    probe = PACKAGE / "models" / "transformer.py"
    lazy = "def f():\n    from ..decoding.loop import make_generator\n"
    assert upward(probe, lazy) == ["triforce_core.models.transformer -> triforce_core.decoding.loop"]
    assert upward(probe, "from ..config import GB\nfrom . import quantized\n") == []
    assert upward(PACKAGE / "config.py", "from .models import loading\n")  # a base module reaching up
    assert cycle_in({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


TESTS = ROOT / "tests"


def imports_of_tests(text: str) -> list[str]:
    """The test modules (and conftest) that a test file's source `text` imports, at the top or inside a function."""
    tests = {p.stem for p in TESTS.glob("test_*.py")} | {"conftest"}
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # `from .test_x import y`
            names = [node.module or ""]
        else:
            continue
        found += [n for n in names if n.removeprefix("tests.") in tests]
    return found


def test_no_test_module_imports_another():
    """Tests stand alone: what several test files share lives in tests/conftest.py (fixtures) or
    tests/helpers (plain functions, by subject); no test file or helper imports a test module or
    conftest. Negative control: the check sees such imports."""
    files = sorted([*TESTS.glob("*.py"), *(TESTS / "helpers").glob("*.py")])
    found = {p.name: hits for p in files if (hits := imports_of_tests(p.read_text(encoding="utf-8")))}
    assert not found, f"imports of test modules: {found}"
    probe = "def f():\n    from test_layout import TESTS\nimport tests.test_layout\nfrom conftest import x\n"
    assert sorted(imports_of_tests(probe)) == ["conftest", "test_layout", "tests.test_layout"]
