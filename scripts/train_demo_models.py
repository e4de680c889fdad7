"""Train the embedded demo pair: a long-context Llama target and a small Llama draft.

Everything runs offline on a CPU (about 45 minutes on 2 cores with the defaults):

1. text: the Python documentation sources and the standard library's docstrings
   (``demo_corpus``); the tutorial and the FAQ are held out;
2. tokenizer: byte-level BPE with a chat template, trained with Hugging Face ``tokenizers``
   (or reused with ``--tokenizer``);
3. target: multi-head attention so that its KV cache dominates at long context. First
   induction heads, the mechanism of copying, on short windows of random tokens in which a
   stretch recurs; then language on 1K-token windows with PoSE-style skipped position ids
   (positions up to 16K) and a large rope base, where a share of every batch is a synthetic
   copy task ("What follows «quote»?") whose answer must be copied from far back in a
   document, or text in which an earlier passage (or a random token string) recurs verbatim;
   finally 4K-token windows. The target is saved before the draft is trained;
4. draft: a much smaller model on 512-token windows, distilled from the target
   (``--draft-only TARGET`` trains just this step against a saved target).

Both models are saved in bfloat16 safetensors with the tokenizer under ``assets/models``.
Seeded and deterministic for a given machine and library versions.

    python -m scripts.train_demo_models               # full run (from the repository root)
    python -m scripts.train_demo_models --quick       # a two-minute smoke run into a scratch folder
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import demo_corpus

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_POSITION = 16384


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:], model_max_length=MAX_POSITION,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def encode_plain(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------
# examples
# --------------------------------------------------------------------------------------
def ambiguous_positions(ids: list[int], start: int, context: int = 3) -> list[int]:
    """Positions i >= start whose last `context` tokens also occur before `start` followed by a
    token other than ids[i].

    These are the places where a copy that matches only on the last few tokens it wrote goes
    astray (every teacher-forced miss of the demo target at 16K was such a place): the
    document offers two continuations of the same short context, and only a longer match
    says which one the quoted passage takes.
    """
    follows: dict[tuple[int, ...], set[int]] = {}
    for j in range(context, start):
        follows.setdefault(tuple(ids[j - context:j]), set()).add(ids[j])
    out = []
    for i in range(max(start, context), len(ids)):
        nxt = follows.get(tuple(ids[i - context:i]))
        if nxt is not None and (len(nxt) > 1 or ids[i] not in nxt):
            out.append(i)
    return out


def copy_sources(text: str, ids: list[int], offsets, doc: str, picks, spans) -> list[int]:
    """For each token position t of a copy conversation, the document position whose token
    the answer takes next (the key an exact copier attends to from query t), or -1.

    The continuation of an answer (after the repeated phrase) is the document's text from
    the end of the quoted phrase on, so answer token i, at character c of the answer,
    corresponds to the document token starting at the same character of the phrase's place
    in the document. A position is given only where that token exists with the same id
    (byte-level BPE can cut the first token differently), for the query t = i - 1 that
    predicts it. The repeated phrase itself is left out: it can be copied from the
    question as well as from the document.
    """
    out = [-1] * len(ids)
    doc_at = text.find(doc)
    if doc_at < 0:
        return out
    token_at = {s: i for i, (s, e) in enumerate(offsets) if e > s}
    for (quote, cont), (a, _) in zip(picks, spans):
        where = doc.find(quote + cont)
        if where < 0:
            continue
        for c in range(a + len(quote), a + len(quote) + len(cont)):
            i = token_at.get(c)
            if i is None or i == 0:
                continue
            p = token_at.get(doc_at + where + (c - a))
            if p is not None and ids[p] == ids[i] and p < i - 1:
                out[i - 1] = p
    return out


class Batcher:
    """Language-model windows and copy-task conversations, with PoSE position ids."""

    def __init__(self, tok, docs: list[str], stream: np.ndarray, seed: int, copy_share: float,
                 pose_share: float, repeat_share: float = 0.0, random_share: float = 0.0,
                 max_position: int = MAX_POSITION):
        self.tok, self.docs, self.stream = tok, docs, stream
        self.rng = random.Random(seed)
        self.copy_share, self.pose_share, self.max_position = copy_share, pose_share, max_position
        self.repeat_share = repeat_share
        self.random_share = random_share
        # share of windows of small-vocabulary recurring passages (alphabet_example)
        self.alphabet_share = 0.0
        self.random_lengths = (12, 64)
        self.vocab = len(tok)
        self.bos = tok.convert_tokens_to_ids("<|endoftext|>")
        self.pad = self.bos
        self.chars_per_token = 3.2
        # Copy answers of 150-400 characters (with the repeated phrase ~50-130 tokens). With
        # 60-200 the target learned to expect an answer to end at almost any word and wrote
        # <|end|> inside the 20 tokens that the copy evaluation compares.
        self.answer_chars = (150, 400)
        self.max_questions = 12
        # candidates per copy question, of which the most ambiguous passage is asked for
        # (demo_corpus.pick_hard_passage); 1: plain random passages
        self.hard_candidates = 1
        # share of copy questions whose phrase's last words also recur elsewhere in the
        # document, followed by other text (demo_corpus.insert_distractors)
        self.distractor_share = 0.0
        # loss weight of answer tokens whose last three tokens also occur earlier in the
        # conversation followed by another token (ambiguous_positions); 1: no emphasis
        self.ambiguous_weight = 1.0
        # the attention sources of the last copy_example (copy_sources), for batch(sources=True)
        self.last_sources: list[int] | None = None
        self.torch_rng = torch.Generator().manual_seed(seed)

    def positions(self, n: int) -> list[int]:
        if self.rng.random() >= self.pose_share or n >= self.max_position:
            return list(range(n))
        split = self.rng.randint(n // 8, n - 1)
        skip = self.rng.randint(0, self.max_position - n)
        return list(range(split)) + list(range(split + skip, n + skip))

    def lm_example(self, n: int):
        start = self.rng.randrange(0, len(self.stream) - n - 1)
        ids = [self.bos] + self.stream[start:start + n - 1].tolist()
        return ids, [1.0] * n

    def repeat_example(self, n: int, random_tokens: bool = False):
        """Text in which an earlier passage recurs verbatim: every recurring token is predictable
        by looking back (this grows induction heads quickly, the basis of copying). With
        random_tokens the passage is a random token string, which only copying can predict."""
        ids, w = self.lm_example(n)
        m = self.rng.randint(24, min(256, n // 4)) if not random_tokens else self.rng.randint(*self.random_lengths)
        a = self.rng.randint(1, n // 2 - m)
        b = self.rng.randint(a + m, n - m)
        if random_tokens:
            ids[a:a + m] = [self.rng.randrange(len(SPECIALS), self.vocab) for _ in range(m)]
        ids[b:b + m] = ids[a:a + m]
        ans = [0.0] * n
        for i in range(b + 2, b + m):
            ans[i] = 1.0
        return ids, w, ans

    def alphabet_example(self, n: int):
        """Text in which passages written with a few random "words" recur.

        Each segment of the window (one per 1,024 tokens) holds a passage drawn from its own
        small vocabulary of 4-12 random words of 1-3 tokens, and later a verbatim run of it
        from a random place. In such a passage every word, and most pairs of words, occur many
        times with different continuations, so the recurrence can only be copied by matching
        the last several tokens written, not the last one or two: the dense form of the
        "short-suffix jump" by which the target lost its place in long documents. The first
        6 tokens of a run, where even a perfect copier cannot yet know its place, carry no
        copy loss.
        """
        ids, w = self.lm_example(n)
        ans = [0.0] * n
        segments = max(1, n // 1024)
        size = n // segments
        for s in range(segments):
            lo = s * size + (1 if s == 0 else 0)
            hi = (s + 1) * size
            span = hi - lo
            m = self.rng.randint(min(48, span // 4), max(min(48, span // 4), min(256, span // 3)))
            words = [[self.rng.randrange(len(SPECIALS), self.vocab) for _ in range(self.rng.randint(1, 3))]
                     for _ in range(self.rng.randint(4, 12))]
            passage: list[int] = []
            while len(passage) < m:
                passage += self.rng.choice(words)
            passage = passage[:m]
            r = self.rng.randint(min(24, m), m)
            off = self.rng.randint(0, m - r)
            a = self.rng.randint(lo, lo + span - m - r)
            b = self.rng.randint(a + m, lo + span - r)
            ids[a:a + m] = passage
            ids[b:b + r] = passage[off:off + r]
            for i in range(b + 6, b + r):
                ans[i] = 1.0
        return ids, w, ans

    def alphabet_batch(self, b: int, n: int):
        """A batch of alphabet_example windows (contiguous positions), for a copy-only phase."""
        rows = [self.alphabet_example(n) for _ in range(b)]
        t = torch.tensor
        return (t([r[0] for r in rows]), torch.arange(n).expand(b, n), t([r[1] for r in rows]),
                t([r[2] for r in rows]))

    def induction_batch(self, b: int, n: int):
        """Short windows of random tokens in which a stretch recurs verbatim at a random distance.

        Only copying can predict the recurrence, and a short window makes the signal dense: this
        is where induction heads (a previous-token head feeding a content-matching head), the
        mechanism of copying, form. Measured on a 2 x 128 toy: the copy loss fell from chance
        (8.3 nats) to 0.45 between steps 700 and 1,000 with 64-token windows, while with
        128-token windows it was still at 6.5 after 2,100 steps. Positions are contiguous.
        """
        ids = torch.randint(len(SPECIALS), self.vocab, (b, n), generator=self.torch_rng)
        ans = torch.zeros(b, n)
        for r in range(b):
            m = self.rng.randint(8, n // 3)
            a = self.rng.randint(0, n // 2 - m)
            c = self.rng.randint(a + m, n - m)
            ids[r, c:c + m] = ids[r, a:a + m]
            ans[r, c + 1:c + m] = 1.0
        pos = torch.arange(n).expand(b, n)
        return ids, pos, torch.ones(b, n), ans

    def document_text(self, chars: int) -> str:
        parts, total = [], 0
        i = self.rng.randrange(len(self.docs))
        while total < chars:
            d = self.docs[i % len(self.docs)]
            parts.append(d)
            total += len(d)
            i += 1
        text = "\n".join(parts)
        start = self.rng.randrange(0, max(1, len(text) - chars))
        # start at a paragraph or at least a word start
        nl = text.find("\n", start)
        start = nl + 1 if 0 <= nl < start + 400 else start
        return text[start:start + chars]

    def copy_example(self, n: int):
        """A conversation: a document, then up to 12 "what follows «quote»?" questions and answers."""
        while True:
            questions = self.rng.randint(1, max(1, min(self.max_questions, (n - 100) // 300)))
            doc = self.document_text(int(self.chars_per_token * (n - 130 * questions - 8)))
            picks = []
            for _ in range(questions):
                picked = demo_corpus.pick_hard_passage(doc, self.rng, self.hard_candidates,
                                                       answer_chars=self.answer_chars)
                if picked is None:
                    break
                picks.append(picked)
            if self.distractor_share > 0:
                doc = demo_corpus.insert_distractors(doc, picks, self.rng, self.distractor_share)
            messages = []
            for k, (quote, cont) in enumerate(picks):
                q = self.rng.choice(demo_corpus.QUESTIONS).format(q=quote)
                content = f"{doc}\n\n{q}" if k == 0 else q
                messages += [{"role": "user", "content": content},
                             {"role": "assistant", "content": demo_corpus.copy_answer(quote, cont)}]
            if not messages:
                continue
            text = self.tok.apply_chat_template(messages, tokenize=False)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = enc["input_ids"], enc["offset_mapping"]
            if len(ids) > n:
                self.chars_per_token *= 0.97
                continue
            # answer tokens: everything after "<|assistant|>\n" up to and including "<|end|>"
            spans, pos = [], 0
            for m in messages[1::2]:
                a = text.index("<|assistant|>\n" + m["content"] + "<|end|>", pos) + len("<|assistant|>\n")
                b = a + len(m["content"]) + len("<|end|>")
                spans.append((a, b))
                pos = b
            weights = [0.0] * len(ids)
            for i, (s, e) in enumerate(offsets):
                if any(a <= s and e <= b and e > s for a, b in spans):
                    weights[i] = 1.0
            is_answer = weights
            if self.ambiguous_weight != 1.0:
                first = next(i for i, w in enumerate(weights) if w > 0)
                for i in ambiguous_positions(ids, first):
                    if weights[i] > 0:
                        weights[i] = self.ambiguous_weight
            lm = [1.0] * len(ids)
            pad = n - len(ids)
            if pad > 24:
                self.chars_per_token *= 1.01
            self.last_sources = copy_sources(text, ids, offsets, doc, picks, spans) + [-1] * pad
            return ids + [self.pad] * pad, lm + [0.0] * pad, is_answer + [0.0] * pad

    def batch(self, b: int, n: int, sources: bool = False):
        """`b` windows of `n` tokens: ids, position ids, LM weights, answer weights; with
        `sources`, also the document position each query should attend to (copy_sources; -1
        where none: every window but copy questions)."""
        ids, pos, lm_w, ans_w, src = [], [], [], [], []
        for _ in range(b):
            r = self.rng.random()
            self.last_sources = None
            if r < self.copy_share:
                x, w, a = self.copy_example(n)
            elif r < self.copy_share + self.repeat_share:
                x, w, a = self.repeat_example(n)
            elif r < self.copy_share + self.repeat_share + self.random_share:
                x, w, a = self.repeat_example(n, random_tokens=True)
            elif r < self.copy_share + self.repeat_share + self.random_share + self.alphabet_share:
                x, w, a = self.alphabet_example(n)
            else:
                x, w = self.lm_example(n)
                a = [0.0] * n
            ids.append(x)
            lm_w.append(w)
            ans_w.append(a)
            src.append(self.last_sources if self.last_sources is not None else [-1] * n)
            pos.append(self.positions(n))
        t = torch.tensor
        if sources:
            return t(ids), t(pos), t(lm_w), t(ans_w), t(src)
        return t(ids), t(pos), t(lm_w), t(ans_w)


def lm_losses(logits, ids, lm_w, ans_w):
    """Mean next-token loss over LM-weighted tokens that are not answer tokens, and the
    ans_w-weighted mean over answer tokens (weights may exceed 1: --ambiguous-weight)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    w = lm_w[:, 1:] * (ans_w[:, 1:] == 0)
    a = ans_w[:, 1:]
    lm = (nll * w).sum() / w.sum().clamp_min(1)
    ans = (nll * a).sum() / a.sum().clamp_min(1)
    return lm, ans, a.sum()


