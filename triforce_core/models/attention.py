"""Attention of new query rows over a cache's keys: the mask, and the path for each shape.

- Few rows (a decoding step, a verification) on the CPU: the native kernel
  (`native_attention`) up to NATIVE_QUERY_ROWS rows, else two batched matrix products up to
  SMALL_QUERY_ROWS.
- Many rows (prefill): PyTorch's CPU flash kernel, in two passes merged by their log-sum-exps
  when every cached key is visible to every row.
- Few rows on a GPU in 16 bits: the flash kernel over the cached keys (`cuda_few_rows`).
- Elsewhere (CUDA prefill, float32 on CUDA, a window cut among many rows): PyTorch's
  scaled-dot-product attention.

Rows are the query heads that share a KV head folded into the query length, ordered (g, s).

Keys and values come in the cache's dtype (`CacheConfig.kv_dtype`): the native kernel widens
16-bit ones to float32 in registers; PyTorch's paths widen them to the queries' dtype first,
so every path computes in the queries' dtype (float32 on the CPU) from the same rounded K/V.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from . import native_attention
from .int16_kv import Int16Heads

# Query rows up to which attention is computed as two matrix products (decode, verification).
SMALL_QUERY_ROWS = 8
# ... and up to which when the caller reads the attention weights (`KeyMass`): a verification
# of grouped-query heads has G rows per token.
PROBED_QUERY_ROWS = 64
# Query rows up to which the native kernel runs (where it is built): every forward of up to
# `native_layers.ROWS` tokens (a 16-token lookup run and its bonus row) for up to 8 query heads
# per KV head (Llama 3 and Mistral have 4, Qwen2.5-7B 7). The bound is an exactness one: a
# verification or lookup run whose rows take another path than a step (PyTorch's kernels sum in
# an order that depends on the rows) gives logits that are not the steps', and speculation is
# then not lossless against our own autoregressive decoding. The kernel is also the faster path
# over the whole range (`python -m bench.attention`; docs/benchmarks.md).
NATIVE_QUERY_ROWS = 8 * 17


# Query rows (query heads x new tokens) up to which a 16-bit forward on a GPU takes
# `cuda_few_rows` (decoding, verification, lookup runs); prefill keeps PyTorch's own choice.
CUDA_FEW_ROWS = 256
# Cached keys from which several new tokens take `cuda_few_rows` too: its split costs ~20 small
# operations a layer, and over a short cache PyTorch's masked kernel is done sooner (measured
# on an H100, `bench.cuda_levels`).
CUDA_SPLIT_KEYS = 16384
# CUDA's flash kernel (FlashAttention-2 inside PyTorch), which also returns each row's log-sum-exp.
CUDA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


# Widened K/V (PyTorch's paths over a 16-bit cache) go to a buffer kept per thread up to this
# size: a fresh one of a long cache's size costs more in page faults than the conversion itself.
WIDEN_BUFFER_BYTES = 512 * 2**20
_buffers = threading.local()


def widened(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [H, T, D] (any strides) in `dtype`, contiguous. On the CPU the result lives in this
    thread's buffer, valid until its next call (`attend` uses it within the call)."""
    if k.device.type != "cpu":
        return k.to(dtype), v.to(dtype)
    buffers = _buffer(tuple(k.shape), dtype)
    if buffers is None:
        return k.to(dtype), v.to(dtype)
    kw, vw = buffers
    kw.copy_(k)
    vw.copy_(v)
    return kw, vw


