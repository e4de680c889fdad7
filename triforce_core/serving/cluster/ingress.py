"""The cluster's front door: the same HTTP API as `serve`, each request relayed to the engine
replica its content key maps to.

    relay = Relay(engine_handle, block_tokens=1024)   # a DeploymentHandle of EngineReplica
    app = ingress_deployment(AccessPolicy(...))       # Relay behind the guard, as a Serve ingress

Behind the `Guard` (the same checks as `serve`), a chat-completions request is

1. parsed and validated here (a 400 costs no replica);
2. keyed by its content (`serving.routing.route_key`, with the model's tokenizer, fetched once
   from a replica): every question about one document, and every turn of one conversation,
   has one key;
3. sent to the engine deployment with that key as its session id: Ray's
   `ConsistentHashRouter` maps a session id to one replica while the set of replicas stays
   (and to the next one on the ring when that one is saturated or gone), so a follow-up
   question lands where its conversation's cache is;
4. answered as the replica answers it: a completion, or its server-sent events relayed piece
   by piece, each the replica's text unchanged (the `triforce` extension, and its `events` where
   a request asks for them, included), with the header `x-triforce-replica` naming the replica.

`GET /v1/models`, `/v1/models/{id}` and `/v1/tokenizer/{model}` are any replica's answer
(every replica serves the same models).

Faults: a replica that dies before it answered (nothing sent yet, streamed or not) costs one
retry, which the router sends to another replica (the answer is the same: decoding is exact);
a second loss is a 503 in the protocol's error shape. A replica lost in the middle of a stream
ends it with an error chunk, never a hang. A client that goes away cancels its generation on
the replica.

`/metrics` counts every answer relayed here (`ServingMetrics.observe` over each answer's own
statistics), so one ingress replica (the default) counts the whole cluster.
"""

# No `from __future__ import annotations`: Serve rebuilds the routes' signatures, and FastAPI
# must see `Request` as the class itself, not a name to resolve.
import json
import threading
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ..metrics import ServingMetrics
from ..openai import ApiError, parse_request
from ..openai.routes import SSE_HEADERS, parse_json
from ..openai.streaming import DONE
from ..routing import route_key

