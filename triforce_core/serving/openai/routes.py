"""The endpoints: `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/health`, `GET /metrics`,
and the extension `GET /v1/tokenizer/{model}`.

    api = ChatCompletionsAPI(engine, worker, SlotPool(engine), model_name="my-model")
    app = create_app(api, AccessPolicy(api_key="s3cret"))   # the routes behind the guard

Models: with `ServedModels`, `/v1/models` lists every model the server can switch to (the
app's picker offers the same), each card with the extension fields `description`, `loaded`
and, once loaded, `context_window`; a request's `model` picks one, loaded on first use (a 404
`model_not_found` for an unknown id, a 400 `model_load_failed` with the load error's one line for
a file that cannot be loaded). Requests on different models run side by side on the one worker.
A loaded model's card also says whether it has a small draft (`small_draft`) and its default
repetition penalty (`repetition_penalty`), and every card the server's speculation settings,
which a request cannot change (`speculation`: budget, chunk_size, draft_window, gamma1, gamma2,
lookup); `GET /v1/tokenizer/{model}` sends its tokenizer
(`tokenizer_wire`), loading the model if need be: what a client that shows token texts, counts
a document's tokens or renders the chat template itself needs (`python app.py --engine URL`).

Who may call (Host, Origin, the API key, JSON bodies, the body limit) is the `Guard`'s concern
(`triforce_core.serving.guard`), which `create_app` puts in front of the routes; the routes
themselves read a body only up to `MAX_BODY_BYTES`.

Each request borrows a cache slot matched by longest common token prefix (`SlotPool`), so a
conversation resent whole each turn prefills only its new tokens; generations run on the one
`EngineWorker` shared with every other caller, their prefill chunks interleaved with the
others' rounds.

`/metrics` is Prometheus' text format: requests, tokens, time to first token and vLLM's
speculative-decoding counters, each the sum of the answers' own statistics
(`triforce_core.serving.metrics`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ...config import DEFAULT_MODE, DRAFT_MODES, ConfigError, GenerationConfig, SamplingConfig, needs_draft, one_line
from ...engine import ContextLengthError, TriForceEngine
from ...models.loading import ModelLoadError
from ...prompting import answer_stops, render_prompt
from ..metrics import ServingMetrics
from ..registry import ServedModels, UnknownModel
from ..slots import SlotPool
from ..tokenizer_wire import tokenizer_payload
from ..worker import EngineWorker
from .schemas import ApiError, CompletionRequest, parse_request
from .streaming import Completion

if TYPE_CHECKING:
    from ..guard import AccessPolicy


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def parse_json(raw: bytes):
    """A request body's JSON (ApiError 400 when it is not)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


