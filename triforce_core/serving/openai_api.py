"""An OpenAI-compatible HTTP API: `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/health`.

    api = ChatCompletionsAPI(engine, worker, SlotPool(engine), model_name="my-model")
    app = FastAPI(); app.include_router(api.router)

Follows the chat-completions protocol as the official `openai` client uses it: `messages`
(system, developer, user, assistant; text content, a long document travels inside them),
`temperature` (default 1, as the protocol says; 0 is greedy and equals Hugging Face's greedy
output), `top_p`, `frequency_penalty` and `presence_penalty` (the protocol's, over the answer's
own tokens, default 0), `max_tokens` / `max_completion_tokens`, `seed`, `stop`, `stream` with
server-sent events and `stream_options.include_usage` (and, as in vLLM, `ignore_eos` for
fixed-length answers and `repetition_penalty`, Hugging Face's, over the answer's tokens; when a
request gives none, the model's default: `TriForceEngine.default_sampling()`, 1 = off for the
demo pair). All three penalties keep decoding exact (`triforce_core.decoding.penalties`). Parameters it does not support are a
400 naming them, never ignored silently. Errors have the protocol's shape:
`{"error": {"message", "type", "param", "code"}}`.

Extension: every completion (and the final streamed chunk, the one with `finish_reason`)
carries `triforce`, the speculation statistics of that response: mode, tokens per target
forward, acceptance per level, tokens by level, decode tokens/s, prefill and reused tokens,
and `passages`: the prompt's passages the answer's retrieval selections read most, each with
its token span, share of heads, the "[Section N: title]" it lies under, its text and `kind`
"read"; in modes without a retrieval level, the passages the answer quotes verbatim (8 tokens
or more), `kind` "quoted", `share` the part of the answer quoted from it
(`citations.answer_passages`).

Models: with `ServedModels`, `/v1/models` lists every model the server can switch to (the
app's picker offers the same), each card with the extension fields `description`, `loaded`
and, once loaded, `context_window`; a request's `model` picks one, loaded on first use (a 404
`model_not_found` for an unknown id, a 500 `model_load_failed` with one line for a file that
cannot be loaded). Requests on different models run side by side on the one worker.

Each request borrows a cache slot matched by longest common token prefix (`SlotPool`), so a
conversation resent whole each turn prefills only its new tokens; generations run on the one
`EngineWorker` shared with every other caller, their prefill chunks interleaved with the
others' rounds. A client that disconnects mid-stream stops its generation within one round
and its slot's caches are freed.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Iterator

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..config import ConfigError, GenerationConfig, SamplingConfig, default_mode
from ..engine import ContextLengthError, TriForceEngine
from ..documents.citations import answer_passages, question_tokens
from ..decoding.events import ChunksSelected, Committed, Finished, Prefilled, Verified
from ..prompting import render_prompt
from ..models.loading import ModelLoadError
from .slots import SlotPool
from .registry import ServedModels, UnknownModel
from .worker import EngineWorker, Job

MAX_BODY_BYTES = 16_000_000  # a long document is ~4 bytes a token: room for a 128K-token context
MAX_STOPS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Accepted only at the value that means "off" (anything else is a 400 naming the parameter).
OFF_VALUES: dict[str, tuple] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "parallel_tool_calls": (True, False),
}
IGNORED = {"user", "metadata", "safety_identifier", "prompt_cache_key"}  # no effect on the answer
SUPPORTED = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop",
             "stream", "stream_options", "frequency_penalty", "presence_penalty",
             "ignore_eos",  # an extension (as in vLLM): fixed-length answers for benchmarks
             "repetition_penalty"}  # an extension (as in vLLM): Hugging Face's penalty


class ApiError(Exception):
    """An error response in the protocol's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class CompletionRequest:
    messages: list[dict]
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: the model's default


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {json.dumps(v)}", param=name)
    if not (low < v <= high if low_open else low <= v <= high):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(400, f"{name} must be in {bounds}, got {v}", param=name)
    return float(v)


def _integer(body: dict, name: str, low: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(v)}", param=name)
    if v < low:
        raise ApiError(400, f"{name} must be >= {low}, got {v}", param=name)
    return v


