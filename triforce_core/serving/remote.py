"""A served engine used from another process: the app's conversations over HTTP.

    engine = RemoteEngine.connect("http://127.0.0.1:8000")   # RemoteError (one line) if it cannot
    session = RemoteChatSession(engine, document=load_document("book.pdf"))
    for event in session.ask("Who is Ishmael?"):             # the same events as in this process
        ...

`RemoteEngine.connect` asks the server (`python -m triforce_core serve`, or `python app.py`) for
its model (`GET /v1/models`: the first card, the started model, with the extensions
`context_window`, `small_draft`, `repetition_penalty`) and that model's tokenizer (`GET
/v1/tokenizer/{model}`, `tokenizer_wire`); nothing is loaded from a hub or a model file here.
It stands in for a `TriForceEngine` wherever a session needs its text side (tokenizer, window,
end-of-sequence ids, prompt checks). A turn is `POST /v1/chat/completions` with `stream: true`
and the extension `"triforce": {"events": true, "inspect": ..., "mode": ...}`: each chunk's
`triforce.events` are rebuilt into the engine's event dataclasses (`event_wire`), so whatever
renders events here renders the server's unchanged. The messages are the session's, a document
leading the first question as in this process; the server's slots reuse the cached prefix of a
conversation resent whole, so a follow-up prefills only its new tokens there.

`RemoteChatSession` and `RemoteBookSession` are `ChatSession` and `BookSession` whose turns run
on the server. Their answers are closed like any generation: the stream's response is closed
with the generator (the next time it yields: within one round or prefill chunk of the server),
which ends the server's generation.

Everything from the server is untrusted: every body and every line of the stream is read up to a
bound, every event is checked field by field (`event_wire`) and against the answer it belongs to
(`AnswerCheck`: positions within the context, tokens within the answer's limit, a bounded number
of events), and every failure is a `RemoteError` with one line. No redirect is followed (the API
key goes to the engine's URL only).
The speculation settings other than the mode (budget, chunk size, γ, draft window, context
lookup) are the server's own flags: a request cannot change them.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import quote, urlsplit

from ..config import GenerationConfig, SamplingConfig, one_line
from ..decoding.events import ChunksSelected, Committed, Drafted, Event, PrefillProgress, Prefilled, Verified
from ..engine import ContextLengthError
from ..prompting import render_prompt
from .book import BookSession
from .event_wire import WireError, event_from_json
from .session import ChatSession
from .tokenizer_wire import tokenizer_from_payload

MAX_BODY_BYTES = 64_000_000  # a JSON answer (a tokenizer of a 256K vocabulary is ~20 MB)
MAX_LINE_BYTES = 32_000_000  # one server-sent event (a round's events, a selection over a long context)
CONNECT_S = 10.0
SPECULATION_INTS = ("budget", "chunk_size", "draft_window", "gamma1", "gamma2")
READ_S = 600.0  # between two reads of a stream: a prefill chunk of a large model on a slow machine
MAX_NAME = 1000  # characters of a model's id or description
MAX_WINDOW = 1 << 24  # tokens of a context window
MAX_TOKEN_ID = (1 << 31) - 1  # a vocabulary's ids


class RemoteError(Exception):
    """The remote engine could not be reached or answered wrongly (one line). Not a RuntimeError:
    a server's "out of memory" is its own, not this process's (`session._is_oom`)."""


class RemoteEngine:
    """What a session needs of an engine, answered by a server (see the module docstring)."""

    target = None  # no model here: nothing to compute a prefill's arithmetic from

    def __init__(self, url: str, model: dict, tokenizer_payload: dict, *, client, api_key: str | None = None):
        """From what `connect` fetched (its model card and tokenizer) and the httpx client it made."""
        self.url = url.rstrip("/")
        self.api_key = api_key
        self._client = client
        if not isinstance(model.get("id"), str) or not 0 < len(model["id"]) <= MAX_NAME:
            raise RemoteError(f"the engine at {self.url} names its model with no id of at most {MAX_NAME} characters")
        self.model_id: str = model["id"]
        note = model.get("description")
        self.note: str | None = note[:MAX_NAME] if isinstance(note, str) else None
        window = model.get("context_window")
        if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= MAX_WINDOW:
            raise RemoteError(f"the engine at {self.url} does not say its model's context window "
                              f"(a whole number of tokens up to {MAX_WINDOW:,})")
        self.context_window = window
        # `draft` is only asked whether it is None (the modes offered); the model is the server's
        self.draft = True if model.get("small_draft") is True else None
        penalty = model.get("repetition_penalty")
        number = isinstance(penalty, (int, float)) and not isinstance(penalty, bool)
        self._penalty = float(penalty) if number and 0 < penalty <= 10 else 1.0  # the model's default, else off
        # the speculation settings the server keeps to itself (those of them it states)
        spec = model.get("speculation") if isinstance(model.get("speculation"), dict) else {}
        self.speculation = {k: v for k, v in spec.items()
                            if (k == "lookup" and isinstance(v, bool)) or (k in SPECULATION_INTS and _count(v))}
        try:
            self.tokenizer, self.eos_token_ids = tokenizer_from_payload(tokenizer_payload)
        except ValueError as e:
            raise RemoteError(f"the engine at {self.url} sent a tokenizer that cannot be used: {e}") from None

    @classmethod
    def connect(cls, url: str, *, api_key: str | None = None, model: str | None = None) -> "RemoteEngine":
        """The engine served at `url` (its started model, or `model`); RemoteError when it cannot
        be used."""
        import httpx

        url = check_url(url)
        client = httpx.Client(timeout=httpx.Timeout(READ_S, connect=CONNECT_S), follow_redirects=False,
                              headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        try:
            return cls._connected(client, url, api_key, model)
        except BaseException:
            client.close()
            raise

    @classmethod
    def _connected(cls, client, url: str, api_key: str | None, model: str | None) -> "RemoteEngine":
        cards = _get_json(client, f"{url}/v1/models", url)
        data = cards.get("data") if isinstance(cards, dict) else None
        if not isinstance(data, list) or not data or not all(isinstance(c, dict) and isinstance(c.get("id"), str)
                                                             for c in data):
            raise RemoteError(f"the engine at {url} lists no models (GET /v1/models)")
        card = data[0] if model is None else next((c for c in data if c["id"] == model), None)
        if card is None:
            raise RemoteError(f"the engine at {url} does not serve {model!r}")
        parts = card["id"].split("/")  # an id is a name or a path below a model folder
        if not 0 < len(card["id"]) <= MAX_NAME or any(part in ("", ".", "..") for part in parts):
            raise RemoteError(f"the engine at {url} names its model {card['id'][:100]!r}: no model id")
        name = quote(card["id"], safe="/")
        payload = _get_json(client, f"{url}/v1/tokenizer/{name}", url)  # loads the model if need be
        if card.get("context_window") is None:  # it was listed before it was loaded
            card = _get_json(client, f"{url}/v1/models/{name}", url)
        if not isinstance(card, dict):
            raise RemoteError(f"the engine at {url} sent a model card that is not an object")
        return cls(url, card, payload, api_key=api_key, client=client)

    # -- what a session asks of an engine -------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def default_sampling(self) -> SamplingConfig:
        return SamplingConfig(repetition_penalty=self._penalty)

    def check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        """As `TriForceEngine.check_prompt`, with what is known here (the server checks again)."""
        spec = config.speculation
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + spec.max_new_tokens > self.context_window:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({spec.max_new_tokens}) = "
                f"{len(prompt_ids) + spec.max_new_tokens} exceeds the target's context window of "
                f"{self.context_window} tokens")
        if spec.uses_draft_model and self.draft is None:
            raise ValueError(f"mode {spec.mode!r} needs a small draft model: the served model has none")

    # -- a turn -----------------------------------------------------------------------------
    def request_body(self, messages: list[dict], config: GenerationConfig, inspect: bool) -> dict:
        s, spec = config.sampling, config.speculation
        if s.top_k:
            raise ValueError("top-k is not part of the chat-completions protocol: a remote engine cannot take it")
        return {"model": self.model_id, "messages": messages, "stream": True,
                "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "repetition_penalty": s.repetition_penalty, "frequency_penalty": s.frequency_penalty,
                "presence_penalty": s.presence_penalty, "max_tokens": spec.max_new_tokens,
                "ignore_eos": spec.ignore_eos,
                "triforce": {"events": True, "inspect": bool(inspect), "mode": spec.mode}}

    def stream(self, messages: list[dict], config: GenerationConfig, inspect: bool = False) -> Iterator[Event]:
        """The events of one answer to `messages` (close the generator to stop it; RemoteError
        for a failure, with the server's one line when it sent one)."""
        import httpx

        body = self.request_body(messages, config, inspect)
        finished = False
        try:
            with self._client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RemoteError(_error_line(self.url, r.status_code, _read(r, MAX_BODY_BYTES, self.url)))
                for data in _sse_data(r, self.url):
                    if data == "[DONE]":
                        finished = True
                        break
                    yield from _chunk_events(data, self.url)
        except httpx.HTTPError as e:
            reason = one_line(e) or type(e).__name__
            raise RemoteError(f"the engine at {self.url} failed mid-answer: {reason}") from None
        if not finished:
            raise RemoteError(f"the engine at {self.url} ended the answer's stream before its end")

    def close(self) -> None:
        self._client.close()


class RemoteSlot:
    """A session's caches, held by the server: the turns go there (`RemoteEngine.stream`), and
    what is kept here is only which tokens the conversation holds."""

    def __init__(self, engine: RemoteEngine, messages_of: Callable[[Sequence[int]], list[dict]]):
        self.engine = engine
        self._messages_of = messages_of  # the messages a prompt's ids were rendered from
        self._tokens: list[int] = []

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig, on_prefill_progress=None,
                 progress_events: bool = False, inspect: bool = False, boundary: int | None = None,
                 stops: tuple[str, ...] = ()) -> Iterator[Event]:
        """As `Slot.generate` (`boundary`: the server keeps its own disk cache; `stops`: the server
        ends the answer at the same texts, `prompting.answer_stops` of the same tokenizer)."""
        events = self.engine.stream(self._messages_of(prompt_ids), config, inspect)
        self._tokens = list(prompt_ids)
        check = AnswerCheck(self.engine.url, len(prompt_ids), config.speculation.max_new_tokens)
        for ev in events:
            check(ev)
            if isinstance(ev, PrefillProgress):
                if on_prefill_progress is not None:
                    on_prefill_progress(ev.done, ev.total)
                if not progress_events:
                    continue
            elif isinstance(ev, Committed):
                self._tokens += ev.token_ids
            yield ev

    def cached_tokens(self) -> list[int]:
        return list(self._tokens)

    def cache_lengths(self) -> dict[str, int]:
        return {"target": 0, "retrieval": 0, "draft": 0}  # nothing held in this process

    def cache_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self._tokens = []


