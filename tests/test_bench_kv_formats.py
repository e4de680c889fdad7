"""bench.kv_formats: the integer roundings it applies to a cache, which slots it touches, and
its reader of the cache through the integer attention kernel."""

import pytest
import torch
from tests.helpers.native import built, needs_compiler

import triforce_core.models.native_attention as native_attention
from bench.kv_formats import FORMATS, KernelAttention, int_blocks, int8_channels, main, round_step
from triforce_core.kv import FullCache
from triforce_core.models import int16_kv


def test_blocks_land_on_the_int8_grid_of_their_own_scale():
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)
    y = int_blocks(x, 32)
    for b in range(2):
        xb, yb = x[..., 32 * b:32 * (b + 1)], y[..., 32 * b:32 * (b + 1)]
        scale = (xb.abs().amax(-1, keepdim=True) / 127).half().float()
        q = yb / scale
        assert torch.equal(q, torch.round(q))  # whole multiples of the block's scale
        assert q.abs().max() <= 127
        assert torch.all((yb - xb).abs() <= scale / 2 + 1e-3 * scale)
    # one scale per block: the small half's values are not rounded on the large half's grid
    assert (int_blocks(x, 0)[..., :32] - x[..., :32]).abs().max() > (y[..., :32] - x[..., :32]).abs().max()


def test_sixteen_bit_blocks_keep_a_float32_scale():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    y = int_blocks(x, 0, 16)
    scale = x.abs().amax(-1, keepdim=True) / 32767
    assert torch.allclose(torch.round(y / scale), y / scale, atol=1e-3)
    assert (y - x).abs().max() <= scale.max() / 2 * 1.001


@needs_compiler
def test_the_kernel_reader_packs_each_token_once_and_reads_as_the_kernel_does():
    """`KernelAttention` over a cache growing a token a step (and rewritten after a truncation)
    gives the kernel's bits over the whole cache packed at once."""
    kernel = built(native_attention)
    g = torch.Generator().manual_seed(3)
    H, T, D = 2, 300, 64
    k, v = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    reader = KernelAttention(kernel, T)
    for t in (1, 2, 100, 101):
        q = torch.randn(H, 1, D, generator=g)
        out, _ = reader(q, k[:, :t], v[:, :t], None, 0.125)
        assert torch.equal(out, kernel.integer_attention(q, int16_kv.pack(k[:, :t], v[:, :t]), None, 0.125)[0])
    before = k.clone()
    k[:, 60:] += 1  # the cache truncated to 60 and refilled with other tokens
    q = torch.randn(H, 1, D, generator=g)
    out, _ = reader(q, k[:, :61], v[:, :61], None, 0.125)
    assert (len(reader.layers), reader.layers[k.data_ptr()].length) == (1, 61)
    assert torch.equal(out, kernel.integer_attention(q, int16_kv.pack(k[:, :61], v[:, :61]), None, 0.125)[0])
    assert not torch.equal(out, kernel.integer_attention(q, int16_kv.pack(before[:, :61], v[:, :61]), None, 0.125)[0])


def test_a_zero_block_stays_zero_and_a_bad_block_is_refused():
    assert torch.equal(int_blocks(torch.zeros(2, 64), 32), torch.zeros(2, 64))
    with pytest.raises(ValueError):
        int_blocks(torch.zeros(2, 48), 32)


def test_channels_take_one_scale_per_channel_over_the_tokens():
    k = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))  # [tokens, D]
    k[:, 3] *= 100  # an outlier channel: its scale must not coarsen the others
    y = int8_channels(k)
    assert torch.equal(y, int_blocks(k.T, 0).T)
    assert (y[:, 0] - k[:, 0]).abs().max() < (int_blocks(k, 0)[:, 0] - k[:, 0]).abs().max()


def test_round_step_touches_only_the_step_and_complete_groups():
    cache = FullCache(2, 2, 64, 8, torch.float16, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    cache.k[:] = torch.randn(cache.k.shape, generator=g).half()
    cache.v[:] = torch.randn(cache.v.shape, generator=g).half()
    k0, v0 = cache.k.clone(), cache.v.clone()
    round_step(cache, 2, *FORMATS["keys-channel-32+values-32"][1:])  # no group of 32 complete yet
    assert torch.equal(cache.k, k0)
    assert not torch.equal(cache.v[:, :, 2], v0[:, :, 2])
    assert torch.equal(cache.v[:, :, :2], v0[:, :, :2]) and torch.equal(cache.v[:, :, 3:], v0[:, :, 3:])

    cache.k[:] = k0
    round_step(cache, 3, ("channel", 4), None)  # the group [0, 4) is complete
    assert torch.equal(cache.k[:, :, :4], int8_channels(k0[:, :, :4].float()).half())
    assert not torch.equal(cache.k[:, :, :4], k0[:, :, :4])
    assert torch.equal(cache.k[:, :, 4:], k0[:, :, 4:])

    cache.k[:], cache.v[:] = k0, v0
    round_step(cache, 5, *FORMATS["float16"][1:])
    assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0)


def test_bad_arguments_are_refused_in_one_line(capsys):
    assert main(["--formats", "int4"]) == 2
    assert "--formats takes" in capsys.readouterr().err
    assert main(["--tokens", "1"]) == 2
    assert main(["--target", "model.safetensors"]) == 2
