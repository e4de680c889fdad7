"""A GGUF file's header settings (its key-value metadata), read without the weights or the vocabulary.

    settings = header_settings(path)   # {"general.architecture": "qwen3moe", "qwen3moe.expert_count": 128, ...}
    settings[VOCABULARY]               # the token list's digest: files that share it can draft for each other

The model picker asks every file in the model folders what it is (`families.refusal`) before
anyone opens it: ggml's `GGUFReader` would parse the whole header, tens of thousands of token
strings and every tensor's entry, into numpy objects. This walks the key-value section only,
keeps the scalar values (numbers, strings, booleans) and steps over the arrays (the token list,
the merges) without keeping them; the tensor entries and the weights after them are never read.
The file is mapped read-only, so only the header's pages are touched.

A file comes from anywhere: every length is checked against the bytes left, and a header that
runs past the file's end, declares an unknown type or more entries than any model has is
`HeaderError` (one line). No torch, no numpy.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
MAX_ENTRIES = 1 << 16  # key-value entries; a model's header has a few dozen
MAX_KEY = 1 << 16  # bytes in one key
# Strings in one array: a vocabulary's tokens or merges (a few hundred thousand; the vocabulary's
# bound, `spec.LIMITS`, is 1 << 20). A lying count past it would walk a file's weights as strings.
MAX_STRINGS = 1 << 22
# GGUF's value types: (struct format, size) of the fixed-size ones; 8 is a string, 9 an array.
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
           7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9
TOKENS = "tokenizer.ggml.tokens"
# A settings key of ours, not the file's: the sha-256 of the token list's bytes as stored (its
# count, then each token's length and bytes), so two files with the same tokens and ids match.
VOCABULARY = "tokenizer.ggml.tokens#sha256"


class HeaderError(ValueError):
    """The header cannot be read (one line)."""


class _Cursor:
    def __init__(self, data, order: str):
        self.data, self.at, self.order = data, 0, order

    def take(self, fmt: str, size: int):
        if self.at + size > len(self.data):
            raise HeaderError("the header runs past the end of the file")
        value = struct.unpack_from(self.order + fmt, self.data, self.at)[0]
        self.at += size
        return value

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise HeaderError("the header runs past the end of the file")
        self.at += size

    def string(self, limit: int | None = None) -> str:
        n = self.take("Q", 8)
        if limit is not None and n > limit:
            raise HeaderError(f"a key of {n:,} bytes")
        self.skip(n)
        return bytes(self.data[self.at - n:self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        """A value of GGUF type `kind`; an array is stepped over (None)."""
        if kind in SCALARS:
            return self.take(*SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("I", 4), self.take("Q", 8)
            if inner in SCALARS:
                self.skip(count * SCALARS[inner][1])
            elif inner == STRING:
                if count > min(MAX_STRINGS, (len(self.data) - self.at) // 8):  # each takes 8 bytes at least
                    raise HeaderError(f"an array of {count:,} strings")
                for _ in range(count):
                    self.skip(self.take("Q", 8))
            else:  # arrays of arrays: no model's header has them
                raise HeaderError(f"an array of type {inner}")
            return None
        raise HeaderError(f"unknown value type {kind}")


def header_settings(path: str | Path) -> dict[str, object]:
    """The scalar key-value entries of the GGUF file at `path` (arrays left out); HeaderError
    when it is not a GGUF file or its header is damaged, OSError when it cannot be read."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise HeaderError("not a GGUF file")
        f.seek(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _settings(data)


def _settings(data) -> dict[str, object]:
    version = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else 0
    order = "<" if version < 1 << 16 else ">"  # a big-endian file's version reads byte-swapped
    cur = _Cursor(data, order)
    cur.skip(4)
    version = cur.take("I", 4)
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version}, not 2 or 3")
    cur.take("Q", 8)  # the tensors' count: their entries follow the key-value section, unread
    entries = cur.take("Q", 8)
    if entries > MAX_ENTRIES:
        raise HeaderError(f"{entries:,} key-value entries, over {MAX_ENTRIES:,}")
    out: dict[str, object] = {}
    for _ in range(entries):
        key = cur.string(MAX_KEY)
        start = cur.at
        value = cur.value(cur.take("I", 4))
        if value is not None:
            out[key] = value
        elif key == TOKENS:
            out[VOCABULARY] = hashlib.sha256(data[start:cur.at]).hexdigest()
    return out
