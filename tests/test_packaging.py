"""pyproject.toml: `pip install .` ships every package and the assets the installed code reads.

The install itself is checked by hand (README, Install); these checks are cheap and need none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def test_every_package_is_listed():
    """A new subpackage of triforce_core or ui must be added to pyproject.toml, or the wheel lacks it."""
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("triforce_core", "ui")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk <= set(SETUPTOOLS["packages"])
    for package in SETUPTOOLS["packages"]:
        folder = SETUPTOOLS.get("package-dir", {}).get(package, package.replace(".", "/"))
        assert (ROOT / folder).is_dir(), f"{package}: {folder} does not exist"


def test_the_assets_the_code_reads_are_package_data():
    from triforce_core import resources

    assert resources.ASSETS == ROOT / "assets"  # a checkout reads its own assets/
    patterns = SETUPTOOLS["package-data"]["triforce_core.assets"]
    shipped = {p for pattern in patterns for p in resources.ASSETS.glob(pattern) if p.is_file()}
    needed = [resources.APP_CSS, resources.SAMPLE_DOCUMENT, resources.SAMPLE_DIR / "python-tutorial-data-structures-modules.txt",
              *(resources.DEMO_MODELS / "target").iterdir(), *(resources.DEMO_MODELS / "draft").iterdir()]
    assert set(needed) <= shipped


def test_the_native_kernels_source_is_package_data():
    from triforce_core.models import native_attention

    models = ROOT / "triforce_core" / "models"
    shipped = {p for pattern in SETUPTOOLS["package-data"]["triforce_core.models"] for p in models.glob(pattern)}
    assert native_attention.SOURCE in shipped


def test_console_scripts_point_at_functions_that_exist():
    import importlib

    for name, target in PYPROJECT["project"]["scripts"].items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_no_import_path_edits():
    """The package, the app, the scripts, the benchmarks and the tests import by package names only."""
    out = subprocess.run(
        ["git", "grep", "-n", "sys" + ".path", "--", "*.py"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode not in (0, 1):  # not a git checkout
        pytest.skip(out.stderr.strip())
    assert out.stdout == ""


def test_the_extraction_process_finds_the_package_from_any_directory(tmp_path):
    """Documents are extracted in a child interpreter, which must import this copy of triforce_core
    even when the caller found it through its working directory and has since left it."""
    code = (
        "from triforce_core.documents import extract_bytes; import os; "
        f"os.chdir({str(tmp_path)!r}); "
        "print(extract_bytes(b'hello world', 'a.txt', timeout_s=60).text)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello world"
