"""Teaching: the inspector (click a token), stepping through a generation round by round, and
the guided lesson.

A token's `data-tf="turn:segment"` reaches `on_pick` through a hidden text box the page's
script fills on click. Step mode submits the generation with a pause after each round
(`round_pauses`): the worker then waits for `on_step` between rounds, serving other users
meanwhile, and Stop still ends it. The lesson is a stepped answer whose pauses end by
themselves after LESSON_ROUND_S (`AnswerHandlers.run_turn`): `lesson_setup` keeps the user's
settings and sets its own, `lesson_end` gives them back.
"""

from __future__ import annotations

import html
from typing import Callable

import gradio as gr

from triforce_core.serving.book import BookSession
from triforce_core.config import GenerationConfig
from triforce_core.decoding.events import ChunksSelected, Committed, Prefilled

from ..inspector import inspector_figure, inspector_html
from ..settings import slider_range
from ..state import AppContext, Lesson, UserState

# The lesson: the paper's three levels on the sample document, sampled, one round a second.
LESSON_QUESTION = "What is a class?"
LESSON_SETTINGS = dict(mode="triforce", temperature=0.8, seed=3, lookup=False)
LESSON_ROUND_S = 1.0  # the lesson runs by itself: the next round after this many seconds
# The controls the lesson sets (`lesson_setup`'s inputs and first outputs, in this order); all
# but the teaching view are given back as the user had them when it ends (`lesson_end`).
LESSON_CONTROLS = ("teaching", "stepmode", "mode", "temperature", "seed", "lookup", "budget")
RESTORED = LESSON_CONTROLS[1:]  # the teaching view stays on: the lesson's answer keeps its struck-through drafts
# What `lesson_setup` and `lesson_end` return, in order ("question": the question it asks;
# "lesson": the lesson's words under the chat), and `on_pick`'s outputs.
LESSON_SETUP_OUTPUTS = (*LESSON_CONTROLS, "question", "lesson")
LESSON_END_OUTPUTS = (*RESTORED, "lesson")
PICK_OUTPUTS = ("inspector", "inspector_plot")
LESSON_INTRO = (
    "The lesson: the question «" + LESSON_QUESTION + "» over {document}, the paper's three levels "
    "(small draft → retrieval level → full target), sampled at temperature 0.8, one round a second by itself "
    "(Step: the next round at once; untick Step mode: run to the end; Stop: end it). "
    "The retrieval budget is {budget:,} tokens, about a quarter of the context ({context}), so the "
    "retrieval level reads only the chunks it selects (the map shows which). "
    "Each round, the small draft proposes a few tokens, the retrieval level (the target's weights over those "
    "chunks) keeps each with probability min(1, p/q) and replaces the first it rejects, and the full target "
    "checks what the retrieval level emitted the same way. "
    "The small draft is the cheapest: a far smaller model over a short window of recent tokens. "
    "The retrieval level costs less than the full target: the same weights, but attention over {budget:,} "
    "tokens of cache instead of the whole context. "
    "The full target reads everything, once per round, to check several tokens in one forward. "
    "The inspector opens on the first rejection: the draw u against p/q, and the token drawn from the residual "
    "in its place. When the answer ends, your settings come back (the teaching view stays on)."
)


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
    return LESSON_INTRO.format(document=what, budget=budget, context=size)


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
        return inspector_html(seg, decode, answer.inspected), inspector_figure(seg, decode)

    def on_step(self, user: UserState | None):
        if user is None or user.job is None or user.job.finished.is_set():
            gr.Info("Nothing to step: tick Step mode, then ask a question.")
            return
        user.job.step()

    def on_step_mode(self, user: UserState | None, on: bool):
        if user is not None and user.job is not None:
            user.job.set_stepping(on)

    def lesson_setup(self, user: UserState | None, *values):
        """After the sample is loaded: the lesson's settings (`LESSON_CONTROLS`, whose current
        `values` it keeps to give back), its budget, teaching view and step mode on, the
        question to ask, and its opening words; the inspector will open on the first rejection.
        `values`: the `LESSON_CONTROLS` as the user has them, then the chunk size."""
        if self.ctx.remote:
            raise gr.Error("The lesson runs round by round in this process: not under a remote engine (--engine).")
        if self.ctx.engine_of(user).draft is None:
            raise gr.Error("The lesson shows the paper's three levels: it needs a small draft model (--draft).")
        if user is None or user.document is None:
            raise gr.Error("The lesson needs the sample document: it could not be loaded.")
        *current, chunk_size = values
        if user.lesson is None or user.lesson.asked:  # a lesson set up but never asked keeps what it saved
            user.lesson = Lesson(dict(zip(LESSON_CONTROLS, current)))
        user.auto_inspect = True
        context = lesson_context(user)
        budget = lesson_budget(context, int(chunk_size))
        s = LESSON_SETTINGS
        return (True, True, gr.update(value=s["mode"]), gr.update(value=s["temperature"]),
                gr.update(value=s["seed"]), gr.update(value=s["lookup"]), gr.update(value=budget), LESSON_QUESTION,
                f'<div class="tf-narration">{html.escape(lesson_intro(user, budget, context))}</div>')

    def lesson_end(self, user: UserState | None):
        """The lesson's answer has ended (finished, stopped or failed): the settings it changed
        come back as the user had them (`RESTORED`), with a last line under its opening words."""
        if user is None or user.lesson is None or not user.lesson.asked:
            return (gr.skip(),) * len(LESSON_END_OUTPUTS)
        saved, user.lesson = user.lesson.saved, None
        user.auto_inspect = False
        done = ('<div class="tf-narration">The lesson is over: your settings are back (mode, temperature, seed, '
                "context lookup, budget, step mode); the teaching view stays on, so its answer keeps its "
                "struck-through drafts. Click any token to inspect it.</div>")
        return (*(gr.update(value=saved[name]) for name in RESTORED), done)