# Queries and keys (after rope) of the layers whose heads --attend-heads supervises, captured
# during the forward pass by the attention function registered in `capture_attention`.
_CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_CAPTURE_LAYERS: set[int] = set()


def capture_attention(model, layers) -> None:
    """Route `model`'s attention through SDPA that also keeps the queries and keys of `layers`
    (with their gradients) for attention_supervision_loss."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa_capturing(module, query, key, value, attention_mask, **kw):
        if module.layer_idx in _CAPTURE_LAYERS:
            _CAPTURED[module.layer_idx] = (query, key)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("sdpa_capturing", sdpa_capturing)
    _CAPTURE_LAYERS.clear()
    _CAPTURE_LAYERS.update(layers)
    model.config._attn_implementation = "sdpa_capturing"


def attention_supervision_loss(heads, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1 - the mean attention that the supervised heads put on the exact source, over the
    queries that have one (src >= 0; copy_sources), and that mean itself.

    A copy that matches only the last few tokens written is as good as the exact one for the
    next-token loss wherever the look-alike goes on with the same token, which is nearly
    everywhere; the exact source position names the one place to read from at every answer
    token, so this loss teaches the match to discriminate where the next-token loss is blind.
    It is the attention itself, not its logarithm: with -log(attention) the heads of the
    demo target grew softer (mean attention on the source fell from 0.66 to 0.33 in 70
    steps), because spreading attention over every look-alike is the cheapest way to lift
    the queries it cannot yet resolve off zero; 1 - attention gives those little gradient and
    works on the near misses, where the source competes with a look-alike.
    """
    mass = []
    for b in range(src.shape[0]):
        rows = (src[b] >= 0).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        target = src[b, rows]
        future = torch.arange(src.shape[1], device=src.device)[None, :] > rows[:, None]
        for layer, head in heads:
            q, k = _CAPTURED[layer]
            scores = (q[b, head, rows].float() @ k[b, head].float().T) * q.shape[-1] ** -0.5
            logp = scores.masked_fill(future, float("-inf")).log_softmax(-1)
            picked = logp.gather(-1, target[:, None]).squeeze(-1)
            mass.append(picked.exp())
    if not mass:
        zero = torch.zeros((), device=src.device)
        return zero, zero
    mean = torch.cat(mass).mean()
    return 1.0 - mean, mean.detach()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


