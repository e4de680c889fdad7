"""The physical limits: decoding by memory bandwidth, prefill by arithmetic.

Decoding:
Decoding one token reads every weight of the target once and the keys and values of every
cached token once; at long context and batch size 1 both are far larger than the caches of the
processor, so a token cannot take less than (weight bytes + KV bytes) / memory bandwidth.
The bandwidth is measured here, in the same process as the benchmark, by reading a buffer
much larger than the last-level cache (median of several passes).

Prefill: each new token costs twice the non-embedding parameters in matrix products, and each
causal (query, key) pair four times head_dim times heads times layers in attention (scores and weighted values); at
64K tokens attention is most of it. Its limit is the processor's matrix-multiply rate,
measured here on a square float32 product.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .loading import sync_device
from .transformer import Transformer
from .quantized import Matrix

BUFFER_BYTES = 512 * 2**20  # well above any last-level cache


@dataclass(frozen=True)
class Limit:
    bytes_per_token: int  # weight bytes + KV bytes at the context length
    weight_bytes: int  # weights read per token (one row of an untied embedding)
    kv_bytes: int
    bandwidth_gbs: float  # measured read bandwidth, 1e9 bytes / s
    tokens_per_s: float  # bandwidth / bytes_per_token: the autoregressive roofline

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes(model: Transformer, context_tokens: int, kv_dtype: torch.dtype | None = None) -> int:
    """K and V of `context_tokens` tokens over all layers: 2 * L * Hkv * D * dtype bytes * context
    (`kv_dtype`: the cache's; None: the model's dtype); an int16 cache (torch.int16) also holds
    two float32 steps per token and KV head."""
    spec = model.spec
    steps = 8 * spec.num_layers * spec.num_kv_heads * context_tokens if kv_dtype == torch.int16 else 0
    return spec.kv_bytes(context_tokens, torch.empty((), dtype=kv_dtype or model.dtype).element_size()) + steps


def measure_bandwidth(device: torch.device, nbytes: int = BUFFER_BYTES, passes: int = 7) -> float:
    """Read bandwidth in gigabytes a second: a sum over a large float32 buffer with the process's threads."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(passes + 1):
        sync_device(device)
        t0 = time.perf_counter()
        x.sum()
        sync_device(device)
        if i:  # the first pass touches the pages
            times.append(time.perf_counter() - t0)
    del x
    return x_bytes(nbytes) / statistics.median(times) / 1e9


def x_bytes(nbytes: int) -> int:
    return nbytes // 4 * 4


def decode_weight_bytes(model: Transformer) -> int:
    """Weight bytes one decoding step reads: every weight, but only one row of an untied embedding."""
    w = model.weight_bytes()
    if model.embed is not model.lm_head:
        embed = model.embed
        nbytes, rows = (embed.nbytes(), embed.n_out) if isinstance(embed, Matrix) else (embed.numel() * embed.element_size(), embed.shape[0])
        w -= nbytes // rows * (rows - 1)
    return w


def nonembedding_params(spec) -> int:
    """Parameters of the attention and MLP projections (what every token multiplies)."""
    h, qkv = spec.hidden_size, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    attn = h * qkv + spec.num_heads * spec.head_dim * h
    return spec.num_layers * (attn + 3 * h * spec.intermediate_size)


def prefill_flops(spec, start: int, end: int) -> float:
    """Floating-point operations to prefill positions [start, end) after `start` cached tokens."""
    n = end - start
    pairs = (end * (end + 1) - start * (start + 1)) / 2  # sum of (p + 1) over the new positions
    return 2.0 * nonembedding_params(spec) * n + 4.0 * spec.head_dim * spec.num_heads * spec.num_layers * pairs


def measure_matmul_gflops(device: torch.device, n: int = 2048, passes: int = 5) -> float:
    """The float32 matrix-multiply rate in GFLOP/s (median of `passes` n x n products)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = []
    for i in range(passes + 1):
        sync_device(device)
        t0 = time.perf_counter()
        a @ b
        sync_device(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def measure_limit(model: Transformer, context_tokens: int, kv_dtype: torch.dtype | None = None) -> Limit:
    w = decode_weight_bytes(model)
    kv = kv_bytes(model, context_tokens, kv_dtype)
    bw = measure_bandwidth(model.device)
    return Limit(bytes_per_token=w + kv, weight_bytes=w, kv_bytes=kv, bandwidth_gbs=bw,
                 tokens_per_s=bw * 1e9 / (w + kv))
