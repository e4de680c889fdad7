"""The command line in tests: its main() run in-process, and caches small enough for the tiny models."""

from __future__ import annotations

import contextlib

# Small caches for the tiny models on the command line (their context window is 1024 tokens).
SMALL_CACHE_FLAGS = ["--budget", "32", "--chunk-size", "4", "--draft-window", "16", "--device", "cpu"]


def run_main(argv):
    """The command line's main(argv) in-process -> (exit code, stdout, stderr)."""
    import io

    from triforce_core.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()

