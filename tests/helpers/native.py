"""The native libraries in tests: whether they can be built here, and that they were."""

from __future__ import annotations

import shutil

import pytest

# The native libraries (`native_attention`, `native_layers`) are compiled at first use: their
# tests need a C compiler, and fail, saying where to look, when one is there but the build failed.
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the native libraries cannot be built here")


def built(library):
    """`library.kernel()`, which must have built and loaded."""
    k = library.kernel()
    assert k is not None, f"{library.__name__} did not build (see the warning logged)"
    return k
