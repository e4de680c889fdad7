"""The target's prefilled K/V kept on disk, in blocks keyed by the exact tokens before them.

    disk = DiskCache(folder, model_key=model_fingerprint(target))
    blocks = disk.blocks(tokens, 1024, full_cache.dtype)  # a key per whole 1024-token block of `tokens`
    n = disk.load(full_cache, blocks, first, end) # tokens read back (stops at a miss or a bad file)
    disk.save(full_cache, blocks[j])              # after block j was computed

A block is one prefill chunk (`CacheConfig.prefill_chunk`; the size is part of the key). Why
blocks and not whole prompts: a document-chat prompt is template + document + question,
so no two prompts are equal, but they share their beginning. Where the caller says where the
document ends (a chat session does), the prefill ends a chunk there too, and that last part
of the document is kept as a tail block (`tail`): the next question after the same document
then runs only its own tokens, not the document's last partial chunk as well. Block j's key hashes the model's
key (its weights, or its file's content), the K/V dtype, the arithmetic the forward runs
(`models.arithmetic`: native kernels or PyTorch's, float or integer products, the processor's
vector instructions, the PyTorch release) and every token of blocks 0..j (a chain), so any
prompt that starts with the same tokens finds the same blocks, whoever wrote them (the app,
`chat`, the HTTP API, another process), and a cache of one K/V dtype or one arithmetic never
finds another's: a float16 prefill is not a float32 one rounded (each layer attended to rounded
K/V), and a kernel that sums in another order gives other bits, so neither could stand for the
other.
A file also names its dtype, and one whose dtype is not the cache's is refused (deleted).

Exactness: a block is written only when it was computed by one prefill forward over exactly
its span, after blocks that were themselves computed (or read) that way (`FullCache.canonical`).
Reading blocks back therefore reproduces, bit for bit, the cache a fresh prefill builds.

A file: a fixed header (magic, version, lengths), a JSON description (key, shape, dtype),
the block's token ids (int32) and its keys and values as the cache holds them
(`FullCache.span`: an int16 cache's planes and steps), with a CRC-32 of everything after the
fixed header. A file that is short, fails its checksum or describes something else is
reported in one line, deleted and rebuilt by the next prefill; it is never used. Writes go
to a temporary file in the same folder, a name of its own for each write, then
`os.replace`; nothing is written elsewhere. So one folder may be shared by several processes
(the app and `chat`, the replicas of `serve --ray`, on a shared filesystem those of several
machines): two that write the same block at once each replace the file whole with the same
bytes, and a reader sees the old file, the new one or none, never a mixture.
The folder is capped in bytes; the least recently used blocks (by modification time, touched
on every read) go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GB, KV_CACHE_MAX_GB, cache_home
from ..models.arithmetic import EXACT, Arithmetic, arithmetic_key
from ..models.loading import weight_files
from .full import FullCache
from .store import kv_dtype_name

log = logging.getLogger(__name__)

MAGIC = b"TFKV"
VERSION = 1
_FIXED = struct.Struct("<4sHIQI")  # magic, version, description length, body length, crc32(rest)
SUFFIX = ".kv"
DEFAULT_MAX_BYTES = int(KV_CACHE_MAX_GB * GB)


def file_digest(path: Path, folder: Path | None = None) -> str:
    """SHA-256 of a file's content, kept under `folder` (default `config.cache_home()/digests`) by
    the file's identity (path, device, inode, size, modification time): a large model file is read
    whole once, not at every start."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    folder = folder or cache_home() / "digests"
    kept = folder / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        text = kept.read_text(encoding="ascii").strip()
        if len(text) == 64:
            return text
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(kept.name + f".tmp{os.getpid()}")
        tmp.write_text(digest, encoding="ascii")
        os.replace(tmp, kept)
    except OSError:
        pass  # a read-only cache folder: the next start hashes the file again
    return digest


