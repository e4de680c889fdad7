"""The retrieval level's cache: the target's own keys/values, a budget-sized slice of them.

Layout after a selection at sequence length T (all keys post-rope, so each keeps its position):

    [ sink chunk | top-k chunks, per layer and KV head | recent tokens r0..T | committed since | speculative ]

Selection: the full cache is cut into chunks of `chunk_size` tokens, each represented by the
mean of its keys. For every layer the current queries score every candidate chunk; with
grouped-query attention the scores of the G query heads sharing a KV head are softmaxed per
query head over the chunks and summed over the group (an estimate of the attention mass that
KV head receives). The top-k chunks per (layer, KV head) are gathered. The first chunk
(attention sink) and the most recent tokens are always kept. When the whole sequence fits the
budget, the selection is the whole cache (the retrieval level is then the exact target).

After selection, committed tokens are appended by copying their keys/values from the full
cache (exact, full-attention KV), never recomputed.

Sliding-window layers (Gemma 3's local layers, `windows`) see only their window, the most
recent tokens: there the "chosen" chunks are the ones just before the recent tokens, so that from
the sink chunk on a local layer's slots hold consecutive positions, and when those reach back a
whole window its view is exactly the target's (`window_start`). Only the layers that read the
whole context rank and choose chunks; the counts (the chunk map, the gauge) are theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .full import FullCache
from .store import KVStore


@dataclass(frozen=True)
class Selection:
    """What one selection chose. Token spans are [start, end) sequence positions."""

    upto: int  # sequence length the selection was made at
    chunk_size: int
    dense: bool  # True when everything fit the budget
    recent_start: int  # tokens [recent_start, upto) are always kept
    chunk_counts: torch.Tensor  # [n_chunks] int64: how many (layer, KV head) pairs chose each chunk
    chunk_ids: torch.Tensor | None  # [L, Hkv, k] chosen chunk indices (None when dense)
    heads: int = 0  # the (layer, KV head) pairs that choose: the full layers' (0: every pair)

    def spans(self) -> list[tuple[int, int, int]]:
        """(start, end, count) of every chunk chosen by at least one (layer, KV head) pair."""
        counts = self.chunk_counts.tolist()
        c = self.chunk_size
        return [(i * c, min((i + 1) * c, self.upto), n) for i, n in enumerate(counts) if n > 0]


class RetrievalCache(KVStore):
    def __init__(self, full: FullCache, budget: int, chunk_size: int, recent: int, room: int,
                 windows: tuple[int | None, ...] | None = None):
        """`windows`: each layer's sliding window (None: it reads the whole context), or None:
        no layer has one."""
        # An int16 full cache's tokens are kept here as float16: this level only proposes, so its
        # reads need not be the target's, and the float kernel reads a 4K budget as fast.
        dtype = full.dtype if full.dtype.is_floating_point else torch.float16
        super().__init__(full.num_layers, full.num_kv_heads, full.head_dim, budget + room, dtype, full.device)
        self.full = full
        self.budget = budget
        self.chunk_size = chunk_size
        self.recent = recent
        self.selection: Selection | None = None
        self.windows = tuple(windows) if windows is not None else (None,) * full.num_layers
        self.local = torch.tensor([w is not None for w in self.windows])  # [L] bool
        # the first slot from which every later slot holds the next position (sparse selections)
        self.consecutive_from = 0

    def window_start(self, window: int | None) -> int:
        """A local layer's first slot to read: its window's, where the slots from
        `consecutive_from` on reach back that far (then `window_exact`), else every slot."""
        if window is None:
            return 0
        start = self.length - window + 1
        return start if start >= self.consecutive_from else 0

    def window_exact(self, window: int | None) -> bool:
        """Whether a layer of this window sees, here, exactly the keys the target's would."""
        return window is not None and (self.exact_positions or self.length - window + 1 >= self.consecutive_from)

    def snapshot(self) -> tuple:
        return super().snapshot(), self.selection, self.exact_positions, self.consecutive_from

    def restore(self, snap: tuple) -> None:
        data, self.selection, self.exact_positions, self.consecutive_from = snap
        super().restore(data)

    def select(self, queries: torch.Tensor, upto: int, mass: torch.Tensor | None = None) -> Selection:
        """Rebuild the cache from full[:upto] using queries [L, H, D] (post-rope, one position);
        with `mass` [L, Hkv, n] (attention the full target gave chunks [0, n)), rank by it, the
        queries' scores only breaking ties (chunks it never attended to)."""
        full, C = self.full, self.chunk_size
        L, Hkv, D = full.num_layers, full.num_kv_heads, full.head_dim
        if upto > full.length:
            raise ValueError(f"cannot select over {upto} tokens; the full cache holds {full.length}")
        n_chunks = (upto + C - 1) // C
        r0 = max(C, upto - self.recent) // C * C  # recent tokens start on a chunk boundary
        n_recent = upto - r0
        k = (self.budget - C - n_recent) // C  # chunks to retrieve among [1, r0 / C)
        n_cand = r0 // C - 1
        if upto <= self.budget or k >= n_cand:
            self.length = 0
            self._copy_from_full(torch.arange(upto, device=full.device).expand(Hkv, upto))
            self.exact_positions = True  # slot == position, so sliding windows apply exactly
            self.consecutive_from = 0
            heads = self._choosing() * Hkv
            counts = torch.full((n_chunks,), heads, dtype=torch.long)
            self.selection = Selection(upto, C, True, 0, counts, None, heads)
            return self.selection
        # 1. Score the candidate chunks with the current queries.
        means = full.chunk_means(C, r0 // C)[:, :, 1:]  # [L, Hkv, n_cand, D]
        H = queries.shape[1]
        q = queries.float().reshape(L, Hkv, H // Hkv, D)  # [L, Hkv, G, D]
        scores = torch.einsum("lhgd,lhcd->lhgc", q, means) * D**-0.5  # [L, Hkv, G, n_cand]
        rank = scores.softmax(dim=-1).sum(dim=2)  # [L, Hkv, n_cand]
        if mass is not None:
            seen = mass[:, :, 1 : r0 // C].to(rank.device, torch.float32)
            observed = torch.zeros_like(rank)
            observed[:, :, : seen.shape[2]] = seen
            rank = observed + 1e-3 * rank / rank.shape[-1]
        # 2. Top-k chunks per (layer, KV head), kept in sequence order.
        top = rank.topk(k, dim=-1).indices.sort(dim=-1).values + 1  # [L, Hkv, k] chunk ids
        # local layers: the k chunks just before the recent tokens, consecutive with them
        top[self.local] = torch.arange(r0 // C - k, r0 // C, device=top.device)
        # 3. Gather: sink chunk, chosen chunks, recent tokens, by position [L, Hkv, n].
        n_sel = k * C
        dev = top.device
        chosen = (top[..., None] * C + torch.arange(C, device=dev)).reshape(L, Hkv, n_sel)
        index = torch.cat([torch.arange(C, device=dev).expand(L, Hkv, C), chosen,
                           torch.arange(r0, upto, device=dev).expand(L, Hkv, n_recent)], dim=2)
        self.length = 0
        self._copy_from_full(index)
        # Slots no longer equal positions: a sliding-window model's window is not applied at this
        # (approximate) level; the full target, which verifies every token, applies it exactly.
        self.exact_positions = False
        self.consecutive_from = C
        heads = self._choosing() * Hkv
        counts = torch.bincount(top[~self.local].flatten().cpu(), minlength=n_chunks)
        counts[0] = heads
        counts[r0 // C :] = heads
        self.selection = Selection(upto, C, False, r0, counts, top, heads)
        return self.selection

    def _choosing(self) -> int:
        """Layers whose selections count: those reading the whole context (all, if none does)."""
        full_layers = int((~self.local).sum())
        return full_layers or len(self.windows)

    def append_from_full(self, start: int, end: int) -> None:
        """Append the full cache's exact keys/values of sequence positions [start, end)."""
        n = end - start
        self.reserve(n)
        self._copy_from_full(torch.arange(start, end, device=self.device).expand(self.num_kv_heads, n))

    def _copy_from_full(self, index: torch.Tensor) -> None:
        """Append the full cache's keys/values of positions index ([Hkv, n], or [L, Hkv, n] a
        layer's own)."""
        self.full.copy_to(self, self.length, index)
        self.length += index.shape[-1]
