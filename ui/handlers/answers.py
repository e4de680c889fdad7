"""Answering: ask, regenerate, compare with autoregressive decoding, stop, clear, and the
teaching view. Answers are generators fed from the engine's worker, so Stop (or a closed page)
ends a generation within one round.

Outputs in `ui.views.STREAMED` order.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import gradio as gr

from triforce_core.serving.book import BookSession
from triforce_core.config import ConfigError, GenerationConfig
from triforce_core.decoding.events import ChunksSelected, Committed, PrefillProgress
from triforce_core.serving.worker import Job

from ..figures import retrieval_map_figure
from ..pasting import question_refused
from ..render import legend_block, status_html
from ..settings import SETTING_NAMES, Settings, retrieval_budget, settings_from
from ..state import Answer, AppContext, UserState
from ..trace import AnswerTrace
from ..views import (PANELS, answer_footer, answer_updates, cleared_panels, empty_panels, gauge,
                     prefill_progress_text, transcript)
from .conversations import document_gone_error, keep_answer
from .documents import read_document
from .teaching import LESSON_ROUND_S, round_pauses

UPDATE_EVERY_S = 0.2  # how often a streaming answer refreshes its text on the page
PANELS_EVERY_S = 1.0  # ... and its figures (re-drawing plots is the browser's heaviest work)
COMPARE_EVERY_S = 0.5  # how often the comparison's progress line refreshes
HTML_BYTES_PER_S = 100_000  # transcript HTML sent per second at most while streaming
# A server streams its answer whether or not the page waits: rounds held here would not be
# rounds the engine waited for, and its speeds would count the waits.
REMOTE_STEPPING = ("Step mode needs the engine in this process: under a remote engine (--engine) answers run "
                   "to the end. Untick Step mode.")


def follow(job: Job, take: Callable[[object], None], interval: Callable[[], float]) -> Iterator[None]:
    """Hand each of `job`'s events to `take` as it arrives, and yield whenever `interval()`
    seconds have passed since the last yield (the caller then refreshes the page). The worker's
    queue is polled every UPDATE_EVERY_S, so the page refreshes during a long prefill too.
    Events already queued are all taken before a refresh: a refresh that costs more than a
    round (a long transcript on a busy machine) would otherwise leave the page further behind
    the generation with every round, and a Stop would land after the answer had ended.
    Errors of the generation are raised here; the caller cancels the job however it ends."""
    last = float("-inf")  # the first event refreshes at once
    for item in job.stream(UPDATE_EVERY_S):
        if item is not None:
            take(item)
            if job.pending:
                continue
        now = time.perf_counter()
        if now - last >= interval():
            yield
            last = time.perf_counter()  # the refresh's own cost does not count as a pause


def before_prefill(worker, job: Job, remote: bool = False) -> str:
    """What a job does before its prefill's first progress: waits behind the requests ahead of
    it on the worker, or reads its prompt (beside the other answers the worker runs meanwhile)."""
    if remote:
        return "waiting for the engine's server"
    ahead = worker.ahead_of(job)
    if ahead:
        return f"waiting for {ahead} {'request' if ahead == 1 else 'requests'} ahead of yours"
    text = "reading the prompt"
    others = worker.sharing(job)
    if others:
        text += f" (the model runs {others} other {'answer' if others == 1 else 'answers'} by turns with it)"
    return text


def measured_with(others: set) -> str:
    """'' for a measurement the worker ran alone, else what ran beside it: 'while 1 other answer
    ran: the ratio is not a clean measurement'."""
    if not others:
        return ""
    n = len(others)
    return f"while {n} other {'answer' if n == 1 else 'answers'} ran: the ratio is not a clean measurement"


