"""Tiny random Hugging Face checkpoints built from configs (no downloads, CPU only), our models
from them, and the word-level tokenizer and chat template that go with them."""

from __future__ import annotations

import os
import random

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from triforce_core.models.transformer import Transformer

CPU = torch.device("cpu")
VOCAB = 97
# A larger init than the default 0.02 keeps random logits far from ties, so greedy
# comparisons are meaningful; 2 layers keep everything fast on 2 cores.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
# Phi-4-mini's rotary embedding, tiny: the first 12 of each head's 16 numbers turn (factor 0.75),
# with longrope's short factors below position 180 and its long ones from there (inside a test's
# 160-token prompt and 40-token answer), and the attention factor its 1024 / 180 ratio gives.
PHI4_ROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    partial_rotary_factor=0.75,
    short_factor=[1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
    long_factor=[1.0, 1.4, 2.5, 4.0, 7.0, 12.0],
    original_max_position_embeddings=180,
)

KINDS = {
    # name: (config class, model class, overrides)
    "llama_gqa_llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama_linear": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama_dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(max_position_embeddings=64, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    "llama_yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
    ),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    # q/k norms, a head size (24) apart from width / heads (16), tied embeddings
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=24)),
    # Gemma 3: sliding-window layers (a window far shorter than the prompts) then a full one,
    # with rotary bases of their own; a query scale apart from the head size's; sandwich norms
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(num_hidden_layers=3, sliding_window=24, sliding_window_pattern=3,
                                                          head_dim=24, query_pre_attn_scalar=20)),
    # fused q/k/v and gate/up (Phi-3-mini: the whole head rotated, the default rope)
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(pad_token_id=0)),
    # Phi-4-mini: partial rotary, longrope, tied embeddings
    "phi4_mini": (Phi3Config, Phi3ForCausalLM, dict(pad_token_id=0, tie_word_embeddings=True, rope_parameters=PHI4_ROPE,
                                                   original_max_position_embeddings=180)),
    # the same with the switch at 256: a generation of the tests' 160 + 40 tokens stays short of it
    "phi4_mini_within": (Phi3Config, Phi3ForCausalLM, dict(pad_token_id=0, tie_word_embeddings=True,
                                                          rope_parameters={**PHI4_ROPE, "original_max_position_embeddings": 256},
                                                          original_max_position_embeddings=256)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=48)),
}
# A small draft: one layer, narrower, same vocabulary.
DRAFT_OVERRIDES = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def make_hf(kind: str, seed: int = 0, **overrides):
    config_cls, model_cls, kind_overrides = KINDS[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **kind_overrides, **overrides})
    model = model_cls(config).eval()
    if config.model_type == "qwen3":  # q/k norms start as ones: random ones, so that q's read as k's shows
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    if config.model_type == "gemma3_text":  # every norm's w starts at 0 (1 + w = 1): random ones, so that each shows
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


# Where `to_ours` puts our models: the CPU, or with TRIFORCE_TEST_DEVICE=cuda a GPU, where the
# exactness tests check the CUDA path against Hugging Face's model on the CPU (docs/results.md's
# GPU section says which files were run there). CI runs everything on the CPU.
OURS = torch.device(os.environ.get("TRIFORCE_TEST_DEVICE", "cpu"))


def to_ours(hf) -> Transformer:
    return Transformer(hf.config, hf.state_dict(), OURS, torch.float32)


def perturbed(hf, scale: float, seed: int = 1):
    """A copy of `hf` with Gaussian noise on every weight: a draft that agrees only partly."""
    clone = type(hf)(hf.config).eval()
    clone.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return clone


def make_tokenizer(words_prefix: str = "w", vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: <unk>=0, <s>=1, </s>=2, then '{prefix}3' ... ; whitespace split."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        vocab_map[f"{words_prefix}{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def save_checkpoint(path, hf, tokenizer=None) -> str:
    hf.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


# A chat template whose role markers are ordinary words of the word-level test vocabulary,
# so every token of a rendered conversation is known.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w3 {% elif m['role'] == 'user' %}w4 "
    "{% else %}w5 {% endif %}{{ m['content'] }} w6 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def words(n: int, seed: int) -> str:
    """n random words of the test vocabulary (w7 .. w96)."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(7, 97)}" for _ in range(n))


def chat_pair(root, name: str) -> tuple[str, str]:
    """A tiny Llama 3 target saved as `root/name` and a draft that agrees with it only partly
    (`root/chat-draft`), both with a chat template: their folders."""
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    hf = make_hf("llama_gqa_llama3", seed=0)
    return save_checkpoint(root / name, hf, tok), save_checkpoint(root / "chat-draft", perturbed(hf, 0.02), tok)


# A model without a chat template that answers in the plain layout and then, as a base model
# does, writes the next question itself: its tokens are whole pieces of that layout, and its
# weights make each token follow from the one before it alone (`plain_layout_checkpoint`).
PLAIN_PIECES = ["<unk>", "<s>", "</s>", "\n", "Question:", "Answer:", " Yes", " Why", "The", " the", " cat", " sat",
                " on", " a", " mat", ".", "What", " What", " did", " do", "?", " "]
# The answer it gives after "Answer:" (then the next question and on, for ever): " Yes" cut
# before "\nQuestion:".
PLAIN_NEXT = {"Answer:": " Yes", " Yes": "\n", "\n": "Question:", "Question:": " Why", " Why": "\n"}


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer of PLAIN_PIECES (a piece's text is its own; they decode joined), no chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {p: i for i, p in enumerate(PLAIN_PIECES)}
    words = "|".join(sorted((p for p in PLAIN_PIECES[3:] if p not in ("\n", " ")), key=len, reverse=True))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "\n|" + "|".join(w.replace("?", r"\?").replace(".", r"\.") for w in words.split("|")) + "| "
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def plain_layout_checkpoint(path, seed: int = 0) -> str:
    """A tiny Llama saved at `path` with `plain_tokenizer`: its layers add nothing (their output
    projections are zero), so the last position's state is its token's embedding, and its head
    maps each token of PLAIN_NEXT to the one after it (others keep their random logits)."""
    tok = plain_tokenizer()
    hf = make_hf("llama_mha", seed=seed, vocab_size=len(PLAIN_PIECES), tie_word_embeddings=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = hf.model.embed_tokens.weight
        normed = embed / embed.pow(2).mean(-1, keepdim=True).add(hf.config.rms_norm_eps).sqrt() * hf.model.norm.weight
        for after in set(PLAIN_NEXT.values()):  # a token's row: the sum of those it follows
            before = [tok.convert_tokens_to_ids(b) for b, a in PLAIN_NEXT.items() if a == after]
            hf.lm_head.weight[tok.convert_tokens_to_ids(after)] = 4 * normed[before].sum(0)
    return save_checkpoint(path, hf, tok)
