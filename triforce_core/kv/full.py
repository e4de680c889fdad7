"""The target's full KV cache: every token of the sequence at its absolute position."""

from __future__ import annotations

import torch

from ..models.native_attention import BLOCK as ATTENTION_BLOCK
from .store import KVStore


class FullCache(KVStore):
    """Key index == absolute position, so sliding-window layers can slice the cache.

    `canonical`: the leading tokens whose K/V equal what a fresh prefill in aligned chunks
    computes (each chunk one forward over [j*chunk, (j+1)*chunk)); only those may be written
    to a `DiskCache`, so that reading them back is bit-exact.

    Chunk means for retrieval are cached here and recomputed only for chunks that changed:
    `low_water` records the shortest length the cache was truncated to since the means were
    last brought up to date.
    """

    exact_positions = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.low_water = 0
        self.canonical = 0
        self._means: torch.Tensor | None = None  # [L, Hkv, n_chunks_max, D] float32
        self._means_chunk = 0
        self._means_valid = 0  # chunks whose mean is up to date

    def window_start(self, window: int | None) -> int:
        # Slot == position: keys older than the first new query's window need not be read. The
        # slice begins at a multiple of the native attention's blocks of keys: a row's result
        # depends on which keys share a block, so a verification's rows and the one-token steps
        # at the same positions read their windows in the same blocks and agree bit for bit
        # (the keys before each row's window are masked out, `attention.Mask.firsts`).
        if window is None:
            return 0
        return max(0, self.length - window + 1) // ATTENTION_BLOCK * ATTENTION_BLOCK

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.low_water = min(self.low_water, length)
        self.canonical = min(self.canonical, length)

    def snapshot(self) -> tuple:
        # Writes only ever append here, so the slots before `length` stay as they are: O(1).
        return (self.length,)

    def restore(self, snap: tuple) -> None:
        self.truncate(snap[0])

    def nbytes(self) -> int:
        means = 0 if self._means is None else self._means.numel() * self._means.element_size()
        return super().nbytes() + means

    def grow(self, capacity: int) -> None:
        if capacity > self.capacity:
            super().grow(capacity)
            self._means = None  # sized by capacity; recomputed on the next selection

    span_align = 1  # a span (`span`) may start at any token

    def span(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) as stored, for the disk cache: one CPU uint8 tensor (keys then
        values, [2, L, Hkv, n, D] in the cache's dtype)."""
        self._check_held(start, stop)
        kv = torch.stack([self.k[:, :, start:stop], self.v[:, :, start:stop]]).to("cpu").contiguous()
        return kv.view(-1).view(torch.uint8)

    def span_nbytes(self, n: int) -> int:
        """The bytes of an n-token span."""
        return 2 * self.num_layers * self.num_kv_heads * n * self.head_dim * self.k.element_size()

    def put_span(self, start: int, stop: int, data: torch.Tensor) -> None:
        """The inverse of `span`, into tokens [start, stop) (which must follow the cached ones)."""
        self._check_span(start, stop, data)
        n = stop - start
        kv = data.view(self.dtype).view(2, self.num_layers, self.num_kv_heads, n, self.head_dim)
        self.k[:, :, start:stop] = kv[0]
        self.v[:, :, start:stop] = kv[1]

    def _check_held(self, start: int, stop: int) -> None:
        """ValueError unless tokens [start, stop) are held and start may begin a span."""
        if start % self.span_align or not 0 <= start < stop <= self.length:
            raise ValueError(f"a span starts on a multiple of {self.span_align} within the {self.length} tokens "
                             f"held, not {start}..{stop}")

    def _check_span(self, start: int, stop: int, data: torch.Tensor) -> None:
        """ValueError unless `data` is a span of tokens [start, stop) that may follow the held ones."""
        if start % self.span_align or not 0 <= start <= self.length or not start < stop <= self.capacity:
            raise ValueError(f"a span {start}..{stop} does not follow the {self.length} tokens held on a multiple of "
                             f"{self.span_align} within a capacity of {self.capacity}")
        if data.dtype != torch.uint8 or data.numel() != self.span_nbytes(stop - start):
            raise ValueError(f"a span of {stop - start} tokens takes {self.span_nbytes(stop - start)} bytes, "
                             f"not {data.numel()}")

    def copy_to(self, dst: KVStore, at: int, index: torch.Tensor) -> None:
        """Write the keys/values of positions index ([Hkv, n], or [L, Hkv, n] each layer's own)
        into the float store `dst`'s slots at.., every layer (one gather for all of them)."""
        L, H = self.num_layers, self.num_kv_heads
        idx = index if index.dim() == 3 else index[None].expand(L, -1, -1)
        li = torch.arange(L, device=idx.device)[:, None, None]
        hi = torch.arange(H, device=idx.device)[None, :, None]
        n = idx.shape[-1]
        dst.k[:, :, at : at + n] = self.k[li, hi, idx]
        dst.v[:, :, at : at + n] = self.v[li, hi, idx]

    def chunk_means(self, chunk_size: int, n_chunks: int) -> torch.Tensor:
        """Mean post-rope key of chunks [0, n_chunks): [L, Hkv, n_chunks, D] float32."""
        if n_chunks * chunk_size > self.length:
            raise ValueError("chunk_means beyond the cached tokens")
        L, Hkv, cap, D = self.num_layers, self.num_kv_heads, self.capacity, self.head_dim
        if self._means is None or self._means_chunk != chunk_size:
            self._means = torch.zeros((L, Hkv, cap // chunk_size, D), dtype=torch.float32, device=self.device)
            self._means_chunk = chunk_size
            self._means_valid = 0
        valid = min(self._means_valid, self.low_water // chunk_size)
        if n_chunks > valid:
            a, b = valid * chunk_size, n_chunks * chunk_size
            for layer in range(L):  # a layer at a time: at 32K the whole cache in float32 would be GBs
                keys = self.keys(layer, a, b).float().reshape(Hkv, n_chunks - valid, chunk_size, D)
                self._means[layer, :, valid:n_chunks] = keys.mean(dim=2)
            valid = n_chunks
        self._means_valid = valid
        self.low_water = self.length
        return self._means[:, :, :n_chunks]
