"""The architecture numbers the forward needs, read from a Hugging Face (transformers) config.

Covers Llama 2/3 (every rope scaling type transformers knows), Mistral (with its sliding
window), and Qwen2 (q/k/v bias, tied embeddings); multi-head and grouped-query attention.
`ModelSpec.from_config` refuses anything else with `UnsupportedModelError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is outside what this decoder implements."""


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

    def kv_bytes(self, tokens: int = 1, element_size: int = 4) -> int:
        """Bytes of K and V that `tokens` tokens occupy over all layers (float32 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size * tokens

    @classmethod
    def from_config(cls, config: Any) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama-family decoders)"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported activation {act!r}: only SwiGLU (silu) is implemented")
        num_heads = config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv:
            raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", "linear", "dynamic", "yarn", "llama3"):
            raise UnsupportedModelError(f"unsupported rope type {rope_type!r}")
        if (rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        n_layers = config.num_hidden_layers
        windows: list[int | None] = [None] * n_layers
        layer_types = getattr(config, "layer_types", None)
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
        )