def _content(m: Any, i: int) -> str:
    param = f"messages[{i}].content"
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"only text content parts are supported, got {kind!r}", param=param)
            parts.append(part["text"])
        return "".join(parts)
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        raise ApiError(400, "tool calls are not supported", param=f"messages[{i}].tool_calls")
    raise ApiError(400, f"{param} must be a string or a list of text parts", param=param)


def parse_request(body: Any) -> CompletionRequest:
    """Validate a chat-completions request body (a 400 `ApiError` names what is wrong)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in SUPPORTED or name in IGNORED or value is None:
            continue
        if name in OFF_VALUES:
            if value not in OFF_VALUES[name]:
                raise ApiError(400, f"{name}={json.dumps(value)} is not supported by this server", param=name,
                               code="unsupported_parameter")
            continue
        raise ApiError(400, f"unsupported parameter: {name}", param=name, code="unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "model is required (see GET /v1/models)", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {role!r} is not supported (system, developer, user, assistant)",
                           param=f"messages[{i}].role")
        out.append({"role": ROLES[role], "content": _content(m, i)})
    if not any(m["role"] == "user" for m in out):
        raise ApiError(400, "messages need at least one user message", param="messages")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", param="stop")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, "stream_options supports only include_usage", param="stream_options")
        include_usage = bool(options.get("include_usage"))
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be true or false", param="ignore_eos")
    max_tokens = _integer(body, "max_tokens", 1)
    max_completion = _integer(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                       param="max_completion_tokens")
    return CompletionRequest(
        messages=out,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        seed=_integer(body, "seed", -(2**63)),
        stop=tuple(stops),
        stream=bool(stream),
        include_usage=include_usage,
        ignore_eos=bool(ignore_eos),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=(None if body.get("repetition_penalty") is None
                            else _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)),
    )


class StopSequences:
    """Cuts the answer's text at the first stop sequence; text that could begin one is held back."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit = False

    def push(self, piece: str) -> str:
        """The text that can be sent after `piece` (the rest of the answer once a stop is hit)."""
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            end = min(found)
            self.hit = True
        else:  # hold back the longest tail that is the beginning of a stop sequence
            hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def flush(self) -> str:
        """At the end of the generation: what was held back (nothing after a stop)."""
        if self.hit:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    @property
    def answer(self) -> str:
        return self.text[: self.sent]


class Tally:
    """The statistics of one response, from its events (also when a stop sequence ended it early)."""

    def __init__(self, prompt_tokens: int, prompt: list[int] | None = None, decode=None, question_tokens: int = 0):
        self.prompt_tokens = prompt_tokens
        # for the passages the answer read most, or quotes (not from its question's last tokens)
        self.prompt, self.decode, self.question_tokens = prompt, decode, question_tokens
        self.answer_ids: list[int] = []
        self.selections: list[ChunksSelected] = []
        self.prefilled: Prefilled | None = None
        self.finished = None
        self.tokens = 0
        self.rounds = 0
        self.by_level: dict[str, int] = {}
        self.proposed: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.t_start = time.perf_counter()
        self.t_decode: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None

    def push(self, ev) -> None:
        now = time.perf_counter()
        if isinstance(ev, Prefilled):
            self.prefilled, self.t_decode = ev, now
        elif isinstance(ev, ChunksSelected):
            self.selections.append(ev)
        elif isinstance(ev, Verified):
            self.proposed[ev.level] = self.proposed.get(ev.level, 0) + ev.proposed
            self.accepted[ev.level] = self.accepted.get(ev.level, 0) + ev.accepted
        elif isinstance(ev, Committed):
            self.t_first = self.t_first or now
            self.tokens += len(ev.token_ids)
            self.answer_ids += ev.token_ids
            self.rounds += 1
            for level in ev.levels:
                self.by_level[level] = self.by_level.get(level, 0) + 1
        elif isinstance(ev, Finished):
            self.finished = ev.stats
        self.t_end = now

    def extension(self, mode: str) -> dict:
        s = self.finished
        if s is not None:  # the decoder's own counts
            decode_s, rounds, by_level = s.decode_s, s.rounds, dict(s.committed_by_level)
            acceptance, by_proposer, tps = dict(s.acceptance), dict(s.acceptance_by_proposer), s.tokens_per_s
        else:
            decode_s = (self.t_end or self.t_start) - (self.t_decode or self.t_start)
            rounds, by_level = self.rounds, dict(self.by_level)
            acceptance = {k: self.accepted[k] / v for k, v in self.proposed.items() if v}
            by_proposer, tps = {}, self.tokens / decode_s if decode_s > 0 else 0.0
        p = self.prefilled
        return {
            "mode": mode,
            "tokens_per_target_forward": self.tokens / rounds if rounds else 0.0,
            "target_forwards": rounds,
            "acceptance": acceptance,
            "acceptance_by_proposer": by_proposer,
            "tokens_by_level": by_level,
            "decode_tokens_per_s": tps,
            "decode_s": decode_s,
            "prefill_tokens": p.tokens if p else 0,
            "reused_tokens": p.reused_tokens if p else 0,
            "disk_tokens": p.disk_tokens if p else 0,
            "prefill_s": p.seconds if p else 0.0,
            "time_to_first_token_s": (self.t_first - self.t_start) if self.t_first else None,
            "passages": (answer_passages(self.selections, self.prompt, self.answer_ids, self.decode,
                                         question_tokens=self.question_tokens)
                         if self.prompt is not None and self.decode is not None else []),
        }

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}


