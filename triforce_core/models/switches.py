"""Environment switches ("NAME=0" turns a fast path off, "NAME=1" an opt-in one on; "off",
"false" and "no" read as "0"), set for the length of a block.

The native kernels (`native_build.Loader`) and the huge pages (`huge_pages`) each read one; the
benchmarks turn them on and off inside one process to compare both sides.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


OFF = ("0", "off", "false", "no")


def is_on(name: str, default: bool = True) -> bool:
    """Whether switch `name` is on (anything but "0", "off", "false" or "no", in any case and
    spacing; `default` when unset)."""
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in OFF


@contextmanager
def switched(name: str, on: bool | str):
    """Switch `name` on or off inside the block (or to a value a switch reads, as a string), as it
    was after it."""
    before = os.environ.get(name)
    os.environ[name] = on if isinstance(on, str) else "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
