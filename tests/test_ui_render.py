"""Answers as the page shows them (ui/answer_html.py, ui.views.transcript): Markdown whose text is
the answer's, each character coloured by the level of its token, one `tf-tok` per token, words
whole; raw HTML in an answer shown as text; the teaching view's rounds under the answer; copy
buttons on finished answers."""

from __future__ import annotations

import html
from html.parser import HTMLParser

from tests.helpers.models import words
from triforce_core.decoding.events import Committed
from triforce_core.serving.session import ChatSession
from ui import AnswerTrace
from ui.answer_html import answer_body_html, copy_buttons, plain_html, rounds_html
from ui.render import transcript_html
from ui.state import Answer

LEVELS = ("lookup", "draft", "retrieval", "target")
TOKEN_CLASSES = ("tf-tok", "tf-tok-more")


def trace_of(pieces: list[str], levels: list[str] | None = None, per_round: int = 3,
             commit: int | None = None) -> AnswerTrace:
    """An answer of these token texts (the first `commit` of them), committed `per_round` at a
    time by the real trace."""
    vocab = {i: p for i, p in enumerate(pieces)}
    trace = AnswerTrace(lambda ids: "".join(vocab[i] for i in ids))
    levels = levels or [LEVELS[i % 4] for i in range(len(pieces))]
    n = len(pieces) if commit is None else commit
    for start in range(0, n, per_round):
        ids = tuple(range(start, min(n, start + per_round)))
        trace.push(Committed(ids, tuple(levels[i] for i in ids), "".join(pieces[i] for i in ids)))
    return trace


