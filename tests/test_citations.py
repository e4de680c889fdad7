"""Citations: the passages an answer's retrieval selections read most, with the section they lie in."""

from __future__ import annotations

import pytest
from conftest import make_tokenizer, words

from triforce_core.citations import cited_passages
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.events import ChunksSelected
from triforce_core.session import ChatSession

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
        assert passages == []  # nothing selected, nothing measured
    else:
        assert 1 <= len(passages) <= 3 and all(0 < p["share"] <= 1 and p["text"] for p in passages)
        assert all(0 < p["tokens"][0] < len(session.prompt_ids(words(4, 6))) for p in passages)
