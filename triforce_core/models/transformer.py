"""A small Llama-family decoder that runs over an explicit cache.

The weights come from a Hugging Face checkpoint (the architectures `spec` accepts, positions
by `rotary`); Hugging Face's own model is the test oracle.

Why our own forward: TriForce runs the *same* target weights against two different caches (the
full cache and the retrieval cache), so the cache must be an argument of the forward, not state
on a module; and the small draft's StreamingLLM cache needs positions re-based inside the cache.

The cache protocol (see `triforce_core.kv`): before a forward of S new tokens the caller checks
capacity; for each layer the forward calls `cache.view(layer, k_new, v_new, window)`, which
writes the new keys/values after the cached ones and returns what the new queries attend to,
the new tokens last; after the last layer it calls `cache.advance(S)`. Attention itself (the mask,
the path for each shape) is `triforce_core.models.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import int8, native_layers
from .arithmetic import Arithmetic, measured_default
from .attention import NATIVE_QUERY_ROWS, Mask, attend, attention_mask
from .int16_kv import Int16Heads
from .ggml_types import LANES
from .quantized import Matrix, StoredTensor
from .rotary import Rotary, apply_rotary
from .spec import ModelSpec, UnsupportedModelError

# A prefill's MLP on the integer products runs this many rows at a time: its [S, 2 * MLP] float32
# gate/up output is then a quarter of a 1B model's 1,024-row chunk's, so the allocator reuses
# memory instead of taking fresh pages from the kernel for each layer, and the intermediate rows
# stay in cache. Those products give each row the same bits whatever rows come with it.
MLP_ROWS = 256


class AttentionCache(Protocol):
    """What the forward needs from a cache (FullCache, RetrievalCache, StreamingCache)."""

    length: int
    exact_positions: bool  # key index == absolute position (needed for sliding windows)
    # (k, v, steps) where the one-call forward may write and read the K/V itself (`_one_call`;
    # steps: an int16 cache's scales), else None
    native_storage: tuple | None

    def view(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor | Int16Heads, torch.Tensor | None, int]: ...

    def advance(self, n: int) -> None: ...


@dataclass
class KeyMass:
    """Asks a forward for the attention mass each chunk of cached keys received.

    After the forward, `layers[l]` is [Hkv, S, n_chunks] float32: for each KV head and new
    query row, the softmax mass (summed over the query heads sharing the KV head) on cached
    keys [c*chunk, (c+1)*chunk), the whole chunks before the new tokens. Only the few-row CPU
    paths (PyTorch's and the native kernel) report them; elsewhere `layers` stays empty.
    """

    chunk: int
    layers: list = field(default_factory=list)


def _cached_chunks(mass: torch.Tensor, n: int, G: int, S: int) -> torch.Tensor:
    """A layer's per-chunk attention [Hkv, G*S, >= n] (rows ordered (g, s)) -> per KV head and new
    token, the first n chunks (the whole cached ones), summed over the G query heads: [Hkv, S, n]."""
    mass = mass[:, :, :n]
    return mass if G == 1 else mass.reshape(mass.shape[0], G, S, n).sum(dim=1)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [R, V] float32 for the requested rows
    queries: torch.Tensor | None  # [L, S, H, D] post-rope queries when captured


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Matrix  # [(H + 2*Hkv) * D outputs, hidden inputs]
    bqkv: torch.Tensor | None  # [(H + 2*Hkv) * D]
    wo: Matrix  # [hidden, H * D]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: Matrix  # [2 * I, hidden]
    w_down: Matrix  # [hidden, I]
    qk_norm: torch.Tensor | None = None  # [2 * D]: the norm over each query head, then each key head (Qwen3, Gemma 3)
    post_attn_norm: torch.Tensor | None = None  # [hidden]: on the attention's output before its residual (Gemma 3)
    post_mlp_norm: torch.Tensor | None = None  # [hidden]: on the MLP's output before its residual (Gemma 3)


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> an [in, out] copy whose rows lie an odd number of 64-byte lines apart.

    A few-row product reads a band of columns down every row; with rows a multiple of 1 KB
    apart (every width of the demo models) those reads fall into a few cache sets and evict
    each other, and a 7-row product ran at half speed (`native_layers`). PyTorch's products
    take the padded rows as they are (a leading dimension), without copying."""
    n_in, n_out = w.shape[1], w.shape[0]
    per_line = 64 // w.element_size()
    lines = -(-n_out // per_line)
    lines += 1 - lines % 2
    buf = w.new_empty(n_in, lines * per_line)
    buf[:, :n_out] = w.t()
    buf[:, n_out:] = 0
    return buf[:, :n_out]


Weight = torch.Tensor | StoredTensor  # a state entry: float, or a GGUF tensor as stored


class Transformer:
    """Llama-family weights plus a forward over an explicit cache. No state besides weights.

    `state` maps Hugging Face parameter names to float tensors, or (a GGUF file) 2-D weights to
    `StoredTensor`s: those stay as stored where the native kernels run (float32 on the CPU),
    else they are dequantized once here."""

    # Few-row forwards as one native call where they can (`_one_call`); False (on the class or
    # an instance): a native call per side of each layer (benchmarks and tests compare both).
    one_call = True

    arithmetic: Arithmetic
    """How this model computes (its products over GGUF blocks, the kernels it takes): per model,
    read at every forward. A model starts with `default_arithmetic()`; an engine sets it
    (`arithmetic.EXACT` when `exact`)."""

    def __init__(self, config: Any, state: dict[str, Weight], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.spec = ModelSpec.from_config(config)
        self.device = device
        self.dtype = dtype
        s = self.spec
        # Where the native layers may run (`native_layers`): float32 on the CPU.
        self._native_ok = device.type == "cpu" and dtype == torch.float32
        self.arithmetic = self.default_arithmetic()
        keep_stored = (
            any(isinstance(w, StoredTensor) for w in state.values())
            and self._native_ok and s.hidden_size % LANES == 0 and native_layers.kernel() is not None
        )

        def get(name: str) -> torch.Tensor:
            w = state[name]
            w = w.dequantized() if isinstance(w, StoredTensor) else w
            return w.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            """A norm's weights as the forward multiplies by them: Gemma's w is applied as 1 + w,
            added in float32 as transformers' Gemma3RMSNorm adds it."""
            if not s.norm_plus_one:
                return get(name)
            w = state[name]
            w = w.dequantized() if isinstance(w, StoredTensor) else w
            return (1.0 + w.to(device=device, dtype=torch.float32)).contiguous()  # float32 in any dtype, as there

        def matrix(*names: str) -> Matrix:
            stored = [state[n] for n in names]
            if keep_stored and all(isinstance(w, StoredTensor) and w.shape[1] % LANES == 0 for w in stored):
                return Matrix(stored=tuple(stored))
            # Projections are stored transposed, [in, out], and applied as x @ W: for the few rows
            # of a decoding step this reads the weights faster on CPU than F.linear's [out, in]
            # layout (measured on the demo target's shapes).
            return Matrix(dense_t=_transposed(torch.cat([get(n) for n in names])))

        embed, head = "model.embed_tokens.weight", "lm_head.weight" if "lm_head.weight" in state else None
        if keep_stored and isinstance(state[embed], StoredTensor):
            self.embed: torch.Tensor | Matrix = matrix(embed)  # [V, hidden]
            self.lm_head: torch.Tensor | Matrix = matrix(head) if head else self.embed
        else:
            self.embed = get(embed)  # [V, hidden]
            self.lm_head = get(head) if head else self.embed
        self.final_norm = norm("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bqkv = None
            if a + "q_proj.bias" in state:
                bqkv = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            if a + "o_proj.bias" in state:
                raise UnsupportedModelError("an output-projection bias is not supported")
            qk_norm = torch.cat([norm(a + "q_norm.weight"), norm(a + "k_norm.weight")]) if s.qk_norm else None
            # Phi-3 keeps q/k/v and gate/up fused, each already one matrix stacked by output: taken as it is
            qkv = (a + "qkv_proj.weight",) if a + "qkv_proj.weight" in state else (
                a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            gate_up = (p + "mlp.gate_up_proj.weight",) if p + "mlp.gate_up_proj.weight" in state else (
                p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            # Llama's post_attention_layernorm is the MLP's norm; in a sandwich it is the
            # attention output's, and the MLP's is pre_feedforward_layernorm.
            sandwich = s.sandwich
            self.layers.append(
                _Layer(
                    attn_norm=norm(p + "input_layernorm.weight"),
                    wqkv=matrix(*qkv),
                    bqkv=bqkv,
                    wo=matrix(a + "o_proj.weight"),
                    mlp_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
                    w_gate_up=matrix(*gate_up),
                    w_down=matrix(p + "mlp.down_proj.weight"),
                    qk_norm=qk_norm,
                    post_attn_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                    post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                )
            )
        # One rotary per set of parameters; `layer_rotary[i]` is layer i's (Gemma 3's local and
        # global layers differ), `rotary` the full layers' (the only one elsewhere).
        if s.rope_layer_types is None:
            self.rotary = Rotary(config, s, device)
            self.layer_rotary = [self.rotary] * s.num_layers
        else:
            by_type = {t: Rotary(config, s, device, layer_type=t) for t in sorted(set(s.rope_layer_types))}
            self.rotary = by_type.get("full_attention") or next(iter(by_type.values()))
            self.layer_rotary = [by_type[t] for t in s.rope_layer_types]
        self.scale = s.head_dim**-0.5 if s.query_scale is None else s.query_scale
        # [] float32, as transformers' Gemma3TextScaledWordEmbedding multiplies by it; None: no scale
        self._embed_scale = None if s.embed_scale == 1.0 else torch.tensor(s.embed_scale, dtype=dtype, device=device)
        self._layer_table: native_layers.LayerTable | None = None  # built at the first one-call forward

    @property
    def vocab_size(self) -> int:
        return self.lm_head.n_out if isinstance(self.lm_head, Matrix) else self.lm_head.shape[0]

    @property
    def quantized(self) -> bool:
        """Whether the weights are kept as a GGUF file stores them."""
        return isinstance(self.lm_head, Matrix)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding weights, each storage once (tied embeddings count once)."""
        tensors: dict[int, torch.Tensor] = {}
        for w in (self.embed, self.lm_head, self.final_norm, *(v for layer in self.layers for v in vars(layer).values())):
            for t in (w.tensors() if isinstance(w, Matrix) else [w] if w is not None else []):
                tensors.setdefault(t.data_ptr(), t)
        return list(tensors.values())

    def weight_bytes(self) -> int:
        """Bytes of all weights (tied embeddings, one storage, counted once)."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[S] ids -> [S, hidden] float."""
        x = self.embed.rows(input_ids) if isinstance(self.embed, Matrix) else self.embed[input_ids]
        return x if self._embed_scale is None else x * self._embed_scale

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_norm_eps)
        # Same arithmetic as transformers' LlamaRMSNorm: statistics in float32; Gemma3RMSNorm
        # multiplies by its (float32) weights before rounding to the dtype.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        if self.spec.norm_plus_one:
            return (xf * weight).to(x.dtype)
        return weight * xf.to(x.dtype)

    def _layer_in(self, x: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor):
        """Norm, q/k/v projection, rotary: x [S, hidden] -> q [H, S, D], k, v [Hkv, S, D]."""
        s = self.spec
        S = x.shape[0]
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        h = self._rms_norm(x, layer.attn_norm)
        qkv = self._project(h, layer.wqkv, layer.bqkv)  # [S, (H + 2Hkv) * D]
        qk = qkv[:, : (H + Hkv) * D].view(S, H + Hkv, D)
        if layer.qk_norm is not None:  # Qwen3: each head's queries and keys normalized, then rotated
            qk = torch.cat([self._rms_norm(qk[:, :H], layer.qk_norm[:D]), self._rms_norm(qk[:, H:], layer.qk_norm[D:])], dim=1)
        # Queries and keys are rotated together (one set of elementwise ops, not two).
        qk = apply_rotary(qk.transpose(0, 1), cos, sin)
        v = qkv[:, (H + Hkv) * D :].view(S, Hkv, D).transpose(0, 1)
        return qk[:H], qk[H:], v

    def _layer_out(self, x: torch.Tensor, out: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """Output projection and MLP with their residuals: out [H, S, D] -> the new x [S, hidden]."""
        S = x.shape[0]
        o = self._project(out.transpose(0, 1).reshape(S, -1), layer.wo)
        x = x + (o if layer.post_attn_norm is None else self._rms_norm(o, layer.post_attn_norm))
        h = self._rms_norm(x, layer.mlp_norm)
        if S > MLP_ROWS and self._integer(layer.w_gate_up) and self._integer(layer.w_down):
            m = torch.cat([self._mlp(h[i : i + MLP_ROWS], layer, S) for i in range(0, S, MLP_ROWS)])
        else:
            m = self._mlp(h, layer, S)
        return x + (m if layer.post_mlp_norm is None else self._rms_norm(m, layer.post_mlp_norm))

    def _mlp(self, h: torch.Tensor, layer: _Layer, forward_rows: int) -> torch.Tensor:
        gate, up = self._project(h, layer.w_gate_up, forward_rows=forward_rows).chunk(2, dim=-1)
        gate = F.silu(gate) if self.spec.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self._project(gate * up, layer.w_down, forward_rows=forward_rows)

    def default_arithmetic(self) -> Arithmetic:
        """The arithmetic measured the default for this model on this processor
        (`arithmetic.measured_default`; nothing is built for a model that never takes the native
        layers)."""
        return measured_default(self._native_ok)

    def _integer(self, w) -> bool:
        """Whether `_project` takes the integer products for `w` (rows independent, bit for bit)."""
        if not (self.arithmetic.products and isinstance(w, Matrix) and w.quantized and self._native_ok):
            return False
        kernel = self.arithmetic.layers()
        return kernel is not None and w.all_k_blocks() and kernel.int8.path() == int8.AVX512_VNNI

    def _project(self, x: torch.Tensor, w: Matrix, bias: torch.Tensor | None = None, forward_rows: int | None = None) -> torch.Tensor:
        """x [S, inputs] @ W (+ bias) -> [S, outputs] on the PyTorch path (a prefill's many rows).

        A GGUF matrix of 256-weight blocks alone takes the integer products where this model's
        are on and the processor runs their VNNI path: each row then gets the decoding steps'
        own arithmetic, with no float32 tile of the matrix (faster than dequantizing for PyTorch's
        float32 product on a 1B Q4_K_M file).
        Anything else (float weights, 32-weight blocks, `exact`, AVX2 alone, where the integer
        products over many rows were not measured against PyTorch's) is a float32 product.

        With `Arithmetic.prefill_tiles`, where AMX's integer tiles run, the 16-bit activations' K-type
        parts take them (`int8.TILES`: the same integers, summed in another order; from WIDE and
        from STEP_TILES, whose steps and verifications have an order of their own), only in a forward of more than
        `ROWS` rows (`forward_rows`, x's own by default; the MLP's blocks of rows pass their
        forward's): no step or verification comes there, and theirs keep one order between them."""
        if self._integer(w):
            kernel = self.arithmetic.layers().int8
            mode = self.arithmetic.products
            rows = x.shape[0] if forward_rows is None else forward_rows
            if (mode in int8.PREFILL_TILES_FROM and rows > native_layers.ROWS and self.arithmetic.prefill_tiles
                    and kernel.tiles()):
                mode = int8.TILES
            y = kernel.product(x, w, mode)
            return y if bias is None else y + bias
        # a biased projection by addmm, as transformers' Linear computes it (`exact` equals it bit for bit)
        return x @ w.dense_t() if bias is None else torch.addmm(bias, x, w.dense_t())

    def _one_call(self, S: int, cache: AttentionCache):
        """The attention kernel when this forward can run as one `decode_layers` call, else None:
        a cache the kernel can write (`native_storage`: float K/V written as `KVStore` writes
        them, or an int16 cache's planes) with room for the S tokens, no layer
        with a window, and few enough rows for the native attention kernel (`attend`'s rule).
        Short caches too: there PyTorch's attention ran about as fast as the kernel, and the
        per-layer Python around it costs more."""
        storage = getattr(cache, "native_storage", None)
        if storage is None:
            return None
        s, k = self.spec, storage[0]
        if (cache.length + S > cache.capacity or any(w is not None for w in s.sliding_windows) or s.sandwich
                or s.num_heads // s.num_kv_heads * S > NATIVE_QUERY_ROWS or k.device.type != "cpu"):
            return None
        fused = self.arithmetic.layers()
        attention = self.arithmetic.attention()
        dtype = torch.int16 if storage[2] is not None else k.dtype
        return attention if attention is not None and fused is not None and fused.takes(dtype) else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache,
        logits_rows: slice | None = slice(None),
        capture_queries: bool = False,
        key_mass: KeyMass | None = None,
    ) -> ForwardOutput:
        """Run S new tokens through the model, appending their keys/values to `cache`.

        input_ids: [S] int64; positions: [S] int64 rotary positions of the new tokens.
        logits_rows: which rows to project to the vocabulary (None = none, e.g. in prefill).
        Returns logits [R, V] in float32 and, when asked, the post-rope queries [L, S, H, D].
        `key_mass` (a cache whose key index is the position): see `KeyMass`.
        """
        s = self.spec
        S = input_ids.shape[0]
        H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
        G = H // Hkv
        x = self._embed(input_ids)  # [S, hidden]
        trig = {id(r): r.cos_sin(positions, self.dtype) for r in self.layer_rotary}  # each rotary's [S, D] cos, sin
        cos, sin = trig[id(self.rotary)]
        masks: dict[tuple[int, int, int | None], Mask | None] = {}
        queries = [] if capture_queries else None
        # Few rows on the CPU: each side of a layer is one native call (`native_layers`).
        fused = self.arithmetic.layers() if S <= native_layers.ROWS and self._native_ok else None
        eps = s.rms_norm_eps
        attention = self._one_call(S, cache) if fused is not None and self.one_call else None
        if attention is not None:  # every layer in one native call: the same arithmetic, no Python between
            if self._layer_table is None:
                self._layer_table = fused.layer_table(self.layers)
            chunk = key_mass.chunk if key_mass is not None and cache.exact_positions else 0
            k_cache, v_cache, steps = cache.native_storage
            q_all, mass_all = fused.decode_layers(x, self._layer_table, eps, H, Hkv, D, cos, sin, self.scale, k_cache,
                                                  v_cache, cache.length, attention, capture_queries, chunk,
                                                  self.arithmetic.products, steps)
            if mass_all is not None:
                key_mass.layers += [_cached_chunks(mass, cache.length // chunk, G, S) for mass in mass_all]
        reported: list[torch.Tensor | None] = [None] * s.num_layers  # each layer's key mass, where it had one
        for i, layer in enumerate(self.layers if attention is None else ()):
            cos, sin = trig[id(self.layer_rotary[i])]
            if fused is not None:
                q, k, v = fused.layer_in(x, layer.attn_norm, eps, layer.wqkv, layer.bqkv, H, Hkv, cos, sin,
                                         self.arithmetic.products, layer.qk_norm, D)
            else:
                q, k, v = self._layer_in(x, layer, cos, sin)  # [H, S, D], [Hkv, S, D], [Hkv, S, D]
            if queries is not None:
                queries.append(q.transpose(0, 1))  # [S, H, D]
            window = s.sliding_windows[i]
            keys, values, key_start = cache.view(i, k, v, window)  # [Hkv, T, D], new tokens last
            T = keys.shape[1]
            # the window applies where the keys are the positions before the new tokens, in order
            exact = cache.exact_positions or (window is not None and getattr(cache, "window_exact", None) is not None
                                              and cache.window_exact(window))
            mask_key = (T, key_start, window if exact else None)
            if mask_key not in masks:
                masks[mask_key] = attention_mask(S, T, key_start, mask_key[2], G, x.device, x.dtype)
            mask = masks[mask_key]
            # Grouped-query attention without copying the cache: the G query heads that share a
            # KV head are folded into the query-length dimension.
            qg = q.reshape(Hkv, G * S, D)  # rows ordered (g, s)
            chunk = key_mass.chunk if key_mass is not None and cache.exact_positions and key_start == 0 else 0
            out, mass = attend(qg, keys, values, mask, self.scale, chunk, self.arithmetic.native_attention,
                               window is not None and exact)  # [Hkv, G*S, D]
            if mass is not None:
                reported[i] = _cached_chunks(mass, (T - S) // chunk, G, S)
            out = out.reshape(H, S, D)
            if fused is not None:
                fused.layer_out(x, out.contiguous(), layer.wo, layer.mlp_norm, eps, layer.w_gate_up, layer.w_down,
                                self.arithmetic.products, layer.post_attn_norm, layer.post_mlp_norm,
                                s.activation == "gelu_tanh")
            else:
                x = self._layer_out(x, out, layer)
        if any(m is not None for m in reported):
            # A local layer whose window cuts the keys reports none: no mass on any chunk (every
            # layer's report covers the same chunks, so that they stack).
            n = next(m for m in reported if m is not None).shape[2]
            key_mass.layers += [torch.zeros(Hkv, S, n) if m is None else m for m in reported]
        cache.advance(S)
        logits = None
        if logits_rows is not None:
            # A stored (GGUF) head is read by the kernel whatever the rows: dequantizing the whole
            # vocabulary for a prefill's last row would cost more than the product.
            head_kernel = fused or (self.arithmetic.layers() if self.quantized else None)
            if head_kernel is not None:
                logits = head_kernel.logits(x[logits_rows].contiguous(), self.final_norm, eps, self.lm_head,
                                            self.arithmetic.products)
            else:
                xr = self._rms_norm(x[logits_rows], self.final_norm)
                head = self.lm_head
                logits = (xr @ head.dense_t() if isinstance(head, Matrix) else F.linear(xr, head)).float()
        if attention is not None:
            q_out = q_all  # [L, S, H, D] as the kernel wrote them, or None
        else:
            q_out = torch.stack(queries) if queries is not None else None
        return ForwardOutput(logits=logits, queries=q_out)
