"""Asking a whole book: its parts ranked by BM25, whole parts read within a budget in document
order, follow-ups keeping the read (and the cached prefix), answers exactly a plain session's."""

from __future__ import annotations

import html
import json
import random

import pytest
from tests.helpers.cli import run_main
from tests.helpers.models import make_tokenizer

from triforce_core.documents.reading import token_starts
from triforce_core.serving.book import BookSession
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.documents import Document, Section, load_document
from triforce_core.documents.sections import with_ends
from triforce_core.documents.reading import BookReader
from triforce_core.serving.session import ChatSession

TOKENIZER = make_tokenizer()


def vocab_words(n: int, lo: int, hi: int, seed: int) -> str:
    """n words of the word-level test vocabulary drawn from w{lo}..w{hi-1} (one token each)."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(lo, hi)}" for _ in range(n))


def book(chapters: list[tuple[str, int, int, int, list[tuple[str, int, int, int]]]]) -> Document:
    """A Markdown-like book: (title, words, lo, hi, subsections) per chapter, each body of words
    from its own range of the vocabulary, so a question's words say where they come from."""
    text, sections = "", []
    for title, n, lo, hi, subs in chapters:
        sections.append(Section(len(text), f"section: {title}", title, 1))
        text += f"{title}\n{vocab_words(n, lo, hi, lo)}\n\n"
        for st, sn, slo, shi in subs:
            sections.append(Section(len(text), f"section: {st}", st, 2))
            text += f"{st}\n{vocab_words(sn, slo, shi, slo)}\n\n"
    return Document(text, "md", "book.md", with_ends(sections, len(text)))


BOOK = book([("Intro", 40, 7, 20, []),
             ("Chapter", 30, 20, 30, [("PageA", 120, 30, 45), ("PageB", 120, 45, 60)]),
             ("Last", 200, 60, 97, [])])


def reader(doc: Document = BOOK, max_part: int = 4096) -> BookReader:
    return BookReader(doc, token_starts(TOKENIZER, doc.text), max_part_tokens=max_part)


def test_parts_are_sections_without_their_subsections_and_cover_the_text():
    r = reader()
    assert [(p.title, p.section) for p in r.parts] == [("Intro", 0), ("Chapter", 1), ("PageA", 2), ("PageB", 3), ("Last", 4)]
    assert "".join(BOOK.text[p.start : p.end] for p in r.parts) == BOOK.text  # every character once
    chapter = r.parts[1]
    assert "PageA" not in BOOK.text[chapter.start : chapter.end]  # the chapter's page is its own part
    # a part's size: its words (one token each) and an estimate for the line naming it
    assert 31 <= chapter.tokens - r._header_tokens(chapter) <= 32


def test_a_long_section_and_plain_text_are_cut_at_paragraphs():
    paragraphs = [vocab_words(30, 7, 97, i) for i in range(10)]
    plain = Document("\n\n".join(paragraphs) + "\n", "txt", "notes.txt")
    r = reader(plain, max_part=100)
    assert [p.pieces for p in r.parts] == [len(r.parts)] * len(r.parts) and len(r.parts) == 4
    for p in r.parts:
        body = plain.text[p.start : p.end].strip()
        assert body.split("\n\n")[0] in paragraphs  # cut between paragraphs, never inside one
        assert p.tokens - r._header_tokens(p) <= 100
    # a part without a heading above it is named by where it starts, not "Part 2 of 4"
    second = r.describe([1])[0]
    opening = " ".join(plain.text[r.parts[1].start : r.parts[1].end].split()[:6])
    assert second["number"] is None and second["title"] == second["name"] == f"Text from «{opening}…»"


def test_what_was_read_is_named_once_under_the_answer_and_on_the_command_line():
    """A part of plain text has no section number and is named by where it starts; a later piece
    of a cut section by its heading and where it starts: the sources under an answer read those
    names (never "None." or "Part 2 of 4"); the command line keeps the index `--sections` picks by."""
    from triforce_core.cli.chat import _read_line
    from ui.render import sources_html

    plain = Document("\n\n".join(vocab_words(30, 7, 97, i) for i in range(10)) + "\n", "txt", "notes.txt")
    long_section = book([("Intro", 40, 7, 20, []), ("Long", 400, 20, 97, [])])
    read = reader(plain, max_part=100).describe([1]) + reader(long_section, max_part=100).describe([2])
    piece = read[1]["part"]
    assert read[1]["number"] == 2 and piece.startswith("2 of ")  # a section cut in pieces keeps its label
    shown = sources_html(read, [])
    plain_start = html.escape(read[0]["name"])
    assert plain_start.startswith("Text from «") and f"<li>{plain_start}</li>" in shown
    assert read[1]["name"].startswith("Long, from «") and f"<li>{html.escape(read[1]['name'])}</li>" in shown
    assert "None" not in shown and "Part " not in shown and " of " not in shown
    line = _read_line(read)
    assert line.endswith(f": {read[0]['name']}; 2 Long (part {piece})]") and "None" not in line, line


def test_pick_reads_whole_parts_best_first_within_the_budget_in_document_order():
    r = reader()
    q = "what follows " + vocab_words(4, 60, 97, 60)  # words of the last chapter ...
    q += " w50"  # ... and one of PageB's
    ranked = r.rank(q)
    assert ranked[0] == 4  # the chapter holding most of the words ranks first
    everything = r.pick(q, 10_000)
    assert everything == sorted(everything) and set(everything) == set(ranked)  # only parts sharing a word
    tight = r.pick(q, r.parts[4].tokens + 5)
    assert tight == [4]  # the best part whole; the next does not fit
    text = r.text(r.pick(q, 10_000))
    assert 0 <= text.index("[Section: PageB]\nPageB\n") < text.index("[Section: Last]\nLast\n")
    assert r.pick("nothing shared", 10_000) == []