def _buffer(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two contiguous CPU tensors of `shape` in this thread's buffer (valid until its next
    call), or None past WIDEN_BUFFER_BYTES (the caller allocates)."""
    n = 1
    for size in shape:
        n *= size
    most = WIDEN_BUFFER_BYTES // torch.empty((), dtype=dtype).element_size()  # elements
    if 2 * n > most:
        return None
    buf = getattr(_buffers, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < 2 * n:
        # a power of two: a prefill's growing cache reallocates it a few times, not every chunk
        _buffers.buf = None  # the old one goes first
        buf = _buffers.buf = torch.empty(min(1 << (2 * n - 1).bit_length(), most), dtype=dtype)
    return buf[:n].view(shape), buf[n : 2 * n].view(shape)


@dataclass(frozen=True)
class Mask:
    start: int  # first key column with a hidden entry: keys before it are seen by every query
    hidden: torch.Tensor  # [R, T - start] bool, True = masked out
    # When every cached key is seen by every query (no window cut): the additive mask [R, S] of
    # the new keys alone, for `split_attention`; else None.
    new_bias: torch.Tensor | None = None
    # When every row sees a prefix of the keys (causal among the new ones, no window cut): the
    # length of each row's prefix [R] int64, for the native kernel; else None.
    limits: torch.Tensor | None = None
    # With a window cut: each row's first visible key [R] int64 (it sees keys firsts..limits - 1,
    # a band), for the float native kernel; else None.
    firsts: torch.Tensor | None = None

    @cached_property
    def visible(self) -> torch.Tensor:
        """[R, T] bool, True = attend (built when a path needs the whole mask)."""
        R, n = self.hidden.shape
        visible = torch.ones(R, self.start + n, dtype=torch.bool, device=self.hidden.device)
        visible[:, self.start :] = ~self.hidden
        return visible


# The CPU flash kernel that also returns each row's log-sum-exp (a private op of the pinned
# torch); without it prefill keeps the masked path.
FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend(q: torch.Tensor, k: torch.Tensor | Int16Heads, v: torch.Tensor | None, mask: Mask | None, scale: float,
           chunk: int = 0, native: bool = True, windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [Hkv, R, D], k/v: [Hkv, T, D], mask: see `attention_mask` (None: all visible)
    -> the output [Hkv, R, D] and, when `chunk` > 0 and the rows are few, the attention
    probability of each whole chunk of `chunk` keys [Hkv, R, >= (T - new keys) // chunk]
    (else None).

    Few query rows (up to NATIVE_QUERY_ROWS) against a long cache (decoding, verification) on
    the CPU: the native kernel (`native_attention`), which reads each key and value once for all
    rows, where it is built, `native` (the model's `Arithmetic.native_attention`) and every row
    sees a prefix of the keys (no window cut); else, up to SMALL_QUERY_ROWS rows, two batched
    matrix products, which also read each key once but run the few-row product compute-bound.
    PyTorch's CPU SDPA is slower there still: its math path rescales every cached key and its
    fused kernel handles a mask over a long cache slowly. Many rows (prefill): the fused kernel,
    which needs 4-D inputs to be chosen (with 3-D inputs SDPA takes the math path).
    K/V in another dtype than q (a 16-bit cache) are widened to q's dtype on those paths.
    `k` may instead be an int16 cache's heads (`Int16Heads`, `v` None): up to NATIVE_QUERY_ROWS
    rows seeing a prefix of the keys go to the integer kernel, whose rows give the same bits
    whatever rows share the call; others read the integers widened to float32.
    `windowed`: a sliding-window layer's keys, which take the native kernel at any length (a
    verification's band and a step's window are then read alike, bit for bit).
    """
    R, T = q.shape[1], k.shape[1]
    cpu = q.device.type == "cpu"
    if isinstance(k, Int16Heads):  # an int16 cache (`kv.int16`): the integer kernel for few rows
        kernel = native_attention.kernel()
        if (R <= NATIVE_QUERY_ROWS and q.dtype == torch.float32
                and (mask is None or (mask.limits is not None and mask.firsts is None))):
            return kernel.integer_attention(q, k, None if mask is None else mask.limits, scale, chunk)
        # many rows (prefill) or a window cut: PyTorch's paths over the integers widened to float32
        k, v = kernel.integer_tokens(k, torch.arange(T).expand(k.heads, T), _buffer((k.heads, T, k.head_dim), q.dtype))
    # 16-bit K/V take the kernel at any length: PyTorch's path would widen them first
    if (cpu and R <= NATIVE_QUERY_ROWS and (T >= native_attention.MIN_KEYS or k.dtype != q.dtype or windowed)
            and q.dtype == torch.float32
            and (mask is None or mask.limits is not None)):
        kernel = native_attention.kernel() if native else None
        if kernel is not None:
            if mask is not None and mask.firsts is not None:  # a band: a window cut
                return kernel.attention(q, k, v, mask.limits, scale, chunk, firsts=mask.firsts)
            return kernel.attention(q, k, v, None if mask is None else mask.limits, scale, chunk)
    if (not cpu and R <= CUDA_FEW_ROWS and CUDA_FLASH is not None and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and (mask is None or (mask.limits is not None and mask.firsts is None and T >= CUDA_SPLIT_KEYS))):
        return cuda_few_rows(q, k, v, mask, scale), None
    if k.dtype != q.dtype:  # a 16-bit cache: PyTorch's kernels want one dtype (exact when widening)
        k, v = widened(k, v, q.dtype)
    few = R <= (SMALL_QUERY_ROWS if chunk <= 0 else PROBED_QUERY_ROWS) and cpu
    if not few and mask is not None and mask.new_bias is not None and FLASH_LSE is not None:
        return split_attention(q, k, v, mask.new_bias, scale), None
    if not few:
        attn_mask = None if mask is None else mask.visible
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=attn_mask, scale=scale)[0], None
    scores = torch.matmul(q * scale, k.transpose(1, 2))  # [Hkv, R, T]
    if mask is not None:  # only the columns that hide something (the new tokens, causally)
        scores[:, :, mask.start :].masked_fill_(mask.hidden, float("-inf"))
    weights = scores.softmax(dim=-1)
    mass = None
    if chunk > 0:  # the caller reads the attention each chunk received (KeyMass)
        n = T // chunk
        mass = weights[:, :, : n * chunk].reshape(q.shape[0], R, n, chunk).sum(dim=-1)
    return torch.matmul(weights, v), mass


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new_bias: torch.Tensor, scale: float):
    """Prefill attention as two flash passes merged by their log-sum-exps: the cached keys,
    seen by every query, with no mask; the chunk's own S keys with the causal mask.

    The CPU flash kernel given a mask over the whole cache reads that mask for every key and
    cannot skip work. q: [Hkv, R, D],
    k/v: [Hkv, T, D], new_bias: [R, S] additive (0 or -inf) -> [Hkv, R, D].
    """
    S = new_bias.shape[1]
    past = k.shape[1] - S
    out_new, lse_new = FLASH_LSE(q[None], k[None, :, past:], v[None, :, past:], 0.0, False,
                                  attn_mask=new_bias, scale=scale)
    if past == 0:
        return out_new[0]
    out_old, lse_old = FLASH_LSE(q[None], k[None, :, :past], v[None, :, :past], 0.0, False, scale=scale)
    top = torch.maximum(lse_old, lse_new)  # [1, Hkv, R]; each row sees its own key: finite
    w_old, w_new = (lse_old - top).exp_(), (lse_new - top).exp_()
    total = w_old + w_new
    w_old, w_new = (w_old / total)[..., None], (w_new / total)[..., None]
    return (out_old.float() * w_old + out_new.float() * w_new).to(q.dtype)[0]


