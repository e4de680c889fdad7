"""The physical limit of autoregressive decoding: memory bandwidth / bytes read per token.

Decoding one token reads every weight of the target once and the keys and values of every
cached token once; at long context and batch size 1 both are far larger than the caches of the
processor, so a token cannot take less than (weight bytes + KV bytes) / memory bandwidth.
The bandwidth is measured here, in the same process as the benchmark, by reading a buffer
much larger than the last-level cache (median of several passes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .loading import sync_device
from .model import DecoderModel

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


def kv_bytes(model: DecoderModel, context_tokens: int) -> int:
    """K and V of `context_tokens` tokens over all layers: 2 * L * Hkv * D * dtype bytes * context."""
    return model.spec.kv_bytes(context_tokens, torch.empty((), dtype=model.dtype).element_size())


def measure_bandwidth(device: torch.device, nbytes: int = BUFFER_BYTES, passes: int = 7) -> float:
    """Read bandwidth in GB/s: a sum over a large float32 buffer with the process's threads."""
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


def decode_weight_bytes(model: DecoderModel) -> int:
    """Weight bytes one decoding step reads: every weight, but only one row of an untied embedding."""
    w = model.weight_bytes()
    if model.embed.data_ptr() != model.lm_head.data_ptr():
        w -= (model.embed.shape[0] - 1) * model.embed.shape[1] * model.embed.element_size()
    return w


def measure_limit(model: DecoderModel, context_tokens: int) -> Limit:
    w = decode_weight_bytes(model)
    kv = kv_bytes(model, context_tokens)
    bw = measure_bandwidth(model.device)
    return Limit(bytes_per_token=w + kv, weight_bytes=w, kv_bytes=kv, bandwidth_gbs=bw,
                 tokens_per_s=bw * 1e9 / (w + kv))
