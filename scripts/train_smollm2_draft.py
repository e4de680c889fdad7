"""Train SmolLM2's small draft: its own first layers with a low-rank adapter, distilled from it.

SmolLM2-135M-Instruct has no smaller model with its tokenizer that installs here, so its draft
is made of the target itself: the first ``--layers`` of its 30 layers, the final norm and the
tied head. Unchanged, such a prefix agrees with the whole model on 6-12 % of tokens (measured on
the held-out tutorial); a low-rank adapter on every projection of the prefix, plus trainable
norms, is distilled from the whole model here. Only the adapter ships
(``assets/models/smollm2-draft``, a few MB); `triforce_core.models.prefix_draft` adds it to the
target's own weights when the pair loads, so the draft costs no second copy of the embedding.

Training data, all offline:

1. plain windows of the Python documentation and the standard library's docstrings
   (``demo_corpus``; the tutorial and the FAQ are held out), each behind the first tokens of
   SmolLM2's chat prompt, as the draft's StreamingLLM cache sees a document: 16 sink tokens,
   then the most recent ones;
2. the target's own answers (greedy, and with its default repetition penalty) to questions
   about documentation excerpts in SmolLM2's chat template: the draft is judged on the
   target's answers, so it learns on them too.

The loss is the KL divergence from the target's next-token distribution plus a cross-entropy
on the target's greedy token (what greedy verification accepts). Progress is logged; a
checkpoint is written every few minutes and ``--resume`` continues from it.

    python -m scripts.train_smollm2_draft                    # about an hour on 2 cores
    python -m scripts.train_smollm2_draft --minutes 3 --answers 16 --out scratch-draft   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import demo_corpus

ROOT = Path(__file__).resolve().parent.parent
SINKS, RECENT = 16, 240  # the draft's StreamingLLM cache (SpeculationConfig.draft_sinks/draft_window)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUESTIONS = (
    "Summarize the text above.",
    "What is the main point of this text?",
    "Explain this in simple words.",
    "What does the text say about {w}?",
    "What is {w}?",
    "How do I use {w}?",
    "Give an example from the text.",
    "What follows «{q}»?",
    "What follows «{q}»?",
    "List the key ideas of the text.",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class LowRank(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update B @ A (B starts at zero)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def load_target():
    from transformers import AutoModelForCausalLM

    from triforce_core.models import gguf_file

    path = gguf_file.smollm2_path()
    _, tokenizer = gguf_file.config_and_tokenizer(path)
    teacher = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return path, teacher, tokenizer


def make_student(teacher, layers: int, rank: int, alpha: float):
    """The teacher's first `layers` layers, its norm and tied head; adapters on every projection."""
    import copy

    from transformers import LlamaForCausalLM

    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    student = LlamaForCausalLM(config)
    own = student.state_dict()
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if k in own}, strict=False)
    student.tie_weights()
    for p in student.parameters():
        p.requires_grad_(False)
    for layer in student.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(owner, name):
                    setattr(owner, name, LowRank(getattr(owner, name), rank, alpha))
        layer.input_layernorm.weight.requires_grad_(True)
        layer.post_attention_layernorm.weight.requires_grad_(True)
    student.model.norm.weight.requires_grad_(True)
    return student


def _adapted(student):
    """(name, module) of every low-rank projection and (name, parameter) of every trained norm,
    under Hugging Face's parameter names (the adapter file's, `prefix_draft`)."""
    for i, layer in enumerate(student.model.layers):
        p = f"model.layers.{i}."
        for part, owner in (("self_attn.", layer.self_attn), ("mlp.", layer.mlp)):
            for name in PROJECTIONS:
                m = getattr(owner, name, None)
                if isinstance(m, LowRank):
                    yield p + part + name, m
        yield p + "input_layernorm.weight", layer.input_layernorm.weight
        yield p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight
    yield "model.norm.weight", student.model.norm.weight


def adapter_state(student) -> dict[str, torch.Tensor]:
    """What ships: per layer and projection A [r, in] and B [out, r] (the scale folded into B),
    the layers' norms and the final norm."""
    out = {}
    for name, m in _adapted(student):
        if isinstance(m, LowRank):
            out[name + ".lora_a"] = m.lora_a.detach().clone()
            out[name + ".lora_b"] = (m.lora_b.detach() * m.scale).clone()
        else:
            out[name] = m.detach().clone()
    return out


def load_adapter(student, folder: Path) -> None:
    """Set the student's adapters and norms from a saved adapter (`adapter_state`'s inverse)."""
    from triforce_core.models import prefix_draft

    _, tensors = prefix_draft.read(str(folder))
    with torch.no_grad():
        for name, m in _adapted(student):
            if isinstance(m, LowRank):
                m.lora_a.copy_(tensors[name + ".lora_a"])
                m.lora_b.copy_(tensors[name + ".lora_b"] / m.scale)
            else:
                m.copy_(tensors[name])


