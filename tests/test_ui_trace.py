"""The app's pure parts: events -> answer trace -> HTML and figure data."""

from __future__ import annotations

import pytest

from tests.helpers.models import words
from triforce_core.config import CHAT_MAX_NEW_TOKENS, DEFAULT_MODE, CacheConfig, ConfigError, GenerationConfig, SpeculationConfig
from triforce_core.decoding.events import ChunksSelected, Committed, Drafted, Verified
from triforce_core.serving.session import ChatSession
from ui import AnswerTrace, context_gauge_html, segments_html
from ui.figures import MAP_MAX_BARS, acceptance_figure, retrieval_map_figure, speed_figure, top_passages

NAMES = {i: f"<{i}>" for i in range(100)}


def decode(ids):
    return "".join(NAMES[i] for i in ids)


def triforce_round():
    """One triforce round, gamma1 = 2, gamma2 = 4.

    The small draft proposes (10, 11): the retrieval level keeps 10, rejects 11, puts 20.
    It proposes (12, 13): both kept, bonus 21 (cut: the speculation is 10 20 12 13).
    The target accepts 10 20, rejects 12 13 and puts 30. Committed: 10 20 30.
    """
    return [
        Drafted("draft", (10, 11)),
        Verified("retrieval", 1, (11,), 20, proposed=2),
        Drafted("draft", (12, 13)),
        Verified("retrieval", 2, (), None, proposed=2, bonus_id=21),
        Verified("target", 2, (12, 13), 30, proposed=4),
        Committed((10, 20, 30), ("draft", "retrieval", "target"), "<10><20><30>"),
    ]


def test_rejected_drafts_are_placed_where_they_happened():
    trace = AnswerTrace(decode)
    for ev in triforce_round():
        trace.push(ev)
    kinds = [(s.kind, s.text, s.level) for s in trace.segments]
    assert kinds == [
        ("round", "", ""),
        ("token", "<10>", "draft"),
        ("rejected", "<11>", "draft"),  # rejected by the retrieval level at offset 1
        ("token", "<20>", "retrieval"),
        ("rejected", "<12>", "draft"),  # the target's rejected tail at offset 2
        ("rejected", "<13>", "draft"),
        ("token", "<30>", "target"),
    ]
    assert trace.token_ids == [10, 20, 30] and trace.levels == ["draft", "retrieval", "target"]
    # each verifier's first rejection names the token it drew in its place; the tail after it, none
    replaced = [(s.text, s.replaced_by) for s in trace.segments if s.kind == "rejected"]
    assert replaced == [("<11>", 20), ("<12>", 30), ("<13>", -1)]
    r = trace.rounds[0]
    assert r.committed == 3 and r.proposed == {"retrieval": 4, "target": 4} and r.accepted == {"retrieval": 3, "target": 2}
    assert trace.acceptance() == {"retrieval": 0.75, "target": 0.5}


def test_the_inspector_names_the_replacement_drawn_from_the_residual():
    from triforce_core.decoding.events import TokenCheck
    from ui.inspector import inspector_html
    from ui.trace import Segment

    check = TokenCheck(11, "draft", "retrieval", q=0.6, p=0.1, u=0.42, accepted=False, p_top=((20, 0.5), (11, 0.1)),
                       q_top=((11, 0.6),), residual_top=((20, 0.8), (12, 0.2)))
    seg = Segment("rejected", "<11>", "draft", "", 11, (check,), round=1, rejected_by="retrieval", replaced_by=20)
    text = inspector_html(seg, decode)
    assert "the replacement «&lt;20&gt;» was drawn from the residual" in text and "residual probability 0.8000" in text
    unnamed = inspector_html(Segment("rejected", "<11>", "draft", "", 11, (check,), round=1), decode)
    assert "the replacement was drawn from the residual" in unnamed and "«&lt;20&gt;»" not in unnamed