_END = object()


def _next(job: Job, timeout: float):
    """The job's next item, None after `timeout`, `_END` at its end (errors raised)."""
    try:
        return job.get(timeout)
    except StopIteration:
        return _END


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
        api_key: str | None = None,
        models: ServedModels | None = None,
    ):
        if engine.tokenizer is None:
            raise ValueError("the HTTP API needs a model with a tokenizer")
        self.engine, self.worker, self.slots = engine, worker, slots  # the default model's
        self.model_name = model_name
        self.served_models = models  # None: `engine` is the only model
        self.base = base_config or GenerationConfig()
        self.mode = mode  # None: by prompt length (`default_mode`), the measured best
        self.api_key = api_key or None
        self.created = int(time.time())
        self.served = 0
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.router.add_api_route("/v1/health", self.health, methods=["GET"])

    # -- routes ------------------------------------------------------------------------------
    async def models(self, request: Request):
        if (denied := self._denied(request)) is not None:
            return denied
        if self.served_models is None:
            return {"object": "list", "data": [self._model_card()]}
        choices = await run_in_threadpool(self.served_models.choices)  # scans the model folders
        return {"object": "list", "data": [self._choice_card(c.id, c.note) for c in choices]}

    async def model(self, model_id: str, request: Request):
        if (denied := self._denied(request)) is not None:
            return denied
        if self.served_models is not None:
            try:
                choice = await run_in_threadpool(self.served_models.find, model_id)
            except UnknownModel:
                return self._unknown_model(model_id).response()
            return self._choice_card(choice.id, choice.note)
        if model_id != self.model_name:
            return self._unknown_model(model_id).response()
        return self._model_card()

    async def health(self):
        return {"status": "ok", "model": self.model_name, "jobs": self.worker.jobs(),
                "slots": self.slots.stats(), "requests_served": self.served}

    async def chat_completions(self, request: Request):
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is {len(raw):,} bytes; the limit is {MAX_BODY_BYTES:,}")
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            req = parse_request(body)
            engine, slots, name = await run_in_threadpool(self._served, body["model"])  # may load it
            # On the worker, which owns the tokenizer as it owns the caches.
            prompt, config = await run_in_threadpool(self.worker.call, lambda: self._prepare(req, engine))
        except ApiError as e:
            return e.response()
        slot, _ = slots.take(prompt)
        job = self.worker.submit(lambda: slot.generate(prompt, config, progress_events=True))
        call = _Call(self, req, prompt, config, slots, slot, job, name)
        if req.stream:
            return StreamingResponse(call.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await call.complete()
        except ApiError as e:
            return e.response()

    # -- helpers -----------------------------------------------------------------------------
    def _denied(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
        return ApiError(401, message, code="invalid_api_key").response()

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
        except ModelLoadError as e:
            raise ApiError(500, f"the model {name!r} could not be loaded: {e}", type="server_error", param="model",
                           code="model_load_failed") from None
        return served.engine, served.slots, served.id

    def _choice_card(self, model_id: str, note: str) -> dict:
        served = self.served_models.loaded(model_id) if self.served_models is not None else None
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "triforce-studio",
                "description": note, "loaded": served is not None,
                "context_window": served.engine.context_window if served is not None else None}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "triforce-studio",
                "context_window": self.engine.context_window}

    def _prepare(self, req: CompletionRequest, engine: TriForceEngine) -> tuple[list[int], GenerationConfig]:
        """Prompt ids and the generation settings on `engine`; a 400 for what cannot run."""
        _, prompt = render_prompt(engine.tokenizer, req.messages)
        spec = self.base.speculation
        mode = self.mode or default_mode(len(prompt))
        if engine.draft is None and mode == "triforce":
            spec = replace(spec, small_draft=False)  # a model without a small draft: the levels it has
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


