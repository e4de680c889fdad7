"""The target's full cache as 16-bit integers, read by the integer attention kernel.

Each key and value vector (one token, one KV head) is kept on a grid of its own absmax
(`models.int16_kv`), as two byte planes in the layout csrc/integer_attention.c reads, with one
float32 step per vector. Teacher-forced on SmolLM2 this cache read through the kernel reads the
document closer to Hugging Face float32 than the float16 default does (mean KL 1.8e-7 against
9.0e-7, `bench.kv_formats`), and its few-row attention is integer products: a 7-row
verification costs far less than seven steps' arithmetic on AMX's tiles.

Every path that reads it gives the same bits for a row whatever rows share its forward: the
kernel's integer sums are exact and its paths (VNNI, tiles, plain C) agree bit for bit, so a
verification's logits equal a step's and speculation stays lossless against plain decoding
over this cache. Prefill, whose many rows go to PyTorch's flash kernel, reads the integers
widened to float32 (`integer_tokens`); so does anything else that wants floats (the retrieval
level's copies, the chunk means).

Storage: kp, vp [L, Hkv, capacity x 2 D] uint8 (a head's planes, `Int16Heads.k`/`v`), sk, sv
[L, Hkv, capacity] float32; the capacity is a multiple of 64 tokens. A span of tokens starting
on a multiple of 16 is a contiguous run of 2 D bytes a token in each plane array, which is how
the disk cache reads and writes whole blocks.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..models import huge_pages, native_attention
from ..models.int16_kv import CAPACITY_STEP, Int16Heads, key_bytes, value_bytes
from .full import FullCache
from .store import KVStore

INT16 = torch.int16  # the dtype that names this cache (`resolve_kv_dtype("int16")`)
SPAN_ALIGN = 16  # tokens: a span from a multiple of it is whole 64-byte lines of keys and values


def check_int16(head_dim: int, chunk_size: int | None = None) -> None:
    """ConfigError unless a model of this head size and a retrieval chunk of this size (None: no
    retrieval) can run over an int16 cache (the integer kernel's head sizes, its blocks of 256
    keys per chunk sum)."""
    if head_dim % 64 or head_dim > 256:
        raise ConfigError(f"kv_dtype int16 needs a head size that is a multiple of 64 up to 256, not {head_dim} "
                          "(use float16)")
    if chunk_size is not None and 256 % chunk_size:
        raise ConfigError(f"kv_dtype int16 needs a retrieval chunk size that divides 256, not {chunk_size}")


def new_full_cache(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                   device: torch.device | str) -> FullCache:
    """A target's full cache of K/V dtype `dtype` (`resolve_kv_dtype`): an `Int16Cache` for
    torch.int16, else a float `FullCache`."""
    if dtype == INT16:
        return Int16Cache(num_layers, num_kv_heads, head_dim, capacity, device)
    return FullCache(num_layers, num_kv_heads, head_dim, capacity, dtype, device)


def _kernel() -> native_attention.Kernel:
    kernel = native_attention.kernel()
    if kernel is None:
        raise ConfigError("kv_dtype int16 needs the native attention kernel, which is off or not built here "
                          "(use float16)")
    return kernel


def _rounded(capacity: int) -> int:
    return -(-capacity // CAPACITY_STEP) * CAPACITY_STEP


class Int16Cache(FullCache):
    """A `FullCache` whose K/V are int16 planes (see the module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device | str = "cpu"):
        if torch.device(device).type != "cpu":
            raise ValueError("an int16 K/V cache runs on the CPU only")
        check_int16(head_dim)
        self.kernel = _kernel()
        super().__init__(num_layers, num_kv_heads, head_dim, capacity, INT16, device)

    def _allocate(self, capacity: int) -> None:
        capacity = _rounded(capacity)
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        # on 2 MB pages, as a float cache is: every step streams the planes (`huge_pages`)
        self.kp = huge_pages.zeros((L, H, capacity * 2 * D), torch.uint8, self.device)
        self.vp = huge_pages.zeros((L, H, capacity * 2 * D), torch.uint8, self.device)
        self.sk = torch.zeros(L, H, capacity)
        self.sv = torch.zeros(L, H, capacity)
        self.capacity = capacity

    def nbytes(self) -> int:
        means = 0 if self._means is None else self._means.numel() * self._means.element_size()
        return 2 * self.kp.numel() + 2 * 4 * self.sk.numel() + means

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old = (self.kp, self.vp, self.sk, self.sv)
        n = _rounded(self.length)  # whole groups of 64 tokens: both planes' groups end there
        self._allocate(capacity)
        for new, was in zip((self.kp, self.vp), old[:2]):
            new[:, :, : n * 2 * self.head_dim] = was[:, :, : n * 2 * self.head_dim]
        for new, was in zip((self.sk, self.sv), old[2:]):
            new[:, :, : self.length] = was[:, :, : self.length]
        del old
        self._means = None

    def heads(self, layer: int, length: int | None = None) -> Int16Heads:
        """One layer's planes as the kernel takes them, `length` (default: the cache's) tokens valid."""
        return Int16Heads(self.kp[layer], self.vp[layer], self.sk[layer], self.sv[layer], self.head_dim,
                          self.length if length is None else length)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kernel.integer_write(self.heads(layer, start), k, v, start)

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of tokens index [Hkv, n] of each KV head, widened to
        float32: [Hkv, n, D]."""
        return self.kernel.integer_tokens(self.heads(layer), index)

    def copy_to(self, dst: KVStore, at: int, index: torch.Tensor) -> None:
        # a layer at a time: the widened float32 copy of a whole budget over every layer would be
        # GBs on an 8B model
        for layer in range(self.num_layers):
            k, v = self.gather(layer, index if index.dim() == 2 else index[layer])
            dst.write(layer, at, k, v)

    def keys(self, layer: int, start: int, stop: int) -> torch.Tensor:
        return self.gather(layer, torch.arange(start, stop).expand(self.num_kv_heads, stop - start))[0]

    def view(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
             window: int | None) -> tuple[Int16Heads, None, int]:
        """Write the new tokens; return the layer's heads (every cached token and the new ones,
        `Int16Heads`, which `models.attention.attend` reads), no separate values, key start 0.
        A window is applied by the mask: the integer kernel reads every key."""
        t, s = self.length, k_new.shape[1]
        self.write(layer, t, k_new, v_new)
        return self.heads(layer, t + s), None, 0

    def window_start(self, window: int | None) -> int:
        return 0

    @property
    def native_storage(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.kp, self.vp, (self.sk, self.sv)

    span_align = SPAN_ALIGN

    def span(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) as stored (start a multiple of SPAN_ALIGN): one uint8 tensor of
        the key planes, the value planes, then the keys' and values' steps, every layer and head."""
        self._check_held(start, stop)
        a, b = self._span_bytes(start, stop)
        keys, values = self.kp[:, :, a:b].clone(), self.vp[:, :, a:b].clone()
        # zeros for the tokens past `stop` in its group: a span's bytes depend on its tokens only
        end, D = (b - a) // (2 * self.head_dim), self.head_dim
        for planes, at, low in ((keys, key_bytes(stop - start, end, D), 16 * D),
                                (values, value_bytes(stop - start, end, D), 4 * D)):
            at = at.reshape(-1)
            planes[:, :, at] = 0
            planes[:, :, at + low] = 0
        parts = [keys.reshape(-1), values.reshape(-1)]
        parts += [s[:, :, start:stop].reshape(-1).view(torch.uint8) for s in (self.sk, self.sv)]
        return torch.cat(parts)

    def span_nbytes(self, n: int) -> int:
        """The bytes of an n-token span (`span`)."""
        a, b = self._span_bytes(0, n)
        return self.num_layers * self.num_kv_heads * (2 * (b - a) + 8 * n)

    def put_span(self, start: int, stop: int, data: torch.Tensor) -> None:
        self._check_span(start, stop, data)
        n, (a, b) = stop - start, self._span_bytes(start, stop)
        L, H = self.num_layers, self.num_kv_heads
        plane, steps = L * H * (b - a), L * H * 4 * n
        at = 0
        for p in (self.kp, self.vp):
            p[:, :, a:b] = data[at : at + plane].view(L, H, b - a)
            at += plane
        for s in (self.sk, self.sv):
            s[:, :, start:stop] = data[at : at + steps].view(torch.float32).view(L, H, n)
            at += steps

    def _span_bytes(self, start: int, stop: int) -> tuple[int, int]:
        """The byte range of tokens [start, stop) in each head's planes: keys come in groups of
        16 tokens and values of 4, each 2 D bytes a token, so from a multiple of 16 both run to
        the end of the last whole group of 16."""
        end = -(-stop // SPAN_ALIGN) * SPAN_ALIGN
        return start * 2 * self.head_dim, end * 2 * self.head_dim
