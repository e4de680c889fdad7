"""The Gradio app: chat with a long document and watch speculative decoding work.

    demo = build_app(lambda: TriForceEngine.from_pretrained(...))

This module is the page's layout and its wiring; what it shows is computed in `ui.views`,
what its events do in `ui.handlers` (one module per feature), what it keeps in `ui.state`,
and its settings in `ui.settings`. `ui.server` serves it with the OpenAI-compatible HTTP API
on one port.
"""

from __future__ import annotations

import html
from typing import Callable

import gradio as gr

from triforce_core.documents import EXTENSIONS
from triforce_core.engine import TriForceEngine
from triforce_core.resources import APP_CSS as CSS_PATH
from triforce_core.serving.history import ConversationStore
from triforce_core.serving.registry import ServedModels
from triforce_core.serving.remote import RemoteEngine
from triforce_core.serving.worker import EngineWorker
from triforce_core.serving.slots import SlotPool

from .figures import acceptance_figure, retrieval_map_figure, speed_figure
from .handlers.answers import AnswerHandlers
from .handlers.chat_endpoint import ChatEndpoint
from .handlers.conversations import BROWSER_KEY, SIDEBAR, ConversationHandlers
from .handlers.documents import DocumentHandlers
from .handlers.models import MODEL_OUTPUTS, ModelHandlers, message_placeholder, model_info, modes_for
from .handlers.teaching import (LESSON_CONTROLS, LESSON_END_OUTPUTS, LESSON_QUERY, LESSON_SETUP_OUTPUTS, PICK_OUTPUTS,
                                TeachingHandlers)
from .inspector import inspector_figure, inspector_html
from .narration import narration_html
from .render import legend_block, passages_html, stats_html, status_html
from .pasting import paste_note, take_question
from .settings import SETTING_NAMES, SETTING_ROWS, Settings, retrieval_budget, setting_control
from .state import AppContext, SessionPool
from .views import DOCUMENT_OUTPUTS, PANELS, STREAMED, doc_info, gauge, stats_rows, transcript, upload_note

__all__ = ["CSS_PATH", "MAX_UPLOAD_MB", "Settings", "build_app"]

MAX_UPLOAD_MB = 50
# The header's light/dark switch: assets/app.js ("dark mode") flips Gradio's dark theme and keeps the choice.
THEME_TOGGLE = ('<button type="button" id="tf-theme" class="tf-theme-toggle" '
                'title="Switch between the light and the dark theme (remembered in this browser)">'
                '<span class="tf-theme-to-dark">Dark mode</span><span class="tf-theme-to-light">Light mode</span></button>')
FILE_TYPES = sorted(EXTENSIONS)