def test_the_table_of_contents_is_a_tree():
    from ui.views import toc_label

    top, sub, subsub = toc_label(1, "Classes", 1, 2048), toc_label(2, "Scopes", 2, 512), toc_label(3, "Names", 3, 64)
    assert top == "Classes · 2,048 tokens"
    assert sub == "\u2003└ Scopes · 512 tokens" and subsub == "\u2003\u2003\u2003└ Names · 64 tokens"
    # the book's own numbering, never the index: 7.1 stays 7.1 though it is the eighth section
    assert toc_label(7, "7. Reference", 1, 900) == "7. Reference · 900 tokens"
    assert toc_label(8, "7.1 Hash functions", 2, 300) == "\u2003└ 7.1 Hash functions · 300 tokens"
    # each level sits further in than its parent (em spaces: HTML keeps them)
    assert [len(x) - len(x.lstrip("\u2003")) for x in (top, sub, subsub)] == [0, 1, 3]


def test_teaching_view_shows_rejections_and_rounds_only_when_asked():
    trace = AnswerTrace(decode)
    for ev in triforce_round() * 2:
        trace.push(ev)
    plain = segments_html(trace.segments)
    teach = segments_html(trace.segments, teaching=True)
    assert plain.count("<span") == 6 and "<s " not in plain and "tf-round" not in plain
    assert teach.count("<s ") == 6 and teach.count("tf-round") == 2
    assert 'class="tf-rej tf-draft"' in teach and "&lt;11&gt;" in teach  # text is escaped
    assert 'title="round 2: the target accepted 2 of 4 proposed tokens"' in teach


def test_single_level_modes_and_autoregressive():
    trace = AnswerTrace(decode)
    trace.push(Drafted("retrieval", (5, 6, 7)))  # retrieval mode: the target verifies these
    trace.push(Verified("target", 1, (6, 7), 8, proposed=3))
    trace.push(Committed((5, 8), ("retrieval", "target")))
    trace.push(Committed((9,), ("target",)))  # autoregressive round: nothing proposed
    seq = [(s.kind, s.text) for s in trace.segments if s.kind != "round"]
    assert seq == [("token", "<5>"), ("rejected", "<6>"), ("rejected", "<7>"), ("token", "<8>"), ("token", "<9>")]
    assert [s.level for s in trace.segments if s.kind == "rejected"] == ["retrieval", "retrieval"]
    assert len(trace.rounds) == 2 and trace.mean_accepted() == 1.5


def test_trace_of_a_real_generation_matches_its_result(chat_engine):
    cfg = GenerationConfig(
        speculation=SpeculationConfig(mode="triforce", max_new_tokens=40, ignore_eos=True, gamma1=2, gamma2=4),
        cache=CacheConfig(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, refresh_every=16),
    )
    prompt = chat_engine.encode(words(200, 3))
    trace = AnswerTrace(chat_engine.detokenize)
    for ev in chat_engine.generate(prompt, cfg):
        trace.push(ev)
    result = chat_engine.run(prompt, cfg)
    s = trace.stats
    assert trace.token_ids == result.token_ids and trace.levels == result.levels
    assert sum(r.committed for r in trace.rounds) == s.new_tokens == 40 and len(trace.rounds) == s.rounds
    assert trace.acceptance() == pytest.approx(s.acceptance)
    assert len([x for x in trace.segments if x.kind == "token"]) == 40
    rejected = sum(1 for x in trace.segments if x.kind == "rejected")
    assert rejected > 0  # a 2%-perturbed draft disagrees sometimes
    assert trace.selections and trace.selections[0].step == 0