def cuda_few_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None, scale: float,
                  flash=None) -> torch.Tensor:
    """A few rows over a long cache on a GPU, in 16 bits (a decoding step, a verification).

    The flash kernel spreads a long key range over the multiprocessors (flash-decoding's split),
    but takes no mask. So the cached keys, which every row sees, go through it unmasked; the S
    new keys, causal among themselves, through two small products in float32; the two parts are
    merged by their log-sum-exps. A single row (S = 1, no mask) takes the kernel alone.

    PyTorch's own choice is several times slower here (`bench.cuda_levels`): for a step it picks
    cuDNN's kernel, which does not split the keys, and a verification's mask sends it to the
    memory-efficient kernel. The arithmetic differs from a single pass by rounding only: in bfloat16
    a verification's logits then differ from a step's by a few units in the last place, where
    PyTorch's path happened to match them bit for bit (`bench.cuda_exactness`).
    q: [Hkv, R, D], k/v: [Hkv, T, D] -> [Hkv, R, D]. `flash` stands in for the CUDA kernel
    (tests pass the CPU's, which returns the same two outputs).
    """
    flash = flash or CUDA_FLASH
    if mask is None:  # every row sees every key
        return flash(q[None], k[None], v[None], scale=scale)[0][0]
    S = mask.hidden.shape[1] + 1  # the hidden columns are the new keys after the first
    past = k.shape[1] - S
    scores = torch.matmul(q.float(), k[:, past:].float().transpose(1, 2)).mul_(scale)  # [Hkv, R, S]
    scores[:, :, 1:].masked_fill_(mask.hidden, float("-inf"))
    lse_new = scores.logsumexp(dim=-1)  # [Hkv, R]; each row sees the first new key: finite
    out_new = torch.matmul(scores.sub_(lse_new[..., None]).exp_(), v[:, past:].float())  # [Hkv, R, D]
    if past == 0:
        return out_new.to(q.dtype)
    out_old, lse_old = flash(q[None], k[None, :, :past], v[None, :, :past], scale=scale)[:2]
    lse_old = lse_old[0].float()
    top = torch.maximum(lse_old, lse_new)
    w_old, w_new = (lse_old - top).exp_(), (lse_new - top).exp_()
    total = w_old + w_new
    out = out_old[0].float() * (w_old / total)[..., None] + out_new * (w_new / total)[..., None]
    return out.to(q.dtype)