def test_a_follow_up_keeps_the_read_while_its_best_part_is_in_it_and_makes_room_when_not():
    r = reader()
    budget = r.parts[2].tokens + r.parts[3].tokens + 4  # PageA and PageB fit, not Last as well
    first = r.pick(vocab_words(3, 30, 45, 30) + " " + vocab_words(3, 45, 60, 45), budget)
    assert first == [2, 3]
    # a question about PageA alone: the read stays as it was (the cached prefix is reused)
    assert r.pick(vocab_words(2, 30, 45, 31), budget, previous=first) == [2, 3]
    # a question about Last: its best part gets in, the kept part ranked lowest for it makes room
    moved = r.pick(vocab_words(4, 60, 97, 61), budget, previous=first)
    assert 4 in moved and len(moved) < 3


@pytest.fixture(scope="module")
def engine(chat_engine):
    return chat_engine


def config(max_new: int = 8) -> GenerationConfig:
    return GenerationConfig(speculation=SpeculationConfig(mode="triforce", max_new_tokens=max_new, ignore_eos=True,
                                                          gamma1=2, gamma2=4),
                            cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4))


def test_book_session_answers_exactly_as_a_session_over_what_it_read(engine):
    session = BookSession(engine, BOOK, reading_budget=300, config=config())
    q1 = vocab_words(3, 30, 45, 30)
    list(session.ask(q1))
    t1 = session.turns[-1]
    assert [s["title"] for s in t1.sections_read] == ["PageA"] or "PageA" in [s["title"] for s in t1.sections_read]
    plain = ChatSession(engine, session.reader.text(session.picked),
                        config=GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=8,
                                                                              ignore_eos=True)))
    list(plain.ask(q1))
    assert t1.token_ids == plain.turns[-1].token_ids  # greedy: exactly the target's answer over that read
    # a follow-up about the same page: the read is unchanged, only the new turn is prefilled
    q2 = vocab_words(2, 30, 45, 33)
    list(session.ask(q2))
    t2 = session.turns[-1]
    assert t2.sections_read == t1.sections_read
    assert t2.stats.reused_tokens >= t1.stats.prompt_tokens - 1 and t2.stats.prefill_tokens < 0.05 * engine.context_window
    list(plain.ask(q2))
    assert t2.token_ids == plain.turns[-1].token_ids


def _chat(pair, *args):
    return run_main(["chat", "--target", pair["target"], "--draft", pair["draft"], "--max-new-tokens", "6",
                     "--ignore-eos", "--budget", "32", "--chunk-size", "4", "--draft-window", "16", "--no-kv-cache", *args])


def test_cli_reads_a_book_beyond_the_window_by_its_relevant_sections(tiny_pair_dir, tmp_path):
    # word-level vocabulary: one token a word; the tiny target's window is 1,024 tokens
    chapters = [("Alpha", 300, 7, 37), ("Beta", 620, 37, 67), ("Gamma", 200, 67, 97)]
    path = tmp_path / "book.md"
    path.write_text("".join(f"# {t}\n{vocab_words(n, lo, hi, lo)}\n\n" for t, n, lo, hi in chapters))
    q_gamma, q_more = vocab_words(3, 67, 97, 1), vocab_words(2, 67, 97, 2)
    code, out, err = _chat(tiny_pair_dir, "--document", str(path), "--question", q_gamma, "--question", q_more, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["document"]["sections"] == "auto" and report["document"]["tokens"] > 1024
    first, second = report["turns"]
    assert [(s["number"], s["title"]) for s in first["sections_read"]] == [(3, "Gamma")]
    assert second["sections_read"] == first["sections_read"]  # kept: the cached read is reused
    assert second["stats"]["reused_tokens"] > 200 and second["stats"]["prefill_tokens"] < 0.05 * 1024
    # without --json the read goes to stderr, before the answer
    code, _out, err = _chat(tiny_pair_dir, "--document", str(path), "--question", q_gamma)
    assert code == 0 and "[read 1 section, about 2" in err and "3 Gamma]" in err
    # all: the whole book, refused with the numbers, before any prefill
    code, _out, err = _chat(tiny_pair_dir, "--document", str(path), "--sections", "all", "--question", q_gamma)
    assert code == 2 and "over the target's context window of 1,024" in err and "[prefilled" not in err
    code, _out, err = _chat(tiny_pair_dir, "--document", str(path), "--reading-budget", "10", "--question", q_gamma)
    assert code == 2 and "--reading-budget must be at least 64" in err


def test_cli_plain_text_is_cut_into_parts_and_ranked(tiny_pair_dir, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(vocab_words(60, 7 + 6 * i, 13 + 6 * i, i) for i in range(14)) + "\n")
    assert load_document(path, timeout_s=None).sections == ()
    q = vocab_words(3, 7 + 6 * 9, 13 + 6 * 9, 5)  # words of the tenth paragraph only
    code, out, err = _chat(tiny_pair_dir, "--document", str(path), "--sections", "auto", "--reading-budget", "256",
                            "--question", q, "--json")
    assert code == 0, err
    read = json.loads(out)["turns"][0]["sections_read"]
    assert len(read) == 1 and read[0]["number"] is None and read[0]["title"].startswith("Text from «w")
    text = path.read_text()
    assert read[0]["start"] <= text.index(vocab_words(60, 61, 67, 9)) < read[0]["end"]
