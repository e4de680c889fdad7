"""The integer attention over an int16 cache (`native_attention.Kernel.integer_attention`,
csrc/integer_attention.c, `models.int16_kv`).

- The layout: the planes the kernel reads hold each token's integers where the source says.
- Every path (plain C, VNNI, AMX's tiles, those that run here) gives the same bits, for row
  counts around the groups and tiles, key counts around the blocks, head sizes 64 and 128,
  causal limits and chunk sums; a row equals itself whatever rows share its call, so a
  verification row equals the step it replaces.
- Against a float64 reference over the dequantized cache: close (the queries and weights are
  rounded to 14-bit grids), and a kernel that lets each row see one key too many is caught.
- Refusals: head sizes and paths the kernel does not cover, a length past the capacity.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.native import built, needs_compiler
from tests.helpers.attention import attention_reference

import triforce_core.models.native_attention as native_attention
from triforce_core.models import int16_kv

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernel():
    return built(native_attention)


def cache(H, T, D, seed, capacity=None):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(H, T, D, generator=g) * 2, torch.randn(H, T, D, generator=g)
    return k, v, int16_kv.pack(k, v, capacity)


def test_the_planes_hold_each_tokens_integers_where_the_kernel_reads_them():
    H, T, D = 2, 37, 64
    k, v, heads = cache(H, T, D, 1, capacity=100)
    assert heads.capacity == 128 and heads.k.shape == (H, 128 * 2 * D) and heads.length == T
    ki, sk = int16_kv.on_grid(k)
    vi, sv = int16_kv.on_grid(v)
    assert torch.equal(heads.sk[:, :T], sk) and torch.equal(heads.sk[:, T:], torch.zeros(H, 128 - T))
    assert ki.abs().amax(-1).eq(int16_kv.GRID).all()  # each vector's absmax lands on the grid's end
    for h, t, d in [(0, 0, 0), (1, 36, 63), (0, 17, 5), (1, 3, 42)]:
        kat = t // 16 * 32 * D + d // 4 * 64 + t % 16 * 4 + d % 4  # the source's layout
        vat = t // 4 * 8 * D + d * 4 + t % 4
        for planes, at, plane_bytes, ints in ((heads.k, kat, 16 * D, ki), (heads.v, vat, 4 * D, vi)):
            hi, lo = int(planes[h, at]), int(planes[h, at + plane_bytes])
            assert 256 * (hi - 128) + lo == int(ints[h, t, d])
    kd, vd = int16_kv.dequantized(k, v)
    assert (kd - k).abs().max() <= k.abs().amax() / int16_kv.GRID


def test_writing_a_token_at_a_time_packs_what_writing_at_once_does():
    H, T, D = 2, 150, 128
    k, v, whole = cache(H, T, D, 4, capacity=200)
    pieces = int16_kv.empty(H, 200, D)
    for start, stop in ((0, 1), (1, 17), (17, 100), (100, 150)):
        int16_kv.write(pieces, k[:, start:stop], v[:, start:stop], start)
    assert pieces.length == T
    for a, b in ((pieces.k, whole.k), (pieces.v, whole.v), (pieces.sk, whole.sk), (pieces.sv, whole.sv)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="do not follow"):
        int16_kv.write(pieces, k[:, :1], v[:, :1], T + 1)  # a gap
    with pytest.raises(ValueError, match="do not follow"):
        int16_kv.write(pieces, k[:, :120], v[:, :120], 150)  # past the capacity (256)


SHAPES = [  # (H, R, T, D)
    (2, 1, 1, 64), (2, 1, 4099, 64), (3, 4, 300, 64), (2, 5, 256, 64), (2, 7, 257, 64), (2, 16, 1000, 64),
    (1, 17, 700, 64), (2, 28, 2049, 128), (1, 3, 513, 128),
]


@pytest.mark.parametrize("H,R,T,D", SHAPES, ids=[f"h{h}-r{r}-t{t}-d{d}" for h, r, t, d in SHAPES])
@pytest.mark.parametrize("chunk", [0, 16])
def test_every_path_gives_the_same_bits_close_to_float64(kernel, H, R, T, D, chunk):
    k, v, heads = cache(H, T, D, H * 1000 + R * 10 + T)
    q = torch.randn(H, R, D, generator=torch.Generator().manual_seed(T))
    limits = None if R == 1 else torch.tensor([max(1, T - R + 1 + r) for r in range(R)])
    results = {p: kernel.integer_attention(q, heads, limits, D**-0.5, chunk, path=p) for p in kernel.integer_paths()}
    out, mass = results["scalar"]
    for path, (o, m) in results.items():
        assert torch.equal(o, out), path
        assert (m is None and mass is None) or torch.equal(m, mass), path
    kd, vd = int16_kv.dequantized(k, v)
    seen = limits if limits is not None else torch.full((R,), T)
    ref_out, ref_mass = attention_reference(q, kd, vd, seen, D**-0.5, chunk or 8)
    assert (out.double() - ref_out).abs().max() < 2e-3  # 14-bit queries and weights
    if chunk:
        assert mass.numel() == 0 or (mass.double() - ref_mass).abs().max() < 1e-4


@pytest.mark.parametrize("D", [64, 128])
def test_a_row_is_the_same_bit_for_bit_whatever_the_rows_beside_it(kernel, D):
    """A step's rows against the same rows inside a verification, on every path: a row's
    grids are its own and its sums are integers."""
    H, R, T = 2, 28, 1500
    _, _, heads = cache(H, T, D, D)
    q = torch.randn(H, R, D, generator=torch.Generator().manual_seed(D))
    limits = torch.arange(T - R + 1, T + 1)
    alone = {}
    for path in kernel.integer_paths():
        for rows in (1, 4, 5, 16, 28):
            for start in range(0, R, rows):
                stop = min(start + rows, R)
                out, mass = kernel.integer_attention(q[:, start:stop], heads, limits[start:stop], 0.125, 16, path=path)
                for r in range(start, stop):
                    first = alone.setdefault(r, (out[:, r - start], mass[:, r - start]))
                    assert torch.equal(out[:, r - start], first[0]) and torch.equal(mass[:, r - start], first[1]), \
                        f"row {r}, {rows} rows a call, {path}"


def test_negative_control_a_leaked_key_is_caught(kernel):
    H, R, T, D = 2, 7, 3000, 64
    k, v, _ = cache(H, T, D, 5)
    v[:, T - R + 1:] *= 100  # the keys a leak would show carry large values
    heads = int16_kv.pack(k, v)
    q = torch.randn(H, R, D, generator=torch.Generator().manual_seed(5))
    limits = torch.arange(T - R + 1, T + 1)
    kd, vd = int16_kv.dequantized(k, v)
    ref_out, _ = attention_reference(q, kd, vd, limits, 0.125, 8)
    good, _ = kernel.integer_attention(q, heads, limits, 0.125)
    leaked, _ = kernel.integer_attention(q, heads, (limits + 1).clamp(max=T), 0.125)
    assert (good.double() - ref_out).abs().max() < 2e-3
    assert (leaked.double() - ref_out).abs().max() > 1e-2


def test_negative_control_one_changed_key_changes_the_bits(kernel):
    """The paths' equality is not that of outputs that ignore the cache: one key's high bytes
    moved by one (each of its integers by 256 of 32767) change the rows' bits on every path."""
    H, R, T, D = 1, 4, 600, 64
    _, _, heads = cache(H, T, D, 9)
    q = torch.randn(H, R, D, generator=torch.Generator().manual_seed(9))
    at = torch.tensor([10 // 16 * 32 * D + d // 4 * 64 + 10 % 16 * 4 + d % 4 for d in range(D)])  # token 10, high plane
    for path in kernel.integer_paths():
        before, _ = kernel.integer_attention(q, heads, None, 0.125, path=path)
        heads.k[0, at] ^= 1
        after, _ = kernel.integer_attention(q, heads, None, 0.125, path=path)
        heads.k[0, at] ^= 1
        assert not torch.equal(before, after), path


def test_refusals(kernel):
    _, _, heads = cache(1, 100, 64, 3)
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        int16_kv.pack(torch.zeros(1, 4, 48), torch.zeros(1, 4, 48))
    with pytest.raises(ValueError, match="does not run here|runs:"):
        kernel.integer_attention(q, heads, None, 0.125, path="gpu")
    with pytest.raises(ValueError, match="heads"):
        kernel.integer_attention(torch.randn(2, 2, 64), heads, None, 0.125)
    for field, bad in (("sk", heads.sk.double()), ("k", heads.k.to(torch.int16)), ("sv", heads.sv[:, :64])):
        good = getattr(heads, field)
        setattr(heads, field, bad)
        with pytest.raises(ValueError, match="contiguous uint8"):
            kernel.integer_attention(q, heads, None, 0.125)
        setattr(heads, field, good)
    heads.length = heads.capacity + 1
    with pytest.raises(ValueError, match="tokens in a cache"):
        kernel.integer_attention(q, heads, None, 0.125)
    heads.length = 100
    with pytest.raises(ValueError, match="chunks of 48"):
        kernel.integer_attention(q, heads, None, 0.125, chunk=48)