DEVICE = torch.device("cpu")


def _autocast():
    """bfloat16 autocast on a GPU (weights and optimizer stay float32); nothing on the CPU."""
    if DEVICE.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def yarn_parameters(theta: float, factor: float, max_pos: int) -> dict:
    """Rope parameters for YaRN scaling by `factor` of a `max_pos` window (see set_yarn)."""
    return {"rope_type": "yarn", "rope_theta": float(theta), "factor": float(factor),
            "original_max_position_embeddings": int(max_pos / factor)}


def make_model(tok, hidden, layers, heads, inter, theta, max_pos, yarn: float | None = None):
    """A Llama; with `yarn` its rope is scaled as the shipped target's is at inference."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=inter, max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
        rope_parameters=({"rope_type": "default", "rope_theta": float(theta)} if yarn in (None, 1.0)
                         else yarn_parameters(theta, yarn, max_pos)),
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, tok.bos_token_id],
        pad_token_id=tok.pad_token_id, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def grow_layers(model, state: dict, layer_map: list[int | None]) -> dict:
    """Map a checkpoint's layers onto `model`'s deeper stack (depth up-scaling).

    Layer i of `model` takes the weights of checkpoint layer `layer_map[i]`; a `None` entry is
    a new layer that keeps its random initialisation except for its two output projections
    (attention `o_proj`, MLP `down_proj`), which are zeroed, so that it adds nothing to the
    residual stream and the grown model computes exactly what the checkpoint computed. The
    zeroed projections receive gradient from the first step, so the new layers learn.
    """
    prefix = "model.layers."
    src_layers = {int(k[len(prefix):].split(".", 1)[0]) for k in state if k.startswith(prefix)}
    missing = sorted({i for i in layer_map if i is not None} - src_layers)
    if missing:
        raise ValueError(f"--init-layers names layers {missing}; the checkpoint has {len(src_layers)} "
                         f"(0-{max(src_layers)})")
    grown = {k: v for k, v in state.items() if not k.startswith(prefix)}
    own = model.state_dict()
    for i, src in enumerate(layer_map):
        if src is None:
            for k, v in own.items():
                if k.startswith(f"{prefix}{i}."):
                    zero = k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                    grown[k] = torch.zeros_like(v) if zero else v.clone()
            continue
        head = f"{prefix}{src}."
        for k, v in state.items():
            if k.startswith(head):
                grown[f"{prefix}{i}.{k[len(head):]}"] = v
    return grown


def copy_only_loss(model, ids, pos, ans_w):
    """Next-token loss on the recurring tokens only, projecting only those rows to the vocabulary."""
    with _autocast():
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state[:, :-1]
    sel = ans_w[:, 1:] > 0
    logits = model.lm_head(hidden[sel]).float()
    return F.cross_entropy(logits, ids[:, 1:][sel])


def train_target(model, batcher, phases, peak_lr, log_every, ckpt: Path, fast_layers=(), fast_scale=1.0,
                 attend_heads=(), attend_weight=0.0):
    """phases: dicts with steps, batch, length and either a kind ("induction", "alphabet") or a mixture.

    The induction and alphabet phases (random-token recurrences, small-vocabulary passages;
    loss on the copy only) run at a constant learning rate after a short warm-up and end
    early once the copy loss has fallen below `stop_below` (mean of the last 50 steps). The
    other phases share one cosine schedule.
    The layers in `fast_layers` (new layers of a grown target) learn at `fast_scale` times
    the learning rate of the rest. Returns the per-phase history (steps run, final losses)
    for the model card.
    """
    fast = {f"model.layers.{i}." for i in fast_layers}
    groups = [{"params": [], "scale": 1.0}, {"params": [], "scale": fast_scale}]
    for name, param in model.named_parameters():
        groups[any(name.startswith(f) for f in fast)]["params"].append(param)
    supervise = bool(attend_heads) and attend_weight > 0
    if supervise:
        capture_attention(model, {layer for layer, _ in attend_heads})
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    main_total = sum(ph["steps"] for ph in phases if ph.get("kind") is None)
    main_step, step, t0 = 0, 0, time.time()
    report = []
    model.train()
    for ph in phases:
        hist = []
        b, n = ph["batch"], ph["length"]
        induction = ph.get("kind") is not None  # a copy-only phase
        make_batch = batcher.alphabet_batch if ph.get("kind") == "alphabet" else batcher.induction_batch
        for k, v in ph.get("mixture", {}).items():
            setattr(batcher, k, v)
        for i in range(ph["steps"]):
            att_mass = None
            if induction:
                lr = ph["lr"] * min(1.0, (i + 1) / 50)
                ids, pos, lm_w, ans_w = (t.to(DEVICE) for t in make_batch(b, n))
            else:
                lr = lr_at(main_step, main_total, peak_lr, 20)
                ids, pos, lm_w, ans_w, *src = (t.to(DEVICE) for t in batcher.batch(b, n, sources=supervise))
            for g in opt.param_groups:
                g["lr"] = lr * g["scale"]
            if induction:
                ans = copy_only_loss(model, ids, pos, ans_w)
                lm, loss = torch.zeros(()), ans
            else:
                with _autocast():
                    logits = model(input_ids=ids, position_ids=pos).logits
                lm, ans, n_ans = lm_losses(logits, ids, lm_w, ans_w)
                loss = lm + (ans if n_ans > 0 else 0.0)
                if supervise:
                    att, att_mass = attention_supervision_loss(attend_heads, src[0])
                    loss = loss + attend_weight * att
                    _CAPTURED.clear()
                main_step += 1
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist.append((lm.item(), ans.item(), att_mass.item() if att_mass is not None else float("nan")))
            step += 1
            if step % log_every == 0 or i + 1 == ph["steps"]:
                recent = hist[-log_every:]
                on_source = [h[2] for h in recent if not math.isnan(h[2])]
                log(f"target step {step} ({ph['name']} {i + 1}/{ph['steps']}, {b} x {n}) "
                    f"lm {np.mean([h[0] for h in recent]):.3f} copy {np.mean([h[1] for h in recent]):.3f}  "
                    + (f"attention on source {np.mean(on_source):.3f}  " if on_source else "")
                    + f"{(time.time() - t0) / 60:.1f} min")
            if step % 200 == 0:
                model.save_pretrained(ckpt / "latest")
            if induction and i >= 50 and np.mean([h[1] for h in hist[-50:]]) < ph["stop_below"]:
                log(f"{ph['name']} phase done after {i + 1} steps: copy loss {np.mean([h[1] for h in hist[-50:]]):.3f}")
                break
        tail = hist[-50:]
        report.append({"name": ph["name"], "steps": len(hist), "max_steps": ph["steps"], "batch": b, "length": n,
                       "final_lm_loss": None if induction else round(float(np.mean([h[0] for h in tail])), 3),
                       "final_copy_loss": round(float(np.mean([h[1] for h in tail])), 3),
                       "mixture": {k: list(v) if isinstance(v, tuple) else v for k, v in ph.get("mixture", {}).items()},
                       "minutes": round((time.time() - t0) / 60, 1)})
    return report


def train_draft(draft, teacher, batcher, steps, b, n, peak_lr, warmup, log_every):
    opt = torch.optim.AdamW(draft.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    teacher.eval()
    draft.train()
    t0, hist = time.time(), []
    for step in range(steps):
        ids, _, lm_w, ans_w = (t.to(DEVICE) for t in batcher.batch(b, n))
        pos = torch.arange(n, device=DEVICE).expand(b, n)
        with torch.no_grad(), _autocast():
            t_logits = teacher(input_ids=ids, position_ids=pos).logits.float()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup)
        with _autocast():
            logits = draft(input_ids=ids, position_ids=pos).logits.float()
        mask = lm_w[:, :-1]
        kl = (F.kl_div(F.log_softmax(logits[:, :-1], -1), F.log_softmax(t_logits[:, :-1], -1),
                       log_target=True, reduction="none").sum(-1) * mask).sum() / mask.sum()
        lm, _, _ = lm_losses(logits, ids, lm_w, torch.zeros_like(ans_w))
        agree = ((logits[:, :-1].argmax(-1) == t_logits[:, :-1].argmax(-1)).float() * mask).sum() / mask.sum()
        loss = kl + 0.25 * lm
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.append((kl.item(), lm.item(), agree.item()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            r = hist[-log_every:]
            el = time.time() - t0
            log(f"draft step {step + 1}/{steps} kl {np.mean([h[0] for h in r]):.3f} lm {np.mean([h[1] for h in r]):.3f} "
                f"top1-agree {np.mean([h[2] for h in r]):.3f}  {el / 60:.1f} min")
    return hist


def save_bf16(model, tok, out: Path, card_meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.bos_token_id]
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    # a tokenizer loaded from a folder (--tokenizer) records how it was loaded: not part of it
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "training.json").write_text(json.dumps(card_meta, indent=2) + "\n")
    model.to(torch.float32)


def set_yarn(folder: Path, factor: float) -> None:
    """Save the model in `folder` with YaRN rope scaling for its 16K window.

    The target trains on windows of at most 8K tokens (PoSE jumps show it larger positions,
    rarely large distances between a quote and the question). YaRN stretches only the slow
    rotary frequencies, whose rotation over such distances was never learned, by `factor`,
    keeps the fast ones (local order, the previous-token heads) as they are, and sharpens
    every attention logit by (1 + 0.1 ln factor)^2 against the larger number of keys. The
    config keeps max_position_embeddings; original_max_position_embeddings = it / factor.
    Hugging Face's Llama and this project's engine both read it.
    """
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    theta = cfg["rope_parameters"]["rope_theta"]
    cfg["rope_parameters"] = yarn_parameters(theta, factor, cfg["max_position_embeddings"])
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    meta_path = folder / "training.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["yarn_factor"] = float(factor)
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "models", help="where target/ and draft/ go")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "demo-train", help="scratch folder")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="reuse this saved tokenizer (e.g. assets/models/target) instead of training one")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--target-shape", default="4x256x4x768",
                   help="layers x hidden x heads x MLP width of the target (default 4x256x4x768)")
    p.add_argument("--induction-steps", type=int, default=2500,
                   help="at most this many steps of 64-token random-token recurrences (ends at copy loss < 1.0)")
    p.add_argument("--induction-batch", type=int, default=64, help="windows per induction step")
    p.add_argument("--init", type=Path, default=None,
                   help="start the target from these weights (a checkpoint folder) instead of random ones")
    p.add_argument("--init-layers", default=None, metavar="MAP",
                   help="with --init, grow the target in depth: one entry per layer of --target-shape, either "
                        "the --init layer it copies or 'new' for a layer that starts as the identity "
                        "(e.g. 0,1,new,2,new,3 turns 4 layers into 6 computing the same function)")
    p.add_argument("--new-layer-lr-scale", type=float, default=1.0, metavar="X",
                   help="with --init-layers, the new layers learn at X times the learning rate (default 1)")
    p.add_argument("--alphabet-steps", type=int, default=0,
                   help="copy-only steps on small-vocabulary recurring passages (--alphabet-shape) after the "
                        "induction phase, at --peak-lr; ends early at a copy loss below 0.2 (default 0: none)")
    p.add_argument("--alphabet-shape", default="32x512", help="batch x length of the alphabet steps (default 32x512)")
    p.add_argument("--language-steps", type=int, default=500, help="steps of 4 x 1024 tokens, language and copying")
    p.add_argument("--language-shape", default="4x1024", help="batch x length of the language steps (default 4x1024)")
    p.add_argument("--copy-share", type=float, default=0.35,
                   help="share of copy-question conversations in the language steps (default 0.35)")
    p.add_argument("--hard-candidates", type=int, default=1,
                   help="copy questions ask for the most ambiguous of this many random passages, the one with "
                        "the most places where the last few characters recur elsewhere (default 1: plain)")
    p.add_argument("--distractor-share", type=float, default=0.0,
                   help="share of copy questions whose phrase's last 2-4 words are also planted elsewhere in the "
                        "document before other text, so only the whole phrase locates the passage (default 0)")
    p.add_argument("--ambiguous-weight", type=float, default=1.0,
                   help="loss weight of copy-answer tokens whose last 3 tokens occur earlier in the document "
                        "with another continuation (default 1: no emphasis)")
    p.add_argument("--attend-heads", default=None, metavar="L.H,...",
                   help="supervise these attention heads (layer.head, e.g. 2.1,3.0) to attend, from each "
                        "copy-answer token, to the exact document position of the next token (default: none)")
    p.add_argument("--attend-weight", type=float, default=1.0,
                   help="weight of that attention loss (1 - attention on the source) beside the next-token "
                        "losses (default 1)")
    p.add_argument("--alphabet-share", type=float, default=0.0,
                   help="share of language-phase windows holding recurring passages written with a few random "
                        "words, copyable only by matching long suffixes (in the long phase at most 0.2; default 0)")
    p.add_argument("--long-steps", type=int, default=120, help="then steps of long windows (--long-shape)")
    p.add_argument("--long-shape", default="1x4096", help="batch x length of the long steps (default 1x4096)")
    p.add_argument("--peak-lr", type=float, default=1e-3,
                   help="peak learning rate of the language and long phases (default 1e-3; lower to fine-tune with --init)")
    p.add_argument("--draft-steps", type=int, default=200, help="steps of 16 x 512 tokens (0: no draft)")
    p.add_argument("--draft-shape", default="2x128x2x256",
                   help="layers x hidden x heads x MLP width of the draft (default 2x128x2x256)")
    p.add_argument("--draft-only", type=Path, default=None, metavar="TARGET",
                   help="train only the draft, distilled from this saved target (its folder is kept)")
    p.add_argument("--yarn-factor", type=float, default=None,
                   help="save the target under --out with YaRN rope scaling by this factor (1: plain rope; "
                        "default 2 when training the target, none with --draft-only); the draft learns from it")
    p.add_argument("--train-with-yarn", action="store_true",
                   help="train the target with the rope scaling it is saved with (--yarn-factor), e.g. to "
                        "fine-tune on windows longer than original_max_position_embeddings")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda (bfloat16 autocast)")
    p.add_argument("--export-corpus", type=Path, default=None, metavar="FILE",
                   help="write the training and held-out text to FILE (gzipped JSON lines) and stop")
    p.add_argument("--corpus", type=Path, default=None, metavar="FILE",
                   help="read the text from a file written by --export-corpus (e.g. on a GPU machine "
                        "without the python3.11-doc package) instead of collecting it")
    p.add_argument("--quick", action="store_true", help="tiny smoke run into --work/quick")
    a = p.parse_args(argv)

    global DEVICE
    DEVICE = torch.device(a.device)
    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    def dims(flag: str, text: str, names: str) -> tuple[int, ...]:
        parts = text.split("x")
        if len(parts) != names.count("x") + 1 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"{flag}: expected {names}, got {text!r}")
        return tuple(int(x) for x in parts)

    layers, hidden, heads, inter = dims("--target-shape", a.target_shape, "LAYERSxHIDDENxHEADSxMLP")
    layer_map = None
    if a.init_layers is not None:
        entries = [e.strip() for e in a.init_layers.split(",")]
        if a.init is None:
            p.error("--init-layers: needs --init (the weights the layers come from)")
        if len(entries) != layers or not all(e == "new" or e.isdigit() for e in entries):
            p.error(f"--init-layers: expected {layers} comma-separated entries (a layer number or 'new'), "
                    f"got {a.init_layers!r}")
        layer_map = [None if e == "new" else int(e) for e in entries]
    attend_heads: list[tuple[int, int]] = []
    if a.attend_heads:
        for entry in a.attend_heads.split(","):
            parts = entry.strip().split(".")
            if len(parts) != 2 or not all(x.isdigit() for x in parts):
                p.error(f"--attend-heads: expected comma-separated layer.head entries, got {a.attend_heads!r}")
            layer, head = int(parts[0]), int(parts[1])
            if layer >= layers or head >= heads:
                p.error(f"--attend-heads: {entry.strip()} is outside the target's {layers} layers x {heads} heads")
            attend_heads.append((layer, head))
    if not a.attend_weight >= 0:
        p.error(f"--attend-weight: expected a weight of 0 or more, got {a.attend_weight}")
    d_layers, d_hidden, d_heads, d_inter = dims("--draft-shape", a.draft_shape, "LAYERSxHIDDENxHEADSxMLP")
    lang_b, lang_n = dims("--language-shape", a.language_shape, "BATCHxLENGTH")
    alpha_b, alpha_n = dims("--alphabet-shape", a.alphabet_shape, "BATCHxLENGTH")
    long_b, long_n = dims("--long-shape", a.long_shape, "BATCHxLENGTH")
    if max(lang_n, long_n, alpha_n) > MAX_POSITION:
        p.error(f"window lengths are at most {MAX_POSITION} tokens")
    if a.yarn_factor is not None and not 1.0 <= a.yarn_factor <= 16.0:
        p.error(f"--yarn-factor: expected a factor between 1 and 16, got {a.yarn_factor}")
    if not a.peak_lr > 0:
        p.error(f"--peak-lr: expected a positive learning rate, got {a.peak_lr}")
    if a.train_with_yarn and (a.draft_only is not None or a.yarn_factor in (None, 1.0)):
        p.error("--train-with-yarn: needs --yarn-factor above 1 and trains the target (not with --draft-only)")
    if a.hard_candidates < 1:
        p.error(f"--hard-candidates: expected at least 1, got {a.hard_candidates}")
    if not 0.0 <= a.distractor_share <= 1.0:
        p.error(f"--distractor-share: expected a share between 0 and 1, got {a.distractor_share}")
    if not a.new_layer_lr_scale > 0:
        p.error(f"--new-layer-lr-scale: expected a positive factor, got {a.new_layer_lr_scale}")
    if a.new_layer_lr_scale != 1.0 and a.init_layers is None:
        p.error("--new-layer-lr-scale: needs --init-layers (it applies to the new layers)")
    if not a.ambiguous_weight > 0:
        p.error(f"--ambiguous-weight: expected a positive weight, got {a.ambiguous_weight}")
    if not 0.0 <= a.copy_share <= 1.0:
        p.error(f"--copy-share: expected a share between 0 and 1, got {a.copy_share}")
    if not 0.0 <= a.alphabet_share <= 1.0 - a.copy_share:
        p.error(f"--alphabet-share: expected a share between 0 and 1 - --copy-share ({1.0 - a.copy_share:g}), "
                f"got {a.alphabet_share}")
    if a.quick:
        a.out = a.work / "quick"
        a.induction_steps, a.language_steps, a.long_steps, a.draft_steps = 3, 4, 2, 4
        a.alphabet_steps = min(a.alphabet_steps, 2)
    a.work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    if a.corpus is not None:
        log(f"text from {a.corpus} ...")
        train_docs, held_docs = demo_corpus.load_corpus(a.corpus)
    else:
        log("collecting text ...")
        train_docs, held_docs = demo_corpus.build_corpus()
    if a.export_corpus is not None:
        demo_corpus.save_corpus(a.export_corpus, train_docs, held_docs)
        log(f"{len(train_docs)} training and {len(held_docs)} held-out documents written to {a.export_corpus} "
            f"({a.export_corpus.stat().st_size / 1e6:.1f} MB)")
        return 0
    train_texts = [d.text for d in train_docs]
    log(f"{len(train_docs)} training documents ({sum(map(len, train_texts)) / 1e6:.1f} M chars), "
        f"{len(held_docs)} held out ({sum(len(d.text) for d in held_docs) / 1e6:.2f} M chars)")

    if a.tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(a.tokenizer))
        log(f"tokenizer from {a.tokenizer}: {len(tok)} tokens")
    else:
        tok = train_tokenizer(train_texts, a.vocab, a.work / "tokenizer")
        log(f"tokenizer: {len(tok)} tokens")
    streams = []
    for text in train_texts:
        streams.append(tok.bos_token_id)
        streams.extend(encode_plain(tok, text))
    stream = np.asarray(streams, dtype=np.int32)
    log(f"training stream: {len(stream) / 1e6:.2f} M tokens ({sum(map(len, train_texts)) / len(stream):.2f} chars/token)")

    if a.draft_only is not None:
        source, yarn = a.draft_only, a.yarn_factor
    else:
        torch.manual_seed(a.seed)
        target = make_model(tok, hidden, layers, heads, inter, 500_000, MAX_POSITION,
                            yarn=a.yarn_factor if a.train_with_yarn else None).to(DEVICE)
        n_target = sum(p.numel() for p in target.parameters())
        log(f"target: {n_target / 1e6:.2f} M parameters")
        if a.init is not None:
            from safetensors.torch import load_file

            state = load_file(str(a.init / "model.safetensors"), device=str(DEVICE))
            if layer_map is not None:
                state = grow_layers(target, state, layer_map)
            target.load_state_dict(state, strict=False)
            target.tie_weights()
            log(f"target weights from {a.init}")
        batcher = Batcher(tok, train_texts, stream, a.seed, copy_share=0.35, pose_share=0.5)
        # 1. induction heads first, on short random-token windows (they did not form in 1,250 steps
        #    of language with copy tasks mixed in); 2. language with copy tasks, recurring passages
        #    and random strings kept in every batch so copying is not forgotten, PoSE position
        #    jumps; 3. long windows.
        # recurring passages and random strings, 4 : 3; then small-vocabulary passages; the rest plain
        recurring = min(0.35, 1.0 - a.copy_share - a.alphabet_share)
        language = dict(copy_share=a.copy_share, repeat_share=recurring * 4 / 7, random_share=recurring * 3 / 7,
                        alphabet_share=a.alphabet_share, pose_share=0.5, random_lengths=(12, 64))
        # in the long phase small-vocabulary passages take the place of plain windows (0.2)
        long = dict(copy_share=0.5, repeat_share=0.15, random_share=0.15, alphabet_share=min(0.2, a.alphabet_share),
                    pose_share=0.3, random_lengths=(16, 100))
        for mixture in (language, long):
            mixture.update(hard_candidates=a.hard_candidates, distractor_share=a.distractor_share,
                           ambiguous_weight=a.ambiguous_weight)
        phases = [
            dict(name="induction", kind="induction", steps=a.induction_steps, batch=a.induction_batch, length=64, lr=1e-3,
                 stop_below=1.0),
            dict(name="alphabet", kind="alphabet", steps=a.alphabet_steps, batch=alpha_b, length=alpha_n,
                 lr=a.peak_lr, stop_below=0.2),
            dict(name="language", steps=a.language_steps, batch=lang_b, length=lang_n, mixture=language),
            dict(name="long", steps=a.long_steps, batch=long_b, length=long_n, mixture=long),
        ]
        phases = [ph for ph in phases if ph["steps"] > 0]
        t0 = time.time()
        report = train_target(target, batcher, phases, peak_lr=a.peak_lr, log_every=10 if not a.quick else 1,
                              ckpt=a.work / "target-ckpt",
                              fast_layers=[i for i, src in enumerate(layer_map or []) if src is None],
                              fast_scale=a.new_layer_lr_scale, attend_heads=attend_heads,
                              attend_weight=a.attend_weight)
        target_meta = {
            "seed": a.seed, "threads": a.threads, "device": a.device, "torch": torch.__version__,
            "train_documents": len(train_docs), "train_tokens_in_corpus": int(len(stream)),
            "held_out": list(demo_corpus.HELD_OUT_DIRS), "target_shape": a.target_shape,
            "init": a.init.name if a.init is not None else None, "init_layers": a.init_layers,
            "new_layer_lr_scale": a.new_layer_lr_scale, "peak_lr": a.peak_lr,
            "hard_candidates": a.hard_candidates, "distractor_share": a.distractor_share,
            "ambiguous_weight": a.ambiguous_weight, "alphabet_share": a.alphabet_share,
            "alphabet_steps": a.alphabet_steps, "alphabet_shape": a.alphabet_shape,
            "attend_heads": a.attend_heads, "attend_weight": a.attend_weight if a.attend_heads else None,
            "trained_with_yarn": a.yarn_factor if a.train_with_yarn else None,
            "target_phases": report, "target_minutes": round((time.time() - t0) / 60, 1),
            "role": "target", "parameters": n_target,
        }
        # saved before the draft is trained: nothing is lost if the draft's training stops
        save_bf16(target, tok, a.out / "target", target_meta)
        source, yarn = a.out / "target", (2.0 if a.yarn_factor is None else a.yarn_factor)

    # the target as shipped (with its rope scaling) is what the draft is distilled from
    if yarn is not None and yarn != 1.0:
        if (a.out / "target").resolve() != source.resolve():
            shutil.copytree(source, a.out / "target", dirs_exist_ok=True)
        set_yarn(a.out / "target", yarn)
        log(f"target {source} saved to {a.out / 'target'} with YaRN factor {yarn}")
        source = a.out / "target"
    if a.draft_steps == 0:
        log(f"no draft (--draft-steps 0); target saved to {source}")
        return 0
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(DEVICE)
    target_meta = json.loads((source / "training.json").read_text())
    n_target = target_meta["parameters"]
    log(f"target from {source}: {n_target / 1e6:.2f} M parameters")

    torch.manual_seed(a.seed + 1)
    draft = make_model(tok, d_hidden, d_layers, d_heads, d_inter, 10_000, MAX_POSITION).to(DEVICE)
    n_draft = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_draft / 1e6:.2f} M parameters ({n_target / n_draft:.1f} x fewer than the target)")
    dbatcher = Batcher(tok, train_texts, stream, a.seed + 1, copy_share=0.0, pose_share=0.0)
    t0 = time.time()
    hist = train_draft(draft, target, dbatcher, a.draft_steps, 16, 512, peak_lr=3e-3,
                       warmup=min(40, a.draft_steps // 3 + 1), log_every=10 if not a.quick else 1)
    draft_meta = {
        "seed": a.seed, "threads": a.threads, "device": a.device, "torch": torch.__version__,
        "role": "draft", "parameters": n_draft, "draft_shape": a.draft_shape,
        "distilled_from": {k: target_meta.get(k) for k in ("target_shape", "parameters")},
        "steps": a.draft_steps, "batch": 16, "length": 512,
        "final_top1_agreement_train": round(float(np.mean([h[2] for h in hist[-20:]])), 3),
        "draft_minutes": round((time.time() - t0) / 60, 1),
    }
    save_bf16(draft, tok, a.out / "draft", draft_meta)
    log(f"saved to {a.out} ({(time.time() - t_start) / 60:.1f} min in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
