"""Tiny GGUF files written with ggml's own `gguf` package from tiny random Hugging Face models.

The weights are written as llama.cpp's converter writes them (Llama's q and k rows reordered for
its rotary layout), quantized to the asked types: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 by the
package's quantizer; the K types (which it cannot quantize at these sizes) as random blocks with
sane scales, which is a valid checkpoint too; a type the engine does not read as random bytes
(to be refused). Hugging Face's model loaded from the same file is the oracle.

A file that lies (a GGUF file comes from the internet) is written by the same function with
`settings` (header numbers changed) or `edit` (tensors changed, dropped or added), or by
`patch_tensor_info` on a written file (a type number or data offset the writer would refuse).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
# A Q4_K_M file's mix: q/k Q4_K, v and down Q6_K; the others spread over the remaining types.
K_MIX = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q5_K,
         "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q4_1, "ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q8_0}
# The 5-bit 32-weight types: q/k Q5_0 stacked with v Q8_0 (a Q4_K_M file's projections whose rows
# are not a multiple of 256, as Gemma 3 270M's), the others Q5_1 and Q5_0.
Q5_MIX = {"attn_q.weight": Q.Q5_0, "attn_k.weight": Q.Q5_0, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q5_1,
          "ffn_gate.weight": Q.Q5_0, "ffn_up.weight": Q.Q5_1, "ffn_down.weight": Q.Q5_0, "token_embd.weight": Q.Q5_1}
LLAMA = dict(hidden_size=256, intermediate_size=512, vocab_size=300)  # K types need 256 inputs


def _vocab(size: int) -> tuple[list[str], list[str]]:
    """Byte-level BPE tokens: the specials, the printable characters, then merged pairs."""
    chars = ([chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"])[: max(2, size - len(TOKENS) - 1)]
    tokens, merges = TOKENS + chars, []  # at least one merge: transformers reads a file without as another kind
    for a in chars:
        for b in chars:
            if len(tokens) >= size:
                return tokens, merges
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    return tokens, merges


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks whose 16-bit scales are small positive numbers (weights of
    order 0.1 to 1, as a trained model's); random bytes for a type the engine does not read."""
    per_block, nbytes = GGML_QUANT_SIZES[Q(qtype)]
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    low, high = (0.0002, 0.002) if per_block == 256 else (0.002, 0.02)
    scale = lambda n: (rng.uniform(low, high, size=(blocks.shape[0], n)).astype(np.float16).view(np.uint8))  # noqa: E731
    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks[:, 0:4] = scale(2)  # d and dmin
    elif qtype == Q.Q6_K:
        blocks[:, 192:208] = rng.integers(-20, 21, size=(blocks.shape[0], 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = scale(1)
    elif qtype in (Q.Q4_1, Q.Q5_1):
        blocks[:, 0:4] = scale(2)  # d and m
    elif qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        blocks[:, 0:2] = scale(1)
    return blocks.reshape(rows, -1)


def _stored(w: np.ndarray, qtype: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    if qtype in (Q.F32, Q.F16):
        return w.astype(np.float32 if qtype == Q.F32 else np.float16), qtype
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return quants.quantize(w.astype(np.float32), Q(qtype)), qtype
    return random_blocks(qtype, *w.shape, rng), qtype


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a q or k projection's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Edit = Callable[[str, np.ndarray], list[tuple[str, np.ndarray]]]


def write_gguf(hf, path: Path, types: dict[str, int], default: int = Q.Q8_0, seed: int = 0, pre: str = "default",
               settings: dict[str, int] | None = None, edit: Edit | None = None) -> Path:
    """Write `hf` (a transformers Llama, Qwen2, Qwen3, Gemma 3 text or Phi-3 model) as a GGUF file; `types` maps a GGUF tensor
    name's suffix (e.g. "attn_v.weight", "token_embd.weight") to its GGML type (else `default`);
    `pre` is the tokenizer's pre-tokenizer type as llama.cpp names it.

    A lying file: `settings` replaces header numbers by the writer's names ("block_count",
    "context_length", "embedding_length", "feed_forward_length", "head_count", "head_count_kv");
    `edit(name, weights)` gets each tensor by its GGUF name, as float32 [rows, cols] before it is
    quantized, and returns the tensors to write in its place (none drops it, two add one)."""
    cfg = hf.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma3_text": "gemma3",
            "phi3": "phi3"}[cfg.model_type]
    gemma = arch == "gemma3"
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    header = dict(block_count=cfg.num_hidden_layers, context_length=cfg.max_position_embeddings,
                  embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                  head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads)
    for key, value in {**header, **(settings or {})}.items():
        getattr(w, f"add_{key}")(value)
    rope = cfg.rope_parameters["full_attention"] if gemma else cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if gemma:  # as llama.cpp's converter writes it (readers take every sixth layer as the full one)
        w.add_sliding_window(cfg.sliding_window)
    if arch in ("qwen3", "gemma3"):  # a head size of its own, as llama.cpp's converter writes it
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
    elif arch == "phi3":  # as llama.cpp's converter writes Phi-3: the rotated numbers, longrope's settings
        rope = cfg.rope_parameters
        head = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_rope_scaling_orig_ctx_len(original)
            for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
                factors = np.asarray(rope[key], dtype=np.float32)
                for name, factors in (edit(name, factors) if edit is not None else [(name, factors)]):
                    w.add_tensor(name, factors.astype(np.float32))
    else:
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, merges = _vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "phi3":  # else transformers' Phi-3 config keeps its padding id 32,000, past a tiny vocabulary
        w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                 # Phi-3's fused tensors (gate and up together in ffn_up, gate first)
                 "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
    if gemma:  # a layer's four norms under Gemma's names
        per_layer = {**per_layer, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    state = hf.state_dict()
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{per_layer[rest]}"
        else:
            gname = names[name]
        a = t.detach().float().numpy()
        if gemma and gname.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's norms as 1 + w
            a = a + np.float32(1)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads)
        for gname, a in (edit(gname, a) if edit is not None else [(gname, a)]):
            if a.ndim == 1:
                w.add_tensor(gname, a.astype(np.float32))
                continue
            suffix = gname.split(".", 2)[-1] if gname.startswith("blk.") else gname
            data, qtype = _stored(a, types.get(suffix, default), rng)
            w.add_tensor(gname, data, raw_dtype=Q(qtype) if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def patch_tensor_info(path: Path, name: str, qtype: int | None = None, offset: int | None = None,
                      dims: tuple[int, ...] | None = None) -> Path:
    """Rewrite, in place, a written tensor's type number, data offset (relative to the data
    section) or dims (as many as it has, the file's order: inputs first) in its header entry:
    what no writer would write. The entry is the name (a u64 length and its bytes), n_dims (u32),
    the dims (u64 each), the type (u32), the offset (u64)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.find(key)
    if at < 0 or data.find(key, at + 1) >= 0:
        raise ValueError(f"{path.name}: tensor {name} is not in the header exactly once")
    at += len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if dims is not None:
        if len(dims) != n_dims:
            raise ValueError(f"{path.name}: tensor {name} has {n_dims} dims, not {len(dims)}")
        struct.pack_into(f"<{n_dims}Q", data, at + 4, *dims)
    at += 4 + 8 * n_dims
    if qtype is not None:
        struct.pack_into("<I", data, at, qtype)
    if offset is not None:
        struct.pack_into("<Q", data, at + 4, offset)
    path.write_bytes(bytes(data))
    return path


def hf_from_gguf(path: Path, head_dim: int | None = None):
    """Hugging Face's own model read from the file (transformers dequantizes it): the oracle.
    `head_dim`: the head size its config takes instead of the one transformers reads (its
    reading of a qwen3 header skips the key length, and keeps Qwen3's default of 128)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {}
    if head_dim is not None:
        extra["config"] = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        extra["config"].head_dim = head_dim
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **extra).eval()


def file_pair(folder: Path, name: str, target_hf, draft_hf, new: int, prompt: int = 120):
    """A target and a draft written as GGUF files (Q8_0, vectors F32) in `folder` as
    `name`-target.gguf / `name`-draft.gguf: (Hugging Face's model read from the target file, ours
    of the target, ours of the draft, a random prompt's ids, HF's greedy `new` tokens after it,
    HF's top-2 logit gap at each)."""
    from triforce_core.models.loading import load_model

    target = write_gguf(target_hf, folder / f"{name}-target.gguf", {})
    draft = write_gguf(draft_hf, folder / f"{name}-draft.gguf", {})
    hf = hf_from_gguf(target)
    vocab = target_hf.config.vocab_size
    ids = torch.randint(3, vocab, (prompt,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, prompt, dtype=torch.long), do_sample=False,
                          max_new_tokens=new, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    ref = out.sequences[0, prompt:].tolist()
    gaps = [float(lg[0].topk(2).values[0] - lg[0].topk(2).values[1]) for lg in out.logits]
    cpu = torch.device("cpu")
    return (hf, load_model(str(target), cpu, torch.float32), load_model(str(draft), cpu, torch.float32),
            ids.tolist(), ref, gaps)
