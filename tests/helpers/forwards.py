"""Our model's forward fed chunk by chunk, and the check that every layer in one native call
equals a native call per side of each layer (the family modules' shared checks)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import CPU
from triforce_core.kv import FullCache
from triforce_core.models import native_layers


def chunk_logits(model, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Our logits of each chunk of ids, fed one after another over one float32 cache."""
    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, sum(map(len, chunks)) + 8, torch.float32, CPU)
    out = []
    for ids in chunks:
        pos = torch.arange(cache.length, cache.length + len(ids))
        out.append(model.forward(torch.tensor(ids), pos, cache).logits)
    return out


def assert_one_call_equals_per_layer(model) -> None:
    """Steps and a verification after a 1,100-token prefill (where the per-layer path takes the
    native attention too): `decode_layers` must run for the three short forwards, and their
    logits must equal those of the per-layer path bit for bit."""
    ids = torch.randint(3, model.vocab_size, (1109,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []
    original = native_layers.Layers.decode_layers

    def counting(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    chunks = [ids[:1100], ids[1100:1101], ids[1101:1108], ids[1108:1109]]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_layers.Layers, "decode_layers", counting)
        one = chunk_logits(model, chunks)
        assert calls == [1, 7, 1], "the one-call path did not run"
        model.one_call = False
        try:
            per_layer = chunk_logits(model, chunks)
        finally:
            del model.one_call
        assert calls == [1, 7, 1]
    for a, b in zip(one, per_layer):
        assert torch.equal(a, b)
