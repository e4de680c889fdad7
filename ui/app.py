"""The Gradio app: chat with a long document and watch speculative decoding work.

    demo = build_app(lambda: TriForceEngine.from_pretrained(...))
    demo.launch(**launch_options())

One engine (model weights) serves every user; each browser session has its own `UserState`
in `gr.State` (its `ChatSession`, hence its own caches, and its answers' traces). Every use of
the engine goes through one `EngineWorker` thread, so users cannot corrupt each other's caches,
and answers are generators fed from that worker, so Stop ends a generation within one round.

The named endpoint `chat(message, document)` streams an answer's plain text for
`gradio_client` (see the README). Its calls borrow cache slots from the same `SlotPool` as the
OpenAI-compatible HTTP API (`triforce_core.serving.openai_api`), which `ui.server` serves on
the same port.
"""

from __future__ import annotations

import html
import threading
import time
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import gradio as gr

from triforce_core.config import (
    MODES,
    PAPER_METHOD,
    CacheConfig,
    ConfigError,
    GenerationConfig,
    SamplingConfig,
    SpeculationConfig,
)
from triforce_core.documents import EXTENSIONS, Document, DocumentError, load_document
from triforce_core.engine import ContextLengthError, TriForceEngine
from triforce_core.events import ChunksSelected, Committed, PrefillProgress
from triforce_core.resources import APP_CSS as CSS_PATH
from triforce_core.resources import SAMPLE_DOCUMENT
from triforce_core.serving.worker import EngineWorker, Job
from triforce_core.session import ChatSession, SessionError
from triforce_core.slots import SlotPool

from .figures import acceptance_figure, retrieval_map_figure, speed_figure, top_passages
from .render import (
    context_gauge_html,
    legend_block,
    passages_html,
    segments_html,
    stats_html,
    status_html,
    transcript_html,
)
from .trace import AnswerTrace

MAX_UPLOAD_MB = 50
UPDATE_EVERY_S = 0.2  # how often a streaming answer refreshes its text on the page
PANELS_EVERY_S = 1.0  # ... and its figures (re-drawing plots is the browser's heaviest work)
HTML_BYTES_PER_S = 100_000  # transcript HTML sent per second at most while streaming
FILE_TYPES = sorted(EXTENSIONS)


@dataclass(frozen=True)
class Settings:
    """What the settings accordion holds (defaults = the engine's defaults)."""

    mode: str = "triforce"
    temperature: float = SamplingConfig.temperature
    top_p: float = SamplingConfig.top_p
    max_new_tokens: int = SpeculationConfig.max_new_tokens
    budget: int = CacheConfig.budget
    chunk_size: int = CacheConfig.chunk_size
    gamma1: int = SpeculationConfig.gamma1
    gamma2: int = SpeculationConfig.gamma2
    draft_window: int = CacheConfig.draft_window
    seed: int | None = None
    lookup: bool = True  # off: the paper's pure three levels (small draft -> retrieval -> target)

    def config(self) -> GenerationConfig:
        return GenerationConfig(
            sampling=SamplingConfig(
                temperature=float(self.temperature), top_p=float(self.top_p),
                seed=None if self.seed is None or self.seed < 0 else int(self.seed),
            ),
            speculation=SpeculationConfig(
                mode=self.mode, gamma1=int(self.gamma1), gamma2=int(self.gamma2), max_new_tokens=int(self.max_new_tokens),
                **({"lookup": True} if self.lookup or self.mode == "lookup" else PAPER_METHOD),
            ),
            cache=CacheConfig(budget=int(self.budget), chunk_size=int(self.chunk_size), draft_window=int(self.draft_window)),
        )