def build_app(
    engine_factory: Callable[[], TriForceEngine],
    *,
    defaults: Settings | None = None,
    max_upload_mb: int = MAX_UPLOAD_MB,
    max_cached_sessions: int = 4,
    max_cache_bytes: int | None = None,
    title: str = "TriForce Studio",
    worker: EngineWorker | None = None,
    slots: SlotPool | None = None,
    models: ServedModels | None = None,
    model_name: str | None = None,
    history: ConversationStore | None = None,
    history_note: str = "",
) -> gr.Blocks:
    """The app around one engine (created once, here), run by `worker` (the one scheduler; a new
    one by default), its `chat` endpoint lending caches from `slots`. With `models` (whose
    started model `engine_factory` gives), the settings offer a model picker: each user may
    switch to any of them (`ui.handlers.models`). The header names the model (`model_name`
    without `models`) and its window. Served by `ui.server`.

    With a `RemoteEngine` (`python app.py --engine URL`), answers run on its server: pass a
    `ThreadWorker`; there is no model picker and no slot pool here, and the speculation settings
    the server keeps to itself are shown as its own.

    With `history` (`triforce_core.serving.history`), every conversation is kept and a sidebar
    lists this browser's (`ui.handlers.conversations`); `history_note`: why there is none (the
    sidebar says it)."""
    engine = engine_factory()
    if engine.tokenizer is None:
        raise ValueError("the app needs a model with a tokenizer")
    defaults = defaults or Settings()
    worker = worker or EngineWorker()
    remote = isinstance(engine, RemoteEngine)
    if remote and models is not None:
        raise ValueError("a remote engine serves its own model: no model picker")
    ctx = AppContext(
        engine=engine, worker=worker, sessions=SessionPool(worker, max_cached_sessions, max_cache_bytes),
        slots=slots if slots is not None or remote else SlotPool(engine, capacity=2), defaults=defaults,
        max_bytes=max_upload_mb * 1_000_000, models=models,
    )
    modes = modes_for(engine)
    documents, answers, endpoint = DocumentHandlers(ctx), AnswerHandlers(ctx), ChatEndpoint(ctx)
    teach = TeachingHandlers(ctx)
    ctx.history, ctx.history_note, ctx.model_name = history, history_note, model_name  # conversations kept
    conversations = ConversationHandlers(ctx, documents)

    # -- layout ----------------------------------------------------------------------------------
    with gr.Blocks(title=title, fill_width=True) as demo:
        page = {"user": gr.State(None, delete_callback=ctx.release_user)}
        gr.HTML(
            f'<div class="tf-header">{THEME_TOGGLE}<h1>{html.escape(title)}</h1><p>Lossless hierarchical speculative decoding '
            "over a long document. Every token is coloured by the level that proposed it; the panels show "
            "where the retrieval level looked and how often each level was right.</p></div>"
        )
        # The loaded model and its window, always in sight (a switch in the settings updates it).
        started = models.started if models is not None else None
        page["model_info"] = gr.HTML(
            model_info(started.id if started else model_name,
                       started.note if started else getattr(engine, "note", None), engine),
            elem_id="tf-model-info")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=420):
                with gr.Row():
                    upload = gr.File(label="Document (txt, md, html, pdf, epub, docx)", file_types=FILE_TYPES,
                                     elem_id="tf-upload", scale=3)
                    sample_btn = gr.Button("Use the sample document", elem_id="tf-sample", scale=1)
                page["upload_note"] = gr.HTML(upload_note(), elem_id="tf-upload-note")  # why a file was refused
                page["docinfo"] = gr.HTML(doc_info(None), elem_id="tf-docinfo")
                page["gauge"] = gr.HTML(gauge(None, retrieval_budget(defaults.budget, defaults.mode), ctx.window),
                                        elem_id="tf-gauge")
                with gr.Column(visible=False, elem_id="tf-toc") as page["toc"]:
                    page["toc_list"] = gr.CheckboxGroup(choices=[], type="value", label="Table of contents",
                                                        elem_id="tf-toc-list")
                    read_btn = gr.Button("Read the selected sections", elem_id="tf-read-sections", size="sm")
                legend = gr.HTML(legend_block(False), elem_id="tf-legend")
                page["chat"] = gr.HTML(transcript(None, False), elem_id="tf-chat", autoscroll=True)
                page["status"] = gr.HTML(status_html("Ready.", "info"), elem_id="tf-status")
                page["narration"] = gr.HTML(narration_html(None), elem_id="tf-narration")
                with gr.Row():
                    message = gr.Textbox(placeholder=message_placeholder(engine),  # the model's kind: ui.handlers.models
                                         show_label=False, scale=5,
                                         elem_id="tf-message", lines=1)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="tf-send")
                    stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="tf-stop")
                page["message"] = message
                page["paste_note"] = gr.HTML(paste_note(), elem_id="tf-paste-note")  # a paste over the cap: what to do
                with gr.Row():
                    regen_btn = gr.Button("Regenerate", elem_id="tf-regenerate")
                    compare_btn = gr.Button("Compare with autoregressive", elem_id="tf-compare")
                    clear_btn = gr.Button("Clear conversation", elem_id="tf-clear")
                    teaching = gr.Checkbox(False, label="Teaching view (rejected drafts, rounds, p and q)",
                                           elem_id="tf-teaching")
                with gr.Row():
                    stepmode = gr.Checkbox(False, label="Step mode (one round per Step)", elem_id="tf-stepmode")
                    step_btn = gr.Button("Step", elem_id="tf-step")
                    # the lesson opens in a tab of its own (`LESSON_QUERY`): this tab is never touched
                    gr.Button("Lesson: watch one round at a time (opens a new tab)", elem_id="tf-lesson-start",
                              link="?" + "=".join(LESSON_QUERY), link_target="_blank")
                lesson = gr.HTML("", elem_id="tf-lesson")
                with gr.Accordion("Settings", open=False, elem_id="tf-settings"):
                    if models is not None:
                        switcher = ModelHandlers(ctx, documents)
                        with gr.Row():
                            page["model"] = gr.Dropdown(switcher.choices(), value=started.id, label="Model",
                                                        elem_id="tf-model", scale=3)
                            model_path = gr.Textbox(label="…or a GGUF file's path (under the model folders)",
                                                    placeholder="/path/to/model.gguf", elem_id="tf-model-path",
                                                    scale=3)
                            open_btn = gr.Button("Open", elem_id="tf-model-open", scale=1, size="sm")
                    system = gr.Textbox(label="System prompt", lines=2, placeholder="optional")
                    controls = {}
                    for row in SETTING_ROWS:
                        with gr.Row():
                            for name in row:
                                controls[name] = setting_control(name, getattr(defaults, name), modes, remote)
            with gr.Column(scale=2, min_width=360):
                page["map"] = gr.Plot(retrieval_map_figure(None), label="Retrieval map", elem_id="tf-map")
                page["passages"] = gr.HTML(passages_html([]), elem_id="tf-passages")
                page["acceptance"] = gr.Plot(acceptance_figure([]), label="Acceptance", elem_id="tf-acceptance")
                page["speed"] = gr.Plot(speed_figure([]), label="Speed", elem_id="tf-speed")
                page["stats"] = gr.HTML(stats_html(stats_rows(None)), elem_id="tf-stats")
                page["inspector"] = gr.HTML(inspector_html(None, engine.detokenize), elem_id="tf-inspector")
                page["inspector_plot"] = gr.Plot(inspector_figure(None, engine.detokenize), label="p and q",
                                                 elem_id="tf-inspector-plot")
        # Filled by the page's script when a token is clicked (see ui/app.js): "turn:segment@nonce".
        pick = gr.Textbox("", elem_id="tf-pick", elem_classes=["tf-hidden"], show_label=False, container=False)
        # A paste too long for a question, used as the document (ui/pasting.py; app.js "big pastes"):
        # the note's button puts the text here and clicks the hidden button.
        paste_text = gr.Textbox("", elem_id="tf-paste-text", elem_classes=["tf-hidden"], show_label=False,
                                container=False)
        paste_btn = gr.Button("Use the paste as the document", elem_id="tf-paste-use", elem_classes=["tf-hidden"])
        # Clicked by the page's script when an answer's Continue button is (app.js "Continue").
        continue_btn = gr.Button("Continue the last answer", elem_id="tf-continue", elem_classes=["tf-hidden"])
        # The API endpoint's own (hidden) components.
        with gr.Row(visible=False):
            api_message = gr.Textbox(label="message")
            api_document = gr.File(label="document")
            api_temperature = gr.Number(None, label="temperature")  # optional: None, the page's default
            api_answer = gr.Textbox(label="answer")
            api_btn = gr.Button("chat")

        # -- conversations kept (ui.handlers.conversations): the sidebar, each browser's own list --
        with gr.Sidebar(label="Conversations", open=False, visible=history is not None or bool(history_note),
                        elem_id="tf-sidebar"):
            gr.HTML('<h3 class="tf-conv-head">Conversations</h3>')
            page["conversation_note"] = gr.HTML(conversations.note(None), elem_id="tf-conv-note")
            page["conversations"] = gr.Radio(choices=[], value=None, label="Kept in this browser, the newest first",
                                             elem_id="tf-conversations", visible=history is not None)
            with gr.Group(visible=history is not None):
                page["conversation_title"] = gr.Textbox(label="Name of the open conversation", max_length=200,
                                                        elem_id="tf-conv-title")
                with gr.Row():
                    rename_btn = gr.Button("Rename", size="sm", elem_id="tf-conv-rename")
                    delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="tf-conv-delete")
                page["undo"] = gr.Button("Undo the delete", size="sm", visible=False, elem_id="tf-conv-undo")
                page["export"] = gr.DownloadButton("Export as Markdown", value=None, interactive=False, size="sm",
                                                   elem_id="tf-conv-export")
        # the browser's token, in its localStorage under the store's secret (so a restart keeps it)
        browser = gr.BrowserState("", storage_key=BROWSER_KEY,
                                  secret=history.browser_secret() if history is not None else None)
        sidebar = [page[name] for name in SIDEBAR]
        listed = dict(fn=conversations.on_answered, inputs=[browser, page["user"]], outputs=sidebar, queue=False,
                      api_visibility="private")

        page["upload"] = upload
        # -- wiring ----------------------------------------------------------------------------
        user, budget, mode = page["user"], controls["budget"], controls["mode"]
        settings_inputs = [controls[name] for name in SETTING_NAMES]
        streamed = [page[name] for name in STREAMED]
        doc_outputs = [page[name] for name in DOCUMENT_OUTPUTS]
        private = dict(api_visibility="private")

        upload.upload(documents.on_upload, [upload, user, budget, mode], doc_outputs, **private)
        sample_btn.click(documents.on_sample, [user, budget, mode], doc_outputs, **private)
        read_btn.click(documents.on_sections, [page["toc_list"], user, budget, controls["max_new_tokens"], mode],
                       doc_outputs, **private)
        # The box empties the moment a question is sent (what it held moves to `asked`), never
        # when the answer ends: a next question typed meanwhile is kept.
        asked = gr.State("")
        take = dict(fn=take_question, inputs=message, outputs=[message, asked], queue=False, **private)
        ask = dict(fn=answers.on_ask, inputs=[asked, user, teaching, stepmode, system, *settings_inputs],
                   outputs=streamed, concurrency_limit=None, **private)
        # a book read by relevance: the sections the question read are ticked once it is answered
        tick = dict(fn=documents.on_answered, inputs=user, outputs=page["toc_list"], queue=False, **private)
        send_btn.click(**take).then(**ask).then(**tick).then(**listed)
        message.submit(**take).then(**ask).then(**tick).then(**listed)
        stop_btn.click(answers.on_stop, [user], None, queue=False, **private)
        paste_btn.click(documents.on_paste, [paste_text, user, budget, mode], doc_outputs + [paste_text, page["paste_note"]],
                        **private)
        regen_btn.click(answers.on_regenerate, [user, teaching, stepmode, system, *settings_inputs], streamed,
                        concurrency_limit=None, **private).then(**tick).then(**listed)
        compare_btn.click(answers.on_compare, [user, teaching, *settings_inputs], streamed,
                          concurrency_limit=None, **private)
        # Continue: the last answer, stopped by its token limit, goes on in place
        continue_btn.click(answers.on_continue, [user, teaching, stepmode, *settings_inputs], streamed,
                           concurrency_limit=None, **private).then(**listed)
        clear_btn.click(answers.on_clear, [user, budget, mode], streamed, **private)
        teaching.change(answers.on_teaching, [user, teaching], [page["chat"], legend], **private)
        pick.change(teach.on_pick, [pick, user], [page[name] for name in PICK_OUTPUTS], queue=False, **private)
        step_btn.click(teach.on_step, [user], None, queue=False, **private)
        stepmode.change(teach.on_step_mode, [user, stepmode], None, queue=False, **private)
        # The lesson, in a tab of its own: the Lesson button opens this page at the lesson's address
        # (`LESSON_QUERY`), whose own page session (never saved) loads the sample, takes the lesson's
        # settings (keeping that tab's), asks its question and runs by itself; when its answer ends
        # (or stops), that tab's settings come back. The tab the button was pressed in is untouched.
        # A tab of the browser's, not a Gradio Tab: the lesson gets the whole page (every panel it
        # explains) with no second copy of the layout, and its session is a page's own `gr.State`.
        # The gate turns True on that page's load alone, and its change runs the lesson.
        by_name = {"teaching": teaching, "stepmode": stepmode, **controls, "question": asked, "lesson": lesson}
        lesson_controls = [by_name[name] for name in LESSON_CONTROLS]
        lesson_gate = gr.State(False)
        demo.load(teach.lesson_open, [user], [user, lesson_gate], **private)
        lesson_gate.change(documents.on_sample, [user, budget, mode], doc_outputs, **private).then(
            teach.lesson_setup, [user, *lesson_controls, controls["chunk_size"]],
            [by_name[name] for name in LESSON_SETUP_OUTPUTS], **private).success(**ask).then(**tick).then(
            teach.lesson_end, [user], [by_name[name] for name in LESSON_END_OUTPUTS], **private)
        # the lesson's words describe its answer: the next action (once it is over) takes them away
        for event in (send_btn.click, message.submit, regen_btn.click, clear_btn.click, sample_btn.click,
                      upload.upload, read_btn.click):
            event(teach.on_action, [user], lesson, queue=False, **private)
        # so does the line under the upload box about a refused file, once the user asks on (a
        # document handler writes that line itself: loading one is not among these)
        for event in (send_btn.click, message.submit, regen_btn.click, clear_btn.click):
            event(upload_note, None, page["upload_note"], queue=False, **private)
        for control in (budget, mode):  # the gauge names the retrieval budget only in a mode that has the level
            control.change(answers.on_budget, [user, budget, mode], page["gauge"], **private)
        # the user's own pick of a mode (not the lesson's or a model switch's): the panels of the
        # answers before describe another mode
        mode.input(answers.on_mode, [user, budget, mode], [page["status"], page["map"], *(page[n] for n in PANELS)],
                   **private)
        api_btn.click(endpoint.chat, [api_message, api_document, api_temperature], api_answer, api_name="chat",
                      concurrency_limit=None)
        if models is not None:
            page["mode"] = controls["mode"]
            page["repetition_penalty"] = controls["repetition_penalty"]
            switched = doc_outputs + [page[name] for name in MODEL_OUTPUTS]
            # `input`, not `change`: the handler itself sets the picker back after a failed load.
            page["model"].input(switcher.on_pick, [page["model"], user, budget, controls["mode"]], switched, **private)
            for event in (open_btn.click, model_path.submit):
                event(switcher.on_path, [model_path, user, budget, controls["mode"]], switched, **private)
            demo.load(switcher.on_page_load, None, page["model"], **private)  # files added since start
        # -- conversations kept: their events (ui.handlers.conversations) --
        if history is not None:
            deleted = gr.State("")
            demo.load(conversations.on_load, [browser, user], [browser, *sidebar], **private)
            page["conversations"].input(conversations.on_open,
                                        [page["conversations"], browser, user, teaching, budget, mode],
                                        doc_outputs + sidebar, **private)
            for event in (rename_btn.click, page["conversation_title"].submit):
                event(conversations.on_rename, [page["conversations"], page["conversation_title"], browser, user],
                      sidebar, **private)
            delete_btn.click(conversations.on_delete, [page["conversations"], browser, user], sidebar + [deleted],
                             **private)
            page["undo"].click(conversations.on_undo, [deleted, browser, user], sidebar + [deleted], **private)
            clear_btn.click(conversations.on_clear, [browser, user], sidebar, **private)
    demo.tf_worker = worker  # for shutdown and tests
    return demo