# -- data ------------------------------------------------------------------------------------
def chat_ids(tokenizer, excerpt: str, question: str) -> list[int]:
    from triforce_core.prompting import render_prompt

    return render_prompt(tokenizer, [{"role": "user", "content": f"{excerpt}\n\n{question}"}])[1]


def question_for(text: str, rng: random.Random) -> str:
    words = [w.strip(".,:;()[]\"'") for w in text.split()]
    words = [w for w in words if len(w) > 4 and w.isidentifier()]
    q = rng.choice(QUESTIONS)
    if "{q}" in q:
        tokens = text.split()
        at = rng.randrange(max(1, len(tokens) - 8))
        return q.format(q=" ".join(tokens[at:at + 6]))
    return q.format(w=rng.choice(words) if words else "this")


def window(ids: list[int], end: int) -> list[int]:
    """The draft's view of ids[:end]: the first SINKS tokens, then the most recent ones."""
    if end <= SINKS + RECENT:
        return ids[:end]
    return ids[:SINKS] + ids[end - RECENT:end]


@torch.no_grad()
def target_answers(teacher, tokenizer, docs: list[str], count: int, new_tokens: int, batch: int,
                   rng: random.Random, excerpt_tokens: int = 360) -> list[list[int]]:
    """`count` chat prompts over documentation excerpts, each with the target's answer."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[list[int]] = []
    while len(out) < count:
        prompts = []
        for _ in range(min(batch, count - len(out))):
            doc = rng.choice(docs)
            ids = tokenizer.encode(doc)
            at = rng.randrange(max(1, len(ids) - excerpt_tokens))
            excerpt = tokenizer.decode(ids[at:at + excerpt_tokens])
            prompts.append(chat_ids(tokenizer, excerpt, question_for(excerpt, rng)))
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        penalty = 1.2 if len(out) // batch % 2 else 1.0  # greedy, then SmolLM2's default penalty
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, repetition_penalty=penalty,
                                  eos_token_id=eos, pad_token_id=pad)
        gen = teacher.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        for p, row in zip(prompts, gen[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            out.append(p + answer)
        log(f"target answers {len(out)}/{count}")
    return out


class Batches:
    """Training windows: plain documentation behind the chat prompt's first tokens, and chats."""

    def __init__(self, tokenizer, docs: list[str], chats: list[list[int]], chat_share: float, rng: random.Random):
        self.rng = rng
        self.sinks = chat_ids(tokenizer, "", "")[:SINKS]
        self.stream = [t for d in docs for t in tokenizer.encode(d + "\n\n")]
        self.chats = chats
        self.chat_share = chat_share if chats else 0.0

    def one(self) -> list[int]:
        if self.rng.random() < self.chat_share:
            ids = self.rng.choice(self.chats)
            end = len(ids) - self.rng.randrange(0, 32) if len(ids) > SINKS + RECENT + 32 else len(ids)
            return window(ids, end)
        at = self.rng.randrange(len(self.stream) - RECENT)
        return self.sinks + self.stream[at:at + RECENT]

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.one() for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        valid = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
        return ids, valid


