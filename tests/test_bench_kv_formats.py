"""bench.kv_formats: the 8-bit roundings it applies to a cache, and which slots it touches."""

import pytest
import torch

from bench.kv_formats import FORMATS, int8_blocks, int8_channels, main, round_step
from triforce_core.kv import FullCache


def test_blocks_land_on_the_int8_grid_of_their_own_scale():
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)
    y = int8_blocks(x, 32)
    for b in range(2):
        xb, yb = x[..., 32 * b:32 * (b + 1)], y[..., 32 * b:32 * (b + 1)]
        scale = (xb.abs().amax(-1, keepdim=True) / 127).half().float()
        q = yb / scale
        assert torch.equal(q, torch.round(q))  # whole multiples of the block's scale
        assert q.abs().max() <= 127
        assert torch.all((yb - xb).abs() <= scale / 2 + 1e-3 * scale)
    # one scale per block: the small half's values are not rounded on the large half's grid
    assert (int8_blocks(x, 0)[..., :32] - x[..., :32]).abs().max() > (y[..., :32] - x[..., :32]).abs().max()


def test_a_zero_block_stays_zero_and_a_bad_block_is_refused():
    assert torch.equal(int8_blocks(torch.zeros(2, 64), 32), torch.zeros(2, 64))
    with pytest.raises(ValueError):
        int8_blocks(torch.zeros(2, 48), 32)


def test_channels_take_one_scale_per_channel_over_the_tokens():
    k = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))  # [tokens, D]
    k[:, 3] *= 100  # an outlier channel: its scale must not coarsen the others
    y = int8_channels(k)
    assert torch.equal(y, int8_blocks(k.T, 0).T)
    assert (y[:, 0] - k[:, 0]).abs().max() < (int8_blocks(k, 0)[:, 0] - k[:, 0]).abs().max()


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
