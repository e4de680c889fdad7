"""A decoder layer's work around attention, in native code, for few rows: `csrc/layers.c`.

A few-row step in PyTorch spends most of what attention leaves on ~20 operators a layer over a
few hundred floats (norms, rotary, cache and mask glue) and on matrix products that read the
weights far below the memory's speed; a small draft's step is nearly all operator overhead.
The kernel does each side of a layer in one call: norm, q/k/v projection (with bias), rotary embedding before attention;
output projection, residual, norm, SwiGLU MLP, residual after it; and the final norm with the
vocabulary projection.

Used by `Transformer.forward` on the CPU in float32 for up to `ROWS` new tokens (decoding,
verification); prefill keeps PyTorch's matrix products, which are compute-bound there and
faster. Results equal PyTorch's to float32 rounding:
the elementwise arithmetic is the same, only the order of sums differs
(tests/test_native_layers.py, greedy equality with Hugging Face across the model zoo).
A model's products mode (`Arithmetic.products`, an `int8` mode), passed to every call, makes
its GGUF matrices' products integer ones: over 16-bit activations for the K types (`int8.WIDE`,
or `int8.STEP_TILES` where AMX's tiles run); 0 is the float path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import int8, int16_kv, native_attention
from .native_build import CSRC, FLAGS, Loader
from .ggml_types import BLOCKS, F32, IN_OUT, Part, Stacked

SOURCE = CSRC / "layers.c"
# No contraction of a * b + c into one rounding: the elementwise steps round as PyTorch's
# separate operators do.
LAYER_FLAGS = FLAGS + ("-ffp-contract=off",)
# New tokens up to which a forward uses the kernel: a 16-token lookup run (the default's longest)
# and its bonus row. Past it a GGUF model's forward dequantizes every matrix for PyTorch's
# products, which costs a few-row forward far more.
ROWS = 17
# `decode_layers`' kind for an int16 cache (csrc/layers.c's CACHE_I16; the float kinds are
# native_attention.KINDS').
INT16_KIND = 3


class Layers:
    """The loaded library. Weights as `Transformer` stores them: [in, out] float32 with
    contiguous rows, any row stride, or a `Matrix`. Each method checks, before the native call,
    that every matrix and vector has the size the buffers it writes are allocated for (a few
    integers a call: a matrix with more outputs than its buffer would be written past, as a
    lying GGUF file once made the native code do); the contents are the caller's."""

    # the last int16 cache `decode_layers` described (`_int16_planes`): its key, description,
    # capacity and attention kernel
    _planes_memo: tuple | None = None

    def __init__(self, lib: ctypes.CDLL | Path, threads: int | None = None):
        lib = lib if isinstance(lib, ctypes.CDLL) else ctypes.CDLL(str(lib))
        P, I, F, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
        lib.layer_in.argtypes = [P, I, I, P, F, P, I, P, P, I, I, I, P, P, P, P, P, I, I, I]
        lib.layer_out.argtypes = [P, I, I, P, I, I, P, I, P, F, P, I, P, I, I, I, I, P, P, I]
        lib.final_logits.argtypes = [P, I, I, P, F, P, I, I64, P, I, I]
        lib.dequantize_rows.argtypes = [P, I64, I, I, P, I64, P, I]
        lib.decode_layers.argtypes = [P, I, I, P, I, F, I, I, I, I, P, P, F, P, P, I, I64, I64, I64, P, I, P, I, P, I, I, I, P,
                                      I]
        lib.decode_layers_takes.argtypes = [I]
        for f in (lib.layer_in, lib.layer_out, lib.final_logits, lib.dequantize_rows, lib.decode_layers,
                  lib.decode_layers_takes):
            f.restype = I
        self.lib = lib
        self.threads = threads  # None: PyTorch's intra-op thread count at each call
        self.int8 = int8.Int8(lib)  # the integer products on their own (tests, benchmarks)

    def _threads(self) -> int:
        return self.threads or torch.get_num_threads()

    @staticmethod
    def _parts(w: Stacked | torch.Tensor, rows_out: bool = False) -> tuple:
        """A matrix's parts for the kernel: a `Matrix`'s own, or one float32 tensor's ([in, out],
        or [out, in] rows when `rows_out`)."""
        if not isinstance(w, torch.Tensor):
            return w.parts, w.n_parts
        if rows_out:
            return (Part * 1)(Part(w.data_ptr(), w.stride(0) * 4, F32, w.shape[0])), 1
        return (Part * 1)(Part(w.data_ptr(), w.stride(0), IN_OUT, w.shape[1])), 1

    @staticmethod
    def _check(failed: int) -> None:
        if failed:
            raise MemoryError("native layer: out of memory for its scratch buffer")

    @staticmethod
    def _dims(w: Stacked | torch.Tensor, rows_out: bool = False) -> tuple[int, int]:
        """A matrix's (inputs, outputs) as the kernel reads it."""
        if not isinstance(w, torch.Tensor):
            return w.n_in, w.n_out
        if w.dim() != 2 or w.dtype != torch.float32 or w.stride(1) != 1:
            raise ValueError(f"native layer: a weight must be a 2-D float32 tensor with contiguous rows, not {w.dtype} "
                             f"{tuple(w.shape)} strides {w.stride()}")
        return (w.shape[1], w.shape[0]) if rows_out else (w.shape[0], w.shape[1])

    @classmethod
    def _matrix(cls, what: str, w: Stacked | torch.Tensor, n_in: int, n_out: int, rows_out: bool = False) -> None:
        got = cls._dims(w, rows_out)
        if got != (n_in, n_out):
            raise ValueError(f"native layer: {what} has {got[1]} outputs x {got[0]} inputs where its buffers take "
                             f"{n_out} x {n_in}")

    @staticmethod
    def _vector(what: str, t: torch.Tensor, *shape: int) -> None:
        """`t` is float32, contiguous, of `shape` (the kernel reads exactly that many numbers)."""
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"native layer: {what} is {t.dtype} {tuple(t.shape)}, expected contiguous float32 {shape}")

    def layer_in(self, x: torch.Tensor, norm: torch.Tensor, eps: float, w_qkv: Stacked | torch.Tensor, bias: torch.Tensor | None,
                 H: int, Hkv: int, cos: torch.Tensor, sin: torch.Tensor, products: int = 0,
                 qk_norm: torch.Tensor | None = None, head_dim: int | None = None):
        """x: [S, E] -> q [H, S, D], k [Hkv, S, D] (rotated), v [Hkv, S, D]. `products`: how the quantized
        matrices' products are computed (an `int8` mode, 0 the float path: the model's
        `Arithmetic.products`; every method here takes it). `qk_norm`: [2 D], an RMSNorm's
        weights over each query head, then each key head, before the rotation (Qwen3), or None.
        `head_dim`: D where cos/sin are narrower, [S, rotary dim] (partial rotary: the first
        numbers of each head turn, the rest pass through); cos's width by default."""
        S, E = x.shape
        D = cos.shape[1] if head_dim is None else head_dim
        rot = self._rotated(cos, D)
        N = (H + 2 * Hkv) * D
        self._vector("x", x, S, E)
        self._vector("the norm", norm, E)
        self._matrix("the q/k/v projection", w_qkv, E, N)
        if bias is not None:
            self._vector("the q/k/v bias", bias, N)
        if qk_norm is not None:
            self._vector("the q/k norms", qk_norm, 2 * D)
        self._vector("cos", cos, S, rot)
        self._vector("sin", sin, S, rot)
        q = torch.empty(H, S, D)
        k = torch.empty(Hkv, S, D)
        v = torch.empty(Hkv, S, D)
        self._check(self.lib.layer_in(
            x.data_ptr(), S, E, norm.data_ptr(), eps, *self._parts(w_qkv),
            None if bias is None else bias.data_ptr(), None if qk_norm is None else qk_norm.data_ptr(),
            H, Hkv, D, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), self._threads(),
            int(products), rot))
        return q, k, v

    @staticmethod
    def _rotated(cos: torch.Tensor, D: int) -> int:
        """The numbers of each head that cos/sin turn: their width, even and within the head (ValueError)."""
        rot = cos.shape[-1] if cos.dim() == 2 else 0
        if rot % 2 or not 2 <= rot <= D:
            raise ValueError(f"native layer: cos is {tuple(cos.shape)}, not [rows, an even number of at most head size {D}]")
        return rot

    def layer_out(self, x: torch.Tensor, attn: torch.Tensor, w_o: Stacked | torch.Tensor, norm: torch.Tensor, eps: float,
                  w_gate_up: Stacked | torch.Tensor, w_down: Stacked | torch.Tensor, products: int = 0,
                  post_attn_norm: torch.Tensor | None = None, post_mlp_norm: torch.Tensor | None = None,
                  gelu: bool = False) -> None:
        """x [S, E] += the attention output's projection, then the MLP's (in place); attn: [H, S, D].
        `post_attn_norm`, `post_mlp_norm`: [E] norms of each output before its residual (Gemma 3's
        sandwich), or None; `gelu`: the MLP's gate is tanh's GELU (GeGLU), not silu."""
        S, E = x.shape
        H, _, D = attn.shape
        intermediate = self._dims(w_down)[0]
        self._vector("x", x, S, E)
        self._vector("the attention output", attn, H, S, D)
        self._matrix("the output projection", w_o, H * D, E)
        self._vector("the MLP norm", norm, E)
        self._matrix("the gate/up projection", w_gate_up, E, 2 * intermediate)
        self._matrix("the down projection", w_down, intermediate, E)
        for what, t in (("the attention output's norm", post_attn_norm), ("the MLP output's norm", post_mlp_norm)):
            if t is not None:
                self._vector(what, t, E)
        self._check(self.lib.layer_out(
            x.data_ptr(), S, E, attn.data_ptr(), H, D, *self._parts(w_o), norm.data_ptr(), eps,
            *self._parts(w_gate_up), *self._parts(w_down), intermediate, self._threads(), int(products),
            None if post_attn_norm is None else post_attn_norm.data_ptr(),
            None if post_mlp_norm is None else post_mlp_norm.data_ptr(), int(gelu)))

    def logits(self, x: torch.Tensor, norm: torch.Tensor, eps: float, lm_head: Stacked | torch.Tensor,
               products: int = 0) -> torch.Tensor:
        """x: [R, E] -> rms_norm(x) @ lm_head^T, [R, V] (lm_head [V, E], or a GGUF matrix)."""
        R, E = x.shape
        V = self._dims(lm_head, rows_out=True)[1]
        self._vector("x", x, R, E)
        self._vector("the final norm", norm, E)
        self._matrix("the head", lm_head, E, V, rows_out=True)
        if isinstance(lm_head, torch.Tensor) and lm_head.stride(0) != E:
            raise ValueError("native layer: a float32 head's rows must lie back to back (the kernel steps E numbers a row)")
        out = torch.empty(R, V)
        self._check(self.lib.final_logits(x.data_ptr(), R, E, norm.data_ptr(), eps, *self._parts(lm_head, rows_out=True),
                                          V, out.data_ptr(), self._threads(), int(products)))
        return out

    def layer_table(self, layers: list) -> LayerTable:
        """The weights of `layers` (`transformer._Layer`s) as `decode_layers` reads them: built once per
        model, the weights never move."""
        return LayerTable(layers)

    def takes(self, kv_dtype: torch.dtype) -> bool:
        """Whether `decode_layers` can write a cache of this dtype (torch.int16: int16 planes)."""
        kind = INT16_KIND if kv_dtype == torch.int16 else native_attention.KINDS.get(kv_dtype)
        return kind is not None and bool(self.lib.decode_layers_takes(kind))

    def decode_layers(self, x: torch.Tensor, table: LayerTable, eps: float, H: int, Hkv: int, D: int, cos: torch.Tensor,
                      sin: torch.Tensor, scale: float, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int,
                      attention: native_attention.Kernel, capture_queries: bool = False,
                      chunk: int = 0, products: int = 0,
                      steps: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [S, E] through every layer in one call, in place; the S new tokens' keys and values
        are written into k_cache/v_cache ([L, Hkv, capacity, D], `length` cached) after the
        cached ones, and every row attends causally to all cached keys (no window). The same
        arithmetic as layer_in, the cache's write, `attention.attention` and layer_out per layer.

        An int16 cache (`kv.int16`) comes as its planes k_cache/v_cache [L, Hkv, capacity x 2 D]
        uint8 with `steps`, its scales (sk, sv) [L, Hkv, capacity] float32: the new tokens are
        written onto their grids and attention is `attention.integer_attention`'s.

        Returns the rotated queries [L, S, H, D] when `capture_queries`, and when `chunk` > 0
        each layer's attention probability per whole chunk of keys [L, Hkv, G S, T // chunk]
        (rows ordered (g, s), as `attention.attention` returns them)."""
        S, E = x.shape
        L, T, R = len(table.array), length + S, H // Hkv * S
        rot = self._rotated(cos, D)
        self._vector("x", x, S, E)
        self._vector("cos", cos, S, rot)
        self._vector("sin", sin, S, rot)
        table.check(E, H, Hkv, D)
        planes = None
        if steps is not None:
            planes, capacity = self._int16_planes(k_cache, v_cache, steps, L, Hkv, D, R, attention)
            block, attn_threads = native_attention.BLOCK, attention.plan(Hkv, R, T, chunk)[1]
            kind, layer_stride, head_stride = INT16_KIND, 0, 0
        else:
            if (tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.dim() != 4 or tuple(k_cache.shape[:2]) != (L, Hkv)
                    or k_cache.shape[3] != D or k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride()
                    or k_cache.stride(3) != 1 or k_cache.stride(2) != D or k_cache.dtype not in native_attention.KINDS):
                raise ValueError(f"decode_layers: caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)} are not alike "
                                 f"[layers {L}, KV heads {Hkv}, capacity, head size {D}] with contiguous token rows")
            capacity = k_cache.shape[2]
            block, attn_threads = attention.plan(Hkv, R, T, chunk)
            kind, layer_stride, head_stride = native_attention.KINDS[k_cache.dtype], k_cache.stride(0), k_cache.stride(1)
        if not 0 <= length <= capacity - S:
            raise ValueError(f"decode_layers: {S} new tokens after {length} do not fit a capacity of {capacity}")
        queries = torch.empty(L, S, H, D) if capture_queries else None
        chunk_sum = torch.empty(L, Hkv, R, T // chunk) if chunk > 0 else None
        failed = self.lib.decode_layers(
            x.data_ptr(), S, E, table.array, L, eps, H, Hkv, D, table.intermediate, cos.data_ptr(),
            sin.data_ptr(), scale, k_cache.data_ptr(), v_cache.data_ptr(), kind, layer_stride, head_stride, length,
            attention.address, block, None if queries is None else queries.data_ptr(), max(chunk, 0),
            None if chunk_sum is None else chunk_sum.data_ptr(), attn_threads, self._threads(), int(products),
            None if planes is None else ctypes.byref(planes), rot)
        if failed == -2:
            raise ValueError(f"decode_layers cannot write a {k_cache.dtype} cache on this machine")
        self._check(failed)
        return queries, chunk_sum

    @staticmethod
    def _int16_planes(k: torch.Tensor, v: torch.Tensor, steps: tuple[torch.Tensor, torch.Tensor], L: int, Hkv: int,
                      D: int, R: int, attention: native_attention.Kernel) -> tuple[Int16Planes, int]:
        """An int16 cache's description for the kernel, after checking every size it will read
        by (ValueError); and its capacity in tokens."""
        sk, sv = steps
        path = native_attention.INTEGER_PATHS.index(attention.integer_path(R))
        # the same cache as the last forward's (its memory, sizes and layout, the same attention
        # path): its description stands; the checks below take views of each tensor, a few
        # operators that cost a step much where a forward has just streamed the caches
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (k, v, sk, sv)) + (
            L, Hkv, D, path, id(attention))
        memo = Layers._planes_memo
        if memo is not None and memo[0] == key:
            return memo[1], memo[2]
        capacity = sk.shape[-1] if sk.dim() == 3 else 0
        # the whole cache's tensors once a forward (not a check a layer in Python): every
        # layer is a slice of them, laid out as layer 0's, which the kernel's own check covers
        if (k.dim() != 3 or tuple(k.shape) != (L, Hkv, capacity * 2 * D) or v.shape != k.shape
                or tuple(sk.shape) != (L, Hkv, capacity) or sv.shape != sk.shape
                or not (k.is_contiguous() and v.is_contiguous() and sk.is_contiguous() and sv.is_contiguous())):
            raise ValueError(f"decode_layers: int16 planes {tuple(k.shape)}, {tuple(v.shape)} and steps {tuple(sk.shape)}, "
                             f"{tuple(sv.shape)} are not contiguous [layers {L}, KV heads {Hkv}, capacity x 2 x {D}] "
                             f"and [{L}, {Hkv}, capacity]")
        native_attention.Kernel.check_heads(int16_kv.Int16Heads(k[0], v[0], sk[0], sv[0], D, 0))
        write, attend = attention.integer_addresses
        planes = Int16Planes(k.data_ptr(), v.data_ptr(), sk.data_ptr(), sv.data_ptr(), k.stride(0), k.stride(1),
                             sk.stride(0), sk.stride(1), write, attend, path)
        Layers._planes_memo = (key, planes, capacity, attention)  # the kernel held: its id stays its own
        return planes, capacity

    def dequantize(self, raw: torch.Tensor, qtype: int, cols: int, out: torch.Tensor | None = None,
                   rows: list[int] | None = None) -> torch.Tensor:
        """raw [n, row bytes] uint8 of GGML type `qtype` -> [n, cols] float32 (into `out`, a
        contiguous [n, cols] float32 tensor, where given); with `rows` (indices into raw, negative
        ones from its end, as indexing counts them), those rows only."""
        per_block, nbytes = BLOCKS.get(qtype, (0, 0))
        if not per_block or cols % per_block or raw.dim() != 2 or raw.dtype != torch.uint8 \
                or raw.shape[1] != cols // per_block * nbytes:
            raise ValueError(f"dequantize: {tuple(raw.shape)} {raw.dtype} bytes are not rows of {cols} weights of GGML type {qtype}")
        raw = raw.contiguous()
        index = None
        if rows is not None:
            n = raw.shape[0]
            if any(not -n <= r < n for r in rows):
                raise IndexError(f"dequantize: row indices {rows} out of range for {n} rows")
            index = (ctypes.c_int64 * len(rows))(*(r + n if r < 0 else r for r in rows))
        count = raw.shape[0] if rows is None else len(rows)
        if out is None:
            out = torch.empty(count, cols)
        elif tuple(out.shape) != (count, cols) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"dequantize: out must be contiguous float32 {(count, cols)}, got {tuple(out.shape)} {out.dtype}")
        if self.lib.dequantize_rows(raw.data_ptr(), raw.stride(0), qtype, cols, index, count, out.data_ptr(),
                                    self._threads()):
            raise ValueError(f"GGML type {qtype} with {cols} columns cannot be dequantized")
        return out


class Int16Planes(ctypes.Structure):
    """An int16 cache, as `struct int16_cache` in csrc/layers.c."""

    P, I64 = ctypes.c_void_p, ctypes.c_int64
    _fields_ = [("k", P), ("v", P), ("sk", P), ("sv", P), ("layer_bytes", I64), ("head_bytes", I64),
                ("layer_steps", I64), ("head_steps", I64), ("write", P), ("attend", P), ("path", ctypes.c_int)]


class LayerWeights(ctypes.Structure):
    """One layer's weights, as `struct layer_weights` in csrc/layers.c."""

    P, I = ctypes.c_void_p, ctypes.c_int
    _fields_ = [("attn_norm", P), ("w_qkv", P), ("n_qkv", I), ("bias", P), ("w_o", P), ("n_o", I), ("mlp_norm", P),
                ("w_gate_up", P), ("n_gu", I), ("w_down", P), ("n_down", I), ("qk_norm", P)]


class LayerTable:
    """Every layer's `LayerWeights`, with the part descriptions they point to kept alive."""

    def __init__(self, layers: list):
        self.layers = layers
        self.keep: list = []

        def parts(w: Stacked | torch.Tensor) -> tuple[int, int]:
            array, n = Layers._parts(w)
            self.keep.append(array)
            return ctypes.addressof(array), n

        rows = []
        sizes = set()
        for layer in layers:
            qkv, o, gu, down = parts(layer.wqkv), parts(layer.wo), parts(layer.w_gate_up), parts(layer.w_down)
            rows.append(LayerWeights(layer.attn_norm.data_ptr(), qkv[0], qkv[1],
                                     None if layer.bqkv is None else layer.bqkv.data_ptr(), o[0], o[1],
                                     layer.mlp_norm.data_ptr(), gu[0], gu[1], down[0], down[1],
                                     None if layer.qk_norm is None else layer.qk_norm.data_ptr()))
            sizes.add(self._sizes(layer))
        if len(sizes) > 1:  # the kernel takes one set of sizes for every layer
            raise ValueError(f"decode_layers: the layers' weights differ in size ({len(sizes)} kinds)")
        self.array = (LayerWeights * len(rows))(*rows)
        (self.sizes,) = sizes
        self.intermediate = Layers._dims(layers[0].w_down)[0]

    @staticmethod
    def _sizes(layer) -> tuple:
        """(norms, q/k/v, bias, output, gate/up, down, q/k norms) sizes of a layer: matrices as (inputs, outputs)."""
        for norm in (layer.attn_norm, layer.mlp_norm):
            Layers._vector("a norm", norm, norm.numel())
        if layer.bqkv is not None:
            Layers._vector("the q/k/v bias", layer.bqkv, layer.bqkv.numel())
        if layer.qk_norm is not None:
            Layers._vector("the q/k norms", layer.qk_norm, layer.qk_norm.numel())
        return (layer.attn_norm.numel(), layer.mlp_norm.numel(), Layers._dims(layer.wqkv),
                None if layer.bqkv is None else layer.bqkv.numel(), Layers._dims(layer.wo),
                Layers._dims(layer.w_gate_up), Layers._dims(layer.w_down),
                None if layer.qk_norm is None else layer.qk_norm.numel())

    def check(self, E: int, H: int, Hkv: int, D: int) -> None:
        """The weights are the sizes the kernel's buffers for width E, H heads and Hkv KV heads of
        size D take (ValueError naming the first that is not)."""
        I, N = self.intermediate, (H + 2 * Hkv) * D
        want = (E, E, (E, N), None if self.sizes[3] is None else N, (H * D, E), (E, 2 * I), (I, E),
                None if self.sizes[7] is None else 2 * D)
        if self.sizes != want:
            names = ("the norm", "the MLP norm", "the q/k/v projection", "the q/k/v bias", "the output projection",
                     "the gate/up projection", "the down projection", "the q/k norms")
            what = next(n for n, got, w in zip(names, self.sizes, want) if got != w)
            raise ValueError(f"decode_layers: {what} is {self.sizes[names.index(what)]} where the buffers take "
                             f"{want[names.index(what)]} (width {E}, heads {H}/{Hkv} of {D}, MLP width {I})")


_loader: Loader[Layers] = Loader("decoder layers", SOURCE, LAYER_FLAGS, Layers)


def build(folder: Path | None = None) -> Path:
    """Compile the library (once per source, flags and processor); the path of the library."""
    return _loader.build(folder)


def kernel() -> Layers | None:
    """The library, built and loaded at the first call; None where it cannot be (logged once)."""
    return _loader.get()

