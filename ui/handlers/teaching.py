"""Teaching: the inspector (click a token), stepping through a generation round by round, and
the guided lesson.

A token's `data-tf="turn:segment"` reaches `on_pick` through a hidden text box the page's
script fills on click. Step mode submits the generation with a pause after each round
(`round_pauses`): the worker then waits for `on_step` between rounds, serving other users
meanwhile, and Stop still ends it. The lesson is a stepped answer whose pauses end by
themselves after LESSON_ROUND_S (`AnswerHandlers.run_turn`), in a tab of its own: the Lesson
button opens the page at `LESSON_QUERY`, whose load (`lesson_open`) gives that page a session of
its own, never saved, and starts it; `lesson_setup` keeps that tab's settings and sets its own,
`lesson_end` gives them back and counts which level produced what (`ui.narration.levels_summary`).
"""

from __future__ import annotations

import html
from typing import Callable

import gradio as gr

from triforce_core.serving.book import BookSession
from triforce_core.config import GenerationConfig
from triforce_core.decoding.events import ChunksSelected, Committed, Prefilled

from ..inspector import inspector_figure, inspector_html
from ..narration import levels_summary
from ..render import answer_label
from ..settings import slider_range
from ..state import AppContext, Lesson, UserState

# The lesson: the paper's three levels on the sample document, sampled, one round a second, in
# a tab of its own (`LESSON_QUERY`). Its question and settings are those SmolLM2 answered fluently
# (`fluency_problem`) over the sample for every seed tried, at the lowest temperature tried
# (`bench.lesson_search.pick`): docs/results.md, "The lesson's question".
LESSON_QUESTION = "How does inheritance work in Python classes?"
LESSON_SETTINGS = dict(mode="triforce", temperature=0.3, seed=1, lookup=False, repetition_penalty=1.2)
LESSON_ROUND_S = 1.0  # the lesson runs by itself: the next round after this many seconds
# The page address that opens the lesson (the Lesson button opens it in a new tab): that page's
# own session loads the sample and runs the lesson; the tab the button was pressed in is untouched.
LESSON_QUERY = ("lesson", "1")
# The controls the lesson sets (`lesson_setup`'s inputs and first outputs, in this order); all
# but the teaching view are given back as the user had them when it ends (`lesson_end`).
LESSON_CONTROLS = ("teaching", "stepmode", "mode", "temperature", "seed", "lookup", "repetition_penalty", "budget")
RESTORED = LESSON_CONTROLS[1:]  # the teaching view stays on: the lesson's answer keeps its struck-through drafts
# What `lesson_setup` and `lesson_end` return, in order ("question": the question it asks;
# "lesson": the lesson's words under the chat), and `on_pick`'s outputs.
LESSON_SETUP_OUTPUTS = (*LESSON_CONTROLS, "question", "lesson")
LESSON_END_OUTPUTS = (*RESTORED, "lesson")
PICK_OUTPUTS = ("inspector", "inspector_plot")
LESSON_INTRO = (
    "The lesson, in a tab of its own: the tab you opened it from keeps its document and conversation, and "
    "nothing of this tab is saved. The question «" + LESSON_QUESTION + "» over {document}, the paper's three "
    "levels (small draft → retrieval level → full target), sampled at temperature {temperature} (seed {seed}, "
    "repetition penalty {penalty}), one round a second by itself "
    "(Step: the next round at once; untick Step mode: run to the end; Stop: end it). "
    "The retrieval budget is {budget:,} tokens, about a quarter of the context ({context}), so the "
    "retrieval level reads only the chunks it selects (the map shows which). "
    "Each round, the small draft proposes a few tokens, the retrieval level (the target's weights over those "
    "chunks) keeps each with probability min(1, p/q) and replaces the first it rejects, and the full target "
    "checks what the retrieval level emitted the same way (p: the verifier's probability of the token, q: the "
    "proposer's). "
    "The small draft is the cheapest: a far smaller model over a short window of recent tokens. "
    "The retrieval level costs less than the full target: the same weights, but attention over {budget:,} "
    "tokens of cache instead of the whole context. "
    "The full target reads everything, once per round, to check several tokens in one forward. "
    "Each token of the answer has the colour of the level that produced it: green, a guess of the small draft "
    "that both checks kept; blue, the retrieval level's own token (drawn where it rejected a guess, or one more "
    "after the guesses it kept); red, the full target's own (drawn where it rejected a proposal, or its bonus "
    "token after a round it accepted whole); struck through, a proposal a level rejected. "
    "The inspector opens on the first rejection: the draw u against p/q, and the token drawn from the residual "
    "(what is left of p after removing what the proposer covered) in its place. When the answer ends, the "
    "counts of each colour are given here and this tab's settings come back (the teaching view stays on)."
)


