"""Chat sessions: the document is prefilled once, later turns reuse it, and answers stay exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.models import CHAT_TEMPLATE as TEMPLATE
from tests.helpers.models import DRAFT_OVERRIDES, make_hf, make_tokenizer, to_ours, words
from triforce_core.config import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.engine import ContextLengthError, TriForceEngine
from triforce_core.decoding.events import Committed, Prefilled
from triforce_core.serving.session import ChatSession, SessionError
from triforce_core.serving.turns import Turn

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("triforce", "retrieval", "draft", "autoregressive")


@pytest.fixture(scope="module")
def engine(chat_engine):
    return chat_engine


def config(mode: str = "triforce", max_new: int = 12, **cache) -> GenerationConfig:
    cc = dict(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, refresh_every=16)
    cc.update(cache)
    return GenerationConfig(
        speculation=SpeculationConfig(mode=mode, max_new_tokens=max_new, ignore_eos=True, gamma1=2, gamma2=4),
        cache=CacheConfig(**cc),
    )


DOCUMENT = words(300, 1)
Q1, Q2, Q3 = words(6, 2), words(5, 3), words(7, 4)


def drain(events):
    out = {"prefilled": None, "ids": []}
    for ev in events:
        if isinstance(ev, Prefilled):
            out["prefilled"] = ev
        elif isinstance(ev, Committed):
            out["ids"] += ev.token_ids
    return out


@pytest.mark.parametrize("mode", MODES)
def test_second_question_reuses_the_document_and_equals_a_fresh_prefill(engine, mode):
    cfg = config(mode)
    session = ChatSession(engine, DOCUMENT, system_prompt="w90 w91", config=cfg)
    prompt1 = session.prompt_ids(Q1)
    first = drain(session.ask(Q1))
    assert first["prefilled"].reused_tokens == 0
    assert session.turns[0].stats.prefill_tokens == len(prompt1)
    fresh_prompt = session.prompt_ids(Q2)
    second = drain(session.ask(Q2))
    stats = session.turns[1].stats
    assert session.document_tokens == 300
    # Only the new question, the template and the previous answer are prefilled.
    assert stats.prefill_tokens <= len(Q2.split()) + len(first["ids"]) + 6
    assert stats.prefill_tokens + stats.reused_tokens == len(fresh_prompt)
    assert stats.reused_tokens > 300
    reference = engine.run(fresh_prompt, cfg)
    assert second["ids"] == reference.token_ids
    assert session.cached_tokens() == (fresh_prompt + second["ids"])[: len(session.cached_tokens())]


def test_three_turns_with_changed_settings_keep_the_cache(engine):
    session = ChatSession(engine, DOCUMENT)
    drain(session.ask(Q1, config("triforce")))
    drain(session.ask(Q2, config("retrieval", budget=64, chunk_size=8)))
    cfg3 = config("draft", max_new=10, draft_window=16)
    prompt3 = session.prompt_ids(Q3)
    third = drain(session.ask(Q3, cfg3))
    assert session.turns[2].stats.reused_tokens > 300
    assert third["ids"] == engine.run(prompt3, cfg3).token_ids


def test_regenerate_rolls_back_and_gives_the_same_greedy_answer(engine):
    session = ChatSession(engine, DOCUMENT, config=config("triforce"))
    drain(session.ask(Q1))
    lengths_after_first = session.cache_lengths()
    events = session.ask(Q2)
    at_prefill = None
    ids = []
    for ev in events:
        if isinstance(ev, Prefilled):
            at_prefill = session.cache_lengths()
        elif isinstance(ev, Committed):
            ids += ev.token_ids
    lengths_after_second = session.cache_lengths()
    assert lengths_after_second["target"] > lengths_after_first["target"]

    regen_at_prefill = None
    regen_ids = []
    for ev in session.regenerate():
        if isinstance(ev, Prefilled):
            regen_at_prefill = session.cache_lengths()
            assert ev.tokens <= 2  # no re-prefill: the last question token is fed again, that is all
        elif isinstance(ev, Committed):
            regen_ids += ev.token_ids
    assert regen_ids == ids
    assert regen_at_prefill == at_prefill
    assert session.cache_lengths() == lengths_after_second
    assert len(session.turns) == 2


def test_edit_last_question(engine):
    cfg = config("triforce")
    session = ChatSession(engine, DOCUMENT, config=cfg)
    drain(session.ask(Q1))
    drain(session.ask(Q2))
    edited = drain(session.edit_last(Q3))
    assert [t.question for t in session.turns] == [Q1, Q3]
    reference = ChatSession(engine, DOCUMENT, config=cfg)
    drain(reference.ask(Q1))
    assert edited["ids"] == drain(reference.ask(Q3))["ids"]
    assert session.turns[1].stats.prefill_tokens < 20


def test_a_stopped_answer_is_kept_and_the_session_goes_on(engine):
    cfg = config("triforce", max_new=30)
    session = ChatSession(engine, DOCUMENT, config=cfg)
    gen = session.ask(Q1)
    got = []
    for ev in gen:
        if isinstance(ev, Committed):
            got += ev.token_ids
            if len(got) >= 5:
                break
    gen.close()
    turn = session.turns[0]
    assert not turn.complete and turn.token_ids == got and turn.answer
    prompt2 = session.prompt_ids(Q2)
    second = drain(session.ask(Q2))
    assert second["ids"] == engine.run(prompt2, cfg).token_ids
    assert session.turns[1].stats.reused_tokens > 300


def test_context_window_is_checked_before_prefill(engine):
    long_doc = words(1000, 5)
    session = ChatSession(engine, long_doc, config=config(max_new=100))
    with pytest.raises(ContextLengthError) as err:
        session.ask(Q1)
    msg = str(err.value)
    assert "the document (1,000 tokens)" in msg and "100 tokens for the answer" in msg and "window of 1,024" in msg
    assert session.cache_lengths()["target"] == 0 and not session.turns


def test_a_refusal_is_a_sentence_with_the_true_numbers_and_only_the_options_there_are(engine):
    """Plain words, every figure the session's own, and only options that exist for the caller and
    would help: truncation only where the caller offers it (the command line), never on the page."""
    session = ChatSession(engine, words(1000, 5), config=config(max_new=100))
    with pytest.raises(ContextLengthError) as err:
        session.ask(words(6, 2))
    assert str(err.value) == (
        "This question is 6 tokens: with the document (1,000 tokens), the chat template (3 tokens) and 100 tokens "
        "for the answer, it needs 1,109 tokens, 85 over the model's context window of 1,024. Lower the answer's "
        "token limit (now 100) or use a shorter document.")
    assert "truncat" not in str(err.value)
    session.truncation_hint = "--truncate"  # what the command line sets: it has that option
    with pytest.raises(ContextLengthError, match=r"use a shorter document or allow truncation \(--truncate\)\.$"):
        session.ask(words(6, 2))
    # a long conversation: clearing it would make room; a question longer than the window: only shortening it helps
    talk = ChatSession(engine, words(300, 5), config=config(max_new=12))
    talk.turns.append(Turn(words(5, 1), answer=words(600, 3)))
    with pytest.raises(ContextLengthError) as err:
        talk.ask(words(200, 2))
    assert "the conversation so far and the chat template (612 tokens)" in str(err.value)
    assert str(err.value).endswith("100 over the model's context window of 1,024. "
                                   "Shorten the question, clear the conversation or use a shorter document.")
    with pytest.raises(ContextLengthError) as err:
        ChatSession(engine, words(30, 5), config=config(max_new=12)).ask(words(1100, 2))
    assert str(err.value).endswith("Shorten the question.") and "token limit" not in str(err.value)


def test_a_book_refusal_says_how_much_of_the_book_could_be_read(engine):
    """A book session over a question that leaves no room names the book's true size and what
    was read of it (none), not "the document (0 tokens)", and offers no option the page lacks."""
    from triforce_core.documents import Document
    from triforce_core.serving.book import BookSession

    book = BookSession(engine, Document(words(1500, 8), "txt", "b.txt"), config=config(max_new=12))
    with pytest.raises(ContextLengthError) as err:
        book.ask(words(1100, 7))
    assert str(err.value) == (
        "This question is 1,100 tokens: with none of the book (1,500 tokens) read, the chat template (3 tokens) "
        "and 12 tokens for the answer, it needs 1,115 tokens, 91 over the model's context window of 1,024. "
        "Shorten the question.")
    assert not book.turns and book.picked == []  # refused before anything ran
    # a question that fits beside part of the book reads it, and a refusal then says how much
    list(book.ask(words(6, 9)))
    read = book.document_tokens
    assert 0 < read < 1500
    assert book._document_words(read) == f"the {read:,} tokens read of the book (1,500 tokens)"


def test_truncation_only_when_allowed_and_reported(engine):
    long_doc = words(1000, 5)
    session = ChatSession(engine, long_doc, config=config(max_new=100), allow_truncation=True)
    out = drain(session.ask(Q1))
    turn = session.turns[0]
    assert turn.truncation is not None
    assert turn.truncation.tokens_before == 1000 and turn.truncation.tokens_after < 1000
    assert "was cut from 1000 to" in turn.truncation.message()
    assert long_doc.startswith(session.document)
    assert len(out["ids"]) == 100
    assert turn.stats.prompt_tokens + 100 <= engine.context_window


def test_out_of_memory_frees_the_caches_and_the_session_stays_usable():
    torch.set_num_threads(1)
    hf = make_hf("llama_mha", seed=3, max_position_embeddings=2**40)
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    engine = TriForceEngine(to_ours(hf), to_ours(make_hf("llama_mha", seed=4, max_position_embeddings=2**40,
                                                         **DRAFT_OVERRIDES)), tok, eos_token_ids=[2])
    session = ChatSession(engine, DOCUMENT)
    huge = config("autoregressive", max_new=2**37)  # the cache for this many tokens cannot be allocated
    with pytest.raises(SessionError, match="out of memory"):
        drain(session.ask(Q1, huge))
    assert session.cache_lengths() == {"target": 0, "retrieval": 0, "draft": 0}
    assert not session.turns[-1].complete
    session.clear()
    out = drain(session.ask(Q1, config("triforce")))
    assert len(out["ids"]) == 12 and session.turns[-1].complete


def test_sampling_turns_follow_the_seed(engine):
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=0.8, seed=11),
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=10, ignore_eos=True),
        cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4),
    )
    a = ChatSession(engine, DOCUMENT, config=cfg)
    b = ChatSession(engine, DOCUMENT, config=cfg)
    assert drain(a.ask(Q1))["ids"] == drain(b.ask(Q1))["ids"]
    assert drain(a.regenerate())["ids"] == drain(b.regenerate())["ids"]


def test_empty_question_and_nothing_to_regenerate(engine):
    session = ChatSession(engine, DOCUMENT)
    with pytest.raises(ValueError, match="empty"):
        session.ask("   ")
    with pytest.raises(ValueError, match="nothing|no answer"):
        session.regenerate()


def test_cli_chat_contract(tiny_pair_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(words(200, 9), encoding="utf-8")
    cmd = [sys.executable, "-m", "triforce_core", "chat", "--target", tiny_pair_dir["target"], "--draft",
           tiny_pair_dir["draft"], "--document", str(doc), "--question", Q1, "--question", Q2, "--max-new-tokens",
           "8", "--ignore-eos", "--budget", "32", "--chunk-size", "4", "--draft-window", "16", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["document"] == {"chars": len(doc.read_text().strip()), "tokens": 200}
    assert [t["question"] for t in payload["turns"]] == [Q1, Q2]
    for t in payload["turns"]:
        # the contract's keys, and the citations extension (a list: the default mode, lookup, selects
        # nothing, so at most the passages the answer quotes)
        assert set(t) == {"question", "answer", "token_ids", "levels", "stats", "passages"}
        assert isinstance(t["passages"], list) and all(p["kind"] == "quoted" for p in t["passages"])
        assert len(t["token_ids"]) == len(t["levels"]) == 8
        assert {"prefill_tokens", "reused_tokens", "prefill_s", "decode_s", "tokens_per_s", "acceptance"} <= set(t["stats"])
    first, second = payload["turns"][0]["stats"], payload["turns"][1]["stats"]
    assert first["reused_tokens"] == 0 and second["reused_tokens"] > 200 and second["prefill_tokens"] < 40

    bad = subprocess.run(cmd[:8] + ["--document", str(tmp_path / "missing.pdf"), "--question", "x"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.pdf'}: no such file"]


# -- Continue: an answer cut by its token limit goes on as one longer answer would have -------------
CONTINUE_MODES = ("triforce", "retrieval", "draft", "lookup", "autoregressive")
FREE_QUESTION = "What is a class?"  # the demo target answers in its own words (no copy of the document)


@pytest.fixture(scope="module")
def demo_engine():
    from triforce_core.models.loading import DEMO_DRAFT, DEMO_TARGET

    return TriForceEngine.from_pretrained(str(DEMO_TARGET), str(DEMO_DRAFT), device="cpu")


@pytest.fixture(scope="module")
def demo_document():
    from triforce_core.resources import SAMPLE_DOCUMENT

    return SAMPLE_DOCUMENT.read_text(encoding="utf-8")[:6000]


def demo_config(mode: str, max_new: int, **sampling) -> GenerationConfig:
    return GenerationConfig(sampling=SamplingConfig(**sampling),
                            speculation=SpeculationConfig(mode=mode, max_new_tokens=max_new),
                            cache=CacheConfig(budget=256, chunk_size=8))


@pytest.mark.parametrize("mode", CONTINUE_MODES)
def test_continue_after_the_limit_gives_the_tokens_of_one_longer_answer(demo_engine, demo_document, mode):
    """The demo pair, greedy with an instruct model's repetition penalty (the penalty counts the
    whole answer, so the continuation must see its first part as already generated): 12 tokens,
    then Continue with 12 more, equals one answer of 24, token for token and in its text."""
    sampling = dict(repetition_penalty=1.2)
    longer = ChatSession(demo_engine, demo_document)
    list(longer.ask(FREE_QUESTION, demo_config(mode, 24, **sampling)))
    cut = ChatSession(demo_engine, demo_document)
    list(cut.ask(FREE_QUESTION, demo_config(mode, 12, **sampling)))
    first = cut.turns[-1]
    assert first.stats.stop_reason == "max_new_tokens" and cut.can_continue()
    events = list(cut.continue_last(demo_config(mode, 12, **sampling)))
    turn, whole = cut.turns[-1], longer.turns[-1]
    assert len(cut.turns) == 1 and turn is first  # the same turn, not a new one
    assert turn.token_ids == whole.token_ids and len(turn.token_ids) == 24
    assert turn.answer == whole.answer and len(turn.levels) == 24
    # the events' text goes on from the first part's: joined, they are the answer's second half
    text = "".join(ev.text for ev in events if isinstance(ev, Committed))
    assert whole.answer.endswith(text) and text
    s = turn.stats
    assert s.new_tokens == 24 and s.stop_reason == "max_new_tokens" and s.mode == mode
    assert s.prompt_tokens == whole.stats.prompt_tokens and s.prefill_tokens <= whole.stats.prefill_tokens + 2
    assert s.decode_s > 0 and s.tokens_per_s == pytest.approx(24 / s.decode_s)


def test_a_continuation_counts_the_answer_so_far_in_its_penalty_and_not_without(demo_engine, demo_document):
    """Negative control: the same prompt and answer ids generated as a fresh answer (the penalty
    then forgets the first part) go elsewhere, so the test above can fail."""
    cfg = demo_config("autoregressive", 12, repetition_penalty=1.2)
    longer = ChatSession(demo_engine, demo_document)
    list(longer.ask(FREE_QUESTION, demo_config("autoregressive", 24, repetition_penalty=1.2)))
    cut = ChatSession(demo_engine, demo_document)
    list(cut.ask(FREE_QUESTION, cfg))
    answer = list(cut.turns.pop().token_ids)
    prompt = cut.prompt_for(FREE_QUESTION)  # the prompt the answer followed
    assert len(prompt) == longer.turns[-1].stats.prompt_tokens
    fresh = [t for ev in cut._slot.generate(prompt + answer, cfg) if isinstance(ev, Committed) for t in ev.token_ids]
    assert answer + fresh != longer.turns[-1].token_ids


def test_continue_says_why_not_and_fills_what_is_left_of_the_window(engine):
    cfg = config("autoregressive", max_new=12)
    session = ChatSession(engine, DOCUMENT, config=cfg)
    with pytest.raises(ValueError, match="no answer to continue"):
        session.continue_last()
    # a document that leaves 5 tokens of the window after a 12-token answer
    probe = len(session.prompt_ids(Q1))
    size = 300 + engine.context_window - 12 - 5 - probe
    session.set_document(words(size, 1))
    assert len(session.prompt_ids(Q1)) + 12 + 5 == engine.context_window
    drain(session.ask(Q1))
    out = drain(session.continue_last())
    assert len(out["ids"]) == 5 and session.turns[-1].stats.new_tokens == 17 and len(session.turns[-1].token_ids) == 17
    assert session.can_continue()  # stopped by its limit (the window's), but no room is left
    with pytest.raises(ContextLengthError, match=r"no room left to continue.*1,024 of 1,024 tokens"):
        session.continue_last()
    # an answer stopped by Stop (or ended by itself) is not continued
    stopped = ChatSession(engine, DOCUMENT, config=config("autoregressive", max_new=12))
    events = stopped.ask(Q1)
    next(ev for ev in events if isinstance(ev, Committed))
    events.close()
    assert not stopped.can_continue()
    with pytest.raises(ValueError, match="only an answer stopped by its token limit"):
        stopped.continue_last()


def test_a_stopped_continuation_keeps_its_tokens_as_a_stopped_answer(engine):
    session = ChatSession(engine, DOCUMENT, config=config("triforce", max_new=12))
    drain(session.ask(Q1))
    events = session.continue_last()
    for ev in events:
        if isinstance(ev, Committed):
            break
    events.close()
    turn = session.turns[-1]
    assert turn.stats is None and 12 < len(turn.token_ids) < 24 and not session.can_continue()
    assert turn.answer == engine.detokenize([t for t in turn.token_ids if t not in engine.eos_token_ids])
