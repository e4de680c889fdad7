"""StreamingLLM cache for the small draft: attention sinks plus a recent window.

Keys are stored rotated with their *slot* index as position, so positions are re-based inside
the cache and never exceed sinks + window + slack: a draft trained on a short context keeps
working at any sequence length. When the window part outgrows window + slack, `compact` moves
the newest `window` tokens next to the sinks and re-rotates their keys by the shift
(rotations compose: R(p - s) = R(-s) R(p)). Compaction runs only between rounds, on committed
tokens, so rolling back a rejected speculation never reaches evicted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.rotary import Rotary, apply_rotary
from .store import KVStore


class StreamingCache(KVStore):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        sinks: int,
        window: int,
        margin: int,
        rotary: Rotary | Sequence[Rotary],  # one for every layer, or each layer's own
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.sinks = sinks
        self.window = window
        self.slack = max(16, window // 4)
        self.margin = margin
        self.rotary = [rotary] * num_layers if isinstance(rotary, Rotary) else list(rotary)
        super().__init__(num_layers, num_kv_heads, head_dim, sinks + window + self.slack + margin, dtype, device)
        self.evicted = 0  # tokens dropped from the middle so far

    def snapshot(self) -> tuple:
        return super().snapshot(), self.evicted

    def restore(self, snap: tuple) -> None:
        data, self.evicted = snap
        super().restore(data)

    def positions(self, logical_start: int, n: int) -> torch.Tensor:
        # Re-based: a token's position is its slot in the cache, whatever its sequence index.
        return torch.arange(self.length, self.length + n, device=self.k.device)

    @property
    def room(self) -> int:
        """Tokens that can be fed before the next compaction is required."""
        return self.sinks + self.window + self.slack - self.length

    def compact(self, force: bool = False) -> None:
        """Evict the middle so that sinks + the newest `window` tokens remain."""
        keep_from = self.length - self.window
        if keep_from <= self.sinks:
            return
        if not force and self.length <= self.sinks + self.window + self.slack:
            return
        shift = keep_from - self.sinks
        # In float32 whatever the K/V dtype, rounded back into it when written: a 16-bit cache
        # loses one rounding per compaction, not the rotation's whole arithmetic.
        back = torch.tensor([-shift], device=self.k.device)
        for rot in {id(r): r for r in self.rotary}.values():  # each set of parameters once, over its layers
            layers = [i for i, r in enumerate(self.rotary) if r is rot]
            cos, sin = rot.cos_sin(back, torch.float32, scaled=False)
            if len(layers) == len(self.rotary):
                self.k[:, :, self.sinks : self.sinks + self.window] = apply_rotary(
                    self.k[:, :, keep_from : self.length].float(), cos, sin)
            else:
                for i in layers:
                    self.k[i, :, self.sinks : self.sinks + self.window] = apply_rotary(
                        self.k[i, :, keep_from : self.length].float(), cos, sin)
        self.v[:, :, self.sinks : self.sinks + self.window] = self.v[:, :, keep_from : self.length].clone()
        self.length = self.sinks + self.window
        self.evicted += shift
