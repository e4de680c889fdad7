"""Caches on 2 MB pages: the same zeros, aligned to a huge page, and ordinary zeros when off."""

import gc
import sys

import pytest
import torch

from triforce_core.models import huge_pages
from triforce_core.kv import FullCache, KVStore

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


@linux
def test_zeros_is_zero_aligned_writable_and_outlives_its_mapping_object():
    shape = (6, 2, 1000, 64)  # 3 MB of float32: more than one huge page
    t = huge_pages.zeros(shape, torch.float32)
    gc.collect()  # only the tensor holds the mapping now
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.PAGE == 0
    assert not t.any()
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()


@linux
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8])
def test_zeros_other_dtypes(dtype):
    t = huge_pages.zeros((4096, 1024), dtype)
    assert t.dtype == dtype and t.shape == (4096, 1024) and t.data_ptr() % huge_pages.PAGE == 0
    assert not t.any()


def test_small_buffers_and_ordinary_pages_asked_for_are_plain_zeros(monkeypatch):
    small = huge_pages.zeros((10, 10), torch.float32)
    assert small.shape == (10, 10) and not small.any()
    monkeypatch.setenv("TRIFORCE_HUGE_PAGES", "0")  # no environment variable decides the pages
    assert huge_pages.available() == (sys.platform.startswith("linux") and hasattr(__import__("mmap"), "MADV_HUGEPAGE"))
    off = huge_pages.zeros((3, 2, 1000, 64), torch.float32, huge=False)
    assert off.shape == (3, 2, 1000, 64) and not off.any()
    # a plain allocation: a tensor over its own storage, not a view into a larger mapping
    assert off.untyped_storage().nbytes() == off.numel() * 4


@linux
def test_kv_store_lives_on_huge_pages_and_grow_keeps_the_tokens():
    store = KVStore(num_layers=4, num_kv_heads=2, head_dim=64, capacity=2048, dtype=torch.float32, device=torch.device("cpu"))
    assert store.k.data_ptr() % huge_pages.PAGE == 0 and store.v.data_ptr() % huge_pages.PAGE == 0
    k = torch.randn(2, 5, 64)
    store.view(1, k, -k, None)
    store.advance(5)
    store.grow(4096)
    assert store.k.data_ptr() % huge_pages.PAGE == 0 and store.capacity == 4096
    assert torch.equal(store.k[1, :, :5], k) and torch.equal(store.v[1, :, :5], -k)
    assert not store.k[:, :, 5:].any()


def test_a_cache_on_ordinary_pages_decodes_the_same(monkeypatch):
    """The page size changes where the bytes live, never what they hold."""
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=64, capacity=9000, dtype=torch.float32, device=torch.device("cpu"))
    huge = FullCache(**shape)
    monkeypatch.setattr(huge_pages, "available", lambda: False)  # where the system has none
    small = FullCache(**shape)
    for cache in (huge, small):
        g = torch.Generator().manual_seed(0)
        cache.view(0, torch.randn(2, 7, 64, generator=g), torch.randn(2, 7, 64, generator=g), None)
    assert torch.equal(huge.k, small.k) and torch.equal(huge.v, small.v)


@linux
def test_a_buffer_beyond_memory_is_a_memory_error():
    """What ChatSession catches to free its caches and go on, as for PyTorch's own allocations."""
    with pytest.raises(MemoryError, match="out of memory"):
        huge_pages.zeros((1 << 50,), torch.uint8)


@linux
def test_copy_of_an_array_is_equal_and_on_huge_pages_when_large():
    import numpy as np
    big = np.arange(3 << 20, dtype=np.uint8).reshape(3, -1)  # 3 MB
    t = huge_pages.copy(big)
    assert t.data_ptr() % huge_pages.PAGE == 0 and np.array_equal(t.numpy(), big)
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = huge_pages.copy(small)
    assert s.dtype == torch.float32 and np.array_equal(s.numpy(), small)
    s[0, 0] = 99  # a copy, not a view of the array
    assert small[0, 0] == 0
