"""Citations: the passages an answer's retrieval selections read most, with the section they lie in;
in modes without a retrieval level, the passages the answer quotes."""

from __future__ import annotations

import pytest
from tests.helpers.models import make_tokenizer, words

from triforce_core.documents.citations import answer_passages, cited_passages, quoted_passages
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.decoding.events import ChunksSelected
from triforce_core.serving.session import ChatSession

TOK = make_tokenizer()
TOK.add_tokens(["[Section", "3:", "Beta]"])  # the header line's words, so the prompt decodes to it


def decode(ids):
    return TOK.decode(ids)


def selection(spans, counts, context=200, heads=4):
    return ChunksSelected(step=0, chunk_size=4, chunk_token_spans=tuple(spans), scores_or_counts=tuple(counts),
                          context_tokens=context, budget=32, heads_total=heads)


def test_the_most_chosen_chunks_with_their_section_skipping_the_sink_the_recent_tokens_and_the_answer():
    prompt_text = words(40, 1) + " [Section 3: Beta]\n " + words(150, 2)
    ids = TOK(prompt_text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    recent = CacheConfig(budget=32, chunk_size=4).recent
    # the first selection right after the prompt, the second after 8 answer tokens
    sels = [selection([(0, 4), (8, 12), (60, 64), (n - 4, n)], [4, 1, 3, 4], context=n),
            selection([(8, 12), (60, 64), (n + 4, n + 8)], [1, 4, 4], context=n + 8)]
    got = cited_passages(sels, ids, decode, k=2)
    # the sink (0-4), the recent tokens and the answer's own tokens are not citations
    assert recent == 4
    assert [p["tokens"] for p in got] == [[60, 64], [8, 12]]
    assert got[0]["share"] == pytest.approx((3 / 4 + 4 / 4) / 2) and got[1]["share"] == pytest.approx(2 / 4 / 2)
    assert got[0]["section"] == "Section 3: Beta" and got[1]["section"] is None  # before the header: none
    assert decode(ids[60:64]) in got[0]["text"]
    assert cited_passages([], ids, decode) == [] and cited_passages([selection([(8, 12)], [1])], ids, decode, k=0) == []


@pytest.fixture(scope="module")
def engine(chat_engine):
    return chat_engine


@pytest.mark.parametrize("mode", ["triforce", "autoregressive"])
def test_each_turn_cites_its_passages_in_modes_with_a_retrieval_level(engine, mode):
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=8, ignore_eos=True, gamma1=2, gamma2=4),
                           cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4))
    session = ChatSession(engine, words(300, 5), config=cfg)
    list(session.ask(words(4, 6)))
    passages = session.turns[-1].passages
    if mode == "autoregressive":
        assert all(p["kind"] == "quoted" for p in passages)  # nothing selected: at most what it quotes
    else:
        assert 1 <= len(passages) <= 3 and all(0 < p["share"] <= 1 and p["text"] for p in passages)
        assert all(0 < p["tokens"][0] < len(session.prompt_ids(words(4, 6))) for p in passages)


def test_quoted_passages_are_the_verbatim_runs_the_answer_repeats_longest_first():
    prompt_text = words(40, 1) + " [Section 3: Beta]\n " + words(150, 2) + " " + words(12, 9)
    ids = TOK(prompt_text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    filler = TOK(words(5, 7), add_special_tokens=False)["input_ids"]
    # 15 tokens from 60, 10 from 100, a 5-token run (too short to be a quote), and the question's words
    answer = filler + ids[60:75] + filler + ids[100:110] + filler + ids[20:25] + ids[n - 12:n]
    got = quoted_passages(answer, ids, decode, end=n - 12)
    assert [p["tokens"] for p in got] == [[60, 75], [100, 110]]
    assert [p["kind"] for p in got] == ["quoted", "quoted"]
    assert got[0]["share"] == pytest.approx(15 / len(answer), abs=1e-4) and got[1]["share"] == pytest.approx(10 / len(answer), abs=1e-4)
    assert got[0]["section"] == "Section 3: Beta" and decode(ids[60:75]) in got[0]["text"]
    # the question (the prompt's last tokens) is not searched; without `end` it would be quoted
    assert [n - 12, n] in [p["tokens"] for p in quoted_passages(answer, ids, decode)]
    # quotes a few tokens apart in the prompt are one passage
    near = quoted_passages(ids[60:70] + filler + ids[75:85], ids, decode, end=n - 12)
    assert [p["tokens"] for p in near] == [[60, 85]] and near[0]["share"] == pytest.approx(20 / 25, abs=1e-4)
    assert quoted_passages(filler, ids, decode) == [] and quoted_passages(answer, ids, decode, k=0) == []


def test_an_answer_cites_what_it_read_before_what_it_quotes():
    ids = TOK(words(200, 3), add_special_tokens=False)["input_ids"]
    answer = ids[50:70]
    read = answer_passages([selection([(8, 12)], [4], context=len(ids))], ids, answer, decode, question_tokens=10)
    assert [p["kind"] for p in read] == ["read"]
    quoted = answer_passages([], ids, answer, decode, question_tokens=10)
    assert [(p["kind"], p["tokens"]) for p in quoted] == [("quoted", [50, 70])]


def test_the_demo_pair_quoting_its_document_cites_the_passage_it_quotes():
    """Lookup mode selects nothing; the demo target answering "What follows «…»?" copies the
    continuation from the document, and the turn cites that passage."""
    from triforce_core import TriForceEngine
    from triforce_core.models.loading import DEMO_TARGET
    from triforce_core.resources import SAMPLE_DOCUMENT

    engine = TriForceEngine.from_pretrained(str(DEMO_TARGET), None, device="cpu")
    text = SAMPLE_DOCUMENT.read_text(encoding="utf-8")[:6000]
    phrase = "a derived class can override any methods of its base"
    assert phrase in text
    session = ChatSession(engine, text, config=GenerationConfig(
        speculation=SpeculationConfig(mode="lookup", max_new_tokens=24)))
    list(session.ask(f"What follows «{phrase}»?"))
    turn = session.turns[-1]
    assert "class or classes, and a method" in turn.answer  # it really quoted the continuation
    assert turn.passages and turn.passages[0]["kind"] == "quoted"
    assert turn.passages[0]["share"] > 0.5 and "class or classes, and a method" in turn.passages[0]["text"]
