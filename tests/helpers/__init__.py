"""What several test files share: plain functions and classes, one module per subject
(fixtures live in tests/conftest.py). Test modules import these, never each other."""