class AnswerCheck:
    """What a served answer's events say, checked against the prompt it answers (a well-formed
    event can still be false): the server read this prompt (the positions it reports, of chunks and
    passages, are this prompt's), positions lie within the context, token ids are ids, no more
    tokens than asked for, and a bounded number of events (an engine yields a few per round, one
    per prefill chunk). Call it on each event; a RemoteError (one line) for the first false one."""

    EVENTS_PER_TOKEN = 16  # an engine's round: drafts, verifications and a selection per level, one commit

    def __init__(self, url: str, prompt_tokens: int, max_new_tokens: int):
        self.url, self.prompt, self.max_new = url, prompt_tokens, max_new_tokens
        self.events, self.committed = 0, 0
        self.max_events = prompt_tokens + self.EVENTS_PER_TOKEN * (max_new_tokens + 1) + 64

    def __call__(self, ev: Event) -> None:
        self.events += 1
        if self.events > self.max_events:
            self._false(f"more than {self.max_events:,} events for one answer")
        if isinstance(ev, PrefillProgress) and not 0 <= ev.start <= ev.start + ev.done <= ev.start + ev.total <= self.prompt:
            self._false(f"a prefill progress {ev.start}+{ev.done}/{ev.total} beyond the prompt's {self.prompt} tokens")
        elif isinstance(ev, Prefilled) and (ev.tokens < 0 or ev.reused_tokens < 0
                                            or ev.tokens + ev.reused_tokens != self.prompt):
            # the positions the server reports (chunks, passages) would not be this prompt's
            self._false(f"read {ev.tokens + ev.reused_tokens} prompt tokens where its tokenizer gives "
                        f"{self.prompt} here")
        elif isinstance(ev, ChunksSelected):
            context = ev.context_tokens
            if not 0 <= context <= self.prompt + self.max_new or ev.chunk_size <= 0 or any(
                    not 0 <= a < b <= context for a, b in ev.chunk_token_spans) or min(ev.scores_or_counts, default=0) < 0:
                self._false("a chunk selection beyond the context")
        elif isinstance(ev, (Drafted, Verified, Committed)):
            ids = list(ev.token_ids if isinstance(ev, (Drafted, Committed)) else
                       [*ev.rejected_ids, *(i for i in (ev.resampled_id, ev.bonus_id) if i is not None),
                        *(c.token_id for c in ev.checks)])
            if any(not 0 <= i <= MAX_TOKEN_ID for i in ids):
                self._false("a token id out of range")
            if isinstance(ev, Committed):
                self.committed += len(ev.token_ids)
                if self.committed > self.max_new:
                    self._false(f"more than the {self.max_new} new tokens asked for")

    def _false(self, what: str) -> None:
        raise RemoteError(f"the engine at {self.url} sent {what}")


