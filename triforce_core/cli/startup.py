"""A process's start: the heavy libraries imported with the cyclic garbage collector paused.

Importing torch, transformers and the engine makes some 300,000 Python objects that live as long
as the process. While they are made, the collector's full passes walk all of them again and
again and find nothing to free, and more passes run while a model's config and tokenizer import
~700 modules. So the entry points pause it for their imports and their engine's load (the app
also while it builds itself around its started model), then freeze the survivors (`gc.freeze`:
later passes leave them out, so a pass during a chat stays short); what that saves is in
docs/results.md, "How long a start takes". A server's later loads (the app's picker, a
request's `model`) are paused without the freeze: the registry lets go of them. Only the entry
points pause it: a program that imports the library keeps its collector as it set it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(freeze: bool = True) -> Iterator[None]:
    """The block runs without the cyclic collector's passes; what exists when it ends is frozen
    (left out of later passes) and the collector runs again. With `freeze=False` nothing is
    frozen: for what the process may let go of later (a server's models beyond the started one,
    which the registry frees with `gc.collect`, and frozen objects are never collected). A
    collector the caller had turned off (or a pause already running, in any thread) stays as
    it is and nothing is frozen."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()