class ChatCompletionsAPI:
    """The routes (`.router`) around one engine, its worker and a slot pool."""

    def __init__(
        self,
        engine: TriForceEngine,
        worker: EngineWorker,
        slots: SlotPool,
        *,
        model_name: str,
        base_config: GenerationConfig | None = None,
        mode: str | None = None,
        models: ServedModels | None = None,
        metrics: ServingMetrics | None = None,
    ):
        if engine.tokenizer is None:
            raise ValueError("the HTTP API needs a model with a tokenizer")
        self.engine, self.worker, self.slots = engine, worker, slots  # the default model's
        self.model_name = model_name
        self.served_models = models  # None: `engine` is the only model
        self.base = base_config or GenerationConfig()
        self.mode = mode  # None: `config.DEFAULT_MODE`
        self.created = int(time.time())
        self.served = 0
        self.metrics = metrics or ServingMetrics()
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/tokenizer/{model_id:path}", self.tokenizer_route, methods=["GET"])
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.router.add_api_route("/v1/health", self.health, methods=["GET"])
        self.router.add_api_route("/metrics", self.scrape, methods=["GET"])

    # -- routes ------------------------------------------------------------------------------
    async def models(self):
        return await self.model_list()

    async def model(self, model_id: str):
        try:
            return await self.model_card(model_id)
        except ApiError as e:
            return e.response()

    async def tokenizer_route(self, model_id: str):
        try:
            return await self.tokenizer_json(model_id)
        except ApiError as e:
            return e.response()

    async def health(self):
        return {"status": "ok", "model": self.model_name, "jobs": self.worker.jobs(),
                "slots": self.slots.stats(), "requests_served": self.served}

    async def scrape(self):
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def chat_completions(self, request: Request):
        received = time.perf_counter()
        try:
            raw = await request.body()  # bounded by the Guard every server puts in front
            call = await self.start(parse_json(raw), received)
        except ApiError as e:
            return e.response()
        except ClientDisconnect:  # gone before its body was read (or refused by the guard's limit)
            return Response(status_code=400)
        if call.req.stream:
            return StreamingResponse(call.sse(), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            return await call.complete()
        except ApiError as e:
            return e.response()

    # -- the same, without HTTP (a server that relays requests, e.g. a Ray replica) ------------
    async def model_list(self) -> dict:
        """`GET /v1/models`'s body."""
        if self.served_models is None:
            return {"object": "list", "data": [self._model_card()]}
        choices = await run_in_threadpool(self.served_models.choices)  # scans the model folders
        return {"object": "list", "data": [self._choice_card(c.id, c.note) for c in choices]}

    async def model_card(self, model_id: str) -> dict:
        """`GET /v1/models/{model_id}`'s body; ApiError 404 for a model not served."""
        if self.served_models is not None:
            try:
                choice = await run_in_threadpool(self.served_models.find, model_id)
            except UnknownModel:
                raise self._unknown_model(model_id) from None
            return self._choice_card(choice.id, choice.note)
        if model_id != self.model_name:
            raise self._unknown_model(model_id)
        return self._model_card()

    async def start(self, body, received: float | None = None) -> Completion:
        """A chat-completions request body's generation, started on the worker (ApiError for a
        request that cannot run): `await call.complete()` or iterate `call.sse()`."""
        received = time.perf_counter() if received is None else received
        req = parse_request(body)
        engine, slots, name = await run_in_threadpool(self._served, body["model"])  # may load it
        # On the worker, which owns the tokenizer as it owns the caches.
        prompt, config = await run_in_threadpool(self.worker.call, lambda: self._prepare(req, engine))
        slot, _ = slots.take(prompt)
        # the plain layout's answer ends at the next "Question:" (`prompting.answer_stops`), as a
        # chat session's does; a request's own `stop` sequences cut the text after that
        job = self.worker.submit(lambda: slot.generate(prompt, config, progress_events=True, inspect=req.inspect,
                                                       stops=answer_stops(engine.tokenizer)))
        self.metrics.started(name)
        return Completion(req, prompt, config, slots, slot, job, name,
                          on_end=lambda call, ok: self._ended(call, ok, received))

    async def tokenizer(self, model_id: str):
        """The tokenizer of a served model, loaded if need be (ApiError as for a request naming it)."""
        engine, _, _ = await run_in_threadpool(self._served, model_id)
        return engine.tokenizer

    async def tokenizer_json(self, model_id: str) -> dict:
        """`GET /v1/tokenizer/{model_id}`'s body (`tokenizer_payload`), the model loaded if need
        be; ApiError as for a request naming it, or a 404 for a tokenizer with no serialized form."""
        engine, _, _ = await run_in_threadpool(self._served, model_id)  # may load it
        try:  # on the worker, which owns the tokenizer as it owns the caches
            return await run_in_threadpool(self.worker.call, lambda: tokenizer_payload(engine))
        except ValueError as e:
            raise ApiError(404, f"the model {model_id!r} has a tokenizer this server cannot send: {one_line(e)}",
                           param="model", code="tokenizer_unavailable") from None

    # -- helpers -----------------------------------------------------------------------------
    def _ended(self, call: Completion, ok: bool, received: float) -> None:
        self.served += ok
        if ok:
            self.metrics.answered(call.model_name, call.finish_reason, call.usage, call.stats,
                                  time.perf_counter() - received)
        else:
            self.metrics.abandoned_request(call.model_name)

    def _unknown_model(self, name: str) -> ApiError:
        served = "GET /v1/models lists the models" if self.served_models is not None else repr(self.model_name)
        return ApiError(404, f"the model {name!r} does not exist; this server serves {served}",
                        param="model", code="model_not_found")

    def _served(self, name: str):
        """(engine, slots, id) of the model a request names, loaded if need be; ApiError otherwise."""
        if self.served_models is None:
            if name != self.model_name:
                raise self._unknown_model(name)
            return self.engine, self.slots, self.model_name
        try:
            served = self.served_models.get(name)
        except UnknownModel:
            raise self._unknown_model(name) from None
        except ModelLoadError as e:  # the request named a file that is no model: the caller's to fix
            raise ApiError(400, f"the model {name!r} could not be loaded: {one_line(e)}", param="model",
                           code="model_load_failed") from None
        return served.engine, served.slots, served.id

    def _choice_card(self, model_id: str, note: str) -> dict:
        served = self.served_models.loaded(model_id) if self.served_models is not None else None
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "triforce-studio",
                "description": note, "loaded": served is not None,
                **self._engine_facts(served.engine if served is not None else None),
                "speculation": self._speculation()}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "triforce-studio",
                **self._engine_facts(self.engine), "speculation": self._speculation()}

    def _speculation(self) -> dict:
        spec, cache = self.base.speculation, self.base.cache
        return {"budget": cache.budget, "chunk_size": cache.chunk_size, "draft_window": cache.draft_window,
                "gamma1": spec.gamma1, "gamma2": spec.gamma2, "lookup": spec.lookup}

    @staticmethod
    def _engine_facts(engine: TriForceEngine | None) -> dict:
        """A card's extension fields (null until the model is loaded)."""
        if engine is None:
            return {"context_window": None, "small_draft": None, "repetition_penalty": None}
        return {"context_window": engine.context_window, "small_draft": engine.draft is not None,
                "repetition_penalty": engine.default_sampling().repetition_penalty}

    def _prepare(self, req: CompletionRequest, engine: TriForceEngine) -> tuple[list[int], GenerationConfig]:
        """Prompt ids and the generation settings on `engine`; a 400 for what cannot run."""
        _, prompt = render_prompt(engine.tokenizer, req.messages)
        spec = self.base.speculation
        mode = req.mode or self.mode or DEFAULT_MODE
        if engine.draft is None and mode in DRAFT_MODES:
            if req.mode:  # asked for: refused, naming the modes this model runs
                raise ApiError(400, needs_draft(mode), param="triforce.mode")
            mode = DEFAULT_MODE  # the server's --mode, on a model without a small draft: the default
        max_new = req.max_tokens or spec.max_new_tokens
        try:
            config = replace(
                self.base,
                sampling=SamplingConfig(
                    temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                    frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                    repetition_penalty=(engine.default_sampling().repetition_penalty if req.repetition_penalty is None
                                        else req.repetition_penalty),
                ),
                speculation=replace(spec, mode=mode, max_new_tokens=max_new,
                                    ignore_eos=req.ignore_eos),
            )
            engine.check_prompt(prompt, config)
        except ContextLengthError:
            window = engine.context_window
            raise ApiError(
                400,
                f"this conversation is {len(prompt)} tokens and max_tokens is {max_new}: {len(prompt) + max_new} "
                f"tokens, but the model's context window is {window} tokens. Shorten the messages or lower max_tokens.",
                param="messages", code="context_length_exceeded",
            ) from None
        except (ConfigError, ValueError) as e:
            raise ApiError(400, str(e)) from None
        return prompt, config


