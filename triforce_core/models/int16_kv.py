"""Keys and values as 16-bit integers, in the layout the integer attention kernel reads.

Each key or value vector (one token, one KV head) is stored on a grid of its own absmax:
x = round(x / s) with s = absmax / 32767, one float32 scale a vector: closer to float32 than a
float16 cache (`bench.kv_formats`), in two bytes an element plus four a vector.

The integers go to `csrc/integer_attention.c` as two unsigned byte planes (the high byte plus
128, the low byte), interleaved as its products read them; the source gives the layout. A
head's planes take 4 D bytes a token of capacity, a multiple of 64 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import huge_pages

GRID = 32767
CAPACITY_STEP = 64  # the kernel reads whole groups of 64 tokens


@dataclass
class Int16Heads:
    """One layer's keys and values for the kernel: k and v [H, head_bytes] uint8, their scales
    sk and sv [H, capacity] float32, the first `length` tokens valid."""

    k: torch.Tensor
    v: torch.Tensor
    sk: torch.Tensor
    sv: torch.Tensor
    head_dim: int
    length: int

    @property
    def heads(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.sk.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(heads, length, head size): the keys' shape as a float cache's view gives it."""
        return self.heads, self.length, self.head_dim


def on_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (integers [..., D] int32 in [-32767, 32767], scales [...] float32);
    a zero vector has scale 0."""
    x = x.float()
    top = x.abs().amax(-1)
    scale = top / GRID
    inv = torch.where(top > 0, GRID / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    ints = torch.round(x * inv[..., None]).clamp_(-GRID, GRID).to(torch.int32)
    return ints, scale


def _planes(ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ((ints >> 8) + 128).to(torch.uint8), (ints & 255).to(torch.uint8)


def key_bytes(start: int, stop: int, D: int) -> torch.Tensor:
    """[stop - start, D] the high plane's byte of each token's dims in a head's keys (the low
    plane's is 16 D further)."""
    t, d = torch.arange(start, stop)[:, None], torch.arange(D)[None, :]
    return t // 16 * 32 * D + d // 4 * 64 + t % 16 * 4 + d % 4


def value_bytes(start: int, stop: int, D: int) -> torch.Tensor:
    """The same for values (the low plane's 4 D further)."""
    t, d = torch.arange(start, stop)[:, None], torch.arange(D)[None, :]
    return t // 4 * 8 * D + d * 4 + t % 4


def empty(heads: int, capacity: int, head_dim: int) -> Int16Heads:
    """An empty cache of `capacity` tokens (rounded up to a multiple of CAPACITY_STEP)."""
    if head_dim % 64:
        raise ValueError(f"an int16 cache needs a head size that is a multiple of 64, not {head_dim}")
    capacity = -(-max(capacity, 1) // CAPACITY_STEP) * CAPACITY_STEP
    planes = capacity * 2 * head_dim
    # on 2 MB pages, as a float cache is: every step streams the planes (`huge_pages`)
    return Int16Heads(huge_pages.zeros((heads, planes), torch.uint8), huge_pages.zeros((heads, planes), torch.uint8),
                      torch.zeros(heads, capacity), torch.zeros(heads, capacity), head_dim, 0)


def write(heads: Int16Heads, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Keys and values [H, n, D] (float) of tokens start.. on their grids, into `heads`; its
    length becomes start + n (what lay past it is no longer read)."""
    H, n, D = k.shape
    if v.shape != k.shape or H != heads.heads or D != heads.head_dim:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} for {heads.heads} heads of {heads.head_dim}")
    if not 0 <= start <= heads.length or start + n > heads.capacity:
        raise ValueError(f"tokens {start}..{start + n} do not follow the {heads.length} held in a cache of {heads.capacity}")
    stop = start + n
    for planes, scales, x, at, low in ((heads.k, heads.sk, k, key_bytes(start, stop, D), 16 * D),
                                       (heads.v, heads.sv, v, value_bytes(start, stop, D), 4 * D)):
        ints, scale = on_grid(x)
        hi, lo = _planes(ints)
        at = at.reshape(-1)
        planes[:, at] = hi.reshape(H, -1)
        planes[:, at + low] = lo.reshape(H, -1)
        scales[:, start:stop] = scale
    heads.length = stop


def pack(k: torch.Tensor, v: torch.Tensor, capacity: int | None = None) -> Int16Heads:
    """Keys and values [H, T, D] (float) on their grids, packed for the kernel; capacity (default
    T) is rounded up to a multiple of CAPACITY_STEP."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must both be [heads, tokens, head size]")
    H, T, D = k.shape
    heads = empty(H, max(capacity or T, T), D)
    write(heads, k, v, 0)
    return heads


def dequantized(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache holds for keys and values [..., D], as float32 (integers times scales)."""
    (ki, sk), (vi, sv) = on_grid(k), on_grid(v)
    return ki.float() * sk[..., None], vi.float() * sv[..., None]