class _OverHTTP:
    """A session's turns sent as the messages its prompt was rendered from. A session renders a
    turn's prompt before the turn runs, and the conversation may change in between (a rerun puts
    the answer it reruns back at once), so the messages are kept with the ids they gave."""

    def __init__(self, engine: RemoteEngine, *args, **kwargs):
        self._rendered: tuple[list[int], list[dict]] | None = None
        super().__init__(engine, *args, **kwargs)
        self._slot = RemoteSlot(engine, self._messages_of)

    def prompt_ids(self, question: str) -> list[int]:
        messages = self.messages(question)
        ids = render_prompt(self.engine.tokenizer, messages)[1]
        self._rendered = (ids, messages)
        return ids

    # Continue sends an answer's first part as token ids after its prompt; the server takes
    # messages, whose chat template would close that answer's turn: refused, in one line.
    def can_continue(self) -> bool:
        return False

    def continue_last(self, *args, **kwargs):
        raise ValueError("Continue needs the engine in this process: under a remote engine (--engine), raise "
                         "Max new tokens and Regenerate instead")

    def _messages_of(self, prompt_ids: Sequence[int]) -> list[dict]:
        if self._rendered is None or self._rendered[0] != list(prompt_ids):
            raise RemoteError("the conversation changed between its prompt and its turn")  # an invariant
        return self._rendered[1]


