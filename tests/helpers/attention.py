"""Attention by definition, in float64: what the native attention kernels are held to."""

from __future__ import annotations

import torch


def attention_reference(q, k, v, limits, scale, chunk, firsts=None):
    """float64: out [H, R, D] and the mass of each whole chunk [H, R, T // chunk]; row r sees keys
    t < limits[r] and, with `firsts`, t >= firsts[r]."""
    T = k.shape[1]
    s = torch.matmul(q.double() * scale, k.double().transpose(1, 2))
    s = s.masked_fill(torch.arange(T)[None, None, :] >= limits[None, :, None], float("-inf"))
    if firsts is not None:
        s = s.masked_fill(torch.arange(T)[None, None, :] < firsts[None, :, None], float("-inf"))
    w = s.softmax(-1)
    n = T // chunk
    return torch.matmul(w, v.double()), w[:, :, : n * chunk].reshape(q.shape[0], q.shape[1], n, chunk).sum(-1)