def _last_paragraph(messages: list[dict]) -> str:
    """The question of a request: its last message's last paragraph (a document may lead it)."""
    last = str(messages[-1].get("content") or "") if messages else ""
    return last.rsplit("\n\n", 1)[-1]


class _Call:
    """One request's generation: its events turned into a completion or a stream of chunks."""

    def __init__(self, api: ChatCompletionsAPI, req: CompletionRequest, prompt: list[int],
                 config: GenerationConfig, slots: SlotPool, slot, job: Job, model_name: str):
        self.api, self.req, self.slots, self.slot, self.job = api, req, slots, slot, job
        self.model_name = model_name
        self.mode = config.speculation.mode
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tally = Tally(len(prompt), prompt, slot.engine.detokenize, question_tokens(slot.engine.tokenizer, _last_paragraph(req.messages)))
        self.stops = StopSequences(req.stop)
        self.finish_reason: str | None = None

    def _fold(self, item) -> str:
        """Fold one event; the text that can be sent now."""
        self.tally.push(item)
        if isinstance(item, Committed):
            return self.stops.push(item.text)
        if isinstance(item, Finished):
            self.finish_reason = "length" if item.stats.stop_reason == "max_new_tokens" else "stop"
        return ""

    def _events(self) -> Iterator[str]:
        """Blocking: the text pieces of the answer, to the end (or the first stop sequence)."""
        for item in self.job:
            piece = self._fold(item)
            if piece:
                yield piece
            if self.stops.hit:
                self.job.cancel()
                self.finish_reason = "stop"
                return
        rest = self.stops.flush()
        if rest:
            yield rest

    def _end(self, ok: bool) -> None:
        self.job.cancel()
        if ok:
            self.slots.give_back(self.slot)
        else:  # abandoned or failed: its caches are not worth keeping
            self.slots.discard(self.slot)
        self.api.served += ok

    async def complete(self) -> dict:
        ok = False
        try:
            text = await run_in_threadpool(lambda: "".join(self._events()))
            ok = True
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the server goes on
            raise ApiError(500, f"the generation failed: {e}", type="server_error") from None
        finally:
            self._end(ok)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": self.finish_reason or "stop", "logprobs": None}],
            "usage": self.tally.usage(),
            "triforce": self.tally.extension(self.mode),
        }

    def _chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
        if self.req.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    async def sse(self):
        ok = False
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            while True:
                item = await anyio.to_thread.run_sync(_next, self.job, 0.5)
                if item is None:
                    continue
                if item is _END:
                    rest = self.stops.flush()
                    if rest:
                        yield self._chunk({"content": rest})
                    break
                piece = self._fold(item)
                if piece:
                    yield self._chunk({"content": piece})
                if self.stops.hit:
                    self.job.cancel()
                    self.finish_reason = "stop"
                    break
            yield self._chunk({}, self.finish_reason or "stop", triforce=self.tally.extension(self.mode))
            if self.req.include_usage:
                usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model_name, "choices": [], "usage": self.tally.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
            ok = True
        except Exception as e:  # noqa: BLE001 - after the headers: reported in the stream
            err = ApiError(500, f"the generation failed: {e}", type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:  # also when the client went away (the task is cancelled here)
            self._end(ok)


def create_app(api: ChatCompletionsAPI) -> FastAPI:
    """A FastAPI app serving only the HTTP API (the `serve` command); no docs pages."""
    app = FastAPI(title="TriForce Studio API", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(api.router)
    return app


def run_server(app, host: str, port: int) -> None:
    """Serve `app` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
