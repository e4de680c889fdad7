"""Large, long-lived CPU buffers on 2 MB pages (Linux transparent huge pages).

A decoding step streams the whole K/V cache once: in 4 KB pages that is tens of thousands of
pages, each a TLB miss, and the hardware prefetchers stop at every page's end; on 2 MB pages
the same stream is a few hundred, and a step's attention is faster (`bench.level_steps
--pages huge,small`).

`zeros` maps fresh anonymous memory (the kernel hands it out zeroed), asks for huge pages over
the 2 MB-aligned part of it (`madvise(MADV_HUGEPAGE)`, which the kernel honours in its default
"madvise" mode), and returns a tensor over it; the mapping lives as long as the tensor. Where
that cannot be done (not Linux, another device, a small buffer) or is not asked for (`huge`
False: a test's other side) it is `torch.zeros`: the same values, on ordinary pages.
"""

from __future__ import annotations

import errno
import math
import mmap
import sys

import numpy as np
import torch

PAGE = 2 << 20  # bytes in a huge page on x86-64 and arm64 (4 KB base pages)


def available() -> bool:
    """Whether `zeros` can ask for huge pages: Linux with MADV_HUGEPAGE."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", huge: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on 2 MB pages where the buffer spans at least one
    (and `huge`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not huge or torch.device(device).type != "cpu" or nbytes < PAGE or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch
    try:
        area = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # what callers catch for an allocation that failed (ChatSession frees its caches)
        if e.errno == errno.ENOMEM:
            raise MemoryError(f"out of memory: cannot map {nbytes / 2**20:.0f} MB") from e
        raise
    whole = torch.frombuffer(area, dtype=torch.uint8)  # holds the mapping for as long as it lives
    start = -whole.data_ptr() % PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, nbytes // PAGE * PAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, same values
        pass
    return whole[start : start + nbytes].view(dtype).view(shape)


def copy(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor holding a copy of `array`, on 2 MB pages where it spans at least one."""
    if array.nbytes < PAGE or not available():
        return torch.from_numpy(np.array(array, copy=True))
    out = zeros(array.shape, torch.from_numpy(np.empty(0, array.dtype)).dtype)
    out.numpy()[...] = array
    return out