# The settings accordion, one control per `Settings` field, in rows; `Settings` holds the names,
# the defaults and (through `config()`) the validation, so this is the only other place a
# setting is named. `setting_control(name, value, modes)` builds one control.
SETTING_ROWS = (
    ("mode", "temperature", "top_p"),
    ("max_new_tokens", "budget", "chunk_size"),
    ("gamma1", "gamma2", "draft_window", "seed", "lookup"),
)
SETTING_NAMES = [f.name for f in fields(Settings)]  # the order handlers receive the values in
_SLIDERS = {  # name: (low, high, step, label)
    "temperature": (0.0, 2.0, 0.05, "Temperature (0 = greedy)"),
    "top_p": (0.05, 1.0, 0.05, "Top-p"),
    "max_new_tokens": (1, 2048, 1, "Max new tokens"),
    "budget": (64, 16384, 64, "Retrieval budget (tokens)"),
    "chunk_size": (1, 64, 1, "Chunk size"),
    "gamma1": (1, 8, 1, "γ1 (small-draft tokens)"),
    "gamma2": (1, 16, 1, "γ2 (tokens per target round)"),
    "draft_window": (16, 2048, 16, "Draft window"),
}
_ELEM_IDS = {"mode": "tf-mode", "max_new_tokens": "tf-max-new", "lookup": "tf-lookup"}
assert sorted(n for row in SETTING_ROWS for n in row) == sorted(SETTING_NAMES), "every setting has one control"


def setting_control(name: str, value, modes: list[str]):
    """The accordion's control for one `Settings` field, showing `value`."""
    elem_id = _ELEM_IDS.get(name)
    if name == "mode":
        return gr.Dropdown(modes, value=value, label="Mode", elem_id=elem_id)
    if name == "seed":
        return gr.Number(value=-1 if value is None else value, label="Seed (sampling; -1 = random)", precision=0)
    if name == "lookup":
        return gr.Checkbox(value, label="Context lookup (off: the paper's three levels)", elem_id=elem_id)
    low, high, step, label = _SLIDERS[name]
    return gr.Slider(low, high, value=value, step=step, label=label, elem_id=elem_id)


@dataclass
class Answer:
    """What the page shows of one turn."""

    trace: AnswerTrace
    footer: str = ""
    baseline: dict | None = None  # the autoregressive comparison of this answer


@dataclass(eq=False)
class UserState:
    """One browser session: its document, conversation (a `ChatSession`) and answers."""

    session: ChatSession
    document: Document | None = None
    answers: list[Answer] = field(default_factory=list)
    job: Job | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)  # prompt token -> document chars
    doc_first: int = -1  # token position where the document begins
    last_used: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.finished.is_set()


class SessionPool:
    """Caps how many users' sessions keep their KV caches: the least recently used idle ones are freed."""

    def __init__(self, worker: EngineWorker, max_cached: int):
        self.worker = worker
        self.max_cached = max_cached
        self._users: "weakref.WeakSet[UserState]" = weakref.WeakSet()
        self._lock = threading.Lock()

    def touch(self, user: UserState) -> None:
        user.last_used = time.monotonic()
        with self._lock:
            self._users.add(user)
            holding = sorted(
                (u for u in self._users if u.session.cache_lengths()["target"] > 0 and u is not user),
                key=lambda u: u.last_used,
            )
        excess = len(holding) + 1 - self.max_cached
        for u in holding[: max(0, excess)]:
            if not u.busy:
                self.worker.call(u.session.release)


# -- pure helpers (tested without a server) ------------------------------------------------------

def settings_from(values: dict) -> Settings:
    """Settings from the accordion's values; raises ConfigError with a clear message."""
    s = Settings(**{k: v for k, v in values.items() if k in Settings.__dataclass_fields__})
    if s.mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}")
    s.config()  # validates every field
    return s


def chunk_labeler(user: UserState) -> Callable[[int, int], tuple[str, str]]:
    """token span -> (where in the document, its text), for the retrieval map's hover."""
    spans, doc = user.spans, user.document
    text = user.session.document
    lead = 0
    if doc is not None:
        lead = len(doc.text) - len(doc.text.lstrip())

    def label(start: int, end: int) -> tuple[str, str]:
        inside = [spans[i] for i in range(max(0, start), min(end, len(spans))) if spans[i][0] >= 0]
        if inside:
            a, b = inside[0][0], inside[-1][1]
            where = doc.locate(a + lead) if doc is not None else ""
            return where, text[a:b]
        if start >= len(spans):
            return "the answer so far", ""
        return "chat template / question", ""

    return label


