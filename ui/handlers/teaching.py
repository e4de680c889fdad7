"""Teaching: the inspector (click a token), stepping through a generation round by round, and
the guided lesson.

A token's `data-tf="turn:segment"` reaches `on_pick` through a hidden text box the page's
script fills on click. Step mode submits the generation with a pause after each round
(`round_pauses`): the worker then waits for `on_step` between rounds, serving other users
meanwhile, and Stop still ends it.
"""

from __future__ import annotations

from typing import Callable

import gradio as gr

from triforce_core.serving.book import BookSession
from triforce_core.config import GenerationConfig
from triforce_core.decoding.events import ChunksSelected, Committed, Prefilled

from ..inspector import inspector_figure, inspector_html
from ..state import AppContext, UserState

# The lesson: the paper's three levels on the sample document, sampled, one round at a time.
LESSON_QUESTION = "What is a class?"
LESSON_SETTINGS = dict(mode="triforce", temperature=0.8, seed=3, lookup=False)
LESSON_INTRO = (
    "The lesson: the question «" + LESSON_QUESTION + "» over {document}, the paper's three levels "
    "(small draft → retrieval level → full target), sampled at temperature 0.8, one round per Step. "
    "Each round, the small draft proposes a few tokens, the retrieval level (the target's weights over a "
    "few chunks of the document) keeps each with probability min(1, p/q) and replaces the first it rejects, "
    "and the full target checks what the retrieval level emitted the same way. The inspector opens on the "
    "first rejection: the draw u against p/q, and the residual the replacement came from."
)


def lesson_intro(user: UserState | None) -> str:
    """The lesson's opening words; a model whose window is shorter than the sample (SmolLM2)
    reads the sample's sections most relevant to the question, as for any book."""
    book = user is not None and isinstance(user.session, BookSession)
    what = ("the sections of the sample document most relevant to it (the whole is over this model's window)"
            if book else "the sample document")
    return LESSON_INTRO.format(document=what)


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

    def lesson_setup(self, user: UserState | None):
        """After the sample is loaded: the lesson's settings, teaching view and step mode on,
        the question to ask; the inspector will open on the first rejection."""
        if self.ctx.engine_of(user).draft is None:
            raise gr.Error("The lesson shows the paper's three levels: it needs a small draft model (--draft).")
        if user is not None:
            user.auto_inspect = True
        s = LESSON_SETTINGS
        return (True, True, gr.update(value=s["mode"]), gr.update(value=s["temperature"]),
                gr.update(value=s["seed"]), gr.update(value=s["lookup"]), LESSON_QUESTION,
                f'<div class="tf-narration">{lesson_intro(user)}</div>')
