"""Few-row attention over a long cache in native code: the CPU kernel of `csrc/attention.c`.

A decoding step has one query row per head, a verification of γ drafted tokens γ rows (times
the query heads that share a KV head). PyTorch's CPU matrix products run such few-row products
far below the memory roofline: a 7-row product over 64K keys costs twice a one-row product,
and a one-row step reads the cache at about half the memory's bandwidth. The kernel
splits the keys into blocks, computes every row's scores of a block while its keys are in
cache, and merges the blocks by their softmax statistics, on PyTorch's own OpenMP threads.

The kernel is compiled from source at first use with the machine's C compiler (flags for the
machine's own vector instructions), into the user's cache folder, keyed by the source, the
flags and the processor; without a compiler `kernel()` is None and the model keeps PyTorch's
path (as one whose `Arithmetic.native_attention` is off). The results equal PyTorch's to float32 rounding
(tests/test_native_attention.py): the order of the sums differs, as it does between PyTorch's
own kernels.

Keys and values may be float32, float16 or bfloat16 (`CacheConfig.kv_dtype`); 16-bit ones are
widened to float32 in registers as they are loaded, so a call over 16-bit K/V equals, bit for
bit, the same call over those K/V widened to float32, and reads half the bytes.

`Kernel.integer_attention` reads a cache of another kind: keys and values as 16-bit integers
(`int16_kv`), in integer arithmetic (csrc/integer_attention.c): each query row and each row's
weights on 14-bit grids of their own, every sum exact in int32, so plain C, VNNI and AMX's int8
tiles give the same bits and a verification's extra rows cost the tiles little. The int16
cache (`kv.int16`, `--kv-dtype int16`) holds such planes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import int16_kv
from .int16_kv import Int16Heads
from .native_build import CSRC, FLAGS, Loader

SOURCE = CSRC / "attention.c"
# What the keys and values may be stored as: the kernel's `kind` code for each.
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BLOCK = 256  # keys per job (the time is flat over a wide range of block sizes)
# Keys from which float32 K/V take the kernel: below, PyTorch's path is as fast (the draft's
# small window keeps it).
MIN_KEYS = 1024
# heads x rows x keys below which one thread runs all the jobs (waking the other costs more than
# it saves).
SMALL_WORK = 1 << 12
# The integer attention's paths, in the kernel's numbering, and the rows above which the tiles
# are its default where they run: up to a step of four query heads VNNI and the tiles cost
# alike, past it the tiles' cost hardly grows with the rows (`bench.attention --integer`).
INTEGER_PATHS = ("scalar", "vnni", "tiles")
INTEGER_TILE_ROWS = 4


def build(folder: Path | None = None) -> Path:
    """Compile the kernel (once per source, flags and processor); the path of the library."""
    return _loader.build(folder)


class Kernel:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL | Path, threads: int | None = None):
        lib = lib if isinstance(lib, ctypes.CDLL) else ctypes.CDLL(str(lib))
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.attention.argtypes = [P, P, P, I64, I, I, I, I, I64, P, I, I, P, P, P, I, P, P]
        lib.attention_band.argtypes = [P, P, P, I64, I, I, I, I, I64, P, P, I, I, P, P, P, I, P, P]
        lib.attention.restype = I
        lib.attention_band.restype = I
        lib.integer_attention.argtypes = [P, P, P, P, P, I64, I64, I, I, I, I64, P, I, I, I, P, P, P, I, P, P]
        lib.integer_attention.restype = I
        lib.integer_attention_paths.argtypes = []
        lib.integer_attention_paths.restype = I
        lib.integer_write.argtypes = [P, P, I, I64, I, I64, P, P, P, P, I64, I64]
        lib.integer_write.restype = I
        lib.integer_write_strided.argtypes = [P, I64, I64, P, I64, I64, I, I64, I, I64, P, P, P, P, I64, I64]
        lib.integer_write_strided.restype = I
        lib.integer_tokens.argtypes = [P, P, P, P, I64, I64, I, I, P, I64, P, P, I]
        lib.integer_tokens.restype = I
        self.lib = lib
        self.address = ctypes.cast(lib.attention, ctypes.c_void_p).value  # for native_layers.decode_layers
        self.integer_addresses = (ctypes.cast(lib.integer_write, ctypes.c_void_p).value,  # and its int16 cache
                                  ctypes.cast(lib.integer_attention, ctypes.c_void_p).value)
        self.threads = threads  # None: PyTorch's intra-op thread count at each call
        self._integer_paths: tuple[str, ...] | None = None

    def plan(self, H: int, R: int, T: int, chunk: int = 0) -> tuple[int, int]:
        """The keys a job takes (a whole number of chunks) and the threads, for H heads of R rows
        over T keys: one thread for small work (waking the others costs more than the work),
        never more threads than jobs. `native_layers.decode_layers` calls the kernel with these too."""
        block = BLOCK if chunk <= 0 else -(-BLOCK // chunk) * chunk
        threads = (self.threads or torch.get_num_threads()) if H * R * T >= SMALL_WORK else 1
        return block, min(threads, H * -(-T // block))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor | None, scale: float,
                  chunk: int = 0, firsts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [H, R, D] float32; k/v: [H, T, D] float32, float16 or bfloat16, both alike (token
        rows contiguous, any head stride);
        limits: [R] int64, row r attends to keys t < limits[r] (each >= 1); None: every key;
        firsts: [R] int64, and to keys t >= firsts[r] (a sliding window; given with limits), or None.

        Returns the output [H, R, D] and, when `chunk` > 0, the attention probability of every
        whole chunk of `chunk` keys, [H, R, T // chunk]."""
        H, R, D = q.shape
        T = k.shape[1]
        if not (q.dtype == torch.float32 and k.dtype == v.dtype and k.dtype in KINDS and k.stride(2) == 1
                and k.stride(1) == D and v.stride(2) == 1 and v.stride(1) == D and k.stride(0) == v.stride(0)):
            raise ValueError("few-row attention needs float32 queries, and keys and values of one dtype (float32, "
                             "float16 or bfloat16) with contiguous token rows")
        # the kernel reads k and v by q's heads and size, and one limit a row: shapes, not values, checked
        if k.dim() != 3 or tuple(k.shape) != tuple(v.shape) or k.shape[0] != H or k.shape[2] != D:
            raise ValueError(f"few-row attention: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
                             f"[heads {H}, keys, head size {D}] as the queries {tuple(q.shape)}")
        if limits is not None and limits.numel() != R:
            raise ValueError(f"few-row attention: {limits.numel()} limits for {R} query rows")
        if firsts is not None and (limits is None or firsts.numel() != R):
            raise ValueError(f"few-row attention: a window's first keys come with limits, one a row ({R})")
        block, threads = self.plan(H, R, T, chunk)
        q, limits, out, m, l, result, chunk_sum = _call_buffers(q, scale, limits, -(-T // block), T, chunk)
        if firsts is not None:
            firsts = firsts.to(torch.int64).contiguous()
        failed = self.lib.attention_band(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), KINDS[k.dtype], H, R, D, T,
            limits.data_ptr() if limits is not None else None, firsts.data_ptr() if firsts is not None else None, block,
            threads, out.data_ptr(), m.data_ptr(), l.data_ptr(), max(chunk, 0),
            chunk_sum.data_ptr() if chunk_sum is not None else None, result.data_ptr())
        if failed:
            raise MemoryError("few-row attention: out of memory for its scratch buffer")
        return result, chunk_sum  # each chunk's probability (the merge scaled the sums)


    def integer_paths(self) -> tuple[str, ...]:
        """The integer attention's paths that run on this machine, of INTEGER_PATHS (asked once:
        the library probes the tiles at its first call)."""
        if self._integer_paths is None:
            bits = self.lib.integer_attention_paths()
            self._integer_paths = tuple(name for i, name in enumerate(INTEGER_PATHS) if bits >> i & 1)
        return self._integer_paths

    def integer_attention(self, q: torch.Tensor, heads: Int16Heads, limits: torch.Tensor | None, scale: float,
                          chunk: int = 0, path: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attention` over an int16 cache (`int16_kv`), in integer arithmetic
        (csrc/integer_attention.c): q [H, R, D] float32 over heads' first `heads.length` tokens.
        `path` is one of INTEGER_PATHS (None: the tiles for more than INTEGER_TILE_ROWS rows where
        they run, else VNNI where it runs); every path gives the same bits."""
        H, R, D = q.shape
        T = heads.length
        if q.dtype != torch.float32 or heads.heads != H or heads.head_dim != D:
            raise ValueError(f"integer attention: queries {tuple(q.shape)} {q.dtype} against {heads.heads} heads of "
                             f"{heads.head_dim}")
        self.check_heads(heads)
        if not 1 <= T <= heads.capacity:
            raise ValueError(f"integer attention: {T} tokens in a cache of {heads.capacity}")
        if limits is not None and limits.numel() != R:
            raise ValueError(f"integer attention: {limits.numel()} limits for {R} query rows")
        if chunk > 0 and BLOCK % chunk:
            raise ValueError(f"integer attention: chunks of {chunk} keys do not divide its blocks of {BLOCK}")
        paths = self.integer_paths()
        path = path or self.integer_path(R)
        if path not in paths:
            raise ValueError(f"integer attention: the {path} path does not run here (runs: {', '.join(paths)})")
        _, threads = self.plan(H, R, T, chunk)
        block = BLOCK
        q, limits, out, m, l, result, chunk_sum = _call_buffers(q, scale, limits, -(-T // block), T, chunk)
        failed = self.lib.integer_attention(
            q.data_ptr(), heads.k.data_ptr(), heads.v.data_ptr(), heads.sk.data_ptr(), heads.sv.data_ptr(),
            heads.k.stride(0), heads.sk.stride(0), H, R, D, T, limits.data_ptr() if limits is not None else None,
            block, threads, INTEGER_PATHS.index(path), out.data_ptr(), m.data_ptr(), l.data_ptr(), max(chunk, 0),
            chunk_sum.data_ptr() if chunk_sum is not None else None, result.data_ptr())
        if failed == -1:
            raise MemoryError("integer attention: out of memory for its scratch buffers")
        if failed:
            raise ValueError(f"integer attention refused its arguments ({failed})")
        return result, chunk_sum


    def integer_path(self, rows: int) -> str:
        """The integer attention's default path for `rows` query rows: the tiles for more than
        INTEGER_TILE_ROWS where they run, else VNNI where it runs, else plain C."""
        paths = self.integer_paths()
        return "tiles" if rows > INTEGER_TILE_ROWS and "tiles" in paths else "vnni" if "vnni" in paths else "scalar"

    @staticmethod
    def check_heads(heads: Int16Heads) -> None:
        """The planes and scales are the types, sizes and layout the kernel reads (`int16_kv`)."""
        H, D, cap = heads.heads, heads.head_dim, heads.capacity
        if D % 64 or D > 256:
            raise ValueError(f"integer attention covers head sizes that are multiples of 64 up to 256, not {D}")
        if (heads.k.shape != (H, cap * 2 * D) or heads.v.shape != heads.k.shape or heads.k.dtype != torch.uint8
                or heads.v.dtype != torch.uint8 or heads.sk.dtype != torch.float32 or heads.sv.dtype != torch.float32
                or heads.sv.shape != heads.sk.shape or cap % int16_kv.CAPACITY_STEP
                or not all(t.is_contiguous() for t in (heads.k, heads.v, heads.sk, heads.sv))):
            raise ValueError(f"integer attention: the cache's planes must be contiguous uint8 [heads, capacity x 2 x "
                             f"head size] and its scales contiguous float32 [heads, capacity], capacity a multiple of "
                             f"{int16_kv.CAPACITY_STEP} (planes {tuple(heads.k.shape)}, scales {tuple(heads.sk.shape)})")

    def integer_write(self, heads: Int16Heads, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """`int16_kv.write` in native code, the same bits: keys and values [H, n, D] of tokens
        start.. onto their grids, into `heads`, whose length becomes start + n."""
        self.check_heads(heads)
        H, n, D = k.shape
        if tuple(v.shape) != (H, n, D) or H != heads.heads or D != heads.head_dim:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} for {heads.heads} heads of "
                             f"{heads.head_dim}")
        if not 0 <= start <= heads.length or start + n > heads.capacity:
            raise ValueError(f"tokens {start}..{start + n} do not follow the {heads.length} held in a cache of "
                             f"{heads.capacity}")
        # rows of D contiguous floats at any head and token strides (a prefill's transposed views: no copy)
        k, v = (x if x.dtype == torch.float32 and x.stride(2) == 1 else x.float().contiguous() for x in (k, v))
        if self.lib.integer_write_strided(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                                          H, n, D, start, heads.k.data_ptr(), heads.v.data_ptr(), heads.sk.data_ptr(),
                                          heads.sv.data_ptr(), heads.k.stride(0), heads.sk.stride(0)):
            raise ValueError(f"integer write refused head size {D}")
        heads.length = start + n

    def integer_tokens(self, heads: Int16Heads, index: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What `heads` holds for tokens index [H, n] (each below its length) of each head, as
        float32 keys and values [H, n, D]: the integers times their steps (into `out`, two
        contiguous float32 [H, n, D] tensors, where given)."""
        self.check_heads(heads)
        H, D = heads.heads, heads.head_dim
        if index.dim() != 2 or index.shape[0] != H:
            raise ValueError(f"integer tokens: an index {tuple(index.shape)} for {H} heads")
        index = index.to(torch.int64).contiguous()
        n = index.shape[1]
        if n and (int(index.min()) < 0 or int(index.max()) >= heads.length):
            raise ValueError(f"integer tokens: indices outside the {heads.length} cached tokens")
        if out is None:
            k, v = torch.empty(H, n, D), torch.empty(H, n, D)
        else:
            k, v = out
            if any(tuple(t.shape) != (H, n, D) or t.dtype != torch.float32 or not t.is_contiguous() for t in out):
                raise ValueError(f"integer tokens: out must be two contiguous float32 {(H, n, D)} tensors")
        if self.lib.integer_tokens(heads.k.data_ptr(), heads.v.data_ptr(), heads.sk.data_ptr(), heads.sv.data_ptr(),
                                   heads.k.stride(0), heads.sk.stride(0), H, D, index.data_ptr(), n, k.data_ptr(),
                                   v.data_ptr(), self.threads or torch.get_num_threads()):
            raise ValueError(f"integer tokens refused head size {D}")
        return k, v


def _call_buffers(q: torch.Tensor, scale: float, limits: torch.Tensor | None, nb: int, T: int, chunk: int):
    """What a kernel call takes beside the cache: the queries pre-scaled, the limits as int64,
    and the buffers it writes (blocks' outputs, maxima and sums over nb blocks, the result, each
    chunk's mass when chunk > 0: the kernel writes every chunk)."""
    H, R, D = q.shape
    q = (q * scale).contiguous()
    if limits is not None:
        limits = limits.to(torch.int64).contiguous()
    chunk_sum = torch.empty(H, R, T // chunk) if chunk > 0 else None
    return q, limits, torch.empty(H, nb, R, D), torch.empty(H, nb, R), torch.empty(H, nb, R), torch.empty(H, R, D), chunk_sum


_loader: Loader[Kernel] = Loader("few-row attention", SOURCE, FLAGS, Kernel)


def kernel() -> Kernel | None:
    """The kernel, built and loaded at the first call; None where it cannot be (logged once)."""
    return _loader.get()