REPLICA_HEADER = "x-triforce-replica"


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions for a replica that died or cannot be reached."""
    from ray import exceptions

    return tuple(getattr(exceptions, n) for n in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
                 if hasattr(exceptions, n))


def _lost(e: BaseException) -> ApiError:
    return ApiError(503, f"the replica serving this request stopped ({type(e).__name__}), and so did the one "
                    "that retried it; send it again", type="server_error", code="replica_unavailable")


class Relay:
    """The routes' work (see the module docstring); one per ingress replica."""

    def __init__(self, engine, block_tokens: int):
        self.engine = engine
        self.block_tokens = block_tokens
        self.metrics = ServingMetrics()
        self._tokenizers: dict[str, tuple[object, threading.Lock]] = {}

    # -- chat completions ---------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        try:
            body = parse_json(await request.body())  # bounded by the guard
            req = parse_request(body)
            key = await self._route_key(body["model"], req.messages)
        except ApiError as e:
            return e.response()
        except ClientDisconnect:
            return Response(status_code=400)
        handle = self.engine.options(session_id=key)
        if req.stream:
            return await self._stream(handle, body, received)
        return await self._complete(handle, body, received)

    async def _complete(self, handle, body: dict, received: float) -> Response:
        lost = _replica_lost_errors()
        model = body["model"]
        self.metrics.started(model)
        try:
            for attempt in range(2):
                try:
                    status, out, replica = await handle.complete.remote(body)
                    break
                except lost as e:
                    if attempt:
                        status, out, replica = None, _lost(e), None
        except BaseException:  # the client went away (cancelled here and on the replica)
            self.metrics.abandoned_request(model)
            raise
        if status is None:
            self.metrics.abandoned_request(model)
            return out.response()
        if status == 200:
            self.metrics.answered(model, out["choices"][0]["finish_reason"], out["usage"], out["triforce"],
                                  time.perf_counter() - received)
        elif status >= 500:  # the generation failed
            self.metrics.abandoned_request(model)
        else:  # refused before it ran, as `serve` refuses it (not counted there either)
            self.metrics.refused(model)
        return JSONResponse(out, status_code=status, headers={REPLICA_HEADER: replica})

    async def _stream(self, handle, body: dict, received: float) -> Response:
        lost = _replica_lost_errors()
        model = body["model"]
        for attempt in range(2):  # nothing has been sent before the first item: a retry is safe
            gen = handle.options(stream=True).stream.remote(body)
            try:
                status, error, replica = await gen.__anext__()
                break
            except lost as e:
                gen.cancel()
                if attempt:
                    return _lost(e).response()
            except BaseException:  # the client went away first
                gen.cancel()
                raise
        if status != 200:
            return JSONResponse(error, status_code=status, headers={REPLICA_HEADER: replica})

        async def relay():
            end, done, counted = None, None, False
            self.metrics.started(model)
            try:
                async for item in gen:
                    if item == DONE:  # held until the answer is counted: a client that scrapes
                        done = item   # /metrics after the stream's end then finds it there
                    elif isinstance(item, str):
                        yield item
                    else:
                        end = item
                if end is not None:
                    counted = True
                    self.metrics.answered(model, end["finish_reason"], end["usage"], end["stats"],
                                          time.perf_counter() - received)
                if done is not None:
                    yield done
            except lost as e:  # the replica died mid-answer: the stream ends with an error
                err = ApiError(503, f"the replica serving this stream stopped ({type(e).__name__}); send the "
                               "request again", type="server_error", code="replica_unavailable")
                yield f"data: {json.dumps(err.body())}\n\n"
            finally:  # also when the client went away: its generation stops on the replica
                gen.cancel()
                if end is None:
                    self.metrics.abandoned_request(model)
                elif not counted:
                    self.metrics.answered(model, end["finish_reason"], end["usage"], end["stats"],
                                          time.perf_counter() - received)

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, REPLICA_HEADER: replica})

    # -- routing ------------------------------------------------------------------------------
    async def _route_key(self, model: str, messages: list[dict]) -> str:
        if model not in self._tokenizers:
            # Any replica: the tokenizer (with its chat template) is the same everywhere.
            status, tokenizer = await self.engine.tokenizer.remote(model)
            if status != 200:
                raise ApiError(status, tokenizer["error"]["message"], type=tokenizer["error"]["type"],
                               param=tokenizer["error"]["param"], code=tokenizer["error"]["code"])
            self._tokenizers.setdefault(model, (tokenizer, threading.Lock()))
        tokenizer, lock = self._tokenizers[model]

        def key() -> str:
            with lock:  # a Rust tokenizer is not to be used by two threads at once
                return route_key(model, tokenizer, messages, self.block_tokens)

        return await run_in_threadpool(key)

    # -- the other routes ---------------------------------------------------------------------
    async def models(self) -> dict:
        return await self.engine.model_list.remote()

    async def model(self, model_id: str) -> Response:
        status, out = await self.engine.model_card.remote(model_id)
        return JSONResponse(out, status_code=status)

    async def tokenizer(self, model_id: str) -> Response:
        """A model's tokenizer (`GET /v1/tokenizer/{model}`), as any replica sends it: the same
        everywhere. Not kept here: a client asks once per connection."""
        status, out = await self.engine.tokenizer_json.remote(model_id)
        return JSONResponse(out, status_code=status)

    async def health(self) -> dict:
        """One replica's health (the one this call reached), and this ingress's requests."""
        replica = await self.engine.health.remote()
        return {"status": "ok", "replica": replica, "requests_running": self._running()}

    def _running(self) -> int:
        return int(sum(s.value for m in self.metrics.running.collect() for s in m.samples))

    async def scrape(self) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)


def ingress_deployment(access):
    """`Relay` as a Serve ingress class (FastAPI, behind the `Guard` with `access`), to be
    decorated with `serve.deployment` and bound to the engine deployment's handle."""
    from fastapi import FastAPI
    from ray import serve

    from ..guard import Guard

    app = FastAPI(title="TriForce Studio API (cluster)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, policy=access)

    @serve.ingress(app)
    class Ingress(Relay):
        @app.get("/v1/models")
        async def get_models(self):
            return await self.models()

        @app.get("/v1/models/{model_id:path}")
        async def get_model(self, model_id: str):
            return await self.model(model_id)

        @app.get("/v1/tokenizer/{model_id:path}")
        async def get_tokenizer(self, model_id: str):
            return await self.tokenizer(model_id)

        @app.post("/v1/chat/completions")
        async def post_chat_completions(self, request: Request):
            return await self.chat_completions(request)

        @app.get("/v1/health")
        async def get_health(self):
            return await self.health()

        @app.get("/metrics")
        async def get_metrics(self):
            return await self.scrape()

    return Ingress