# What a lesson's answer must be to read as text (the lesson's question and settings were picked
# by it: `python -m bench.lesson_search`, docs/results.md, "The lesson's question"): at least
# FLUENT_WORDS words, and no run of RUN_WORDS words that comes back RUN_TIMES times (a loop).
FLUENT_WORDS, RUN_WORDS, RUN_TIMES = 25, 6, 3


def words_of(text: str) -> list[str]:
    """The words of `text`, lower case, without the punctuation around them."""
    words = (w.strip(".,;:!?\"'()[]{}«»`*").lower() for w in text.split())
    return [w for w in words if w]


def repeated_run(text: str, run: int = RUN_WORDS) -> int:
    """How many times the most frequent run of `run` consecutive words occurs in `text`
    (overlapping runs count: a loop of one short phrase repeats every run inside it)."""
    words = words_of(text)
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - run + 1):
        key = tuple(words[i:i + run])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


def fluency_problem(text: str) -> str | None:
    """Why an answer does not read as text (too short, or looping), or None when it does."""
    n = len(words_of(text))
    if n < FLUENT_WORDS:
        return f"{n} words, under {FLUENT_WORDS}"
    times = repeated_run(text)
    if times >= RUN_TIMES:
        return f"a run of {RUN_WORDS} words repeated {times} times"
    return None


def lesson_context(user: UserState) -> int:
    """Tokens of context the lesson's question reads: the document, or for a book over the
    window the sections its question reads, up to the reading budget."""
    if isinstance(user.session, BookSession):
        return user.session.reading_budget
    return user.session.document_tokens


