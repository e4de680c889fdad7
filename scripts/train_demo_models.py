"""Train the embedded demo pair: a long-context Llama target and a small Llama draft.

Everything runs offline on a CPU (about 45 minutes on 2 cores with the defaults):

1. text: the Python documentation sources and the standard library's docstrings
   (``demo_corpus``); the tutorial and the FAQ are held out;
2. tokenizer: byte-level BPE with a chat template, trained with Hugging Face ``tokenizers``
   (or reused with ``--tokenizer``);
3. target: multi-head attention so that its KV cache dominates at long context. First
   induction heads, the mechanism of copying, on short windows of random tokens in which a
   stretch recurs; then language windows with PoSE-style skipped position ids (positions up
   to 16K) and a large rope base, where a share of every batch is a synthetic copy task
   ("What follows «quote»?") whose answer must be copied from far back in a document, or
   text in which an earlier passage (or a random token string) recurs verbatim; finally
   longer windows. The target is saved before the draft is trained;
4. draft: a much smaller model on 512-token windows, distilled from the target
   (``--draft-only TARGET`` trains just this step against a saved target).

The shipped target came from a fresh run of the defaults followed by fine-tuning runs of
this script (``--init`` and the phase flags); ``assets/models/README.md`` lists the exact
invocations, and what else was tried and not kept.

Both models are saved in bfloat16 safetensors with the tokenizer under ``assets/models``.
Seeded and deterministic for a given machine and library versions.

    python -m scripts.train_demo_models               # full run (from the repository root)
    python -m scripts.train_demo_models --quick       # a two-minute smoke run into a scratch folder
"""

from __future__ import annotations

import argparse
import contextlib
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
class Batcher:
    """Language-model windows and copy-task conversations, with PoSE position ids.

    A window is ids, LM weights (0 on padding) and answer weights (1 on the tokens whose loss
    is the copy loss: copy answers and recurrences)."""

    def __init__(self, tok, docs: list[str], stream: np.ndarray, seed: int, copy_share: float,
                 pose_share: float, repeat_share: float = 0.0, random_share: float = 0.0,
                 max_position: int = MAX_POSITION):
        self.tok, self.docs, self.stream = tok, docs, stream
        self.rng = random.Random(seed)
        self.copy_share, self.pose_share, self.max_position = copy_share, pose_share, max_position
        self.repeat_share = repeat_share
        self.random_share = random_share
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
            is_answer = [1.0 if any(a <= s and e <= b and e > s for a, b in spans) else 0.0 for s, e in offsets]
            pad = n - len(ids)
            if pad > 24:
                self.chars_per_token *= 1.01
            return ids + [self.pad] * pad, [1.0] * len(ids) + [0.0] * pad, is_answer + [0.0] * pad

    def batch(self, b: int, n: int):
        """`b` windows of `n` tokens of the mixture: ids, position ids, LM weights, answer weights."""
        ids, pos, lm_w, ans_w = [], [], [], []
        for _ in range(b):
            r = self.rng.random()
            if r < self.copy_share:
                x, w, a = self.copy_example(n)
            elif r < self.copy_share + self.repeat_share:
                x, w, a = self.repeat_example(n)
            elif r < self.copy_share + self.repeat_share + self.random_share:
                x, w, a = self.repeat_example(n, random_tokens=True)
            else:
                x, w = self.lm_example(n)
                a = [0.0] * n
            ids.append(x)
            lm_w.append(w)
            ans_w.append(a)
            pos.append(self.positions(n))
        t = torch.tensor
        return t(ids), t(pos), t(lm_w), t(ans_w)


# --------------------------------------------------------------------------------------
# models and training
# --------------------------------------------------------------------------------------
def lm_losses(logits, ids, lm_w, ans_w):
    """Mean next-token loss over LM-weighted tokens that are not answer tokens, and the
    ans_w-weighted mean over answer tokens."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    w = lm_w[:, 1:] * (ans_w[:, 1:] == 0)
    a = ans_w[:, 1:]
    lm = (nll * w).sum() / w.sum().clamp_min(1)
    ans = (nll * a).sum() / a.sum().clamp_min(1)
    return lm, ans, a.sum()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: torch.device):
    """bfloat16 autocast on a GPU (weights and optimizer stay float32); nothing on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
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