def document_span(user: UserState) -> tuple[int, int] | None:
    inside = [i for i, (a, _b) in enumerate(user.spans) if a >= 0]
    return (inside[0], inside[-1] + 1) if inside else None


def answer_footer(trace: AnswerTrace, stopped: bool) -> str:
    s = trace.stats
    if s is None:
        return f"stopped after {trace.new_tokens} tokens" if stopped else ""
    acc = ", ".join(f"{k} {v:.2f}" for k, v in s.acceptance.items())
    reused = f", {s.reused_tokens:,} reused" if s.reused_tokens else ""
    prefill = trace.prefill
    pre = f"prefill {prefill.tokens:,} tokens in {prefill.seconds:.1f}s{reused} · " if prefill is not None else ""
    return (
        f"{s.mode} · {s.new_tokens} tokens at {s.tokens_per_s:.1f} tok/s · {pre}"
        f"mean accepted {s.mean_accepted:.2f}" + (f" · acceptance {acc}" if acc else "")
    )


def stats_rows(answer: Answer | None) -> list[tuple[str, str]]:
    if answer is None:
        return [("status", "no answer yet")]
    t = answer.trace
    rows = [("tokens", f"{t.new_tokens}"), ("tokens/s", f"{t.tokens_per_s():.1f}"),
            ("mean accepted length", f"{t.mean_accepted():.2f} tokens per target forward")]
    for level, value in t.acceptance().items():
        name = "lookup / small draft → retrieval" if level == "retrieval" else "proposals → target"
        rows.append((f"acceptance, {name}", f"{value:.2f}"))
    if t.prefill is not None:
        rows.append(("prefill", f"{t.prefill.tokens:,} tokens in {t.prefill.seconds:.2f}s ({t.prefill.reused_tokens:,} reused)"))
    b = answer.baseline
    if b is not None:
        rows.append(("autoregressive", f"{b['tokens_per_s']:.1f} tok/s"))
        if b["tokens_per_s"] > 0 and t.stats is not None:
            rows.append(("speed-up", f"{t.stats.tokens_per_s / b['tokens_per_s']:.2f}×"))
        rows.append(("outputs identical", b["identical"]))
    return rows


def transcript(user: UserState | None, teaching: bool) -> str:
    if user is None or not user.session.turns:
        return transcript_html([], "Load a document (or the sample), then ask a question about it.")
    turns = []
    for turn, answer in zip(user.session.turns, user.answers):
        turns.append((turn.question, segments_html(answer.trace.segments, teaching), answer.footer))
    return transcript_html(turns)


# -- the app ---------------------------------------------------------------------------------------