class _Turn:
    """One streaming answer: its trace, the status line, whether a new chunk selection awaits
    the retrieval map, and whether the answer has taken its place beside its turn yet. Until the
    first event the status line says what the answer waits for (`before_prefill`)."""

    def __init__(self, user: UserState, answer: Answer, label: str, spec, job: Job, worker=None):
        self.user, self.answer, self.label, self.spec, self.job = user, answer, label, spec, job
        self.worker = worker
        self.t0 = time.perf_counter()  # the job is submitted right after: the prefill's clock
        self._status: str | None = None  # set by the first event
        self.new_map = False
        self.shown = False

    @property
    def status(self) -> str:
        if self._status is None:
            return status_html(f"{self.label}: {before_prefill(self.worker, self.job, self.spec is None)}…", "busy")
        return self._status

    @status.setter
    def status(self, value: str) -> None:
        self._status = value

    def take(self, item) -> None:
        if isinstance(item, PrefillProgress):
            text = prefill_progress_text(item, time.perf_counter() - self.t0, self.spec)
            self.status = status_html(f"{self.label}: {text}", "busy", item.done / max(item.total, 1))
            return
        if not self.shown:  # the session has appended this turn: keep answers aligned with turns
            del self.user.answers[max(0, len(self.user.session.turns) - 1):]
            self.user.answers.append(self.answer)
            self.user.panels_mode = None  # the panels show this answer now
            self.shown = True
        trace = self.answer.trace
        # A stepped answer's waits for Step are no decoding time: its clock leaves them out, and
        # so does its final speed (the waits after rounds; the one after the prefill precedes it).
        waits = list(self.job.waits)
        trace.waited_s = trace.waited_before + sum(seconds for after, seconds in waits if isinstance(after, Committed))
        trace.push(item, time.perf_counter() - sum(seconds for _after, seconds in waits))
        self.new_map = self.new_map or isinstance(item, ChunksSelected)
        if trace.new_tokens:
            self.status = status_html(f"{self.label}: {trace.new_tokens} tokens", "busy")