class Spans(HTMLParser):
    """The token spans of a rendering (class, level, data-tf, text) and the rendering without
    them (every other tag and all text as written)."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.spans: list[dict] = []
        self.plain: list[str] = []
        self._stack: list[dict | None] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "span" and cls and cls[0] in TOKEN_CLASSES:
            span = {"class": cls[0], "level": cls[1][3:], "tf": a.get("data-tf"), "title": a.get("title"), "text": ""}
            self.spans.append(span)
            self._stack.append(span)
            return
        if tag == "span":
            self._stack.append(None)
        self.plain.append(self.get_starttag_text())

    def handle_startendtag(self, tag, attrs):
        self.plain.append(self.get_starttag_text())

    def handle_endtag(self, tag):
        if tag == "span" and self._stack and self._stack.pop() is not None:
            return
        self.plain.append(f"</{tag}>")

    def handle_data(self, data):
        for span in self._stack:
            if span is not None:
                span["text"] += data
        self.plain.append(data)

    def handle_entityref(self, name):
        self.handle_data(f"&{name};")

    def handle_charref(self, name):
        self.handle_data(f"&#{name};")


def parsed(markup: str) -> Spans:
    p = Spans()
    p.feed(markup)
    p.close()
    return p


def body_of(pieces: list[str], **kw) -> tuple[str, AnswerTrace, Spans]:
    trace = trace_of(pieces, **kw)
    markup = answer_body_html(trace.segments, key=7)
    assert markup.startswith('<div class="tf-answer-body">') and markup.endswith("</div>")
    return markup, trace, parsed(markup[len('<div class="tf-answer-body">'):-len("</div>")])


def token_indices(trace: AnswerTrace) -> list[int]:
    return [i for i, s in enumerate(trace.segments) if s.kind == "token"]


TRICKY = [
    "In", "her", "its", " from", " **bo", "ld** and", " `in", "line`", " code", ":\n\n",
    "```py", "thon\n", "def f(a):\n", "    return a < 2 <script>alert(1)</script>\n", "```\n\n",
    "- one\n", "- tw", "o\n\n",
    "| x | y |\n", "|---|---|\n", "| 1 | *2* |\n\n",
    "<script>", "alert(2)", "</script> & more\n\n",
    "```\n", "unfinished = ", "True",
]


def test_the_coloured_answer_is_the_markdown_rendering_with_spans_added():
    """Strip the token spans and what is left is markdown-it's rendering of the answer's text,
    character for character: the colours add no text, drop none and move none."""
    text = "".join(TRICKY)
    markup, trace, p = body_of(TRICKY)
    assert "".join(p.plain) == plain_html(text)
    assert trace.text == text


def test_one_tf_tok_per_token_in_order_coloured_by_its_level():
    markup, trace, p = body_of(TRICKY)
    firsts = [s for s in p.spans if s["class"] == "tf-tok"]
    # one first piece per token, in order, each with its token's level and inspector key
    assert [s["tf"] for s in firsts] == [f"7:{i}" for i in token_indices(trace)]
    tokens = [trace.segments[i] for i in token_indices(trace)]
    assert [s["level"] for s in firsts] == [t.level for t in tokens]
    # every piece's text is a part of its own token's text (Markdown marks dropped)
    by_key = {f"7:{i}": trace.segments[i] for i in token_indices(trace)}
    for span in p.spans:
        seg = by_key[span["tf"]]
        assert span["level"] == seg.level
        shown = html.unescape(span["text"])
        assert all(ch in seg.text for ch in shown), (shown, seg.text)
    # a later piece only follows the first piece of the same token
    seen = set()
    for span in p.spans:
        assert (span["class"] == "tf-tok") == (span["tf"] not in seen), span
        seen.add(span["tf"])


def test_a_word_of_three_tokens_reads_as_one_word():
    markup, trace, p = body_of(["In", "her", "its", " words"])
    assert "".join(p.plain) == "<p>Inherits words</p>\n"
    assert [s["text"] for s in p.spans] == ["In", "her", "its", " words"]
    assert markup.count("</span><span") == 3  # the three pieces touch: nothing between them


def test_bold_split_across_tokens_keeps_each_characters_colour():
    markup, trace, p = body_of(["Say", " **bo", "ld**", " now"], levels=["draft", "target", "lookup", "draft"])
    assert "<strong>" in markup
    pieces = [(s["text"], s["level"], s["class"]) for s in p.spans]
    # " **bo": its space before <strong>, its "bo" inside; "ld**": "ld" inside
    assert pieces == [("Say", "draft", "tf-tok"), (" ", "target", "tf-tok"), ("bo", "target", "tf-tok-more"),
                      ("ld", "lookup", "tf-tok"), (" now", "draft", "tf-tok")]


def test_markdown_blocks_inline_code_lists_tables_and_code_fences():
    markup, _, _ = body_of(TRICKY)
    assert '<pre><code class="language-python">' in markup
    assert markup.count('<div class="tf-code">') == 2 and markup.count('class="tf-copy-code"') == 2
    assert "<code>" in markup and "<ul>" in markup and markup.count("<li>") == 2
    assert "<table>" in markup and "<th>" in markup and "<em>" in markup
    # the unfinished fence (an answer still streaming) is a code block to the end
    assert markup.endswith("</code></pre></div>\n</div>")
    assert "unfinished = " in markup


def test_raw_html_in_an_answer_is_text_never_markup():
    markup, _, p = body_of(TRICKY)
    assert "<script" not in markup.lower() and "&lt;script&gt;" in markup
    assert "alert(2)" in markup and "&amp; more" in markup


def test_links_are_inert_for_the_page_and_images_are_not_fetched():
    markup, _, _ = body_of(["See [the docs](https://example.com/x) and", " [bad](javascript:alert(1))",
                            " ![a chart](https://example.com/c.png)"])
    assert 'href="https://example.com/x"' in markup and 'rel="noopener nofollow noreferrer"' in markup
    assert 'target="_blank"' in markup
    assert "javascript:" not in markup.split("[bad]")[0] and 'href="javascript' not in markup
    assert "<img" not in markup and "a chart" in markup


def test_an_unmatched_character_does_not_shift_the_next_blocks_colours():
    """An entity's character is not in the source: the next paragraph's colours start on its own line."""
    pieces = ["&copy;" * 5, " tail\n\n", "Next", " paragraph"]
    markup, trace, p = body_of(pieces, levels=["draft", "draft", "target", "lookup"])
    assert [(s["text"], s["level"]) for s in p.spans if s["class"] == "tf-tok" and s["text"]][-2:] == [
        ("Next", "target"), (" paragraph", "lookup")]


def test_tokens_without_a_visible_character_keep_an_empty_span():
    markup, trace, p = body_of(["Hi", "\n\n", "**", "there", "**"])
    firsts = [s for s in p.spans if s["class"] == "tf-tok"]
    assert len(firsts) == 5 and [s["text"] for s in firsts] == ["Hi", "", "", "there", ""]


def test_an_answer_with_no_token_yet_is_empty():
    assert answer_body_html([]) == "" and rounds_html([]) == ""


def test_the_rounds_view_keeps_rejected_drafts_and_round_marks_under_the_answer():
    trace = trace_of(["a", "b", "c", "d"], per_round=2)
    markup = rounds_html(trace.segments, key=2)
    assert markup.startswith('<details class="tf-answer-rounds"><summary>Rounds and rejected drafts</summary>')
    assert markup.count('class="tf-round"') == 2
    assert 'class="tf-tok' not in markup and markup.count('class="tf-seg tf-') == 4  # not the answer's tokens
    assert 'data-tf="2:1"' in markup


def test_copy_buttons_carry_the_markdown_escaped():
    markup = copy_buttons("# Title\n<script>x</script> & `code`")
    assert "Copy Markdown" in markup and "Copy text" in markup
    assert '<template class="tf-md"># Title\n&lt;script&gt;x&lt;/script&gt; &amp; `code`</template>' in markup


def test_transcript_places_the_actions_after_the_footer():
    page = transcript_html([("Q?", "answer", "lookup · 12 tokens", "<details class=tf-sources></details>",
                             "<button>Continue</button>"), ("Q2?", "", "")])
    assert page.count('<div class="tf-actions"><button>Continue</button></div>') == 1
    assert page.index("lookup · 12 tokens") < page.index("tf-actions") < page.index("tf-sources")


def test_the_transcript_renders_an_answer_again_only_when_it_grew():
    from ui.views import answer_html

    pieces = ["Hello", " **wor", "ld**", "!"]
    trace = trace_of(pieces, per_round=3, commit=3)
    answer = Answer(trace)
    first = answer_html(answer, 0, False)
    assert answer_html(answer, 0, False) is first  # the same answer: the cached rendering
    assert "tf-answer-rounds" in answer_html(answer, 0, True) and "tf-answer-rounds" not in first
    trace.push(Committed((3,), ("target",), "!"))  # the answer grows: rendered anew
    grown = answer_html(answer, 0, False)
    assert grown is not first and grown.count('class="tf-tok ') == 4 and "!" in grown


def test_views_transcript_has_copy_buttons_only_on_finished_answers(chat_engine):
    from triforce_core.config import GenerationConfig, SpeculationConfig
    from ui.state import UserState
    from ui.views import transcript

    user = UserState(ChatSession(chat_engine, words(40, 5)))
    cfg = GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=6, ignore_eos=True))
    for question in ("w7 w8?", "w9 w10?"):
        trace = AnswerTrace(chat_engine.detokenize)
        for ev in user.session.ask(question, cfg):
            trace.push(ev)
        user.answers.append(Answer(trace))
    user.answers[0].footer = "autoregressive · 6 tokens"  # the first has ended, the second streams
    page = transcript(user, False)
    assert page.count('class="tf-actions"') == 1 and page.count('class="tf-copy-md"') == 1
    assert page.index("tf-copy-md") < page.index("w9 w10?")
    source = page.split('<template class="tf-md">')[1].split("</template>")[0]
    assert html.unescape(source) == user.session.turns[0].answer == user.answers[0].trace.text
    assert page.count('class="tf-tok ') == 12  # one per token of both answers