def create_app(api: ChatCompletionsAPI, access: AccessPolicy | None = None) -> FastAPI:
    """A FastAPI app serving only the HTTP API (the `serve` command), behind the `Guard` with
    `access` (default: loopback names only, no key); no docs pages."""
    from ..guard import AccessPolicy, Guard  # here: the guard reads this package's error shape

    app = FastAPI(title="TriForce Studio API", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(api.router)
    app.add_middleware(Guard, policy=access or AccessPolicy())
    app.state.tf_stop = api.worker.close  # a stop cancels the generations: open streams end (run_server)
    return app


def run_server(app, host: str, port: int, stopped: str | None = None) -> None:
    """Serve `app` with uvicorn until Ctrl-C or SIGTERM, then return (a clean stop, not a signal's
    death). When the stop begins, `app.state.tf_stop()` (if set) runs on the server's event loop,
    before uvicorn waits for the open connections: it ends what would stream on (the worker's
    generations, a page's streams), so they close within the graceful shutdown instead of being
    cancelled with a traceback. `stopped`: the line printed on stderr at the end."""
    import signal
    import sys
    import threading

    import uvicorn

    on_stop = getattr(app.state, "tf_stop", None)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if on_stop is not None:
                on_stop()
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    # uvicorn raises the signal it stopped on again once it has shut down, under the handlers it
    # found: SIGTERM's is made Ctrl-C's (KeyboardInterrupt), which ends here as a normal return.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        server.run()
    except KeyboardInterrupt:  # the stop's own signal, raised again after the shutdown
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    if stopped:
        print(stopped, file=sys.stderr, flush=True)