def lesson_budget(context: int, chunk_size: int) -> int:
    """About a quarter of the context, in whole steps of the budget slider (within its range),
    and at least the three chunks a retrieval budget holds: the retrieval level then drops
    most chunks."""
    low, high, step = (int(x) for x in slider_range("budget"))
    least = max(low, -(-3 * chunk_size // step) * step)
    return min(int(high), max(least, context // 4 // step * step))


def lesson_intro(user: UserState | None, budget: int, context: int) -> str:
    """The lesson's opening words; a model whose window is shorter than the sample (SmolLM2)
    reads the sample's sections most relevant to the question, as for any book."""
    book = user is not None and isinstance(user.session, BookSession)
    what = ("the sections of the sample document most relevant to it (the whole is over this model's window)"
            if book else "the sample document")
    size = f"up to {context:,} tokens" if book else f"{context:,} tokens"
    s = LESSON_SETTINGS
    return LESSON_INTRO.format(document=what, budget=budget, context=size, temperature=s["temperature"],
                               seed=s["seed"], penalty=s["repetition_penalty"])


def round_pauses(config: GenerationConfig, eos_ids) -> Callable[[object], bool]:
    """The pause test for a stepped generation: after the prefill (its selection, when the mode
    retrieves) and after each round's `Committed`, except the last one (nothing follows it)."""
    spec = config.speculation
    first = ChunksSelected if spec.uses_retrieval else Prefilled
    state = {"tokens": 0, "started": False}
    stops = frozenset() if spec.ignore_eos else frozenset(eos_ids)

    def pause_after(item) -> bool:
        if isinstance(item, first) and not state["started"]:
            state["started"] = True
            return True
        if isinstance(item, Committed):
            state["tokens"] += len(item.token_ids)
            return state["tokens"] < spec.max_new_tokens and not any(t in stops for t in item.token_ids)
        return False

    return pause_after


def parse_pick(key: str) -> tuple[int, int] | None:
    """'3:17@1712345' (turn, segment, a nonce so a second click on a token fires again)."""
    try:
        turn, seg = (key or "").split("@")[0].split(":")
        return int(turn), int(seg)
    except ValueError:
        return None


class TeachingHandlers:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def on_pick(self, key, user: UserState | None):
        """The inspector for the clicked token."""
        decode = self.ctx.engine_of(user).detokenize
        picked = parse_pick(key)
        if user is None or picked is None:
            return inspector_html(None, decode), inspector_figure(None, decode)
        turn, i = picked
        if not (0 <= turn < len(user.answers)) or not (0 <= i < len(user.answers[turn].trace.segments)):
            return inspector_html(None, decode), inspector_figure(None, decode)
        answer = user.answers[turn]
        seg = answer.trace.segments[i]
        label = answer_label(turn + 1, answer.trace.text)
        return inspector_html(seg, decode, answer.inspected, label), inspector_figure(seg, decode, label)

    def on_step(self, user: UserState | None):
        if user is None or user.job is None or user.job.finished.is_set():
            gr.Info("Nothing to step: tick Step mode, then ask a question.")
            return
        user.job.step()

    def on_step_mode(self, user: UserState | None, on: bool):
        if user is not None and user.job is not None:
            user.job.set_stepping(on)

    def lesson_open(self, user: UserState | None, request: gr.Request):
        """A page opened at the lesson's address (`LESSON_QUERY`, the Lesson button's new tab): a
        session of its own, never saved (`keep` False), and the lesson's start (True to the gate
        whose change runs it); any other page: nothing. Outputs: the user, the gate."""
        params = getattr(request, "query_params", None) or {}
        key, value = LESSON_QUERY
        if params.get(key) != value:
            return gr.skip(), gr.skip()
        self.lesson_possible(user)
        user = user or self.ctx.new_user()
        user.keep = False
        return user, True

    def lesson_possible(self, user: UserState | None) -> None:
        """Raise the one-line reason this app cannot run the lesson, if there is one."""
        if self.ctx.remote:
            raise gr.Error("The lesson runs round by round in this process: not under a remote engine (--engine).")
        if self.ctx.engine_of(user).draft is None:
            raise gr.Error("The lesson shows the paper's three levels: it needs a small draft model (--draft).")

    def on_action(self, user: UserState | None):
        """The user's next action (a question, a document, clearing): the lesson's words go once
        its answer is over (they described it); while it runs they stay."""
        if user is not None and user.lesson is not None:
            return gr.skip()
        return ""

    def lesson_setup(self, user: UserState | None, *values):
        """After the sample is loaded: the lesson's settings (`LESSON_CONTROLS`, whose current
        `values` it keeps to give back), its budget, teaching view and step mode on, the
        question to ask, and its opening words; the inspector will open on the first rejection.
        `values`: the `LESSON_CONTROLS` as the user has them, then the chunk size."""
        self.lesson_possible(user)
        if user is None or user.document is None:
            raise gr.Error("The lesson needs the sample document: it could not be loaded.")
        *current, chunk_size = values
        if user.lesson is None or user.lesson.asked:  # a lesson set up but never asked keeps what it saved
            user.lesson = Lesson(dict(zip(LESSON_CONTROLS, current)))
        user.auto_inspect = True
        user.keep = False  # the lesson's session is never saved
        context = lesson_context(user)
        budget = lesson_budget(context, int(chunk_size))
        values = {"teaching": True, "stepmode": True, **LESSON_SETTINGS, "budget": budget}
        return (*(gr.update(value=values[name]) for name in LESSON_CONTROLS), LESSON_QUESTION,
                f'<div class="tf-narration tf-lesson-words">{html.escape(lesson_intro(user, budget, context))}</div>')

    def lesson_end(self, user: UserState | None):
        """The lesson's answer has ended (finished, stopped or failed): the settings it changed
        come back as the user had them (`RESTORED`), with a last line under its opening words."""
        if user is None or user.lesson is None or not user.lesson.asked:
            return (gr.skip(),) * len(LESSON_END_OUTPUTS)
        saved, user.lesson = user.lesson.saved, None
        user.auto_inspect = False
        summary = levels_summary(user.answers[-1].trace) + " " if user.answers else ""
        done = ('<div class="tf-narration tf-lesson-words">' + html.escape(
                summary + "The lesson is over: this tab's settings are back (mode, temperature, seed, repetition "
                "penalty, context lookup, budget, step mode); the teaching view stays on, so its answer keeps its "
                "struck-through drafts. Click any token to inspect it. This tab's conversation is not saved; "
                "the tab you came from is as you left it.") + "</div>")
        return (*(gr.update(value=saved[name]) for name in RESTORED), done)