def test_retrieval_map_has_one_bar_per_chunk_with_its_text():
    sel = ChunksSelected(0, 4, ((0, 4), (8, 12), (40, 44)), (6, 3, 6), context_tokens=44, budget=12, heads_total=6)
    fig = retrieval_map_figure(sel, lambda a, b: (f"page {a // 8 + 1}", f"text {a}-{b}"), document_span=(0, 40))
    bar = fig.data[0]
    assert list(bar.x) == [2, 10, 42] and list(bar.y) == [1.0, 0.5, 1.0] and list(bar.width) == [4, 4, 4]
    assert "page 2" in bar.hovertext[1] and "«text 8-12»" in bar.hovertext[1] and "3 of 6 heads" in bar.hovertext[1]
    assert "3 chunks of 4 tokens, budget 12" in fig.layout.title.text
    assert fig.layout.shapes  # the document's extent
    assert "No retrieval selection" in retrieval_map_figure(None).layout.annotations[0].text


def test_retrieval_map_at_book_length_is_binned():
    # 64K tokens, every other 8-token chunk chosen: 4,096 chunks into at most MAP_MAX_BARS bars.
    spans = tuple((a, a + 8) for a in range(0, 65536, 16))
    counts = tuple(1 + (i % 16) for i in range(len(spans)))
    sel = ChunksSelected(0, 8, spans, counts, context_tokens=65536, budget=4096, heads_total=16)
    calls = []

    def label(a, b):
        calls.append((a, b))
        return f"page {a // 1000 + 1}", f"text {a}-{b}"

    fig = retrieval_map_figure(sel, label)
    bar = fig.data[0]
    assert len(bar.x) == MAP_MAX_BARS and len(calls) == MAP_MAX_BARS
    assert all(w == 64 - 8 for w in bar.width)  # bins of 64 tokens: chunks at 0 and 16, 32, 48
    assert list(bar.y[:2]) == [4 / 16, 8 / 16]  # each bin's most chosen chunk
    assert "4 chunks chosen here, the most by 4 of 16 heads" in bar.hovertext[0]
    assert "4096 chunks of 8 tokens, budget 4096, shown in 1024 bins" in fig.layout.title.text
    assert sum(len(h) for h in bar.hovertext) < 200_000


def test_most_read_passages_skip_the_sink_and_what_is_not_the_document():
    sel = ChunksSelected(  # budget 24, chunk 4: the recent tokens are the last 4
        0, 4, ((0, 4), (8, 12), (16, 20), (24, 28), (28, 32), (40, 44)), (6, 2, 5, 5, 6, 6),
        context_tokens=44, budget=24, heads_total=6,
    )
    label = lambda a, b: (f"line {a}", f"words {a} to {b}")  # noqa: E731
    top = top_passages(sel, label, document_span=(0, 32), k=2)
    assert top == [("line 28", "words 20 to 32", 1.0), ("line 16", "words 8 to 28", 5 / 6)]
    assert [w for w, _t, _s in top_passages(sel, label, document_span=(0, 44), k=9)] == [
        "line 28", "line 16", "line 24", "line 8"]  # never the sink (0) nor the recent tokens (40)
    assert top_passages(None, label, (0, 32)) == [] and top_passages(sel, label, None) == []


def test_acceptance_and_speed_figures():
    trace = AnswerTrace(decode)
    for ev in triforce_round() * 3:
        trace.push(ev)
    fig = acceptance_figure(trace.rounds, smooth=2)
    names = [t.name for t in fig.data]
    assert names == ["tokens per round", "lookup / small draft accepted by retrieval", "proposals accepted by target"]
    assert list(fig.data[2].y) == [0.5, 0.5, 0.5] and list(fig.data[0].y) == [3, 3, 3]
    speed = speed_figure([("this answer", 40.0), ("autoregressive", 10.0)])
    assert list(speed.data[0].x) == [40.0, 10.0]


def test_context_gauge():
    fits = context_gauge_html(1000, 100, 16384, 4096)
    assert "1,000" in fits and "retrieval budget <b>4,096</b>" in fits and "tf-over" not in fits
    assert "whole context fits the retrieval budget" in fits
    over = context_gauge_html(16000, 1000, 16384, 4096)
    assert "tf-over" in over and "does not fit" in over and "reads 24%" in over
    assert "caches in memory" not in over
    held = context_gauge_html(65000, 100, 65536, 4096, cache_bytes=551_000_000)
    assert "caches in memory <b>551 MB</b>" in held


