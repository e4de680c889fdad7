"""Processes sharing one disk K/V cache folder, as the replicas of a cluster do (for
tests/test_kv_disk.py): writers replacing one block over and over, a reader checking each read.
Its own module, importing only torch and the cache: each process it starts imports it anew."""

from __future__ import annotations

import torch

from triforce_core.kv import DiskCache, FullCache
from triforce_core.kv.disk import Block

# 2 layers x 2 KV heads x 1024 tokens x 64 float32 values, keys and values: a 2 MB block,
# written in many system calls
SHAPE = (2, 2, 1024, 64)


def shared_block(folder: str):
    """(disk cache, block, full cache holding the block's K/V), the same in every process."""
    L, H, n, D = SHAPE
    cache = FullCache(L, H, D, n, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.length = cache.canonical = n
    # a fixed key: `DiskCache.blocks` would name this process's arithmetic, building the native
    # kernels in every process first; the files, not the keys, are what is tested
    block = Block(0, 0, n, "5a" * 32, tuple(range(n)))
    return DiskCache(folder, model_key="shared-model"), block, cache


def empty_like(cache: FullCache) -> FullCache:
    L, H, n, D = cache.k.shape
    return FullCache(L, H, D, n, cache.k.dtype, cache.k.device)


def write_rounds(index: int, folder: str, ready, both, rounds: int, seen) -> None:
    """`rounds` times: the block deleted, then written by both writers at once (as two replicas
    that both missed it), then left until the reader has found it again."""
    import time

    torch.set_num_threads(1)
    disk, block, cache = shared_block(folder)
    ready.wait()
    for _ in range(rounds):
        both.wait()
        if index == 0:
            disk.path(block).unlink(missing_ok=True)
        both.wait()
        before = seen.value
        assert disk.save(cache, block)
        while seen.value == before and disk.has(block):  # let the reader find this round's block
            time.sleep(0.001)


def read_checked(folder: str, ready, done, seen, results) -> None:
    """Read the block over and over until `done`; `seen` counts the reads that found it. Puts
    (reads that found it, reads that differed from it, problems met)."""
    torch.set_num_threads(1)
    disk, block, cache = shared_block(folder)
    ready.wait()
    found = differ = 0
    into = empty_like(cache)
    while not done.is_set():
        into.length = into.canonical = 0
        into.k.zero_()
        into.v.zero_()
        if disk.load(into, [block], 0, 1):
            found += 1
            differ += not (torch.equal(into.k, cache.k) and torch.equal(into.v, cache.v))
            with seen.get_lock():
                seen.value += 1
    results.put((found, differ, list(disk.problems)))
