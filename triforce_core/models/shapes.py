"""A whole checkpoint's tensors against the settings it declares, before any kernel sees one.

A file says its settings (width, heads, layers, ...) and, separately, each tensor's shape. The
native kernels size their output buffers from the settings and write as many outputs as a
matrix has rows, so a matrix with more rows than its settings give writes past a buffer (a
GGUF file whose layer 0 q projection had twice its rows crashed the process in `malloc`), and
one with fewer runs and answers nonsense. So every tensor is checked here against the shape
the settings give it, every layer's every tensor must be there and nothing beyond the last
layer, and the first disagreement is refused in one line:

    blk.0.attn_q.weight is [1152, 576], expected [576, 576] (heads 9 x head size 64, width 576)

Shapes are as PyTorch writes them, [outputs, inputs] (a GGUF file lists them the other way
round). Names are Hugging Face's; `label` turns one into the file's own for the message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from .spec import FUSED_TYPES, InconsistentModelError, ModelSpec

Shape = tuple[int, ...]
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Optional per layer: q/k/v biases (Qwen2), all three or none; the output bias is let through to
# `Transformer`, which refuses it as unsupported (a clearer line than "unexpected").
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_O_BIAS = "self_attn.o_proj.bias"
HEAD = "lm_head.weight"


def expected(spec: ModelSpec) -> tuple[dict[str, tuple[Shape, str]], dict[str, tuple[Shape, str]]]:
    """(required, optional) tensors: Hugging Face name -> (shape, why, in the settings' words)."""
    E, I, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    width, mlp = f"width {E}", f"MLP width {I}"
    q, kv = f"heads {H} x head size {D}", f"KV heads {Hkv} x head size {D}"
    vocab = f"vocabulary {V}, {width}"
    required = {"model.embed_tokens.weight": ((V, E), vocab), "model.norm.weight": ((E,), width)}
    optional = {HEAD: ((V, E), vocab)}  # absent: the head is tied to the embedding
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        required.update({
            p + "input_layernorm.weight": ((E,), width),
            p + "self_attn.q_proj.weight": ((H * D, E), f"{q}, {width}"),
            p + "self_attn.k_proj.weight": ((Hkv * D, E), f"{kv}, {width}"),
            p + "self_attn.v_proj.weight": ((Hkv * D, E), f"{kv}, {width}"),
            p + "self_attn.o_proj.weight": ((E, H * D), f"{width}, {q}"),
            p + "post_attention_layernorm.weight": ((E,), width),
            p + "mlp.gate_proj.weight": ((I, E), f"{mlp}, {width}"),
            p + "mlp.up_proj.weight": ((I, E), f"{mlp}, {width}"),
            p + "mlp.down_proj.weight": ((E, I), f"{width}, {mlp}"),
        })
        if spec.model_type in FUSED_TYPES:  # Phi-3: q/k/v in one tensor, gate/up in one
            for one in ("q_proj", "k_proj", "v_proj"):
                del required[p + f"self_attn.{one}.weight"]
            del required[p + "mlp.gate_proj.weight"], required[p + "mlp.up_proj.weight"]
            required.update({
                p + "self_attn.qkv_proj.weight": (((H + 2 * Hkv) * D, E), f"{q} + 2 x {kv}, {width}"),
                p + "mlp.gate_up_proj.weight": ((2 * I, E), f"2 x {mlp}, {width}"),
            })
        if spec.sandwich:  # Gemma 3: a norm before the MLP, one after it (and post_attention_layernorm after attention)
            required.update({p + "pre_feedforward_layernorm.weight": ((E,), width),
                             p + "post_feedforward_layernorm.weight": ((E,), width)})
        if spec.qk_norm:  # Qwen3, Gemma 3: one norm over each head's queries, one over each head's keys
            required.update({p + "self_attn.q_norm.weight": ((D,), f"head size {D}"),
                             p + "self_attn.k_norm.weight": ((D,), f"head size {D}")})
        optional.update({
            p + "self_attn.q_proj.bias": ((H * D,), q),
            p + "self_attn.k_proj.bias": ((Hkv * D,), kv),
            p + "self_attn.v_proj.bias": ((Hkv * D,), kv),
            p + _O_BIAS: ((E,), width),
        })
    return required, optional


def _dims(shape: Shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def check(spec: ModelSpec, shapes: Mapping[str, Shape], label: Callable[[str], str] = str,
          head_required: bool = False) -> None:
    """Every tensor of `shapes` (Hugging Face name -> shape, [outputs, inputs]) against `spec`;
    the first disagreement as InconsistentModelError, naming the tensor by `label(name)`.

    `head_required`: the head (`lm_head.weight`) must be there (a checkpoint whose config says
    its head is not tied); else a missing head is the embedding, as llama.cpp reads a GGUF file.
    """
    required, optional = expected(spec)
    L = spec.num_layers
    present = 1 + max((int(m.group(1)) for n in shapes if (m := _LAYER.fullmatch(n))), default=-1)
    # 1. nothing the settings do not give: a layer past the last, or a tensor of no known role
    for name in shapes:
        if name in required or name in optional:
            continue
        m = _LAYER.fullmatch(name)
        if m and int(m.group(1)) >= L:
            raise InconsistentModelError(f"{label(name)} belongs to layer {m.group(1)}, but the file declares {L} layers (0-{L - 1})")
        raise InconsistentModelError(f"{label(name)} is not a tensor this {spec.model_type} decoder reads (an unsupported layout)")
    # 2. every tensor the forward reads is there
    for name in required:
        if name not in shapes:
            m = _LAYER.fullmatch(name)
            if m and present < L:
                raise InconsistentModelError(f"{label(name)} is missing: the file declares {L} layers and has tensors for {present}")
            raise InconsistentModelError(f"{label(name)} is missing")
    if head_required and HEAD not in shapes:
        raise InconsistentModelError(f"{label(HEAD)} is missing (the config says the head is not tied to the embedding)")
    for i in range(L):
        names = [f"model.layers.{i}.{b}" for b in _QKV_BIAS]
        if any(n in shapes for n in names) and not all(n in shapes for n in names):
            missing = next(n for n in names if n not in shapes)
            raise InconsistentModelError(f"{label(missing)} is missing (the layer has the other q/k/v biases)")
    # 3. each one's shape is the one its settings give
    for name, shape in shapes.items():
        want, why = required[name] if name in required else optional[name]
        if tuple(shape) != want:
            raise InconsistentModelError(f"{label(name)} is {_dims(tuple(shape))}, expected {_dims(want)} ({why})")