def test_the_gauge_of_a_mode_without_a_retrieval_level_names_no_budget():
    """Mode lookup (the default), draft or autoregressive reads the whole context each step: the
    gauge must not say the retrieval level reads a share of it, nor draw its budget."""
    from ui.settings import retrieval_budget

    assert [retrieval_budget(4096, m) for m in ("triforce", "retrieval", "draft", "lookup", "autoregressive")] == [
        4096, 4096, None, None, None]
    none = context_gauge_html(16000, 1000, 65536, retrieval_budget(4096, "lookup"))
    assert "no retrieval level in this mode" in none and "16,000" in none
    assert "retrieval level reads" not in none and "retrieval budget" not in none and "tf-gauge-budget" not in none
    assert "reads 24%" in context_gauge_html(16000, 1000, 65536, retrieval_budget(4096, "triforce"))


def test_settings_are_validated_with_clear_messages():
    from ui.settings import Settings, settings_from

    assert settings_from({"mode": "draft", "budget": 256, "seed": 3.0}).config().sampling.seed == 3
    with pytest.raises(ConfigError, match="budget"):
        settings_from({"budget": 8, "chunk_size": 8})
    with pytest.raises(ConfigError, match="mode"):
        settings_from({"mode": "fast"})
    # the engine's defaults, with a chat answer's limit
    assert Settings().config() == GenerationConfig(
        speculation=SpeculationConfig(mode=DEFAULT_MODE, max_new_tokens=CHAT_MAX_NEW_TOKENS), cache=CacheConfig()
    )


def test_chunk_labels_point_into_the_document(chat_engine):
    from triforce_core.documents import Document, Section
    from ui.state import UserState
    from ui.views import chunk_labeler, document_span

    text = words(60, 1) + "\n" + words(60, 2)
    doc = Document(text, "txt", "d.txt", (Section(0, "page 1"), Section(len(words(60, 1)) + 1, "page 2")))
    user = UserState(ChatSession(chat_engine, doc), document=doc)
    user.spans, user.doc_first = user.session.token_char_spans("w9 w10")
    start, end = document_span(user)
    assert start == user.doc_first == 1 and end - start == 120  # "w4 " opens the user message
    label = chunk_labeler(user)
    where, snippet = label(start, start + 3)
    assert where == "page 1" and snippet == " ".join(text.split()[:3])
    assert label(start + 60, start + 62)[0] == "page 2"
    assert label(0, 1) == ("chat template / question", "")
    assert label(10_000, 10_004) == ("the answer so far", "")


def test_an_answer_lists_its_sources_escaped():
    from ui.render import sources_html, transcript_html

    read = [{"number": 16, "title": "What Is <Ownership>?", "part": None}, {"number": 17, "title": "References", "part": "2 of 3"}]
    cited = [{"section": "Section 16: What Is <Ownership>?", "share": 0.34, "text": "Each value has an <owner>"}]
    html_ = sources_html(read, cited)
    assert "2 sections read" in html_ and "1 most-read passage" in html_
    assert "16. What Is &lt;Ownership&gt;?" in html_ and "(part 2 of 3)" in html_
    assert "34% of heads" in html_ and "&lt;owner&gt;" in html_ and "<owner>" not in html_
    assert sources_html(None, []) == ""  # a plain conversation whose answer neither read nor quoted: no block
    quoted = sources_html(None, [{"section": None, "share": 0.4, "text": "a <quote>", "kind": "quoted"}])
    assert "1 quoted passage" in quoted and "Quoted in the answer" in quoted and "40% of the answer" in quoted
    page = transcript_html([("Q?", "answer", "lookup · 12 tokens", html_), ("Q2?", "", "")])
    assert page.count("tf-sources") == 1 and page.index("tf-sources") > page.index("lookup · 12 tokens")
