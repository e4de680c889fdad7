"""Citations: the passages an answer's retrieval selections read most, with the section they lie in;
in modes without a retrieval level, the passages the answer quotes; never a passage that is not
the document's (an earlier answer the model repeats, the question, the template)."""

from __future__ import annotations

import pytest
from tests.helpers.models import make_tokenizer, words

from triforce_core.documents.citations import (DocumentText, answer_passages, cited_passages, question_tokens,
                                               quoted_passages)
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.decoding.events import ChunksSelected
from triforce_core.serving.session import ChatSession
from triforce_core.serving.turns import Turn

TOK = make_tokenizer()
TOK.add_tokens(["[Section:", "Beta]"])  # the part line's words, so the prompt decodes to it


def decode(ids):
    return TOK.decode(ids)


def selection(spans, counts, context=200, heads=4):
    return ChunksSelected(step=0, chunk_size=4, chunk_token_spans=tuple(spans), scores_or_counts=tuple(counts),
                          context_tokens=context, budget=32, heads_total=heads)


def test_the_most_chosen_chunks_with_their_section_skipping_the_sink_the_recent_tokens_and_the_answer():
    prompt_text = words(40, 1) + " [Section: Beta]\n " + words(150, 2)
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
    assert got[0]["section"] == "Beta" and got[1]["section"] is None  # before the header: none
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
    prompt_text = words(40, 1) + " [Section: Beta]\n " + words(150, 2) + " " + words(12, 9)
    ids = TOK(prompt_text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    filler = TOK(words(5, 7), add_special_tokens=False)["input_ids"]
    # 15 tokens from 60, 10 from 100, a 5-token run (too short to be a quote), and the question's words
    answer = filler + ids[60:75] + filler + ids[100:110] + filler + ids[20:25] + ids[n - 12:n]
    got = quoted_passages(answer, ids, decode, end=n - 12)
    assert [p["tokens"] for p in got] == [[60, 75], [100, 110]]
    assert [p["kind"] for p in got] == ["quoted", "quoted"]
    assert got[0]["share"] == pytest.approx(15 / len(answer), abs=1e-4) and got[1]["share"] == pytest.approx(10 / len(answer), abs=1e-4)
    assert got[0]["section"] == "Beta" and decode(ids[60:75]) in got[0]["text"]
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


# -- only the document's text is cited ----------------------------------------------------------


def _conversation(engine, document: str, answers: list[str], system: str | None = None) -> ChatSession:
    """A session over `document` whose earlier turns answered `answers`, as if it had generated them."""
    session = ChatSession(engine, document, system_prompt=system)
    for i, answer in enumerate(answers):
        session.turns.append(Turn(words(3, 100 + i), answer=answer))
    return session


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _next_turn(session: ChatSession, question: str) -> list[int]:
    """The prompt of `question`, with its turn begun, as `ChatSession.ask` leaves it for the citations."""
    prompt = session.prompt_ids(question)
    session.turns.append(Turn(question))
    return prompt


def test_the_documents_tokens_in_the_prompt_are_known(engine):
    document, system = words(120, 21), words(10, 22)
    session = _conversation(engine, document, [words(12, 23)], system=system)
    prompt = _next_turn(session, words(4, 24))
    start, end = session.document_span(prompt)
    assert prompt[start:end] == _ids(engine, document)  # the system prompt and the template before it are not
    assert ChatSession(engine, "").document_span(prompt) is None


def test_a_follow_up_repeating_an_earlier_answer_cites_nothing_of_it_and_still_cites_the_document(engine):
    document, earlier = words(200, 11), words(24, 12)  # the first answer: words the document does not hold
    assert not DocumentText(document).holds(engine.detokenize(_ids(engine, earlier)))
    session = _conversation(engine, document, [earlier])
    question = words(4, 13)
    prompt = _next_turn(session, question)
    decode, repeat = engine.detokenize, _ids(engine, earlier)  # the second answer repeats the first
    # negative control: the search over the whole prompt before the question cites the earlier answer
    old = answer_passages([], prompt, repeat, decode, question_tokens=question_tokens(engine.tokenizer, question))
    assert old and old[0]["kind"] == "quoted" and old[0]["tokens"][0] >= session.document_span(prompt)[1]
    assert " ".join(earlier.split()[:8]) in old[0]["text"]
    assert session.passages([], prompt, repeat, question) == []
    # a quote of the document is still cited, the repeated answer beside it is not
    quote = _ids(engine, document)[60:80]
    got = session.passages([], prompt, quote + repeat, question)
    assert [p["kind"] for p in got] == ["quoted"] and decode(quote) in got[0]["text"]
    assert got[0]["share"] == pytest.approx(20 / (20 + len(repeat)), abs=1e-4)
    assert all(DocumentText(document).holds(p["text"]) for p in got)


def test_the_most_read_chunks_are_the_documents_never_an_earlier_answers(engine):
    document, earlier = words(200, 31), words(24, 32)
    session = _conversation(engine, document, [earlier])
    question = words(4, 33)
    prompt = _next_turn(session, question)
    start, end = session.document_span(prompt)
    at = next(i for i in range(end, len(prompt)) if prompt[i : i + 24] == _ids(engine, earlier))
    chosen = selection([(at + 4, at + 8), (start + 40, start + 44)], [4, 2], context=len(prompt))
    # negative control: counted over the whole prompt, the earlier answer is the most read
    assert cited_passages([chosen], prompt, engine.detokenize)[0]["tokens"] == [at + 4, at + 8]
    got = session.passages([chosen], prompt, [], question)
    assert [p["tokens"] for p in got] == [[start + 40, start + 44]] and got[0]["kind"] == "read"


def test_a_passage_whose_text_is_not_the_documents_is_dropped_wherever_it_lies():
    """The text check alone (no span): a passage of the prompt not found in the document is not shown."""
    doc_text = words(60, 41)
    other = words(20, 42)
    ids = TOK(doc_text + " " + other, add_special_tokens=False)["input_ids"]
    answer = ids[60:80]  # the part of the prompt that is not the document
    assert quoted_passages(answer, ids, decode) and not quoted_passages(answer, ids, decode, document=doc_text)
    assert quoted_passages(ids[10:30], ids, decode, document=doc_text)[0]["tokens"] == [10, 30]
    text = DocumentText("Alpha  beta,\ngamma. [Section: 2.1 Data]\nDelta epsilon")
    assert text.holds("ALPHA beta, gamma.") and text.holds("gamma. [Section: 2.1 Data] Delta")
    assert text.holds("1 Data] Delta eps") and text.holds("beta, gamma. [Secti")  # cut through a part line
    assert not text.holds("beta gamma delta") and not text.holds("") and not text.holds("[Section: 2.1 Data]")


def test_over_follow_ups_that_repeat_earlier_answers_no_passage_is_not_the_documents(engine):
    """Conversations whose answers mix quotes of the document with repeats of earlier answers, of
    the question and of the system prompt: every passage cited is the document's (checked apart
    from the citations' own check: its tokens lie where the document's do, its text is a stretch
    of the document's); the whole-prompt search would have cited others."""
    import random

    bad_new = bad_old = cited = 0
    for seed in range(12):
        rng = random.Random(seed)
        document, system = words(160, 1000 + seed), words(12, 2000 + seed)
        session = _conversation(engine, document, [], system=system)
        doc_ids, flat = _ids(engine, document), " ".join(document.split())
        for turn in range(4):
            question = words(6, 3000 + 10 * seed + turn)
            prompt = _next_turn(session, question)
            start, end = session.document_span(prompt)
            pieces = [doc_ids[(a := rng.randrange(0, 140)) : a + rng.randrange(8, 20)], _ids(engine, system),
                      _ids(engine, question)] + [_ids(engine, t.answer) for t in session.turns[:-1]]
            rng.shuffle(pieces)
            answer = [t for piece in pieces for t in piece]
            for passages, new in ((session.passages([], prompt, answer, question), True),
                                  (answer_passages([], prompt, answer, engine.detokenize,
                                                   question_tokens=question_tokens(engine.tokenizer, question)), False)):
                for p in passages:
                    a, b = p["tokens"]
                    outside = not (start <= a < b <= end and engine.detokenize(prompt[a:b]) in flat)
                    bad_new, bad_old = bad_new + (outside and new), bad_old + (outside and not new)
                    cited += new
            session.turns[-1].answer = engine.detokenize(answer)
    assert cited >= 12 and bad_new == 0
    assert bad_old > 0  # negative control: the old search cites them
