"""One server on one port: the Gradio app at `/` and the OpenAI-compatible HTTP API at `/v1`.

    app = build_server(engine, model_name="triforce-demo-target")
    app = build_server(models=ServedModels(load, folders, started=(target, draft)))  # with a model picker
    run_server(app, "127.0.0.1", 7860)

Both halves sit behind one `Guard` (`triforce_core.serving.guard`: Host and Origin checks, the
API key over the page, its Gradio API and /v1 alike, body limits; docs/security.md), and share
one `EngineWorker` (the scheduler every caller goes through) and, per model,
one `SlotPool` (the `chat` endpoint's and the HTTP API's prefix-matched caches); the app's users
keep their own sessions, capped by `max_cached_sessions`. With `models`, the app's picker and
the API's `/v1/models` offer the same models, and each user or request picks its own.

`build_remote_server(engine)` serves the app alone around a `RemoteEngine` (`python app.py
--engine URL`): its answers run on that engine's server, which serves the HTTP API itself.
"""

from __future__ import annotations

from fastapi import FastAPI

from triforce_core.engine import TriForceEngine
from triforce_core.serving.guard import AccessPolicy, Guard
from triforce_core.serving.history import ConversationStore
from triforce_core.serving.registry import ServedModels
from triforce_core.serving.openai import ChatCompletionsAPI
from triforce_core.serving.openai import run_server as serve
from triforce_core.serving.remote import RemoteEngine
from triforce_core.serving.worker import EngineWorker, ThreadWorker
from triforce_core.serving.slots import SlotPool

from triforce_core.resources import APP_JS

from .app import CSS_PATH, MAX_UPLOAD_MB, build_app
from .settings import Settings

__all__ = ["build_remote_server", "build_server", "mount_options", "run_server"]


def mount_options(max_upload_mb: int = MAX_UPLOAD_MB) -> dict:
    """Secure defaults for mounting the app: upload limit, no file access beyond uploads, no
    monitoring endpoint, no tracebacks sent to browsers (a handler's `gr.Error` still shows its
    one line); the bind address, 127.0.0.1 by default, and the `Guard` are the server's."""
    return dict(
        max_file_size=f"{max_upload_mb}mb",
        enable_monitoring=False,
        allowed_paths=[],
        ssr_mode=False,
        show_error=False,
        css_paths=[CSS_PATH] if CSS_PATH.exists() else None,
        head=f"<script>{APP_JS.read_text(encoding='utf-8')}</script>" if APP_JS.exists() else None,
        footer_links=["api"],
    )


def build_server(
    engine: TriForceEngine | None = None,
    *,
    model_name: str | None = None,
    models: ServedModels | None = None,
    defaults: Settings | None = None,
    api_mode: str | None = None,
    access: AccessPolicy | None = None,
    api_slots: int = 4,
    max_upload_mb: int = MAX_UPLOAD_MB,
    max_cached_sessions: int = 4,
    max_cache_bytes: int | None = None,
    history: ConversationStore | None = None,
    history_note: str = "",
) -> FastAPI:
    """The FastAPI app: HTTP API routes first, then the Gradio app mounted at `/`, all behind the
    `Guard` with `access` (default: loopback names only, no key, bodies outside /v1 up to the
    upload limit). Either one `engine` served as `model_name`, or `models` (their started model
    loaded here)."""
    import gradio as gr

    if models is not None:
        served = models.default()
        engine, model_name, slots = served.engine, served.id, served.slots
    elif engine is None or model_name is None:
        raise ValueError("build_server needs an engine and its model_name, or models")
    else:
        slots = SlotPool(engine, capacity=api_slots)
    worker = EngineWorker()
    demo = build_app(lambda: engine, defaults=defaults, max_upload_mb=max_upload_mb,
                     max_cached_sessions=max_cached_sessions, max_cache_bytes=max_cache_bytes,
                     worker=worker, slots=slots, models=models, model_name=model_name, history=history,
                     history_note=history_note)
    demo.queue(default_concurrency_limit=8)
    base = (defaults or Settings()).config()
    api = ChatCompletionsAPI(engine, worker, slots, model_name=model_name, base_config=base, mode=api_mode,
                             models=models)
    app = FastAPI(title="TriForce Studio", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(api.router)
    app = gr.mount_gradio_app(app, demo, path="/", **mount_options(max_upload_mb))
    app.add_middleware(Guard, policy=access or AccessPolicy(max_body=(max_upload_mb + 1) * 1_000_000))
    app.state.tf_api = api
    app.state.tf_stop = stopping(worker, app)
    return app


def build_remote_server(
    engine: RemoteEngine,
    *,
    defaults: Settings | None = None,
    access: AccessPolicy | None = None,
    max_upload_mb: int = MAX_UPLOAD_MB,
    max_cached_sessions: int = 4,
    history: ConversationStore | None = None,
    history_note: str = "",
) -> FastAPI:
    """The FastAPI app of the page alone, its answers run on `engine`'s server (each on a thread
    of its own: they wait on the network, not on a model here), behind the `Guard` as above."""
    import gradio as gr

    demo = build_app(lambda: engine, defaults=defaults, max_upload_mb=max_upload_mb,
                     max_cached_sessions=max_cached_sessions, worker=ThreadWorker(), model_name=engine.model_id,
                     history=history, history_note=history_note)
    demo.queue(default_concurrency_limit=8)
    app = FastAPI(title="TriForce Studio", docs_url=None, redoc_url=None, openapi_url=None)
    app = gr.mount_gradio_app(app, demo, path="/", **mount_options(max_upload_mb))
    app.add_middleware(Guard, policy=access or AccessPolicy(max_body=(max_upload_mb + 1) * 1_000_000))
    app.state.tf_stop = stopping(demo.tf_worker, app)
    return app


# -- a clean stop ------------------------------------------------------------------------------------

def stopping(worker, app: FastAPI):
    """What ends the streams of `app` when the server stops: every generation on `worker` is
    cancelled (an answer streaming to a page or to /v1 ends as a Stop would end it) and the
    worker closed; every open page's heartbeat stream (Gradio's, kept open as long as a page
    is) ends. Runs on the server's event loop (see `run_server`)."""
    from starlette.routing import Mount

    pages = [route.app for route in app.routes if isinstance(route, Mount) and hasattr(route.app, "stop_event")]

    def stop() -> None:
        worker.close()
        for page in pages:
            page.stop_event.set()

    return stop


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` until Ctrl-C or SIGTERM, open pages or not: their answers are stopped, the
    worker closed, and one line says so (`triforce_core.serving.openai.run_server`)."""
    serve(app, host, port, stopped="TriForce Studio stopped.")
