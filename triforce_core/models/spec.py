"""The architecture numbers the forward needs, read from a Hugging Face (transformers) config.

Covers Llama 2/3 (every rope scaling type transformers knows), Mistral (with its sliding
window), Qwen2 (q/k/v bias, tied embeddings), dense Qwen3 (an RMSNorm on each head's queries
and keys before the rotary embedding, `qk_norm`), Gemma 3's text decoder (`GEMMA3`: norms
around both halves of a layer, GeGLU, an embedding scale, a query scale of its own, sliding-window
layers with a rotary base of their own) and Phi-3 / Phi-4-mini (fused q/k/v and gate/up tensors,
longrope, a rotary embedding over part of each head: `rotary_dim`); multi-head and grouped-query
attention.
`ModelSpec.from_config` refuses anything else with `UnsupportedModelError`, and numbers that
contradict one another or no real model has (a damaged or lying file) with
`InconsistentModelError`: the native kernels size their buffers from these numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from . import families

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
# What a family adds to the one forward, beyond the config's numbers: Qwen3 and Gemma 3
# normalize each head's queries and keys (their own [head size] weights, q then k) before the
# rotary embedding.
QK_NORM_TYPES = ("qwen3", "gemma3_text")
# Gemma 3's text decoder (transformers' Gemma3TextConfig; GGUF's gemma3), beside the norms:
# - every RMSNorm weight w is applied as 1 + w (`norm_plus_one`);
# - the attention's output and the MLP's output are normalized before their residuals, and the
#   MLP has a norm of its own before it (`sandwich`: a layer has four norms);
# - the MLP is GeGLU with tanh's GELU (`activation`);
# - the embedding is multiplied by the square root of the width (`embed_scale`);
# - queries are scaled by query_pre_attn_scalar ** -0.5, not head size ** -0.5 (`query_scale`);
# - sliding-window and full layers take the rotary parameters of their own layer type
#   (`rope_layer_types`: a local base of 10K, a global one of 1M).
GEMMA3 = ("gemma3_text",)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # the config's name -> the forward's
# Phi-3's attention rotates only the first `rotary_dim` numbers of each head (`partial_rotary_factor`,
# Phi-4-mini's 0.75); transformers' other families here rotate the whole head whatever the config says.
PARTIAL_ROTARY_TYPES = ("phi3",)
# Families whose checkpoints keep q/k/v in one tensor (`self_attn.qkv_proj`) and gate/up in one
# (`mlp.gate_up_proj`), each stacked by output as the forward stacks the others' (`shapes`).
FUSED_TYPES = ("phi3",)

# Upper bounds on the settings. The largest model of the supported families, Llama 3.1 405B,
# has width 16,384, MLP width 53,248, 126 layers, 128 heads (8 KV heads) of size 128, a
# vocabulary of 128,256 and a context of 131,072; Qwen2's vocabulary is 152,064 and
# Qwen2.5-1M's context 1,010,000. Each bound leaves four times those or more, so every real 1B-70B
# (and 405B) checkpoint passes, and still stops a number no file of real weights could back.
# The context length sizes no buffer (a generation's caches are sized by its own prompt and
# answer, and an allocation that fails is one line), so its bound only refuses nonsense.
LIMITS = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "vocab_size": 1 << 20, "num_layers": 1 << 10,
          "num_heads": 1 << 10, "num_kv_heads": 1 << 10, "head_dim": 1 << 10, "max_position_embeddings": 1 << 40}
# Each setting in the words of a message (the tensor check's too, `shapes`).
WORDS = {"hidden_size": "width", "intermediate_size": "MLP width", "vocab_size": "vocabulary", "num_layers": "layers",
         "num_heads": "heads", "num_kv_heads": "KV heads", "head_dim": "head size",
         "max_position_embeddings": "context length"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is outside what this decoder implements."""


class InconsistentModelError(ValueError):
    """The checkpoint contradicts itself: settings out of any real model's bounds or at odds with
    one another, or a tensor whose shape the settings do not give (one line)."""


