"""What turns one generation into the protocol's answer: a completion, or server-sent events.

The text is cut at the first stop sequence (`StopSequences`); the generation is cancelled there.
A client that disconnects mid-stream stops its generation within one round, and its slot's
caches are freed.

Extension: every completion (and the final streamed chunk, the one with `finish_reason`)
carries `triforce`, the speculation statistics of that response (`Tally`): mode, tokens per
target forward, acceptance per level, tokens by level, decode tokens/s, prefill and reused
tokens, `spec_decode` (per verifying level, the counts behind vLLM's speculative-decoding
counters, which `/metrics` sums: `triforce_core.serving.metrics`), and `passages`: the prompt's passages the answer's retrieval selections read most, each
with its token span, share of heads, the "[Section: title]" it lies under, its text and
`kind` "read"; in modes without a retrieval level, the passages the answer quotes verbatim (8
tokens or more), `kind` "quoted", `share` the part of the answer quoted from it
(`citations.answer_passages`).

Extension, on request (`"triforce": {"events": true}`, streamed only): each chunk also carries
`triforce.events`, the engine's events since the chunk before (`event_wire.event_to_json`): one
chunk per prefill chunk (`PrefillProgress`), per `Prefilled` or `ChunksSelected`, and per round
(its `Drafted` and `Verified` events travel with its `Committed`, in a chunk whose delta holds
the round's text, or nothing while a stop sequence holds it back); `Finished` rides the final
chunk, beside the statistics. The events describe the engine's tokens: a stop sequence cuts the
text, not them. A request that does not ask gets neither the events nor the chunks that carry only them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Iterator

import anyio
from starlette.concurrency import run_in_threadpool

from ...config import GenerationConfig
from ...documents.citations import answer_passages, question_tokens
from ...decoding.events import ChunksSelected, Committed, Drafted, Finished, Prefilled, Verified
from ..event_wire import event_to_json
from ..slots import SlotPool
from ..worker import Job
from .schemas import ApiError, CompletionRequest


# The stream's last line: the OpenAI protocol's end marker.
DONE = "data: [DONE]\n\n"


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
        self.drafts: dict[str, int] = {}  # verifications that checked at least one proposed token
        self.accepted_at: dict[str, list[int]] = {}  # accepted tokens by their position in the draft
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
            if ev.proposed:
                self.drafts[ev.level] = self.drafts.get(ev.level, 0) + 1
                at = self.accepted_at.setdefault(ev.level, [])
                at.extend([0] * (ev.proposed - len(at)))
                for i in range(ev.accepted):  # the accepted tokens are a prefix of the draft
                    at[i] += 1
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
        if s is not None:  # the speculation loop's own counts
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
            "spec_decode": self.spec_decode(),
            "passages": (answer_passages(self.selections, self.prompt, self.answer_ids, self.decode,
                                         question_tokens=self.question_tokens)
                         if self.prompt is not None and self.decode is not None else []),
        }

    def spec_decode(self) -> dict:
        """Per verifying level, vLLM's speculative-decoding counts: verifications of a draft,
        tokens proposed, tokens accepted, and accepted tokens by position in their draft."""
        return {level: {"drafts": n, "draft_tokens": self.proposed.get(level, 0),
                        "accepted_tokens": self.accepted.get(level, 0),
                        "accepted_per_position": list(self.accepted_at.get(level, []))}
                for level, n in sorted(self.drafts.items())}

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


def _last_paragraph(messages: list[dict]) -> str:
    """The question of a request: its last message's last paragraph (a document may lead it)."""
    last = str(messages[-1].get("content") or "") if messages else ""
    return last.rsplit("\n\n", 1)[-1]


class Completion:
    """One request's generation: its events turned into a completion or a stream of chunks.

    `on_end(completion, ok)` runs once, when the answer was sent (`ok`; its `finish_reason`,
    `usage` and `stats`, the `triforce` extension sent, are set) or abandoned or failed; the
    slot is back in `slots` by then.
    """

    def __init__(self, req: CompletionRequest, prompt: list[int], config: GenerationConfig, slots: SlotPool,
                 slot, job: Job, model_name: str,
                 on_end: Callable[["Completion", bool], None] = lambda call, ok: None):
        self.req, self.slots, self.slot, self.job = req, slots, slot, job
        self.model_name, self.on_end = model_name, on_end
        self.mode = config.speculation.mode
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tally = Tally(len(prompt), prompt, slot.engine.detokenize, question_tokens(slot.engine.tokenizer, _last_paragraph(req.messages)))
        self.stops = StopSequences(req.stop)
        self.finish_reason: str | None = None
        self.usage: dict | None = None  # as sent, once the answer ended
        self.stats: dict | None = None  # the `triforce` extension as sent
        self._sent_events: list[dict] = []  # with `req.events`: the events the next chunk carries

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
        self.on_end(self, ok)

    def _final(self) -> tuple[dict, dict]:
        """The answer's usage and statistics, kept as sent."""
        self.finish_reason = self.finish_reason or "stop"
        self.usage, self.stats = self.tally.usage(), self.tally.extension(self.mode)
        return self.usage, self.stats

    async def complete(self) -> dict:
        ok = False
        try:
            text = await run_in_threadpool(lambda: "".join(self._events()))
            usage, stats = self._final()
            ok = True
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the server goes on
            raise ApiError(500, f"the generation failed: {e}", type="server_error") from None
        finally:
            self._end(ok)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": self.finish_reason, "logprobs": None}],
            "usage": usage,
            "triforce": stats,
        }

    def _chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
        if self.req.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    def _taken(self) -> list[dict]:
        events, self._sent_events = self._sent_events, []
        return events

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
                if self.req.events:
                    self._sent_events.append(event_to_json(item))
                    if not isinstance(item, (Drafted, Verified, Finished)):  # a round's drafts go with its commit
                        delta = {"content": piece} if piece else {}
                        yield self._chunk(delta, triforce={"events": self._taken()})
                elif piece:
                    yield self._chunk({"content": piece})
                if self.stops.hit:
                    self.job.cancel()
                    self.finish_reason = "stop"
                    break
            usage, stats = self._final()
            extension = {**stats, "events": self._taken()} if self.req.events else stats
            yield self._chunk({}, self.finish_reason, triforce=extension)
            if self.req.include_usage:
                chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model_name, "choices": [], "usage": usage}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield DONE
            ok = True
        except Exception as e:  # noqa: BLE001 - after the headers: reported in the stream
            err = ApiError(500, f"the generation failed: {e}", type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:  # also when the client went away (the task is cancelled here)
            self._end(ok)
