"""What several test files share: plain functions and classes, one module per subject
(fixtures live in tests/conftest.py). Test modules import these, never each other."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
