"""One engine replica of the cluster: the HTTP API's work, without HTTP.

    replica = EngineReplica(build, threads=2)     # build() -> ChatCompletionsAPI (loads the model)
    status, body = await replica.complete(body)   # a chat-completions request, answered whole
    async for item in replica.stream(body): ...   # (status, error) first, then the SSE text, then the end

A plain class: `deploy` makes it a Ray Serve deployment (`serve.deployment(...)(EngineReplica)`),
so this module imports without Ray. Each replica holds its own engine, worker and cache slots,
exactly as `serve` in one process does, so its answers are that server's answers (the same
greedy tokens: decoding is exact, whichever replica runs it). Its `--kv-cache-dir` may be a
folder every replica reaches: a document one replica prefilled is read back by another.

Results cross process boundaries as plain values (status codes, dicts, strings): an `ApiError`
travels as (status, its body), never as an exception, which Ray would wrap.
"""

from __future__ import annotations

import os
from typing import AsyncIterator, Callable

from ..openai import ApiError
from ..openai.routes import ChatCompletionsAPI


def replica_id() -> str:
    """This replica's id in Serve (its process id outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except (ImportError, RuntimeError, AttributeError):
        return f"pid-{os.getpid()}"


def node_id() -> str | None:
    """The Ray node (machine) this replica runs on; None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except (ImportError, RuntimeError, AttributeError):
        return None


class EngineReplica:
    """An engine, its worker and slot pool (`ChatCompletionsAPI`), for requests relayed to it."""

    def __init__(self, build: Callable[[], ChatCompletionsAPI], threads: int):
        import torch

        # Its share of the machine's cores: intra-op threads (the native kernels follow them too).
        torch.set_num_threads(max(1, threads))
        self.threads = threads
        self.api = build()
        self.id, self.node = replica_id(), node_id()

    async def complete(self, body) -> tuple[int, dict, str]:
        """(status, response body, replica id) of a request answered whole."""
        try:
            call = await self.api.start(body)
            return 200, await call.complete(), self.id
        except ApiError as e:
            return e.status, e.body(), self.id

    async def stream(self, body) -> AsyncIterator:
        """A streamed request: first (status, error body or None, replica id); on 200 the
        server-sent events' text, piece by piece, as `serve` sends them, and last, once the
        answer was sent whole, {"finish_reason", "usage", "stats"} (not for the client: its
        relay counts it). Cancelled (the client went away), the generation stops within a round."""
        try:
            call = await self.api.start(body)
        except ApiError as e:
            yield e.status, e.body(), self.id
            return
        yield 200, None, self.id
        async for piece in call.sse():
            yield piece
        if call.stats is not None and call.usage is not None:
            yield {"finish_reason": call.finish_reason, "usage": call.usage, "stats": call.stats}

    async def model_list(self) -> dict:
        return await self.api.model_list()

    async def model_card(self, model_id: str) -> tuple[int, dict]:
        try:
            return 200, await self.api.model_card(model_id)
        except ApiError as e:
            return e.status, e.body()

    async def tokenizer(self, model_id: str) -> tuple[int, object]:
        """(200, the model's tokenizer) for the relay's route keys, or (status, error body)."""
        try:
            return 200, await self.api.tokenizer(model_id)
        except ApiError as e:
            return e.status, e.body()

    async def tokenizer_json(self, model_id: str) -> tuple[int, dict]:
        """(200, `GET /v1/tokenizer/{model_id}`'s body), or (status, error body)."""
        try:
            return 200, await self.api.tokenizer_json(model_id)
        except ApiError as e:
            return e.status, e.body()

    async def health(self) -> dict:
        return {**await self.api.health(), "replica": self.id, "node": self.node, "threads": self.threads}

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine worker stopped cannot answer; Serve
        replaces it."""
        if not self.api.worker.alive:
            raise RuntimeError("the engine's worker thread has stopped")