class AnswerHandlers:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def run_turn(self, user: UserState, start: Callable[[], Iterator], teaching: bool, budget, label: str,
                 config: GenerationConfig | None = None, stepping: bool = False, auto_step_s: float | None = None,
                 answer: Answer | None = None):
        """Stream one generation of `user` (`start()` -> its events, on the worker) into page updates;
        `budget`: the gauge's retrieval budget (`settings.retrieval_budget`, None without that level).

        With the teaching view on, the generation was started with inspect=True (`start` does
        that); with `config`, it can be stepped round by round (paused while `stepping`). With
        `auto_step_s` (the lesson), a pause ends by itself after that many seconds: the answer
        runs one round at that pace, Step still ends a pause at once. With `answer` (Continue), the
        generation goes on in that answer, the last one, instead of a new one."""
        ctx = self.ctx
        engine, window = ctx.engine_of(user), ctx.window_of(user)  # the user's model
        answer = answer or Answer(AnswerTrace(engine.detokenize), inspected=teaching)
        pauses = round_pauses(config, engine.eos_token_ids) if config is not None else None
        user.job = job = ctx.worker.submit(start, pause_after=pauses, stepping=stepping)
        ctx.sessions.touch(user)
        turn = _Turn(user, answer, label, getattr(engine.target, "spec", None), job, ctx.worker)  # None: remote
        interval, last_panels, error = UPDATE_EVERY_S, 0.0, None
        paused_at = None  # when the current pause was first seen (auto_step_s)
        try:
            for _ in follow(job, turn.take, lambda: interval):
                now = time.perf_counter()
                panels = now - last_panels >= PANELS_EVERY_S
                if panels:
                    last_panels = now
                waiting = job.waiting
                if auto_step_s is not None:
                    paused_at = (now if paused_at is None else paused_at) if waiting else None
                    if waiting and now - paused_at >= auto_step_s:
                        job.step()
                        paused_at, waiting = None, False
                status = turn.status
                if waiting:
                    rounds = len(answer.trace.rounds)
                    done = f"{'round ' + str(rounds) if rounds else 'the prefill'} done"
                    status = status_html(
                        f"Lesson: {done}; round {rounds + 1} follows in a second (Step: at once; untick Step mode: "
                        "run to the end; Stop: end it)." if auto_step_s is not None else
                        f"Step mode: {done}. Press Step for round {rounds + 1} (untick Step mode to run on).", "info")
                out = answer_updates(user, answer, status, teaching, budget, window, new_map=turn.new_map and panels,
                                     panels=panels, decode=engine.detokenize, waiting=waiting,
                                     auto_step=auto_step_s is not None)
                # The page re-renders the whole transcript on each update: send long ones less
                # often, so a slow browser never falls behind (and a Stop shows at once).
                interval = max(UPDATE_EVERY_S, len(out[1]) / HTML_BYTES_PER_S)
                yield out
                turn.new_map = turn.new_map and not panels
        except Exception as e:  # bad input, context limit, out of memory: shown, the app goes on
            error = str(e) or type(e).__name__
        finally:
            job.cancel()  # a closed page or a failure stops the generation too
            answer.ran_with.update(job.ran_with)  # for a comparison of its speed (on_compare)
        answer.footer = answer_footer(answer.trace, job.stopped)
        if not turn.shown and len(user.session.turns) > len(user.answers):
            user.session.turns.pop()  # failed or stopped before its prefill finished: no answer to keep
        keep_answer(self.ctx, user, config)  # the conversation saved whole (ui.handlers.conversations)
        if error is not None:
            status = status_html(error, "error")
        elif job.stopped:
            status = status_html(f"Stopped after {answer.trace.new_tokens} tokens.", "info")
        else:
            status = status_html(answer.footer or "Done.", "ok")
        yield answer_updates(user, answer, status, teaching, budget, window, new_map=True, panels=True,
                             decode=engine.detokenize)

    def prepare(self, user, setting_values, stepping: bool = False) -> tuple[UserState, Settings]:
        """The user (new if none yet) and the settings, or a clear error."""
        if stepping and self.ctx.remote:
            raise gr.Error(REMOTE_STEPPING)
        user = user or self.ctx.new_user()
        if user.busy:
            raise gr.Error("An answer is already being generated; wait for it or press Stop.")
        document_gone_error(user)  # a reopened conversation whose document was let go
        try:
            settings = settings_from(dict(zip(SETTING_NAMES, setting_values)))
        except (ConfigError, TypeError, ValueError) as e:
            raise gr.Error(f"Invalid setting: {e}")
        return user, settings

    @staticmethod
    def _book_read(user) -> None:
        """A book read by relevance: the document shown is what this question reads of it."""
        if isinstance(user.session, BookSession):
            user.document = read_document(user.session)

    def on_ask(self, message, user, teaching, stepping, system, *setting_values):
        message = (message or "").strip()
        if not message:
            raise gr.Error("Type a question first.")
        refused = question_refused(message)  # before any tokenizing (ui.pasting: the box keeps it)
        if refused:
            raise gr.Error(refused)
        user, settings = self.prepare(user, setting_values, bool(stepping))
        user.session.system_prompt = (system or "").strip() or None
        config = settings.config()

        def start():
            events = user.session.ask(message, config, progress_events=True, inspect=bool(teaching))
            self._book_read(user)
            user.spans, user.doc_first = user.session.token_char_spans(message)
            return events

        budget = retrieval_budget(settings.budget, settings.mode)
        lesson = user.lesson is not None and not user.lesson.asked  # the lesson's question: it runs by itself
        if lesson:
            user.lesson.asked = True
        yield from self.run_turn(user, start, teaching, budget, "Lesson" if lesson else "Answering", config,
                                 bool(stepping), auto_step_s=LESSON_ROUND_S if lesson else None)

    def on_regenerate(self, user, teaching, stepping, system, *setting_values):
        user, settings = self.prepare(user, setting_values, bool(stepping))
        if not user.session.turns:
            raise gr.Error("There is no answer to regenerate.")
        question = user.session.turns[-1].question
        user.session.system_prompt = (system or "").strip() or None
        config = settings.config()

        def start():
            events = user.session.regenerate(config, progress_events=True, inspect=bool(teaching))
            self._book_read(user)
            user.answers = user.answers[: len(user.session.turns)]
            user.spans, user.doc_first = user.session.token_char_spans(question)
            return events

        budget = retrieval_budget(settings.budget, settings.mode)
        yield from self.run_turn(user, start, teaching, budget, "Regenerating", config, bool(stepping))

    def on_continue(self, user, teaching, stepping, *setting_values):
        """Continue: the last answer, stopped by its token limit, goes on with the page's settings
        (Max new tokens more), in the same answer on the page, exactly as a larger limit would have
        written it (`ChatSession.continue_last`); the session says why when it cannot (one line in
        the status: an answer that ended on its own, a full window, a remote engine)."""
        user, settings = self.prepare(user, setting_values, bool(stepping))
        session = user.session
        if not session.turns or len(user.answers) != len(session.turns):
            raise gr.Error("There is no answer to continue.")
        answer, config = user.answers[-1], settings.config()

        def start():
            events = session.continue_last(config, progress_events=True, inspect=bool(teaching))  # checks raise here
            answer.trace.continuing()
            answer.footer = ""  # the answer streams again: no footer, sources or buttons until it ends
            return events

        budget = retrieval_budget(settings.budget, settings.mode)
        yield from self.run_turn(user, start, teaching, budget, "Continuing", config, bool(stepping), answer=answer)

    def on_compare(self, user, teaching, *setting_values):
        """Re-run the last answer autoregressively; report the speed ratio and whether the
        outputs are identical (they must be, greedy)."""
        ctx = self.ctx
        user, settings = self.prepare(user, setting_values)
        if not user.session.turns or not user.answers or user.answers[-1].trace.stats is None:
            raise gr.Error("Ask a question (and let the answer finish) first.")
        answer = user.answers[-1]
        # as long as the answer (a continued one's limit is its whole length; one ended by EOS ends there too)
        ar = Settings(**{**settings.__dict__, "mode": "autoregressive",
                         "max_new_tokens": max(1, answer.trace.new_tokens)}).config()
        user.job = job = ctx.worker.submit(lambda: user.session.rerun_last(ar, progress_events=True))
        engine, window = ctx.engine_of(user), ctx.window_of(user)
        baseline = AnswerTrace(engine.detokenize)

        def take(item) -> None:
            if not isinstance(item, PrefillProgress):
                baseline.push(item, time.perf_counter())

        def page(message: str, kind: str) -> tuple:
            return answer_updates(user, answer, status_html(message, kind), teaching,
                                  retrieval_budget(settings.budget, settings.mode), window, new_map=False,
                                  decode=engine.detokenize)

        try:
            for _ in follow(job, take, lambda: COMPARE_EVERY_S):
                doing = (f"{baseline.new_tokens} tokens" if baseline.new_tokens
                         else before_prefill(ctx.worker, job, ctx.remote))
                yield page(f"Autoregressive baseline: {doing}…", "busy")
        except Exception as e:  # shown; the conversation is as it was
            yield page(str(e) or type(e).__name__, "error")
            return
        finally:
            job.cancel()
        if job.stopped or baseline.stats is None:
            yield page("Comparison stopped.", "info")
            return
        same = baseline.token_ids == answer.trace.token_ids
        greedy = settings.temperature == 0
        identical = ("yes" if same else "NO") if greedy else ("yes" if same else "no (sampling: expected to differ)")
        # Both runs share the one worker with every other user: answers it ran between their
        # events slowed them by turns, so their ratio is not the modes' own.
        load = measured_with(answer.ran_with | job.ran_with)
        answer.baseline = {"tokens_per_s": baseline.stats.tokens_per_s, "identical": identical, "load": load}
        speed = answer.trace.tokens_per_s()  # without a stepped answer's waits for Step
        ratio = speed / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0
        yield page(
            f"Autoregressive: {baseline.stats.tokens_per_s:.1f} tok/s; this answer "
            f"{speed:.1f} tok/s ({ratio:.2f}×); identical output: {identical}."
            + (f" Measured {load}." if load else ""),
            "ok" if same or not greedy else "error",
        )

    def on_stop(self, user):
        if user is not None and user.job is not None:
            user.job.cancel()

    def on_clear(self, user, budget, mode=None):
        if user is not None:
            if user.busy:
                raise gr.Error("Stop the answer before clearing.")
            user.session.clear()
            user.answers = []
        status = status_html("Conversation cleared (the document stays loaded).", "info")
        budget = retrieval_budget(budget, mode or self.ctx.defaults.mode)
        return empty_panels(user, status, budget, self.ctx.window_of(user))

    def on_teaching(self, user, teaching):
        return transcript(user, teaching), legend_block(teaching)

    def on_mode(self, user, budget, mode):
        """The user picked another mode: the earlier answers' panels (retrieval map, passages,
        charts, figures, round narration, inspector) describe the mode they ran in, so they are
        cleared; the conversation stays. Outputs: the status line, the map, `ui.views.PANELS`.
        During an answer nothing changes (its panels are the running answer's), nor for the mode
        the panels already describe: the dropdown also sends `input` when it is closed without a
        pick, which cleared an answer's panels for no change."""
        skip = (gr.skip(),) * (2 + len(PANELS))
        if user is None or user.busy or not user.answers:
            return skip
        stats = user.answers[-1].trace.stats
        shown = user.panels_mode or (stats.mode if stats is not None else None)
        if mode == shown:
            return skip
        user.panels_mode = mode
        panels = cleared_panels()
        status = status_html(f"Mode {mode}: the next answer runs in it; the panels of the answers before are "
                             "cleared (the conversation stays).", "info")
        return (status, retrieval_map_figure(None), *(panels[name] for name in PANELS))

    def on_budget(self, user, budget, mode=None):
        """The gauge after a change of the budget or the mode (`mode` None: the app's default)."""
        return gauge(user, retrieval_budget(budget, mode or self.ctx.defaults.mode), self.ctx.window_of(user))