def whole(value: Any) -> bool:
    """An integer (a bool is not one: `True` layers is a damaged file, not 1)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_bound(words: str, value: Any, limit: int) -> None:
    """`value` is a whole number in 1..limit, else InconsistentModelError saying so."""
    if not whole(value):
        raise InconsistentModelError(f"{words} is {value!r}, not a whole number")
    if not 1 <= value <= limit:
        raise InconsistentModelError(f"{words} is {value}, outside 1..{limit:,} (the bound over every real model)")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers the forward needs, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_type: str
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    intermediate_size: int = 0  # the MLP's width (arithmetic counts only)
    qk_norm: bool = False  # an RMSNorm on each head's q and k before the rotary embedding (Qwen3, Gemma 3)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma 3)
    norm_plus_one: bool = False  # norm weights w applied as 1 + w (Gemma 3)
    sandwich: bool = False  # norms on the attention's and the MLP's outputs, and one before the MLP (Gemma 3)
    embed_scale: float = 1.0  # the embedding's rows are multiplied by it (Gemma 3: the width's square root)
    query_scale: float | None = None  # attention's score scale; None: head size ** -0.5
    # per layer, the key of config.rope_parameters its rotary parameters are under (Gemma 3's
    # "sliding_attention" / "full_attention"); None: one set of parameters for every layer
    rope_layer_types: tuple[str, ...] | None = None
    rotary_dim: int = 0  # the numbers of each head the rotary embedding turns, the first ones; 0: all (head_dim)

    def check(self) -> "ModelSpec":
        """The settings against one another and against `LIMITS` (InconsistentModelError, one
        line); itself. Every spec read from a config is checked (`from_config`); one made by
        hand for arithmetic (an attention-only count, say) need not be."""
        for name, limit in LIMITS.items():
            check_bound(f"{WORDS[name]} ({name})", getattr(self, name), limit)
        H, Hkv, D, E = self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size
        if H % Hkv:
            raise InconsistentModelError(f"heads {H} are not a multiple of KV heads {Hkv}: each KV head serves a whole group")
        if D % 2:
            raise InconsistentModelError(f"head size {D} is odd: the rotary embedding turns pairs of numbers")
        # A head size other than width / heads is legal (Mistral Nemo: 32 heads of 128, width
        # 5120), but heads that do not divide the width are a lie (transformers refuses them too).
        if E % H and H * D != E:
            raise InconsistentModelError(f"heads {H} do not divide width {E} (and heads {H} x head size {D} = {H * D} is not it)")
        if not (isinstance(self.rms_norm_eps, Real) and math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1):
            raise InconsistentModelError(f"the norm's epsilon {self.rms_norm_eps!r} is not a small positive number")
        if len(self.sliding_windows) != self.num_layers:
            raise InconsistentModelError(f"{len(self.sliding_windows)} layer types for {self.num_layers} layers")
        if self.rope_layer_types is not None and len(self.rope_layer_types) != self.num_layers:
            raise InconsistentModelError(f"{len(self.rope_layer_types)} rotary layer types for {self.num_layers} layers")
        for name, value in (("the embedding scale", self.embed_scale), ("the query scale", self.query_scale)):
            if value is not None and not (isinstance(value, Real) and math.isfinite(value) and 0 < value < 1e6):
                raise InconsistentModelError(f"{name} {value!r} is not a positive number")
        for w in self.sliding_windows:
            if w is not None:
                check_bound("the sliding window", w, LIMITS["max_position_embeddings"])
        if self.rotary_dim and (not whole(self.rotary_dim) or self.rotary_dim % 2 or not 2 <= self.rotary_dim <= D):
            raise InconsistentModelError(f"the rotary embedding's {self.rotary_dim!r} numbers a head are not an even "
                                         f"number in 2..{D} (head size {D})")
        return self

    @property
    def rotated(self) -> int:
        """How many numbers of each head the rotary embedding turns (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def windowed(self) -> bool:
        """Whether some layer has a sliding window."""
        return any(w is not None for w in self.sliding_windows)

    def kv_bytes(self, tokens: int = 1, element_size: int = 4) -> int:
        """Bytes of K and V that `tokens` tokens occupy over all layers (float32 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size * tokens

    @classmethod
    def from_config(cls, config: Any) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        refused = families.refusal(model_type, config, SUPPORTED_MODEL_TYPES)  # a family or feature left out
        if refused is not None:
            raise UnsupportedModelError(refused.line)
        gemma = model_type in GEMMA3
        act = getattr(config, "hidden_activation" if gemma else "hidden_act", None) or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {act!r}: the MLP's gate is silu (SwiGLU) or "
                                        f"gelu_pytorch_tanh (GeGLU)")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, cap, None):
                raise UnsupportedModelError(f"{cap} is set: logit soft-capping (Gemma 2) is not supported")
        num_heads = config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or num_heads
        n_layers = config.num_hidden_layers
        # before dividing by them or making a list per layer (`check` does the rest)
        for name, value in (("num_heads", num_heads), ("hidden_size", config.hidden_size), ("num_layers", n_layers)):
            check_bound(f"{WORDS[name]} ({name})", value, LIMITS[name])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope = getattr(config, "rope_parameters", None) or {}
        partial = 1.0 if gemma else rope.get("partial_rotary_factor") or 1.0
        rotary_dim = 0
        if partial != 1.0:
            if model_type not in PARTIAL_ROTARY_TYPES:
                raise UnsupportedModelError("partial rotary embeddings are not supported")
            if not (isinstance(partial, Real) and 0 < partial < 1):
                raise InconsistentModelError(f"the partial rotary factor {partial!r} is not a number in (0, 1]")
            rotary_dim = int(head_dim * partial)  # as transformers sizes the inverse frequencies
        layer_types = getattr(config, "layer_types", None)
        rope_layer_types = None
        if gemma:  # parameters per layer type
            if not (isinstance(layer_types, (list, tuple)) and len(layer_types) == n_layers
                    and all(t in ("sliding_attention", "full_attention") and isinstance(rope.get(t), dict)
                            for t in layer_types)):
                raise InconsistentModelError("Gemma 3's layer types or their rotary parameters are missing or unknown")
            rope_layer_types = tuple(layer_types)
        rope_sets = [rope[t] for t in sorted(set(rope_layer_types))] if rope_layer_types else [rope]
        for params in rope_sets:
            if params.get("rope_type", "default") not in ("default", "linear", "dynamic", "yarn", "llama3", "longrope"):
                raise UnsupportedModelError(f"unsupported rope type {params.get('rope_type')!r}")
            if gemma and (params.get("partial_rotary_factor") or 1.0) != 1.0:
                raise UnsupportedModelError("partial rotary embeddings are not supported")
            if gemma and params.get("rope_type") == "longrope":
                raise UnsupportedModelError("longrope on a model with rotary parameters per layer type is not supported")
        rope_type = (rope["full_attention"] if gemma else rope).get("rope_type", "default")  # Gemma 3: the full layers'
        if rope_type == "longrope":
            check_longrope(rope, rotary_dim or head_dim)
        windows: list[int | None] = [None] * n_layers
        sliding = getattr(config, "sliding_window", None)
        if sliding is not None:
            if layer_types is not None:
                windows = [sliding if t == "sliding_attention" else None for t in layer_types]
            else:
                windows = [sliding] * n_layers
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=n_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_type=rope_type,
            sliding_windows=tuple(windows),
            intermediate_size=config.intermediate_size,
            qk_norm=model_type in QK_NORM_TYPES,
            activation=ACTIVATIONS[act],
            norm_plus_one=gemma,
            sandwich=gemma,
            embed_scale=config.hidden_size**0.5 if gemma else 1.0,
            query_scale=config.query_pre_attn_scalar**-0.5 if gemma else None,
            rope_layer_types=rope_layer_types,
            rotary_dim=rotary_dim,
        ).check()


def check_longrope(rope: dict, rotated: int) -> None:
    """Longrope's settings (Phi-3): a short and a long factor per rotated pair, finite and
    positive, and the length where the long ones start (InconsistentModelError, one line). A
    factor list of the wrong length would be broadcast by the frequencies' arithmetic, not refused."""
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if (not isinstance(factors, (list, tuple)) or len(factors) != rotated // 2
                or not all(isinstance(f, Real) and math.isfinite(f) and f > 0 for f in factors)):
            got = f"{len(factors)} numbers" if isinstance(factors, (list, tuple)) else repr(factors)
            raise InconsistentModelError(f"longrope's {key} is {got}, not {rotated // 2} positive numbers (one per "
                                         f"rotated pair of {rotated})")
    check_bound("longrope's original_max_position_embeddings", rope.get("original_max_position_embeddings"),
                LIMITS["max_position_embeddings"])
