"""Where the bundled files are: the embedded demo models, the sample documents, the app's CSS and script.

They live in `assets/` at the root of the repository. `pip install .` ships the same folder
inside the package, as `triforce_core/assets` (pyproject.toml maps it), so one lookup serves
both: the package's own copy when installed, else the checkout's.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _assets() -> Path:
    installed = _PACKAGE / "assets"  # package data of an installed wheel
    return installed if installed.is_dir() else _PACKAGE.parent / "assets"  # a checkout


ASSETS = _assets()
DEMO_MODELS = ASSETS / "models"  # target/ and draft/: see assets/models/README.md
SAMPLE_DIR = ASSETS / "sample"
SAMPLE_DOCUMENT = SAMPLE_DIR / "python-tutorial-classes.txt"  # the app's and the bench's default document
APP_CSS = ASSETS / "app.css"
APP_JS = ASSETS / "app.js"  # the page's script: a click on a token opens the inspector