def build_app(
    engine_factory: Callable[[], TriForceEngine],
    *,
    defaults: Settings | None = None,
    max_upload_mb: int = MAX_UPLOAD_MB,
    max_cached_sessions: int = 4,
    title: str = "TriForce Studio",
    worker: EngineWorker | None = None,
    slots: SlotPool | None = None,
) -> gr.Blocks:
    """The app around one engine (created once, here), run by `worker` (the one scheduler; a new
    one by default), its `chat` endpoint lending caches from `slots`. Served by `ui.server`."""
    engine = engine_factory()
    if engine.tokenizer is None:
        raise ValueError("the app needs a model with a tokenizer")
    defaults = defaults or Settings(mode="triforce" if engine.draft is not None else "retrieval")
    worker = worker or EngineWorker()
    slots = slots if slots is not None else SlotPool(engine, capacity=2)
    pool = SessionPool(worker, max_cached_sessions)
    window = engine.context_window
    max_bytes = max_upload_mb * 1_000_000
    modes = [m for m in MODES if engine.draft is not None or m in ("retrieval", "lookup", "autoregressive")]

    def new_user() -> UserState:
        return UserState(ChatSession(engine))

    def release_user(user: UserState | None) -> None:
        if user is not None:
            if user.job is not None:
                user.job.cancel()
            user.session.release()

    def gauge(user: UserState | None, budget: int) -> str:
        if user is None:
            return context_gauge_html(0, 0, window, int(budget))
        doc = user.session.document_tokens if user.document is not None else 0
        total = len(user.session.cached_tokens()) or doc
        return context_gauge_html(doc, max(0, total - doc), window, int(budget))

    def doc_info(user: UserState | None) -> str:
        if user is None or user.document is None:
            return '<div class="tf-docinfo">No document loaded.</div>'
        d = user.document
        pages = f" · {d.pages} pages" if d.pages else ""
        return (
            f'<div class="tf-docinfo"><b>{html.escape(d.name or "document")}</b> · {d.format}{pages} · '
            f"{d.chars:,} characters · {user.session.document_tokens:,} tokens</div>"
        )

    # -- loading a document --------------------------------------------------------------------
    def set_document(user: UserState | None, doc: Document, budget) -> tuple:
        user = user or new_user()
        if user.busy:
            raise gr.Error("An answer is being generated; stop it before changing the document.")
        worker.call(lambda: (user.session.set_document(doc), user.session.document_tokens))
        user.document, user.answers, user.spans = doc, [], []
        return (
            user, doc_info(user), gauge(user, budget),
            status_html(f"Loaded {doc.name}: {user.session.document_tokens:,} tokens. Ask a question.", "ok"),
            transcript(user, False), retrieval_map_figure(None),
        )

    def on_upload(file, user, budget):
        if file is None:
            return (gr.skip(),) * 6
        path = Path(file if isinstance(file, str) else file.name)
        try:
            doc = load_document(path, max_bytes=max_bytes, name=path.name)
        except DocumentError as e:
            message = f"Could not read {path.name}: {e}"
            gr.Warning(message)
            return (user, gr.skip(), gr.skip(), status_html(message, "error"), gr.skip(), gr.skip())
        return set_document(user, doc, budget)

    def on_sample(user, budget):
        doc = load_document(SAMPLE_DOCUMENT, max_bytes=max_bytes)
        return set_document(user, doc, budget)

    # -- answering -----------------------------------------------------------------------------
    def run_turn(user: UserState, start, teaching: bool, budget, label: str):
        """Stream one generation of `user` (start(progress) -> events) into page updates."""
        answer = Answer(AnswerTrace(engine.decode))
        user.job = job = worker.submit(start)
        pool.touch(user)
        last_yield = last_panels = 0.0
        interval = UPDATE_EVERY_S
        new_map, error, shown = False, None, False
        status = status_html(f"{label}: waiting for the model…", "busy")
        try:
            for item in job.stream(UPDATE_EVERY_S):
                if item is None:
                    pass
                elif isinstance(item, PrefillProgress):
                    status = status_html(
                        f"{label}: prefilling {item.done:,} / {item.total:,} tokens", "busy", item.done / max(item.total, 1)
                    )
                else:
                    if not shown:  # the session has appended this turn: keep answers aligned with turns
                        del user.answers[max(0, len(user.session.turns) - 1) :]
                        user.answers.append(answer)
                        shown = True
                    answer.trace.push(item, time.perf_counter())
                    new_map = new_map or isinstance(item, ChunksSelected)
                    if answer.trace.new_tokens:
                        status = status_html(f"{label}: {answer.trace.new_tokens} tokens", "busy")
                now = time.perf_counter()
                if now - last_yield >= interval:
                    panels = now - last_panels >= PANELS_EVERY_S
                    last_yield = now
                    if panels:
                        last_panels = now
                    out = updates(user, answer, status, teaching, budget, new_map and panels, panels)
                    # The page re-renders the whole transcript on each update: send long ones less
                    # often, so a slow browser never falls behind (and a Stop shows at once).
                    interval = max(UPDATE_EVERY_S, len(out[1]) / HTML_BYTES_PER_S)
                    yield out
                    new_map = new_map and not panels
        except Exception as e:  # bad input, context limit, out of memory: shown, the app goes on
            error = str(e) or type(e).__name__
        finally:
            job.cancel()  # a closed page or a failure stops the generation too
        answer.footer = answer_footer(answer.trace, job.stopped)
        if not shown and len(user.session.turns) > len(user.answers):
            user.session.turns.pop()  # failed or stopped before its prefill finished: no answer to keep
        if error is not None:
            status = status_html(error, "error")
        elif job.stopped:
            status = status_html(f"Stopped after {answer.trace.new_tokens} tokens.", "info")
        else:
            status = status_html(answer.footer or "Done.", "ok")
        yield updates(user, answer, status, teaching, budget, True)

    def updates(user, answer, status, teaching, budget, new_map, panels: bool = True):
        t = answer.trace
        if not panels:  # text only: the answer so far and the status line
            return (user, transcript(user, teaching), status) + (gr.skip(),) * 6
        map_fig = passages = gr.skip()
        if new_map:
            sel = t.selections[-1] if t.selections else None
            labeler, span = chunk_labeler(user), document_span(user)
            map_fig = retrieval_map_figure(sel, labeler, span, max(0, len(t.selections) - 1))
            passages = passages_html(top_passages(sel, labeler, span))
        speed = [("this answer", t.tokens_per_s())]
        if answer.baseline is not None:
            speed.append(("autoregressive", answer.baseline["tokens_per_s"]))
        return (
            user, transcript(user, teaching), status, map_fig, passages, acceptance_figure(t.rounds),
            speed_figure(speed if t.new_tokens else []), stats_html(stats_rows(answer)), gauge(user, budget),
        )

    def prepare(user, settings_values) -> tuple[UserState, Settings]:
        user = user or new_user()
        if user.busy:
            raise gr.Error("An answer is already being generated; wait for it or press Stop.")
        try:
            settings = settings_from(settings_values)
        except (ConfigError, TypeError, ValueError) as e:
            raise gr.Error(f"Invalid setting: {e}")
        return user, settings

    def ask_start(user: UserState, question: str, config: GenerationConfig):
        def start():
            events = user.session.ask(question, config, progress_events=True)
            user.spans, user.doc_first = user.session.token_char_spans(question)
            return events

        return start

    def on_ask(message, user, teaching, system, *setting_values):
        settings_values = dict(zip(SETTING_NAMES, setting_values))
        message = (message or "").strip()
        if not message:
            raise gr.Error("Type a question first.")
        user, settings = prepare(user, settings_values)
        user.session.system_prompt = (system or "").strip() or None
        yield from run_turn(user, ask_start(user, message, settings.config()), teaching, settings.budget, "Answering")

    def on_regenerate(user, teaching, system, *setting_values):
        settings_values = dict(zip(SETTING_NAMES, setting_values))
        user, settings = prepare(user, settings_values)
        if not user.session.turns:
            raise gr.Error("There is no answer to regenerate.")
        question = user.session.turns[-1].question
        user.session.system_prompt = (system or "").strip() or None
        config = settings.config()

        def start():
            events = user.session.regenerate(config, progress_events=True)
            user.answers = user.answers[: len(user.session.turns)]
            user.spans, user.doc_first = user.session.token_char_spans(question)
            return events

        yield from run_turn(user, start, teaching, settings.budget, "Regenerating")

    def on_compare(user, teaching, *setting_values):
        settings_values = dict(zip(SETTING_NAMES, setting_values))
        user, settings = prepare(user, settings_values)
        if not user.session.turns or not user.answers or user.answers[-1].trace.stats is None:
            raise gr.Error("Ask a question (and let the answer finish) first.")
        answer = user.answers[-1]
        ar = Settings(**{**settings.__dict__, "mode": "autoregressive"}).config()
        user.job = job = worker.submit(lambda: user.session.rerun_last(ar, progress_events=True))
        baseline = AnswerTrace(engine.decode)
        last = 0.0
        try:
            for item in job.stream(UPDATE_EVERY_S):
                if item is not None and not isinstance(item, PrefillProgress):
                    baseline.push(item, time.perf_counter())
                if time.perf_counter() - last > 0.5:
                    last = time.perf_counter()
                    msg = f"Autoregressive baseline: {baseline.new_tokens} tokens…"
                    yield updates(user, answer, status_html(msg, "busy"), teaching, settings.budget, False)
        except Exception as e:  # shown; the conversation is as it was
            yield updates(user, answer, status_html(str(e) or type(e).__name__, "error"), teaching, settings.budget, False)
            return
        finally:
            job.cancel()
        if job.stopped or baseline.stats is None:
            yield updates(user, answer, status_html("Comparison stopped.", "info"), teaching, settings.budget, False)
            return
        same = baseline.token_ids == answer.trace.token_ids
        greedy = settings.temperature == 0
        identical = ("yes" if same else "NO") if greedy else ("yes" if same else "no (sampling: expected to differ)")
        answer.baseline = {"tokens_per_s": baseline.stats.tokens_per_s, "identical": identical}
        ratio = answer.trace.stats.tokens_per_s / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0
        msg = (
            f"Autoregressive: {baseline.stats.tokens_per_s:.1f} tok/s; this answer "
            f"{answer.trace.stats.tokens_per_s:.1f} tok/s ({ratio:.2f}×); identical output: {identical}."
        )
        yield updates(user, answer, status_html(msg, "ok" if same or not greedy else "error"), teaching, settings.budget, False)

    def on_stop(user):
        if user is not None and user.job is not None:
            user.job.cancel()

    def on_clear(user, budget):
        if user is not None:
            if user.busy:
                raise gr.Error("Stop the answer before clearing.")
            user.session.clear()
            user.answers = []
        return (
            user, transcript(user, False), status_html("Conversation cleared (the document stays loaded).", "info"),
            retrieval_map_figure(None), passages_html([]), acceptance_figure([]), speed_figure([]),
            stats_html(stats_rows(None)),
            gauge(user, budget),
        )

    def on_teaching(user, teaching):
        return transcript(user, teaching), legend_block(teaching)

    # -- the API endpoint ------------------------------------------------------------------------
    def api_chat(message: str, document):
        """Answer `message` about `document` (a file, or None) and stream the answer's text."""
        message = (message or "").strip()
        if not message:
            raise gr.Error("the message is empty")
        doc = None
        if document is not None:
            path = Path(document if isinstance(document, str) else getattr(document, "path", None) or document.name)
            try:
                doc = load_document(path, max_bytes=max_bytes, name=path.name)
            except DocumentError as e:
                raise gr.Error(f"could not read {path.name}: {e}")
        config = defaults.config()
        # The conversation a chat session would start (the document leading the question),
        # rendered and checked against the context window on the worker, which owns the tokenizer.
        try:
            prompt = worker.call(lambda: ChatSession(engine, doc).prompt_for(message, config))
        except (ContextLengthError, ValueError) as e:
            raise gr.Error(str(e))
        slot, _ = slots.take(prompt)
        job = worker.submit(lambda: slot.generate(prompt, config, progress_events=True))
        text = ""
        ok = False
        try:
            for item in job:
                if isinstance(item, Committed):
                    text += item.text
                    yield text
            ok = True
        except (ContextLengthError, SessionError, ValueError) as e:
            raise gr.Error(str(e))
        finally:
            job.cancel()
            if ok:
                slots.give_back(slot)
            else:  # a failed or abandoned call: its caches are not worth keeping
                slots.discard(slot)
        yield text

    # -- layout ----------------------------------------------------------------------------------
    with gr.Blocks(title=title, fill_width=True) as demo:
        user_state = gr.State(None, delete_callback=release_user)
        gr.HTML(
            f'<div class="tf-header"><h1>{html.escape(title)}</h1><p>Lossless hierarchical speculative decoding '
            "over a long document. Every token is coloured by the level that proposed it; the panels show "
            "where the retrieval level looked and how often each level was right.</p></div>"
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=420):
                with gr.Row():
                    upload = gr.File(label="Document (txt, md, html, pdf, epub, docx)", file_types=FILE_TYPES,
                                     elem_id="tf-upload", scale=3)
                    sample_btn = gr.Button("Use the sample document", elem_id="tf-sample", scale=1)
                docinfo = gr.HTML(doc_info(None), elem_id="tf-docinfo")
                gauge_html = gr.HTML(gauge(None, defaults.budget), elem_id="tf-gauge")
                legend = gr.HTML(legend_block(False), elem_id="tf-legend")
                chat = gr.HTML(transcript(None, False), elem_id="tf-chat", autoscroll=True)
                status = gr.HTML(status_html("Ready.", "info"), elem_id="tf-status")
                with gr.Row():
                    message = gr.Textbox(placeholder="Ask about the document, e.g. What follows «a phrase from it»?",
                                         show_label=False, scale=5,
                                         elem_id="tf-message", lines=1)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="tf-send")
                    stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="tf-stop")
                with gr.Row():
                    regen_btn = gr.Button("Regenerate", elem_id="tf-regenerate")
                    compare_btn = gr.Button("Compare with autoregressive", elem_id="tf-compare")
                    clear_btn = gr.Button("Clear conversation", elem_id="tf-clear")
                    teaching = gr.Checkbox(False, label="Teaching view (rejected drafts, rounds)", elem_id="tf-teaching")
                with gr.Accordion("Settings", open=False, elem_id="tf-settings"):
                    system = gr.Textbox(label="System prompt", lines=2, placeholder="optional")
                    controls = {}
                    for row in SETTING_ROWS:
                        with gr.Row():
                            for name in row:
                                controls[name] = setting_control(name, getattr(defaults, name), modes)
            with gr.Column(scale=2, min_width=360):
                map_plot = gr.Plot(retrieval_map_figure(None), label="Retrieval map", elem_id="tf-map")
                passages = gr.HTML(passages_html([]), elem_id="tf-passages")
                acc_plot = gr.Plot(acceptance_figure([]), label="Acceptance", elem_id="tf-acceptance")
                speed_plot = gr.Plot(speed_figure([]), label="Speed", elem_id="tf-speed")
                stats = gr.HTML(stats_html(stats_rows(None)), elem_id="tf-stats")
        # The API endpoint's own (hidden) components.
        with gr.Row(visible=False):
            api_message = gr.Textbox(label="message")
            api_document = gr.File(label="document")
            api_answer = gr.Textbox(label="answer")
            api_btn = gr.Button("chat")

        settings_inputs = [controls[name] for name in SETTING_NAMES]
        budget = controls["budget"]
        streamed = [user_state, chat, status, map_plot, passages, acc_plot, speed_plot, stats, gauge_html]
        doc_outputs = [user_state, docinfo, gauge_html, status, chat, map_plot]

        upload.upload(on_upload, [upload, user_state, budget], doc_outputs, api_visibility="private")
        sample_btn.click(on_sample, [user_state, budget], doc_outputs, api_visibility="private")
        # The box empties the moment a question is sent (what it held moves to `asked`), never
        # when the answer ends: a next question typed meanwhile is kept.
        asked = gr.State("")
        take = dict(fn=lambda m: ("", m), inputs=message, outputs=[message, asked], queue=False,
                    api_visibility="private")
        ask_args = dict(inputs=[asked, user_state, teaching, system, *settings_inputs], outputs=streamed,
                        api_visibility="private", concurrency_limit=None)
        send_btn.click(**take).then(**ask_args, fn=on_ask)
        message.submit(**take).then(**ask_args, fn=on_ask)
        stop_btn.click(on_stop, [user_state], None, queue=False, api_visibility="private")
        regen_btn.click(on_regenerate, [user_state, teaching, system, *settings_inputs], streamed,
                        api_visibility="private", concurrency_limit=None)
        compare_btn.click(on_compare, [user_state, teaching, *settings_inputs], streamed,
                          api_visibility="private", concurrency_limit=None)
        clear_btn.click(on_clear, [user_state, budget], streamed, api_visibility="private")
        teaching.change(on_teaching, [user_state, teaching], [chat, legend], api_visibility="private")
        budget.change(gauge, [user_state, budget], gauge_html, api_visibility="private")
        api_btn.click(api_chat, [api_message, api_document], api_answer, api_name="chat", concurrency_limit=None)
    demo.tf_worker = worker  # for shutdown and tests
    return demo
