"""GGML's 5-bit 32-weight blocks, Q5_0 and Q5_1, read by the native kernels on every path.

Llama.cpp's Q4_K_M files keep Q5_0 where a row is not a multiple of 256 (Gemma 3 270M's q and
k, stacked with a Q8_0 v). Each check runs on the three builds of the float products: the one
this machine compiles (AVX-512 where it has it), the AVX2 path (the AVX-512 one left out) and
the scalar fallback (a build for plain x86-64: no AVX2, no F16C).

- Dequantization equals the `gguf` package's numpy one (which transformers uses) bit for bit,
  on blocks of extreme scales (zero, negative, fp16's largest and subnormal, infinite) and every
  pattern of the fifth bits (none, all, each alone, alternating, halves), with every nibble.
  Negative control: the same blocks with the 32-bit high-bit word read in the other byte order
  dequantize differently (so the check can tell the order apart).
- Products of 1..17 rows against a Q5_0, a Q5_1 and stacked matrices (q/k/v: Q5_0, Q5_0, Q8_0)
  are within float32 rounding of the float64 product of the dequantized weights, row r is the
  same bits whatever rows come with it, and the three builds agree bit for bit. Negative
  control: the weights with the high bits in the other byte order are not within it.
- A Q5_0/Q5_1 tensor whose bytes do not make its shape is refused in one line, by the
  stored tensor and by the kernel's own check (the file-level lie: tests/test_hostile_models.py).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from tests.helpers.gguf_files import random_blocks
from tests.helpers.native import built, needs_compiler
from tests.helpers.products import activation_rows

from triforce_core.models import native_build, native_layers
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
TYPES = [Q.Q5_0, Q.Q5_1]
# where each type's fields lie: (bytes a block, offset of qh, offset of the nibbles)
LAYOUT = {Q.Q5_0: (22, 2, 6), Q.Q5_1: (24, 4, 8)}
BUILDS = ["native", "avx2", "scalar"]
FP16_EXTREMES = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 3 * 2.0**-20, 2.0**-14, np.inf, -np.inf,
                 0.0137, -0.0021]
HIGH_BITS = [0, 0xFFFFFFFF, 0x55555555, 0xAAAAAAAA, 0x0000FFFF, 0xFFFF0000, 0x000000FF, 0xFF000000, 0x12345678] + [
    1 << i for i in range(32)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, native_layers.Layers]:
    """The library as this machine builds it, without its AVX-512 path, and for plain x86-64."""
    out = {"native": built(native_layers)}
    if platform.machine() == "x86_64":
        folder = tmp_path_factory.mktemp("q5-builds")
        flags = native_layers.LAYER_FLAGS
        out["avx2"] = native_layers.Layers(native_build.build(native_layers.SOURCE, flags + ("-DTRIFORCE_NO_AVX512",), folder))
        plain = tuple("-march=x86-64" if f == "-march=native" else f for f in flags)
        out["scalar"] = native_layers.Layers(native_build.build(native_layers.SOURCE, plain, folder))
    return out


def _library(builds, build: str) -> native_layers.Layers:
    if build not in builds:
        pytest.skip(f"the {build} build is an x86-64 one")
    return builds[build]


def extreme_blocks(qtype) -> np.ndarray:
    """[n, block bytes]: every (d, m) of FP16_EXTREMES paired with every qh of HIGH_BITS, the
    nibble bytes running through all 256 values across the blocks."""
    nbytes, at_qh, at_qs = LAYOUT[qtype]
    rng = np.random.default_rng(int(qtype))
    scales = [(d, m) for d in FP16_EXTREMES for m in (FP16_EXTREMES if qtype == Q.Q5_1 else [0.0])]
    pairs = [(d, m, qh) for d, m in scales for qh in HIGH_BITS]
    blocks = np.zeros((len(pairs), nbytes), np.uint8)
    for i, (d, m, qh) in enumerate(pairs):
        blocks[i, 0:2] = np.array([d], np.float16).view(np.uint8)
        if qtype == Q.Q5_1:
            blocks[i, 2:4] = np.array([m], np.float16).view(np.uint8)
        blocks[i, at_qh : at_qh + 4] = np.array([qh], "<u4").view(np.uint8)
        blocks[i, at_qs:] = (np.arange(16) + 16 * i) % 256 if i % 2 else rng.integers(0, 256, 16)
    return blocks


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """The same float32 bits, NaN (an infinite scale times zero) where the other is NaN."""
    nan = np.isnan(want)
    return bool((np.isnan(got) == nan).all() and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)))


def _high_bits_swapped(blocks: np.ndarray, qtype) -> np.ndarray:
    """The blocks with each qh word's four bytes reversed: the other byte order's reading."""
    _, at_qh, _ = LAYOUT[qtype]
    out = blocks.copy()
    out[..., at_qh : at_qh + 4] = blocks[..., at_qh : at_qh + 4][..., ::-1]
    return out


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantization_equals_the_gguf_package_bit_for_bit_at_the_extremes(builds, build, qtype):
    lib = _library(builds, build)
    blocks = extreme_blocks(qtype)
    blocks = blocks[: blocks.shape[0] // 4 * 4]
    with np.errstate(invalid="ignore"):  # an infinite scale times a zero
        want = quants.dequantize(blocks, qtype).reshape(-1, 128)
    rows = torch.from_numpy(blocks.reshape(-1, 4 * blocks.shape[1]))  # 128 weights a row
    assert _same_bits(lib.dequantize(rows, int(qtype), 128).numpy(), want)
    picked = [5, 0, -1, 3]  # the rows lookup (an embedding's) reads the same values
    assert _same_bits(lib.dequantize(rows, int(qtype), 128, rows=picked).numpy(), want[picked])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_negative_control_the_high_bits_in_the_other_byte_order_dequantize_differently(builds, qtype):
    blocks = extreme_blocks(qtype)
    got = builds["native"].dequantize(torch.from_numpy(blocks), int(qtype), 32).numpy()
    with np.errstate(invalid="ignore"):
        swapped = quants.dequantize(_high_bits_swapped(blocks, qtype), qtype)
    assert not _same_bits(got, swapped)


def _matrix(stack, seed: int) -> tuple[Matrix, torch.Tensor, torch.Tensor]:
    """A stacked matrix of random blocks over 256 inputs, its weights as the gguf package
    dequantizes them, and those weights with the 5-bit parts' high bits read in the other byte
    order (the control)."""
    rng = np.random.default_rng(seed)
    parts, dense, swapped = [], [], []
    for q, rows in stack:
        raw = random_blocks(q, rows, 256, rng)
        parts.append(StoredTensor(int(q), torch.from_numpy(raw), (rows, 256)))
        blocks = raw.reshape(rows, 8, -1)
        other = _high_bits_swapped(blocks, q).reshape(rows, -1) if q in LAYOUT else raw
        dense.append(torch.from_numpy(quants.dequantize(raw, q)))
        swapped.append(torch.from_numpy(quants.dequantize(other, q)))
    return Matrix(stored=tuple(parts)), torch.cat(dense), torch.cat(swapped)


STACKS = {"q5_0": ((Q.Q5_0, 37),), "q5_1": ((Q.Q5_1, 37),), "q5_0_qkv": ((Q.Q5_0, 24), (Q.Q5_0, 8), (Q.Q8_0, 8)),
          "q5_1_q5_0_q8_0": ((Q.Q5_1, 21), (Q.Q5_0, 19), (Q.Q8_0, 5))}


@pytest.mark.parametrize("stack", list(STACKS))
def test_products_are_exact_to_float32_rounding_and_independent_of_the_rows_beside(builds, stack):
    """1..17 rows (one row takes the outputs-side-by-side path, more the rows-sharing-a-block
    one): within float32 rounding of float64 (each output sums 16 lanes of 16 FMAs, then a tree
    of 4: at most 20 roundings of sum |w x|); row r the same bits alone and among n rows; the
    three builds the same bits."""
    m, dense, swapped = _matrix(STACKS[stack], seed=11)
    x = activation_rows(17, 256, seed=12)
    wd = dense.double()
    slack = 20 * 2.0**-24 * (x.double().abs() @ wd.abs().t()) + 1e-30
    results = {}
    for build, lib in builds.items():
        alone = torch.cat([lib.int8.product(x[r : r + 1], m, 0, threads=1) for r in range(17)])
        for n in range(2, 18):
            together = lib.int8.product(x[:n], m, 0, threads=2)
            assert torch.equal(together, alone[:n]), f"{build}: {n} rows"
        assert ((alone.double() - x.double() @ wd.t()).abs() <= slack).all(), build
        results[build] = alone
    for build, y in results.items():
        assert torch.equal(y, results["native"]), build
    # the control: weights read with the other byte order of qh are far outside the rounding
    assert not ((results["native"].double() - x.double() @ swapped.double().t()).abs() <= slack).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_tensor_whose_bytes_do_not_make_its_shape_is_refused_in_one_line(builds, qtype):
    nbytes = LAYOUT[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, 4, 64, np.random.default_rng(1)))
    assert StoredTensor(int(qtype), raw, (4, 64)).dequantized().shape == (4, 64)  # the control: the right bytes
    for shape, data in (((4, 64), raw[:, :-1]), ((4, 64), torch.zeros(4, 2 * nbytes + 2, dtype=torch.uint8)),
                        ((4, 48), raw[:, : 3 * nbytes // 2])):
        with pytest.raises(ValueError, match=rf"a {qtype.name} tensor of shape \({shape[0]}, {shape[1]}\) cannot be") as e:
            StoredTensor(int(qtype), data.contiguous(), shape)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=rf"are not rows of 64 weights of GGML type {int(qtype)}") as e:
        builds["native"].dequantize(raw[:, :-2].contiguous(), int(qtype), 64)
    assert "\n" not in str(e.value)
