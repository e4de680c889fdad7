"""A small draft made of the target's own first layers plus a trained low-rank adapter.

A model with no smaller sibling sharing its tokenizer (SmolLM2-135M) can still have a draft:
its first few layers, its final norm and its head. Unchanged, such a prefix predicts badly (its
layers were trained to feed the next layer, not the head), so a low-rank update of every
projection and new norms are distilled from the whole model (`scripts/train_smollm2_draft.py`).

A draft folder holds only that adapter: `draft.json` (the kind, the number of layers kept, the
target file it was trained on) and `adapter.safetensors` (per layer and projection A [r, in] and
B [out, r], the scale folded into B; the layers' norms and the final norm). When a pair loads,
each kept projection becomes W + B @ A, stored as Q8_0 blocks when the target's weights are kept
as stored (the kernels read it; 8 bits keep the trained update), else in the target's dtype. The
embedding and the head are the target's own tensors: the draft adds no copy of them.

The draft is only a proposer: whatever its weights, verification keeps the output exact.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from .transformer import Transformer
from .ggml_types import Q8_0
from .quantized import Matrix, StoredTensor

KIND = "target-prefix-low-rank"
MANIFEST = "draft.json"
WEIGHTS = "adapter.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


class PrefixDraftError(ValueError):
    """The adapter cannot be read, or does not fit the target (one-line message)."""


def is_prefix_draft(name: str | None) -> bool:
    """Whether `name` is a folder holding a prefix draft's adapter."""
    if not name:
        return False
    manifest = Path(name).expanduser() / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


def read(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, adapter tensors in float32) of a prefix-draft folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder).expanduser()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        tensors = {k: v.float() for k, v in load_file(str(path / WEIGHTS)).items()}
    except (OSError, ValueError, SafetensorError) as e:
        raise PrefixDraftError(f"cannot read the draft adapter in {folder}: {str(e).splitlines()[0]}") from e
    if manifest.get("kind") != KIND or not isinstance(manifest.get("layers"), int) or manifest["layers"] < 1:
        raise PrefixDraftError(f"{folder}/{MANIFEST} does not describe a prefix draft (kind {KIND!r}, layers >= 1)")
    return manifest, tensors


def write(folder: str | Path, tensors: dict[str, torch.Tensor], layers: int, target_file: str, **details) -> None:
    """Save an adapter (names as `read` returns them) in float16, with its manifest."""
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}, str(path / WEIGHTS))
    manifest = {"kind": KIND, "target_file": target_file, "layers": layers, **details}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _parts(matrix: Matrix, sizes: list[int]) -> list[torch.Tensor]:
    """A projection's stacked pieces as float32 [outputs, inputs] tensors."""
    if matrix.quantized:
        return [t.dequantized() for t in matrix.stored]
    return list(matrix.dense_t().t().float().split(sizes))


def _q8_0(w: torch.Tensor) -> StoredTensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(np.ascontiguousarray(w.numpy(), dtype=np.float32), GGMLQuantizationType.Q8_0)
    return StoredTensor(Q8_0, torch.from_numpy(np.ascontiguousarray(raw)), tuple(w.shape))


def build(target: Transformer, folder: str) -> Transformer:
    """The draft described by `folder` over `target`'s weights. Raises PrefixDraftError."""
    manifest, adapter = read(folder)
    s = target.spec
    k = manifest["layers"]
    if k >= s.num_layers:
        raise PrefixDraftError(f"the draft keeps {k} layers but the target has only {s.num_layers}")
    stored = target.quantized
    q_out, kv_out, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size

    def merged(name: str, base: torch.Tensor):
        a, b = adapter.get(name + ".lora_a"), adapter.get(name + ".lora_b")
        if a is None or b is None:
            raise PrefixDraftError(f"the draft adapter has no update for {name}")
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(base.shape) or a.shape[0] != b.shape[1]:
            raise PrefixDraftError(
                f"the draft adapter's {name} is {tuple(b.shape)} x {tuple(a.shape)}, the target's weight is "
                f"{tuple(base.shape)}: this draft was trained for another model ({manifest.get('target_file', '?')})")
        w = base + b @ a
        return _q8_0(w) if stored else w.to(target.dtype)

    def vector(name: str, like: torch.Tensor) -> torch.Tensor:
        v = adapter.get(name)
        if v is None or v.shape != like.shape:
            raise PrefixDraftError(f"the draft adapter's {name} is missing or does not match the target's")
        return v

    state: dict = {}
    embed = target.embed.stored[0] if isinstance(target.embed, Matrix) else target.embed
    state["model.embed_tokens.weight"] = embed
    if target.lm_head is not target.embed:
        state["lm_head.weight"] = target.lm_head.stored[0] if isinstance(target.lm_head, Matrix) else target.lm_head
    state["model.norm.weight"] = vector("model.norm.weight", target.final_norm)
    for i, layer in enumerate(target.layers[:k]):
        p = f"model.layers.{i}."
        if layer.bqkv is not None:
            raise PrefixDraftError("a prefix draft over a model with q/k/v biases is not supported")
        if layer.qk_norm is not None:  # its adapters are trained on Llama-family layers
            raise PrefixDraftError("a prefix draft over a model with q/k norms (Qwen3) is not supported")
        pieces = {
            **dict(zip(ATTENTION, _parts(layer.wqkv, [q_out, kv_out, kv_out]))),
            "o_proj": _parts(layer.wo, [s.hidden_size])[0],
            **dict(zip(MLP, _parts(layer.w_gate_up, [inter, inter]))),
            "down_proj": _parts(layer.w_down, [s.hidden_size])[0],
        }
        for name, base in pieces.items():
            owner = "self_attn." if name in (*ATTENTION, "o_proj") else "mlp."
            state[p + owner + name + ".weight"] = merged(p + owner + name, base)
        state[p + "input_layernorm.weight"] = vector(p + "input_layernorm.weight", layer.attn_norm)
        state[p + "post_attention_layernorm.weight"] = vector(p + "post_attention_layernorm.weight", layer.mlp_norm)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = k
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:k])
    return Transformer(config, state, target.device, target.dtype)
