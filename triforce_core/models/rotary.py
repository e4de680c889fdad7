"""Rotary position embeddings (RoPE) of the supported checkpoints.

Inverse frequencies come from transformers' rope utilities (every rope type `ModelSpec`
accepts). The forward rotates queries and keys with `apply_rotary`; so does the small draft's
StreamingLLM cache when it re-bases the positions of its keys (`triforce_core.kv.streaming`).

Partial rotary (Phi-4-mini): cos/sin are [S, rotary_dim] and only the first rotary_dim numbers
of each head turn, the rest pass through (`apply_rotary`, as transformers' Phi-3 does).

Longrope (Phi-3's long-context checkpoints): transformers' forward picks the short or the long
factors for all its rows by its largest position (`dynamic_rope_update`: long once the length
passes original_max_position_embeddings) and never re-rotates a cached key; here each position
takes its own (`Rotary.long_from`), the same numbers for a position whatever forward, chunk or
cache computes it, which equals that forward one token at a time. But Phi-3's `generate` drops
its cache when the sequence first passes original_max_position_embeddings and recomputes every
position with the long factors: a generation that reaches that length would need every cached
key re-rotated, which this engine does not do, so `Rotary.refusal` names it and the engine
refuses it (`TriForceEngine.check_prompt`); every shorter one equals transformers' answer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .spec import ModelSpec

TABLE_BLOCK = 256  # positions per block of precomputed rotary values


class Rotary:
    """Rotary position embeddings; inverse frequencies from transformers' rope utilities."""

    def __init__(self, config: Any, spec: ModelSpec, device: torch.device, layer_type: str | None = None):
        """`layer_type`: the key of config.rope_parameters whose parameters these are (a model whose
        layer types have parameters of their own, `ModelSpec.rope_layer_types`), else None."""
        self.config = config
        self.spec = spec
        self.device = device
        self.layer_type = layer_type
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        self.rope_type = params.get("rope_type", "default")
        self.long_from: int | None = None  # longrope: the first position rotated with the long factors
        self.long_inv_freq: torch.Tensor | None = None
        if self.rope_type == "default":
            base = params["rope_theta"]
            dim = spec.rotated
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
            scaling = 1.0
        elif layer_type is None:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, device)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, device, layer_type=layer_type)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float)
        self.scaling = float(scaling)
        if self.rope_type == "longrope":  # the short factors above; the long ones as transformers takes them
            self.long_from = int(config.rope_parameters["original_max_position_embeddings"])
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=self.long_from + 1)
            self.long_inv_freq = long_inv.to(device=device, dtype=torch.float)
        self._table: tuple | None = None  # ((start, dtype), (cos, sin)) of one block of positions

    def _freqs_for(self, max_position: int) -> tuple[torch.Tensor, float]:
        """Dynamic types depend on the sequence length seen by the forward (as in transformers)."""
        original = self.spec.max_position_embeddings
        seq_len = max_position + 1
        if self.rope_type == "dynamic" and seq_len > original:
            extra = {} if self.layer_type is None else {"layer_type": self.layer_type}
            inv, scaling = ROPE_INIT_FUNCTIONS["dynamic"](self.config, self.device, seq_len=seq_len, **extra)
            return inv.to(self.device, torch.float), float(scaling)
        return self.inv_freq, self.scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [S] int64 -> cos, sin: [S, head_dim] in `dtype`.

        A decoding step's few positions are read from a block of `TABLE_BLOCK` consecutive
        positions computed once (the block is fixed by the position, so a position's values do
        not depend on the history): computing them costs ~8 operators a forward."""
        n = positions.numel()
        if scaled and 0 < n <= TABLE_BLOCK and self.rope_type != "dynamic" and positions.device.type == "cpu":
            # The positions as Python numbers: one operator. After a forward has streamed the
            # weights through the caches, each operator's first call costs its cache misses,
            # and a step's positions are consecutive: two views of the block, not five operators.
            at = positions.tolist() if positions.dim() == 1 else positions.reshape(-1).tolist()
            lo, hi = min(at), max(at)
            start = lo // TABLE_BLOCK * TABLE_BLOCK
            if lo >= 0 and hi < start + TABLE_BLOCK:
                if self._table is None or self._table[0] != (start, dtype):
                    block = torch.arange(start, start + TABLE_BLOCK, device=positions.device)
                    self._table = ((start, dtype), self._compute(block, dtype, True))
                cos, sin = self._table[1]
                if positions.dim() == 1 and at == list(range(lo, lo + n)):  # read only: views of the table
                    return cos[lo - start : lo - start + n], sin[lo - start : lo - start + n]
                index = positions - start
                return cos[index], sin[index]
        return self._compute(positions, dtype, scaled)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.inv_freq, self.scaling
        if self.rope_type == "dynamic":  # reading the largest position waits for the device: only here
            inv_freq, scaling = self._freqs_for(int(positions.max()) if positions.numel() else 0)
        if self.long_inv_freq is not None:  # longrope: each position's own factors
            inv_freq = torch.where((positions >= self.long_from)[:, None], self.long_inv_freq[None, :], inv_freq[None, :])
        freqs = positions[:, None].to(torch.float) * inv_freq  # [S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
        s = scaling if scaled else 1.0
        return (emb.cos() * s).to(dtype), (emb.sin() * s).to(dtype)

    def refusal(self, prompt: int, new: int) -> str | None:
        """Why a generation of `new` tokens after a `prompt`-token prompt cannot give transformers'
        answer, or None: with longrope, one whose forwards reach original_max_position_embeddings
        tokens (module docstring)."""
        if self.long_from is None or prompt + new - 1 <= self.long_from:
            return None
        return (f"prompt ({prompt} tokens) + max_new_tokens ({new}) pass this model's longrope switch at "
                f"{self.long_from} tokens (original_max_position_embeddings), where transformers re-rotates every "
                f"cached key with the long factors, which this engine does not do; keep them within {self.long_from}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., S, D]; cos/sin: [S, D], or [S, R < D] (partial rotary: the first R numbers turn,
    the rest pass through)."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        part = x[..., :rotated]
        return torch.cat([part * cos + rotate_half(part) * sin, x[..., rotated:]], dim=-1)
    return x * cos + rotate_half(x) * sin