class RemoteChatSession(_OverHTTP, ChatSession):
    """A `ChatSession` whose turns run on a `RemoteEngine`'s server."""


class RemoteBookSession(_OverHTTP, BookSession):
    """A `BookSession` (a book read by the sections each question needs) whose turns run on a
    `RemoteEngine`'s server."""


# -- reading what the server sends, bounded ----------------------------------------------------

def check_url(url: str) -> str:
    """An engine's base URL, checked: http(s), a host, no credentials, query or fragment."""
    url = (url or "").strip().rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port  # a ValueError for a port that is no number
    except ValueError as e:
        raise RemoteError(f"the engine's URL {url[:200]!r} cannot be read: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"the engine's URL must start with http:// or https:// and name a host, got {url[:200]!r}")
    if parts.username is not None or parts.password is not None:
        raise RemoteError("the engine's URL must not hold credentials: pass its API key with --engine-key")
    if parts.query or parts.fragment or (port is not None and port <= 0):
        raise RemoteError(f"the engine's URL must be a base address, without a query or fragment, got {url[:200]!r}")
    return url


def _line(text: str) -> str:
    """A server's message as one short printable line (no control characters reach a terminal)."""
    return "".join(c if c.isprintable() else " " for c in text.strip().splitlines()[0][:300])


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 24


def _get_json(client, url: str, base: str) -> Any:
    import httpx

    try:
        with client.stream("GET", url) as r:
            raw = _read(r, MAX_BODY_BYTES, base)
            if r.status_code != 200:
                raise RemoteError(_error_line(base, r.status_code, raw, f"GET {url[len(base):]}"))
    except httpx.HTTPError as e:
        raise RemoteError(f"cannot reach the engine at {base}: {one_line(e) or type(e).__name__}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise RemoteError(f"the engine at {base} answered {url[len(base):]} with something that is not JSON") from None


def _read(response, limit: int, base: str) -> bytes:
    out = bytearray()
    for part in response.iter_bytes():
        out += part
        if len(out) > limit:
            raise RemoteError(f"the engine at {base} sent more than {limit:,} bytes")
    return bytes(out)


def _error_line(base: str, status: int, raw: bytes, what: str = "the answer") -> str:
    """The server's own error message (the protocol's error shape) or its status, for `what`
    (e.g. "GET /v1/models")."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError, RecursionError):
        message = None
    message = _line(message) if isinstance(message, str) and message.strip() else f"HTTP {status}"
    return f"the engine at {base} refused {what[:200]}: {message}"


def _sse_data(response, base: str) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, each line bounded."""
    buf = bytearray()
    for part in response.iter_bytes():
        buf += part
        while True:
            end = buf.find(b"\n")
            if end < 0:
                break
            line, buf = bytes(buf[:end]).rstrip(b"\r"), buf[end + 1:]
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", errors="replace")
        if len(buf) > MAX_LINE_BYTES:
            raise RemoteError(f"the engine at {base} sent an event of more than {MAX_LINE_BYTES:,} bytes")


def _chunk_events(data: str, base: str) -> Iterator[Event]:
    try:
        chunk = json.loads(data)
    except (json.JSONDecodeError, RecursionError):  # nesting beyond any event's: no JSON of ours
        raise RemoteError(f"the engine at {base} sent a chunk that is not JSON") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"the engine at {base} sent a chunk that is not an object")
    if "error" in chunk:
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else None
        raise RemoteError(f"the engine at {base} failed: "
                          + (_line(message) if isinstance(message, str) and message.strip() else "no reason given"))
    ext = chunk.get("triforce")
    if ext is None:
        return
    events = ext.get("events") if isinstance(ext, dict) else None
    if not isinstance(events, list):
        raise RemoteError(f"the engine at {base} sent no events (is it a TriForce Studio server?)")
    for item in events:
        try:
            yield event_from_json(item)
        except WireError as e:
            raise RemoteError(f"the engine at {base} sent an event that cannot be read: {e}") from None