def attention_mask(
    S: int, T: int, key_start: int, window: int | None, G: int, device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Mask | None:
    """Boolean mask [G*S, T] (True = attend) for S new queries against T keys, the new ones last.

    Every cached key is in the past of every new query; among the new tokens attention is
    causal. With a sliding window (only for caches whose key index is the absolute position,
    key_start being the first key's position), query i at position P_i sees keys > P_i - window.
    Returns None when nothing needs masking (a single query without window cut).
    """
    if S == 1 and (window is None or T <= window):  # one query sees every key
        return None
    past = T - S
    q_idx = torch.arange(S, device=device)[:, None]  # [S, 1]
    if window is None or T <= window:  # no window cut: every cached key, the new ones causally
        # Built over the S new columns only: an [R, T] mask over a long cache costs a verification more.
        hidden = (torch.arange(S, device=device)[None, :] > q_idx).repeat(G, 1)  # [G*S, S], rows (g, s)
        new_bias = None
        if device.type == "cpu" and G * S > SMALL_QUERY_ROWS:
            new_bias = torch.zeros(G * S, S, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        limits = (past + 1 + torch.arange(S, device=device)).repeat(G)
        return Mask(past + 1, hidden[:, 1:], new_bias, limits)
    k_idx = torch.arange(T, device=device)[None, :]  # [1, T]
    visible = (k_idx <= past + q_idx) & (key_start + k_idx > key_start + past + q_idx - window)
    hidden_cols = (~visible).any(dim=0).nonzero()
    if hidden_cols.numel() == 0:
        return None
    visible = visible.repeat(G, 1)  # rows ordered (g, s) like the folded queries
    start = int(hidden_cols[0])
    new_bias = None
    if start >= past and device.type == "cpu" and G * S > SMALL_QUERY_ROWS:
        new_bias = torch.zeros(G * S, S, dtype=dtype, device=device).masked_fill_(~visible[:, past:], float("-inf"))
    # A window cut leaves some row without the oldest keys: each row sees a band of the keys,
    # [firsts, limits) (the float native kernel reads bands; the integer one prefixes only).
    rows = torch.arange(S, device=device)
    limits = (past + 1 + rows).repeat(G)
    firsts = (past + rows - window + 1).clamp(min=0).repeat(G)
    return Mask(start, ~visible[:, start:], new_bias, limits, firsts)