def distill_loss(student_logits, teacher_logits, valid, ce_weight: float):
    t_logp = F.log_softmax(teacher_logits, dim=-1)
    s_logp = F.log_softmax(student_logits, dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    ce = -s_logp.gather(-1, teacher_logits.argmax(-1, keepdim=True)).squeeze(-1)
    w = valid / valid.sum()
    return ((kl + ce_weight * ce) * w).sum(), kl


@torch.no_grad()
def agreement(student, teacher, rows: list[list[int]]) -> float:
    """Share of positions where the student's greedy token is the target's."""
    hit = total = 0
    for r in rows:
        x = torch.tensor([r])
        hit += int((student(x).logits.argmax(-1) == teacher(x).logits.argmax(-1)).sum())
        total += len(r)
    return hit / total


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "models" / "smollm2-draft",
                   help="folder for the adapter (default assets/models/smollm2-draft)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "triforce-studio" / "smollm2-draft",
                   help="checkpoints and the target's generated answers")
    p.add_argument("--layers", type=int, default=6, help="the target's first layers the draft keeps (default 6)")
    p.add_argument("--rank", type=int, default=48, help="adapter rank (default 48)")
    p.add_argument("--minutes", type=float, default=45.0, help="training time, not counting data (default 45)")
    p.add_argument("--answers", type=int, default=192, help="target answers to generate for training (default 192)")
    p.add_argument("--answer-tokens", type=int, default=96)
    p.add_argument("--chat-share", type=float, default=0.35, help="share of windows from the target's answers")
    p.add_argument("--batch", type=int, default=4, help="windows of 256 tokens per step (default 4)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--init", type=Path, help="start from this saved adapter (a further round of training)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    a.work.mkdir(parents=True, exist_ok=True)
    path, teacher, tok = load_target()
    log(f"target {path.name}: {teacher.config.num_hidden_layers} layers")
    train_docs, held = demo_corpus.build_corpus()
    docs = [d.text for d in train_docs]
    answers_file = a.work / f"answers-{a.answers}-{a.answer_tokens}.json"
    if answers_file.exists():
        chats = json.loads(answers_file.read_text())
    else:  # top up the largest earlier set of answers of this length, if any
        earlier = sorted((int(f.name.split("-")[1]), f) for f in a.work.glob(f"answers-*-{a.answer_tokens}.json")
                         if int(f.name.split("-")[1]) < a.answers)
        chats = json.loads(earlier[-1][1].read_text()) if earlier else []
        log(f"generating {a.answers - len(chats)} target answers ({a.answer_tokens} tokens each)")
        chats += target_answers(teacher, tok, docs, a.answers - len(chats), a.answer_tokens, 16,
                                random.Random(a.seed + len(chats)))
        answers_file.write_text(json.dumps(chats))
    data = Batches(tok, docs, chats, a.chat_share, rng)
    log(f"{len(data.stream)} documentation tokens, {len(chats)} chats")
    held_rng = random.Random(7)
    held_ids = [t for d in held for t in tok.encode(d.text)]
    held_rows = []
    for _ in range(6):
        at = held_rng.randrange(len(held_ids) - RECENT)
        held_rows.append(data.sinks + held_ids[at:at + RECENT])

    student = make_student(teacher, a.layers, a.rank, alpha=a.rank)
    if a.init is not None:
        load_adapter(student, a.init)
        log(f"started from the adapter in {a.init}")
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    ckpt = a.work / f"checkpoint-{a.layers}x{a.rank}.pt"
    elapsed, step = 0.0, 0
    if a.resume and ckpt.exists():
        state = torch.load(ckpt)
        student.load_state_dict(state["student"], strict=False)
        opt.load_state_dict(state["opt"])
        elapsed, step = state["elapsed"], state["step"]
        log(f"resumed at step {step}, {elapsed / 60:.1f} min")
    else:
        log(f"held-out agreement before training: {agreement(student, teacher, held_rows):.3f}")
    log(f"trainable parameters: {sum(p.numel() for p in params):,}")
    budget = a.minutes * 60
    last_save = time.time()
    ema = None
    while elapsed < budget:
        t0 = time.time()
        frac = elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, valid = data.batch(a.batch)
        with torch.no_grad():
            t_logits = teacher(ids).logits
        s_logits = student(ids).logits
        loss, kl = distill_loss(s_logits, t_logits, valid, a.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hit = float(((s_logits.argmax(-1) == t_logits.argmax(-1)).float() * valid).sum() / valid.sum())
        ema = hit if ema is None else 0.95 * ema + 0.05 * hit
        step += 1
        elapsed += time.time() - t0
        if step % 20 == 0:
            log(f"step {step} {elapsed / 60:.1f}/{a.minutes:.0f} min lr {lr:.2e} loss {loss.item():.3f} "
                f"kl {float((kl * valid).sum() / valid.sum()):.3f} train agreement {ema:.3f}")
        if time.time() - last_save > 300:
            torch.save({"student": {k: v for k, v in student.state_dict().items() if "lora" in k or "norm" in k},
                        "opt": opt.state_dict(), "elapsed": elapsed, "step": step}, ckpt)
            last_save = time.time()
    held_agreement = agreement(student, teacher, held_rows)
    log(f"held-out agreement after {step} steps: {held_agreement:.3f}")
    save(a, student, path, {"steps": step, "minutes": round(elapsed / 60, 1),
                            "held_out_top1_agreement": round(held_agreement, 3),
                            "train_top1_agreement": round(ema or 0.0, 3)})
    return 0


def save(a, student, path: Path, results: dict) -> None:
    from triforce_core.models import prefix_draft

    training = {"script": "scripts/train_smollm2_draft.py", "seed": a.seed, "batch": a.batch, "window": SINKS + RECENT,
                "answers": a.answers, "answer_tokens": a.answer_tokens, "chat_share": a.chat_share, "lr": a.lr,
                "ce_weight": a.ce_weight, "torch": torch.__version__, **results}
    if a.init is not None:  # a further round: what the adapter it started from had been through
        training["continued_from"] = json.loads((a.init / prefix_draft.MANIFEST).read_text()).get("training")
    prefix_draft.write(a.out, adapter_state(student), a.layers, path.name, rank=a.rank, training=training)
    log(f"saved {a.out}")


if __name__ == "__main__":
    raise SystemExit(main())
