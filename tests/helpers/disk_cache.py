"""A conversation over one document with the disk K/V cache: a fresh engine as after a restart,
two questions, and the block files it leaves."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.models import CHAT_TEMPLATE, make_tokenizer, to_ours, words
from triforce_core.config import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.decoding.events import Committed
from triforce_core.engine import TriForceEngine
from triforce_core.serving.session import ChatSession
from triforce_core.serving.turns import Turn

CHUNK = 32  # prefill chunk = disk block: the 300-word document spans 9 whole blocks
DOCUMENT = words(300, 11)
Q1, Q2 = words(6, 12), words(5, 13)


def new_engine(weights, folder=None, **disk) -> TriForceEngine:
    """A fresh engine, as after a restart: new model objects from the same weights."""
    hf, draft = weights
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    engine = TriForceEngine(to_ours(hf), to_ours(draft), tok, eos_token_ids=[2])
    if folder is not None:
        engine.use_disk_cache(folder, **disk)
    return engine


def config(mode: str, temperature: float = 0.0, seed: int | None = None) -> GenerationConfig:
    """`mode`'s settings for the conversation, prefilled in CHUNK-token chunks (the disk's blocks)."""
    return GenerationConfig(
        sampling=SamplingConfig(temperature=temperature, seed=seed),
        speculation=SpeculationConfig(mode=mode, max_new_tokens=12, ignore_eos=True, gamma1=2, gamma2=4),
        cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, refresh_every=16,
                          prefill_chunk=CHUNK),
    )


def two_turns(engine, cfg):
    """Q1 then Q2 about DOCUMENT: (each answer's tokens, each turn's stats, the session)."""
    session = ChatSession(engine, DOCUMENT, config=cfg)
    answers = []
    for q in (Q1, Q2):
        answers.append([t for ev in session.ask(q) if isinstance(ev, Committed) for t in ev.token_ids])
    return answers, [t.stats for t in session.turns], session


def block_files(folder) -> list[Path]:
    """The disk cache's block files in `folder`, oldest first."""
    return sorted(Path(folder).glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)


def document_end(engine, cfg) -> int:
    """Where the document ends in the first prompt's tokens (`ChatSession.document_end`)."""
    session = ChatSession(engine, DOCUMENT, config=cfg)
    prompt = session.prompt_ids(Q1)
    session.turns.append(Turn(Q1))
    return session.document_end(prompt)
