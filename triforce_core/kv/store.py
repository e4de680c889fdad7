"""Preallocated key/value storage with an explicit length.

All layers live in two tensors, k and v, of shape [L, Hkv, capacity, D]. Writing a token is an
indexed copy; rolling back after a rejected speculation is setting `length`. Nothing here ever
grows a tensor with `torch.cat`.

The tensors' dtype is the cache's K/V dtype (`CacheConfig.kv_dtype`, see `resolve_kv_dtype`),
which may be narrower than the model's: `view` rounds the new keys and values into it as it
writes them (round to nearest even), and returns them from the cache, so the forward that wrote
them attends to the same rounded values as every later one.
"""

from __future__ import annotations

import torch

from ..models import huge_pages
from ..config import DEFAULT_KV_DTYPE, GGUF_KV_DTYPE, INT16_KV_MIN_HEAD, KV_DTYPES, ConfigError

_TORCH_DTYPES = {name: getattr(torch, name) for name in KV_DTYPES}
GROW_SLACK = 4096  # the most tokens `make_room` adds beyond what is needed


def resolve_kv_dtype(name: str | None, model_dtype: torch.dtype, device: torch.device | str,
                     quantized: bool = False, head_dim: int | None = None, chunk_size: int = 8,
                     windowed: bool = False) -> torch.dtype:
    """The torch dtype of a cache's K/V: `name` ("float32", "float16", "bfloat16"; "int16" is
    torch.int16, a full cache's integer planes, `kv.int16`, for a float32 model on the CPU), or for None /
    "auto", when the model computes in float32 on the CPU with the native few-row attention
    kernel (where it was measured; PyTorch's few-row path would widen the whole cache at every
    step), `config.GGUF_KV_DTYPE` for a model whose weights are a GGUF file's (`quantized`,
    `Transformer.quantized`) and `config.DEFAULT_KV_DTYPE` for any other, except int16 for a
    GGUF model's full cache (`head_dim` given) with heads of `config.INT16_KV_MIN_HEAD` or more
    where the integer kernel's vector paths run and the retrieval level's `chunk_size` divides
    its blocks of 256 keys and no layer has a sliding window (`windowed`: a float cache gives a
    local layer its window as a slice of its keys, which the native kernels read; the int16
    cache's planes, kept in groups of tokens, cannot be sliced at any token, so every local layer
    would read its keys widened to float32); elsewhere the model's own dtype. (`exact`
    engines name float32: `TriForceEngine`.)"""
    if name is None or name == "auto":
        if torch.device(device).type == "cpu" and model_dtype == torch.float32:
            from ..models import native_attention  # builds the kernel at the first call, as the first forward would

            kernel = native_attention.kernel()
            if kernel is not None:
                if (quantized and not windowed and head_dim is not None and head_dim >= INT16_KV_MIN_HEAD and head_dim % 64 == 0
                        and head_dim <= 256 and 256 % chunk_size == 0 and {"vnni", "tiles"} & set(kernel.integer_paths())):
                    return torch.int16
                return _TORCH_DTYPES[GGUF_KV_DTYPE if quantized else DEFAULT_KV_DTYPE]
        return model_dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or auto, got {name!r}")
    if name == "int16" and (torch.device(device).type != "cpu" or model_dtype != torch.float32):
        raise ConfigError(f"kv_dtype int16 is read by the CPU's integer kernel: it needs a float32 model on the CPU, "
                          f"not {kv_dtype_name(model_dtype)} on {torch.device(device).type}")
    return _TORCH_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """float16 for torch.float16, and so on."""
    return str(dtype).removeprefix("torch.")


class CacheFullError(RuntimeError):
    """A forward would write past the preallocated capacity."""


class KVStore:
    """K/V for every layer of one model: k, v: [L, Hkv, capacity, D]; slots [0, length) valid."""

    exact_positions = False  # key index == absolute position (FullCache only)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.length = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """Empty storage for `capacity` tokens (sets `capacity`)."""
        shape = (self.num_layers, self.num_kv_heads, capacity, self.head_dim)
        # on 2 MB pages: every step streams all of it (`huge_pages`)
        self.k = huge_pages.zeros(shape, self.dtype, self.device)
        self.v = huge_pages.zeros(shape, self.dtype, self.device)
        self.capacity = capacity

    @property
    def free(self) -> int:
        return self.capacity - self.length

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, n: int) -> None:
        """Fail before a forward of n tokens that would not fit."""
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"{type(self).__name__} holds {self.length} of {self.capacity} tokens; "
                f"cannot add {n} more"
            )

    def make_room(self, need: int) -> None:
        """Grow to hold `need` tokens, with room for a few more turns: a conversation needs a
        little more each turn, and every reallocation copies the whole cache. The extra is a quarter of the capacity, at most GROW_SLACK tokens."""
        if need > self.capacity:
            self.grow(need + min(self.capacity // 4, GROW_SLACK))

    def grow(self, capacity: int) -> None:
        """Reallocate to a larger capacity, keeping the cached slots (between generations only)."""
        if capacity <= self.capacity:
            return
        L, H, _, D = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = huge_pages.zeros((L, H, capacity, D), old.dtype, old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
            del old
        self.capacity = capacity

    @property
    def native_storage(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
        """(k, v, None) when this cache writes and reads K/V as this class does (a subclass with
        its own `view` does not): the forward may then run every layer in one native call
        (`native_layers.decode_layers`); an int16 cache gives its planes and steps; else None."""
        return (self.k, self.v, None) if type(self).view is KVStore.view else None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [Hkv, n, D] of tokens start.. of one layer (rounded into the cache's
        dtype); `length` is the caller's to set."""
        self.k[layer].narrow(1, start, k.shape[1]).copy_(k)  # (cheaper than slice assignment: ~20 us a call)
        self.v[layer].narrow(1, start, v.shape[1]).copy_(v)

    def keys(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """One layer's keys of tokens [start, stop): [Hkv, n, D] in the cache's dtype (float32
        for an int16 cache: its integers widened)."""
        return self.k[layer, :, start:stop]

    def view(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write k_new/v_new [Hkv, S, D] after the cached tokens; return keys/values [Hkv, T, D]."""
        t, s = self.length, k_new.shape[1]
        self.write(layer, t, k_new, v_new)
        start = self.window_start(window)
        return self.k[layer, :, start : t + s], self.v[layer, :, start : t + s], start

    def window_start(self, window: int | None) -> int:
        """First slot the new queries may see (0: every cached key; a mask does the rest)."""
        return 0

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens: O(1), the data past it is simply ignored."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def positions(self, logical_start: int, n: int) -> torch.Tensor:
        """Rotary positions of n new tokens whose sequence index starts at logical_start."""
        return torch.arange(logical_start, logical_start + n, device=self.device)

    def snapshot(self) -> tuple:
        """What `restore` needs to return here: a copy of the valid slots (later writes may
        overwrite them, e.g. a compaction or a re-selection)."""
        n = self.length
        return n, self.k[:, :, :n].clone(), self.v[:, :, :n].clone()

    def restore(self, snap: tuple) -> None:
        n, k, v = snap
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.length = n
