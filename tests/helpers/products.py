"""Inputs and references for the quantized products' tests (`triforce_core.models.int8`).

Activation rows of varied size, matrices of random blocks, the activations' quantizations as
defined (8 bits in one or two levels, 16 bits), and the checks several kernels' tests share.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tests.helpers.gguf_files import random_blocks
from triforce_core.models.quantized import Matrix, StoredTensor

K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def activation_rows(S: int, K: int, seed: int) -> torch.Tensor:
    """Activations of varied size: normal rows, one a thousand times smaller, one with a
    dominant input, one of zeros (a block with d = 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, K, generator=g)
    if S > 1:
        x[1] *= 1e-3
    if S > 2:
        x[2, 5] = 40.0
    if S > 3:
        x[3] = 0.0
    return x


def random_matrix(qtype, rows: int, cols: int, seed: int) -> tuple[Matrix, torch.Tensor]:
    """A one-part matrix of random blocks of `qtype`, and its weights dequantized ([rows, cols] float32)."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    t = StoredTensor(int(qtype), torch.from_numpy(raw), (rows, cols))
    return Matrix(stored=(t,)), t.dequantized()


def one_level(x: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, q) per input: d = max|x| / 127 per block of `per` (float32), q = round(x / d) half away
    from zero (as the kernel: x times the float32 inverse of d), clamped to +-127."""
    S, K = x.shape
    blocks = x.astype(np.float32).reshape(S, K // per, per)
    d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    v = (blocks * inv).astype(np.float64)
    q = np.clip(np.trunc(v + np.copysign(0.5, v)), -127, 127).astype(np.float32)
    return np.broadcast_to(d, blocks.shape).reshape(S, K), q.reshape(S, K)


def two_levels(x: np.ndarray, per: int) -> np.ndarray:
    """The inputs the two levels carry: d1 q1 + d2 q2, the residual r = x - d1 q1 in float32."""
    d1, q1 = one_level(x, per)
    r = (x.astype(np.float32) - (d1 * q1).astype(np.float32)).astype(np.float32)
    d2, q2 = one_level(r, per)
    return d1.astype(np.float64) * q1 + d2.astype(np.float64) * q2


def sixteen_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d, q) per input as defined: d = max|x| / 32767 per 256 (float32), q = round(x / d) half
    away from zero (x times the float32 inverse of d), clamped to +-32767."""
    S, K = x.shape
    blocks = x.astype(np.float32).reshape(S, K // 256, 256)
    d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(32767)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    v = (blocks * inv).astype(np.float64)
    q = np.clip(np.trunc(v + np.copysign(0.5, v)), -32767, 32767)
    return np.broadcast_to(d, blocks.shape).reshape(S, K), q.reshape(S, K)


def assert_16_bit_products(kernels, qtype, mode: int, rows: int) -> torch.Tensor:
    """`mode`'s products (16-bit activations) of `rows` rows are within float32 rounding (1e-6 of
    sum |w x|) of the 16-bit inputs times the weights; the two levels' inputs, which carry about
    one bit less, are not (the negative control). Returns them, with their slack."""
    m, w = random_matrix(qtype, 31, 768, seed=6)
    x = activation_rows(rows, 768, seed=7)
    y = kernels.product(x, m, mode, threads=2).double()
    wd = w.double()
    slack = 1e-6 * (x.double().abs() @ wd.abs().t()) + 1e-30
    d, q = sixteen_bits(x.numpy())
    assert ((y - torch.from_numpy(d.astype(np.float64) * q) @ wd.t()).abs() <= slack).all()
    two = torch.from_numpy(two_levels(x.numpy(), 256)) @ wd.t()
    assert not ((y - two).abs() <= slack).all()
    return y, slack


def mixed_stack(rng, K: int) -> dict:
    """One matrix's parts of every kind, by type: the three K types, four 32-weight ones, float16."""
    parts = {q: StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, K, rng)), (rows, K))
             for q, rows in ((Q.Q4_K, 20), (Q.Q8_0, 9), (Q.Q6_K, 17), (Q.Q4_1, 5), (Q.Q5_0, 6), (Q.Q5_K, 3), (Q.Q5_1, 4))}
    parts[Q.F16] = StoredTensor(int(Q.F16), torch.from_numpy(rng.standard_normal((6, K)).astype(np.float16).view(np.uint8)), (6, K))
    return parts


def assert_each_part_as_alone(kernels, x, parts: dict, mode: int) -> None:
    """The stack's product in `mode` gives each part's outputs as that part alone does: `mode`
    for the K types, the float path for the others."""
    stack = kernels.product(x, Matrix(stored=tuple(parts.values())), mode, threads=2)
    start = 0
    for q, p in parts.items():
        want = kernels.product(x, Matrix(stored=(p,)), mode if q in K_TYPES else 0, threads=1)
        assert torch.equal(stack[:, start : start + p.shape[0]], want), q.name
        start += p.shape[0]


def edge_rows(S: int) -> torch.Tensor:
    """S >= 7 rows of 512 inputs at the edges: halves, the clamp (q = -32767: hi -128), zeros,
    denormals, a NaN (its block's d NaN, so the row's outputs NaN as the float path's), infinity,
    a huge block, every input negative (hi at its floor)."""
    rows = activation_rows(S, 512, seed=4).numpy().copy()
    rows[0, :16] = [32767, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 32766.5, -32766.5, 0.0, -0.0, 1e-40, -3e-39, 7.5, -7.5, -32767]
    rows[1, 3] = np.nan
    rows[2, 300] = np.inf
    rows[3, :256] = 1e-40
    rows[4, 256:] = 0.0
    rows[5, 10] = 3.4e38
    rows[6] = -np.abs(rows[6]) * 1e4
    return torch.from_numpy(rows)


Q4_K_M_LIKE = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q4_K,
               "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q4_K, "ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q4_K}