def copy_only_loss(model, ids, pos, ans_w, device: torch.device):
    """Next-token loss on the recurring tokens only, projecting only those rows to the vocabulary."""
    with autocast(device):
        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state[:, :-1]
    sel = ans_w[:, 1:] > 0
    logits = model.lm_head(hidden[sel]).float()
    return F.cross_entropy(logits, ids[:, 1:][sel])


def train_target(model, batcher, phases, peak_lr, log_every, ckpt: Path, device: torch.device = torch.device("cpu")):
    """phases: dicts with steps, batch, length and either kind="induction" or a mixture.

    The induction phase (random-token recurrences, loss on the copy only) runs at a constant
    learning rate after a short warm-up and ends early once its copy loss has fallen below
    `stop_below` (mean of the last 50 steps). The other phases share one cosine schedule.
    Returns the per-phase history (steps run, final losses) for the model card.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    main_total = sum(ph["steps"] for ph in phases if ph.get("kind") is None)
    main_step, step, t0 = 0, 0, time.time()
    report = []
    model.train()
    for ph in phases:
        hist = []
        b, n = ph["batch"], ph["length"]
        induction = ph.get("kind") == "induction"
        for k, v in ph.get("mixture", {}).items():
            setattr(batcher, k, v)
        for i in range(ph["steps"]):
            if induction:
                lr = ph["lr"] * min(1.0, (i + 1) / 50)
                ids, pos, lm_w, ans_w = (t.to(device) for t in batcher.induction_batch(b, n))
            else:
                lr = lr_at(main_step, main_total, peak_lr, 20)
                ids, pos, lm_w, ans_w = (t.to(device) for t in batcher.batch(b, n))
            for g in opt.param_groups:
                g["lr"] = lr
            if induction:
                ans = copy_only_loss(model, ids, pos, ans_w, device)
                lm, loss = torch.zeros(()), ans
            else:
                with autocast(device):
                    logits = model(input_ids=ids, position_ids=pos).logits
                lm, ans, n_ans = lm_losses(logits, ids, lm_w, ans_w)
                loss = lm + (ans if n_ans > 0 else 0.0)
                main_step += 1
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist.append((lm.item(), ans.item()))
            step += 1
            if step % log_every == 0 or i + 1 == ph["steps"]:
                recent = hist[-log_every:]
                log(f"target step {step} ({ph['name']} {i + 1}/{ph['steps']}, {b} x {n}) "
                    f"lm {np.mean([h[0] for h in recent]):.3f} copy {np.mean([h[1] for h in recent]):.3f}  "
                    f"{(time.time() - t0) / 60:.1f} min")
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


def train_draft(draft, teacher, batcher, steps, b, n, peak_lr, warmup, log_every,
                device: torch.device = torch.device("cpu")):
    """Distil `draft` from `teacher`: KL to the teacher's next-token law plus a quarter of the
    plain language-model loss, on contiguous windows of plain text."""
    opt = torch.optim.AdamW(draft.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    teacher.eval()
    draft.train()
    t0, hist = time.time(), []
    for step in range(steps):
        ids, _, lm_w, ans_w = (t.to(device) for t in batcher.batch(b, n))
        pos = torch.arange(n, device=device).expand(b, n)
        with torch.no_grad(), autocast(device):
            t_logits = teacher(input_ids=ids, position_ids=pos).logits.float()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup)
        with autocast(device):
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


# --------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked before any work; shapes are parsed into tuples of ints."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="at most this many induction steps; the phase ends once the copy loss is below 1.0 (0: skip)")
    p.add_argument("--induction-batch", type=int, default=64, help="windows per induction step")
    p.add_argument("--init", type=Path, default=None,
                   help="start the target from these weights (a checkpoint folder) instead of random ones")
    p.add_argument("--language-steps", type=int, default=500, help="steps of language and copying (--language-shape)")
    p.add_argument("--language-shape", default="4x1024", help="batch x length of the language steps (default 4x1024)")
    p.add_argument("--copy-share", type=float, default=0.35,
                   help="share of language-phase windows that are copy questions (default 0.35)")
    p.add_argument("--hard-candidates", type=int, default=1,
                   help="each copy question asks for the most ambiguous of this many random passages (default 1)")
    p.add_argument("--distractor-share", type=float, default=0.0,
                   help="share of copy questions whose phrase's last words are planted elsewhere in the document "
                        "(default 0)")
    p.add_argument("--long-steps", type=int, default=120, help="then steps of long windows (--long-shape)")
    p.add_argument("--long-shape", default="1x4096", help="batch x length of the long steps (default 1x4096)")
    p.add_argument("--peak-lr", type=float, default=1e-3,
                   help="peak learning rate of the language and long phases (default 1e-3; lower to fine-tune with --init)")
    p.add_argument("--draft-steps", type=int, default=200, help="steps of 16 x 512 tokens (0: no draft)")
    p.add_argument("--draft-shape", default="2x128x2x256",
                   help="layers x hidden x heads x MLP width of the draft (default 2x128x2x256)")
    p.add_argument("--draft-only", type=Path, default=None, metavar="TARGET",
                   help="train only the draft, distilled from this saved target (its folder is kept)")
    p.add_argument("--max-position", type=int, default=MAX_POSITION,
                   help=f"the target's context window: saved as max_position_embeddings and spanned by the "
                        f"PoSE position jumps (default {MAX_POSITION}; the 64K target: 65536 with --yarn-factor 8)")
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

    def dims(flag: str, text: str, names: str) -> tuple[int, ...]:
        parts = text.split("x")
        if len(parts) != names.count("x") + 1 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"{flag}: expected {names}, got {text!r}")
        return tuple(int(x) for x in parts)

    a.target_dims = dims("--target-shape", a.target_shape, "LAYERSxHIDDENxHEADSxMLP")
    a.draft_dims = dims("--draft-shape", a.draft_shape, "LAYERSxHIDDENxHEADSxMLP")
    a.language_dims = dims("--language-shape", a.language_shape, "BATCHxLENGTH")
    a.long_dims = dims("--long-shape", a.long_shape, "BATCHxLENGTH")
    if not 1024 <= a.max_position <= 262144:
        p.error(f"--max-position: expected 1024 to 262144 tokens, got {a.max_position}")
    if max(a.language_dims[1], a.long_dims[1]) > a.max_position:
        p.error(f"window lengths are at most --max-position ({a.max_position}) tokens")
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
    if not 0.0 <= a.copy_share <= 1.0:
        p.error(f"--copy-share: expected a share between 0 and 1, got {a.copy_share}")
    if a.quick:
        a.out = a.work / "quick"
        a.induction_steps, a.language_steps, a.long_steps, a.draft_steps = 3, 4, 2, 4
    return a


def load_text_and_tokenizer(a: argparse.Namespace):
    """The training documents, the held-out ones, the tokenizer and the training token stream."""
    if a.corpus is not None:
        log(f"text from {a.corpus} ...")
        train_docs, held_docs = demo_corpus.load_corpus(a.corpus)
    else:
        log("collecting text ...")
        train_docs, held_docs = demo_corpus.build_corpus()
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
    return train_docs, tok, train_texts, stream


def target_phases(a: argparse.Namespace) -> list[dict]:
    """1. induction heads first, on short random-token windows (they did not form in 1,250
    steps of language with copy tasks mixed in); 2. language with copy tasks, recurring
    passages and random strings kept in every batch so copying is not forgotten, PoSE position
    jumps; 3. long windows. Phases with no steps are left out."""
    recurring = min(0.35, 1.0 - a.copy_share)  # recurring passages and random strings, 4 : 3
    language = dict(copy_share=a.copy_share, repeat_share=recurring * 4 / 7, random_share=recurring * 3 / 7,
                    pose_share=0.5, random_lengths=(12, 64))
    long = dict(copy_share=0.5, repeat_share=0.15, random_share=0.15, pose_share=0.3, random_lengths=(16, 100))
    for mixture in (language, long):
        mixture.update(hard_candidates=a.hard_candidates, distractor_share=a.distractor_share)
    phases = [
        dict(name="induction", kind="induction", steps=a.induction_steps, batch=a.induction_batch, length=64,
             lr=1e-3, stop_below=1.0),
        dict(name="language", steps=a.language_steps, batch=a.language_dims[0], length=a.language_dims[1],
             mixture=language),
        dict(name="long", steps=a.long_steps, batch=a.long_dims[0], length=a.long_dims[1], mixture=long),
    ]
    return [ph for ph in phases if ph["steps"] > 0]


def run_target(a: argparse.Namespace, tok, train_docs, train_texts, stream, device: torch.device) -> Path:
    """Train the target (from --init if given) and save it under --out; returns its folder."""
    layers, hidden, heads, inter = a.target_dims
    torch.manual_seed(a.seed)
    target = make_model(tok, hidden, layers, heads, inter, 500_000, a.max_position,
                        yarn=a.yarn_factor if a.train_with_yarn else None).to(device)
    n_target = sum(p.numel() for p in target.parameters())
    log(f"target: {n_target / 1e6:.2f} M parameters")
    if a.init is not None:
        from safetensors.torch import load_file

        target.load_state_dict(load_file(str(a.init / "model.safetensors"), device=str(device)), strict=False)
        target.tie_weights()
        log(f"target weights from {a.init}")
    batcher = Batcher(tok, train_texts, stream, a.seed, copy_share=0.35, pose_share=0.5,
                      max_position=a.max_position)
    t0 = time.time()
    report = train_target(target, batcher, target_phases(a), peak_lr=a.peak_lr, log_every=10 if not a.quick else 1,
                          ckpt=a.work / "target-ckpt", device=device)
    meta = {
        "seed": a.seed, "threads": a.threads, "device": a.device, "torch": torch.__version__,
        "train_documents": len(train_docs), "train_tokens_in_corpus": int(len(stream)),
        "held_out": list(demo_corpus.HELD_OUT_DIRS), "target_shape": a.target_shape,
        "init": a.init.name if a.init is not None else None, "peak_lr": a.peak_lr,
        "hard_candidates": a.hard_candidates, "distractor_share": a.distractor_share,
        "trained_with_yarn": a.yarn_factor if a.train_with_yarn else None, "max_position": a.max_position,
        "target_phases": report, "target_minutes": round((time.time() - t0) / 60, 1),
        "role": "target", "parameters": n_target,
    }
    # saved before the draft is trained: nothing is lost if the draft's training stops
    tok.model_max_length = a.max_position  # a reused tokenizer keeps the window it was saved with
    save_bf16(target, tok, a.out / "target", meta)
    return a.out / "target"


def run_draft(a: argparse.Namespace, tok, train_texts, stream, source: Path, device: torch.device) -> None:
    """Distil the draft from the target saved in `source` and save it under --out."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(device)
    target_meta = json.loads((source / "training.json").read_text())
    n_target = target_meta["parameters"]
    log(f"target from {source}: {n_target / 1e6:.2f} M parameters")
    layers, hidden, heads, inter = a.draft_dims
    torch.manual_seed(a.seed + 1)
    draft = make_model(tok, hidden, layers, heads, inter, 10_000, MAX_POSITION).to(device)
    n_draft = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_draft / 1e6:.2f} M parameters ({n_target / n_draft:.1f} x fewer than the target)")
    batcher = Batcher(tok, train_texts, stream, a.seed + 1, copy_share=0.0, pose_share=0.0)
    t0 = time.time()
    hist = train_draft(draft, target, batcher, a.draft_steps, 16, 512, peak_lr=3e-3,
                       warmup=min(40, a.draft_steps // 3 + 1), log_every=10 if not a.quick else 1, device=device)
    meta = {
        "seed": a.seed, "threads": a.threads, "device": a.device, "torch": torch.__version__,
        "role": "draft", "parameters": n_draft, "draft_shape": a.draft_shape,
        "distilled_from": {k: target_meta.get(k) for k in ("target_shape", "parameters")},
        "steps": a.draft_steps, "batch": 16, "length": 512,
        "final_top1_agreement_train": round(float(np.mean([h[2] for h in hist[-20:]])), 3),
        "draft_minutes": round((time.time() - t0) / 60, 1),
    }
    save_bf16(draft, tok, a.out / "draft", meta)


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    a.work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if a.export_corpus is not None:
        train_docs, held_docs = demo_corpus.build_corpus() if a.corpus is None else demo_corpus.load_corpus(a.corpus)
        demo_corpus.save_corpus(a.export_corpus, train_docs, held_docs)
        log(f"{len(train_docs)} training and {len(held_docs)} held-out documents written to {a.export_corpus} "
            f"({a.export_corpus.stat().st_size / 1e6:.1f} MB)")
        return 0
    train_docs, tok, train_texts, stream = load_text_and_tokenizer(a)

    if a.draft_only is not None:
        source, yarn = a.draft_only, a.yarn_factor
    else:
        source = run_target(a, tok, train_docs, train_texts, stream, device)
        yarn = 2.0 if a.yarn_factor is None else a.yarn_factor
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
    run_draft(a, tok, train_texts, stream, source, device)
    log(f"saved to {a.out} ({(time.time() - t_start) / 60:.1f} min in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