def model_fingerprint(model, full_limit: int = 1 << 30, source: str | os.PathLike | None = None) -> str:
    """A key for a model's K/V: its architecture, rope parameters, dtype and weights.

    Weights are hashed whole up to `full_limit` bytes in all. A larger model is keyed by its
    files' content (`source`: the GGUF file or folder it was loaded from, hashed once and kept,
    `file_digest`); loaded from elsewhere (a hub id), by each tensor's shape, first and last
    megabyte and a strided sample (hashing 16 GB at every start would cost minutes).
    """
    h = hashlib.sha256()
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    h.update(repr(model.spec).encode())
    h.update(json.dumps(rope, sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    tensors = model.weight_tensors()
    whole = sum(t.numel() * t.element_size() for t in tensors) <= full_limit
    files = [] if whole else weight_files(source)
    if files:
        for f in files:
            h.update(f"{f.name}:{file_digest(f)}".encode())
        return h.hexdigest()
    for t in tensors:
        raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        h.update(str(tuple(t.shape)).encode())
        if whole or raw.numel() <= 3 << 20:
            h.update(raw.numpy().tobytes())
        else:
            mb = 1 << 20
            step = max(1, raw.numel() // (1 << 20))
            for part in (raw[:mb], raw[-mb:], raw[::step]):
                h.update(part.contiguous().numpy().tobytes())
    return h.hexdigest()


def chain_keys(head: str, tokens, block_tokens: int) -> list[str]:
    """The keys of the whole `block_tokens`-token blocks of `tokens`: key j is the SHA-256 of
    `head` and of every token of blocks 0..j (as int32), so two token sequences share key j
    exactly when they share `head` and their first (j + 1) * block_tokens tokens.

        chain_keys("m", [5, 6, 7, 8, 9], 2)   # two keys: of [5, 6], then of [5, 6, 7, 8]
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    h = hashlib.sha256(head.encode())
    out = []
    for j in range(len(tokens) // block_tokens):
        part = [int(t) for t in tokens[j * block_tokens : (j + 1) * block_tokens]]
        h.update(torch.tensor(part, dtype=torch.int32).numpy().tobytes())
        out.append(h.copy().hexdigest())
    return out


@dataclass(frozen=True)
class Block:
    """Block `index` of a token sequence: tokens [start, end), keyed by everything up to `end`."""

    index: int
    start: int
    end: int
    key: str
    tokens: tuple[int, ...]


class DiskCache:
    """K/V blocks of one model in one folder (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, model_key: str, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 0:
            raise ValueError(f"the disk cache's size cap must be >= 0, got {max_bytes}")
        self.folder = Path(folder)
        self.model_key = model_key
        self.max_bytes = max_bytes
        self.full = False  # the cap was reached by one prefill's own blocks: stop writing more
        self.problems: list[str] = []  # one line per bad file met (also logged)

    # -- keys ------------------------------------------------------------------------------
    def blocks(self, tokens: list[int], block_tokens: int, kv_dtype: torch.dtype,
               device: torch.device | str = "cpu", arithmetic: Arithmetic = EXACT) -> list[Block]:
        """The whole `block_tokens`-token blocks of `tokens` in a cache of `kv_dtype` on `device`,
        each with its key (which names the arithmetic of a model's forward: `arithmetic_key`, for
        a model of the given `arithmetic`)."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        b = block_tokens
        keys = chain_keys(self._head(b, kv_dtype, device, arithmetic), tokens, b)
        return [Block(j, j * b, (j + 1) * b, key, tuple(int(t) for t in tokens[j * b : (j + 1) * b]))
                for j, key in enumerate(keys)]

    def _head(self, block_tokens: int, kv_dtype: torch.dtype, device, arithmetic: Arithmetic) -> str:
        """What every key of this cache hashes first: the model, the block size, the K/V dtype
        and the arithmetic the forward runs now (`arithmetic_key`)."""
        return f"{self.model_key}/{block_tokens}/{kv_dtype_name(kv_dtype)}/{arithmetic_key(device, arithmetic)}"

    def tail(self, tokens: list[int], boundary: int, block_tokens: int, kv_dtype: torch.dtype,
             device: torch.device | str = "cpu", arithmetic: Arithmetic = EXACT) -> Block | None:
        """The block from the last whole block's start before `boundary` to `boundary` (a
        document's end, where prompts that differ only in their question part), keyed by the
        same head as `blocks` and every token before `boundary`; None where `boundary` ends a
        whole block (those cover it) or lies outside `tokens`. A prefill computes it as one
        chunk of its own (`Prefill.prefill_steps`), so reading it back gives the bits a fresh
        prefill with the same boundary computes."""
        b = block_tokens
        if b < 1:
            raise ValueError(f"block_tokens must be >= 1, got {b}")
        if not 0 < boundary <= len(tokens) or boundary % b == 0:
            return None
        h = hashlib.sha256(f"{self._head(b, kv_dtype, device, arithmetic)}/tail".encode())
        h.update(torch.tensor([int(t) for t in tokens[:boundary]], dtype=torch.int32).numpy().tobytes())
        start = boundary // b * b
        return Block(boundary // b, start, boundary, h.hexdigest(), tuple(int(t) for t in tokens[start:boundary]))

    def path(self, block: Block) -> Path:
        return self.folder / (block.key + SUFFIX)

    def has(self, block: Block) -> bool:
        return self.path(block).is_file()

    # -- reading ---------------------------------------------------------------------------
    def load(self, cache: FullCache, blocks: list[Block], first: int, end: int) -> int:
        """Read blocks[first:end] into `cache` (whose length must be blocks[first].start), in
        order, stopping at the first missing or bad one; returns the tokens read."""
        if first >= end:
            return 0
        if cache.length != blocks[first].start:
            raise ValueError(f"the cache holds {cache.length} tokens, not {blocks[first].start}")
        done = 0
        for block in blocks[first:end]:
            kv = self._read(block, cache)
            if kv is None:
                break
            a, b = block.start, block.end
            cache.put_span(a, b, kv)
            cache.length = b
            cache.canonical = b
            done += b - a
        return done

    def _read(self, block: Block, cache: FullCache) -> torch.Tensor | None:
        path = self.path(block)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                data = data[: f.readinto(data)]
            os.utime(path)  # least recently used eviction goes by modification time
        except FileNotFoundError:
            return None  # evicted meanwhile (another process): a miss
        except OSError as e:
            self._bad(path, f"cannot be read ({e.strerror or e})")
            return None
        L, H, D = cache.num_layers, cache.num_kv_heads, cache.head_dim
        n = block.end - block.start
        try:
            magic, version, desc_len, body_len, crc = _FIXED.unpack_from(data)
            if magic != MAGIC or version != VERSION:
                return self._bad(path, "is not a K/V block of this version")
            rest = memoryview(data)[_FIXED.size :]
            if len(rest) != desc_len + body_len:
                return self._bad(path, f"is truncated ({len(data)} bytes, expected {_FIXED.size + desc_len + body_len})")
            if zlib.crc32(rest) != crc:
                return self._bad(path, "fails its checksum")
            desc = json.loads(bytes(rest[:desc_len]))
        except (struct.error, ValueError) as e:
            return self._bad(path, f"is malformed ({e})")
        expect = {"key": block.key, "shape": [L, H, n, D], "dtype": kv_dtype_name(cache.dtype)}
        if any(desc.get(k) != v for k, v in expect.items()) or body_len != 4 * n + cache.span_nbytes(n):
            return self._bad(path, "describes another block, shape or dtype")
        body = rest[desc_len:]
        ids = torch.frombuffer(body, dtype=torch.int32, count=n)
        if tuple(ids.tolist()) != block.tokens:
            return self._bad(path, "holds other tokens than its key says")
        return torch.frombuffer(body, dtype=torch.uint8, offset=4 * n)  # the span (`FullCache.span`)

    def _bad(self, path: Path, why: str) -> None:
        line = f"K/V cache file {path.name} {why}: ignored and deleted; it is rebuilt by the next prefill"
        log.warning(line)
        self.problems.append(line)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # -- writing ---------------------------------------------------------------------------
    def save(self, cache: FullCache, block: Block, protect: set[str] = frozenset()) -> bool:
        """Write `block`'s keys/values from `cache` (computed canonically: see the module
        docstring) unless present; evict old blocks over the cap, never those in `protect`.
        Returns whether the block is on disk afterwards."""
        path = self.path(block)
        if path.is_file():
            return True
        if self.full:
            return False
        a, b = block.start, block.end
        if cache.canonical < b:
            raise ValueError(f"block {block.index} is not canonical in this cache (canonical up to {cache.canonical})")
        L, H, D = cache.num_layers, cache.num_kv_heads, cache.head_dim
        n = b - a
        desc = json.dumps({"key": block.key, "shape": [L, H, n, D],
                           "dtype": kv_dtype_name(cache.dtype)}).encode()
        ids = torch.tensor(block.tokens, dtype=torch.int32).numpy().tobytes()
        if a % cache.span_align:  # a prefill chunk off an int16 cache's groups: not kept (the next prefill recomputes it)
            return False
        body = ids + cache.span(a, b).numpy().tobytes()
        crc = zlib.crc32(body, zlib.crc32(desc))
        size = _FIXED.size + len(desc) + len(body)
        if not self._make_room(size, protect):
            self.full = True
            log.warning("the K/V cache folder %s is full (cap %.1f GB): later blocks of this prompt are not kept",
                        self.folder, self.max_bytes / GB)
            return False
        # A name no other writer uses, whatever its machine, process or thread: writers of the
        # same block sharing the folder each replace the file whole.
        tmp = self.folder / f".{block.key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_FIXED.pack(MAGIC, VERSION, len(desc), len(body), crc))
                f.write(desc)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write the K/V cache file %s (%s): not kept", path, e.strerror or e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.full = True  # one line per prompt, not per block
            return False
        return True

    def entries(self) -> list[os.DirEntry]:
        """The block files, least recently used first."""
        try:
            found = [e for e in os.scandir(self.folder) if e.name.endswith(SUFFIX) and e.is_file()]
        except OSError:  # no folder yet (or not a folder: writes then fail and say so)
            return []
        return sorted(found, key=lambda e: e.stat().st_mtime_ns)

    def size(self) -> int:
        return sum(e.stat().st_size for e in self.entries())

    def _make_room(self, size: int, protect: set[str]) -> bool:
        """Delete least recently used blocks (not in `protect`) until `size` more bytes fit."""
        if size > self.max_bytes:
            return False
        entries = [(e, e.stat().st_size) for e in self.entries()]
        total = sum(n for _, n in entries)
        for e, n in entries:
            if total + size <= self.max_bytes:
                break
            if e.name[: -len(SUFFIX)] in protect:
                continue
            try:
                os.unlink(e.path)
                total -= n
            except OSError:
                pass
        return total + size <= self.max_bytes

    def clear(self) -> None:
        for e in self.entries():
            try:
                os.unlink(e.path)
            except OSError:
                pass
