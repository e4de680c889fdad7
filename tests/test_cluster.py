"""`serve --ray` for real: a local Ray cluster (2 CPUs), two engine replicas of a tiny model pair
deployed by the command line joining it (`--address`), driven through Serve's HTTP proxy by the
official `openai` client and httpx.

Answers are compared with the same prompt run alone, in this process, through `TriForceEngine`
(exact decoding: whichever replica answers, greedy tokens are the same). Which replica answered
is the `x-triforce-replica` header. Nothing here waits on a clock to decide a result: each
wait polls for a state with a generous bound (the machine may be paused for minutes).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import httpx
import pytest

from tests.helpers.models import CHAT_TEMPLATE, make_hf, make_tokenizer, perturbed, save_checkpoint, words
from tests.helpers.servers import free_port, running_server, scrape_metrics
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.prompting import render_prompt
from tests.helpers.page import ask_on_page, in_browser  # the page in headless Chromium (skips without it)

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install '.[cluster]'): serve --ray's "
                          "tests need a real local cluster")
pytest.importorskip("ray.serve", reason="Ray is installed without Serve (pip install '.[cluster]')")
openai = pytest.importorskip("openai")

# The heaviest tests (a Ray cluster here, a browser and the app in test_app) take turns on one
# pytest worker (make test's --dist loadgroup) instead of sharing two cores at once.
pytestmark = pytest.mark.xdist_group("app")

MODEL = "chat-target"
WINDOW = 4096  # room for a stream long enough to be cut by a replica's death
CHUNK = 64  # prefill chunk = disk block = the most a route key hashes
CACHE = dict(budget=48, chunk_size=4, draft_window=24, draft_sinks=4, prefill_chunk=CHUNK)
FLAGS = ["--budget", "48", "--chunk-size", "4", "--draft-window", "24", "--draft-sinks", "4", "--gamma2", "4",
         "--prefill-chunk", str(CHUNK), "--mode", "triforce", "--slots", "4", "--device", "cpu"]
REPLICA = "x-triforce-replica"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-models")
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    hf = make_hf("llama_gqa_llama3", seed=0, max_position_embeddings=WINDOW)
    return {"target": save_checkpoint(root / MODEL, hf, tok),
            "draft": save_checkpoint(root / "chat-draft", perturbed(hf, 0.02), tok),
            "kv": root / "shared-kv"}


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    """A local Ray cluster in this process, and `serve --ray --address` deploying two replicas on it."""
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        address = ray.get_runtime_context().gcs_address
        port = free_port()
        log = tmp_path_factory.mktemp("serve-ray") / "serve.log"
        cmd = [sys.executable, "-m", "triforce_core", "serve", "--ray", "--address", address, "--replicas", "2",
               "--cpus-per-replica", "1", "--target", models["target"], "--draft", models["draft"],
               "--port", str(port), "--kv-cache-dir", str(models["kv"]), *FLAGS]
        base = f"http://127.0.0.1:{port}"
        probe = lambda: httpx.get(f"{base}/v1/health", timeout=5).status_code == 200  # noqa: E731
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # a cluster and three replicas start in a minute here; the machine may be paused meanwhile
        with running_server(cmd, log, probe, env, what="serve --ray", timeout=900) as proc:
            yield {"base": base, "proc": proc, "log": log, "serve": serve}
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["base"] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def local(models):
    """The served pair loaded in this process."""
    from triforce_core.engine import TriForceEngine

    return TriForceEngine.from_pretrained(models["target"], models["draft"], device="cpu")


def config(engine, max_tokens: int) -> GenerationConfig:
    """The replicas' settings (their flags), greedy, with the model's own repetition penalty."""
    return GenerationConfig(sampling=engine.default_sampling(),
                            speculation=SpeculationConfig(mode="triforce", max_new_tokens=max_tokens, gamma2=4),
                            cache=CacheConfig(**CACHE))


@pytest.fixture(scope="module")
def reference(local):
    """Answers run alone, in this process."""
    def answer(messages, max_tokens):
        _, ids = render_prompt(local.tokenizer, messages)
        return local.run(ids, config(local, max_tokens)).text

    return answer


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """What `serve` serves with the replicas' flags (`build_api`, `create_app`: the same code, run
    in this process without uvicorn), as an HTTP client of it."""
    from starlette.testclient import TestClient

    from triforce_core.cli.main import build_parser
    from triforce_core.cli.serve import access_policy, build_api
    from triforce_core.serving.openai import create_app

    args = build_parser().parse_args(["serve", "--target", models["target"], "--draft", models["draft"],
                                      "--kv-cache-dir", str(tmp_path_factory.mktemp("serve-kv")), *FLAGS])
    api = build_api(args)
    try:
        with TestClient(create_app(api, access_policy(args)), base_url="http://127.0.0.1:8000") as client:
            yield client
    finally:
        api.worker.close()


def document(seed: int, n: int = 300) -> str:
    return words(n, seed)


def ask(doc: str, question: str) -> list[dict]:
    """A conversation's first question about `doc`: the document leads the message."""
    return [{"role": "user", "content": doc + "\n\n" + question}]


def post(cluster, messages, max_tokens=16, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
    return httpx.post(cluster["base"] + "/v1/chat/completions", json=body, timeout=300)


def engine_replicas() -> set[str]:
    """The ids of the engine replicas alive now (their actors are named after them)."""
    prefix = "SERVE_REPLICA::triforce#engine#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def replaced(serve, dead: str) -> bool:
    """Serve runs two engine replicas again, the dead one not among them."""
    status = serve.status().applications["triforce"].deployments["engine"]
    alive = engine_replicas()
    return status.replica_states.get("RUNNING", 0) == 2 and len(alive) == 2 and dead not in alive


# -- answers -----------------------------------------------------------------------------------------

def test_answers_through_the_cluster_equal_the_prompt_run_alone(cluster, client, reference):
    for i in range(3):
        messages = ask(document(200 + i, 120), words(6, 300 + i))
        expected = reference(messages, 24)
        r = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=24)
        completion = r.parse()
        assert completion.choices[0].message.content == expected and r.headers[REPLICA]
        stats = completion.model_extra["triforce"]
        assert stats["mode"] == "triforce" and "target" in stats["spec_decode"]
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].model_extra["triforce"]["mode"] == "triforce"


def test_bad_requests_are_refused_in_the_protocols_shape(cluster):
    r = post(cluster, [{"role": "user", "content": "w7"}], max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(cluster["base"] + "/v1/chat/completions", timeout=60,
                   json={"model": "nope", "messages": [{"role": "user", "content": "w7"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(cluster["base"] + "/v1/chat/completions", content=b"{", timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(cluster["base"] + "/v1/health", headers={"Host": "evil.example"}, timeout=60)
    assert r.status_code == 403  # the same guard as `serve`
    health = httpx.get(cluster["base"] + "/v1/health", timeout=60).json()["replica"]
    assert health["replica"] in engine_replicas() and health["node"] == ray.get_runtime_context().get_node_id()
    assert [m["id"] for m in httpx.get(cluster["base"] + "/v1/models", timeout=60).json()["data"]][0] == MODEL


# -- routing --------------------------------------------------------------------------------------

def test_a_documents_requests_stay_on_the_replica_holding_its_cache(cluster):
    """Each document's questions, and its follow-ups resent whole, reach one replica, which
    reuses its cached prefix; the documents spread over both replicas."""
    seen: dict[int, str] = {}
    for seed in range(16):  # documents until both replicas hold some (each has a 1/2 chance)
        doc = document(seed)
        messages = ask(doc, words(5, 100 + seed))
        first = post(cluster, messages)
        assert first.status_code == 200, first.text
        seen[seed] = first.headers[REPLICA]
        follow = messages + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": words(4, 200 + seed)}]  # the conversation resent whole
        other = ask(doc, words(5, 400 + seed))  # another conversation about the same document
        for messages in (follow, other):
            r = post(cluster, messages)
            assert r.headers[REPLICA] == seen[seed]
            stats = r.json()["triforce"]
            assert stats["reused_tokens"] >= 300, stats  # the document (300 words) was not prefilled again
        if seed >= 3 and len(set(seen.values())) == 2:
            break
    assert len(set(seen.values())) == 2, seen


# -- faults -------------------------------------------------------------------------------------

def kill_replica(replica_id: str) -> None:
    assert replica_id in engine_replicas()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::triforce#engine#{replica_id}", namespace="serve"), no_restart=True)


def wait_for(check, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)


def test_a_request_whose_replica_dies_is_answered_by_another_from_the_shared_cache(cluster, models):
    """A question about a document, then the same question again, its replica killed as soon as
    the ingress has sent it on: it is answered all the same (the router's choice or one retry
    sends it to another replica), with the same answer, its document read from the shared disk
    cache instead of prefilled; Serve starts a replica in the dead one's place."""
    import threading

    messages = ask(document(500, 600), words(6, 501))
    first = post(cluster, messages, max_tokens=16, ignore_eos=True)
    assert first.status_code == 200
    holder = first.headers[REPLICA]
    assert list(models["kv"].glob("*.kv"))  # the prefill was written to the shared folder
    got: list = []
    # 2,000 tokens of decoding: the kill lands while the replica runs it
    sender = threading.Thread(target=lambda: got.append(post(cluster, messages, max_tokens=2000, ignore_eos=True)))
    sender.start()
    wait_for(lambda: got or httpx.get(cluster["base"] + "/v1/health", timeout=60).json()["requests_running"],
             "the ingress sending the request on")
    answered_before_the_kill = bool(got)
    kill_replica(holder)
    sender.join(timeout=900)
    again = got[0]
    assert again.status_code == 200, again.text
    answer = again.json()["choices"][0]["message"]["content"]
    assert answer.startswith(first.json()["choices"][0]["message"]["content"])  # greedy: the same answer, longer
    if not answered_before_the_kill:
        assert again.headers[REPLICA] != holder
        assert again.json()["triforce"]["disk_tokens"] > 0  # read back, not prefilled
    wait_for(lambda: replaced(cluster["serve"], holder), "Serve replacing the killed replica")


def test_a_stream_cut_by_its_replicas_death_ends_with_an_error_chunk(cluster, client):
    """A replica killed mid-stream: the stream ends, with an error in the protocol's shape (the
    chunks before it carrying the events asked for), and the cluster answers the next request."""
    body = {"model": MODEL, "messages": ask(document(600, 40), words(4, 601)), "temperature": 0,
            "max_tokens": WINDOW - 200, "ignore_eos": True, "stream": True, "triforce": {"events": True}}
    contents, head, tail = 0, [], []
    with httpx.stream("POST", cluster["base"] + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            head.append(line)
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                contents += 1
                if contents == 2:
                    holder = r.headers[REPLICA]
                    kill_replica(holder)
                    break
        tail = [line for line in lines if line.startswith("data: ")]
    assert tail and "[DONE]" not in tail[-1], tail[-3:]  # it ended before its 3,896 tokens
    error = json.loads(tail[-1][len("data: "):])["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    chunks = streamed(head + tail[:-1])[1:]  # after the first (its role)
    assert chunks and all(c["triforce"]["events"] for c in chunks)
    r = post(cluster, ask(document(602, 40), words(4, 603)))
    assert r.status_code == 200
    wait_for(lambda: replaced(cluster["serve"], holder), "Serve replacing the killed replica")


# -- metrics ------------------------------------------------------------------------------------

def test_metrics_count_the_answers_relayed(cluster, client):
    """The ingress's /metrics rises by exactly the sums of the answers' own statistics."""
    before = scrape_metrics(cluster["base"], MODEL)
    answers = []
    for i, stream in enumerate([False, True]):
        messages = ask(document(700 + i, 100), words(5, 710 + i))
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, temperature=0,
                                                         max_tokens=20, stream_options={"include_usage": True}))
            final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
            answers.append((chunks[-1].usage.model_dump(), final.model_extra["triforce"]))
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
            answers.append((r.usage.model_dump(), r.model_extra["triforce"]))
    after = scrape_metrics(cluster["base"], MODEL)

    def rise(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert rise("triforce:generation_tokens_total") == sum(u["completion_tokens"] for u, _ in answers)
    assert rise("triforce:prompt_tokens_total") == sum(u["prompt_tokens"] for u, _ in answers)
    for level in ("retrieval", "target"):
        for field in ("drafts", "draft_tokens", "accepted_tokens"):
            assert rise(f"triforce:spec_decode_num_{field}_total", level=level) == sum(
                s["spec_decode"].get(level, {}).get(field, 0) for _, s in answers)
    assert rise("triforce:time_to_first_token_seconds_count") == len(answers)


# -- the page's extensions (python app.py --engine URL) -------------------------------------------

TIMES = ("decode_tokens_per_s", "decode_s", "prefill_s", "time_to_first_token_s")
STATS_TIMES = ("prefill_s", "decode_s", "tokens_per_s", "level_seconds")


def streamed(lines) -> list[dict]:
    """A stream's chunks, `[DONE]` as the string."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def without_clocks(chunk):
    """A chunk with what differs between two runs of one answer blanked: its id and time of
    creation, and the clock readings of its statistics and events."""
    if not isinstance(chunk, dict):
        return chunk
    chunk = {**chunk, "id": None, "created": None}
    ext = chunk.get("triforce")
    if ext is not None:
        ext = {**ext, **{k: None for k in TIMES if k in ext}}
        if "events" in ext:
            events = []
            for e in ext["events"]:
                if e["type"] == "Prefilled":
                    e = {**e, "seconds": None}
                elif e["type"] == "Finished":
                    e = {**e, "stats": {**e["stats"], **{k: None for k in STATS_TIMES}}}
                events.append(e)
            ext["events"] = events
        chunk["triforce"] = ext
    return chunk


def test_the_tokenizer_route_answers_through_the_cluster_as_serve(cluster, served):
    theirs = served.get(f"/v1/tokenizer/{MODEL}")
    r = httpx.get(f"{cluster['base']}/v1/tokenizer/{MODEL}", timeout=120)
    assert r.status_code == theirs.status_code == 200, r.text
    assert r.json() == theirs.json() and r.json()["chat_template"] == CHAT_TEMPLATE
    r = httpx.get(f"{cluster['base']}/v1/tokenizer/no-such-model", timeout=60)
    assert r.status_code == 404 and r.json() == served.get("/v1/tokenizer/no-such-model").json()
    r = httpx.get(f"{cluster['base']}/v1/tokenizer/{MODEL}", headers={"Host": "evil.example"}, timeout=60)
    assert r.status_code == 403  # behind the guard, as every route


def test_a_stream_with_events_through_the_cluster_is_serves_chunk_for_chunk(cluster, served):
    """Every chunk the cluster relays, its `triforce.events` and the final chunk's statistics
    included, is the one `serve` sends for the same greedy request (but ids and clock readings)."""
    body = {"model": MODEL, "messages": ask(document(800, 150), words(5, 801)), "temperature": 0, "max_tokens": 24,
            "stream": True, "stream_options": {"include_usage": True}, "triforce": {"events": True}}
    with httpx.stream("POST", cluster["base"] + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        ours = streamed(r.iter_lines())
    with served.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        theirs = streamed(r.iter_lines())
    assert ours[-1] == "[DONE]" and ours[-2]["usage"]["completion_tokens"] > 0
    final = [c for c in ours[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["triforce"]["events"][-1]["type"] == "Finished"
    assert {e["type"] for c in ours[:-1] for e in c.get("triforce", {}).get("events", [])} >= {
        "PrefillProgress", "Prefilled", "ChunksSelected", "Drafted", "Verified", "Committed", "Finished"}
    assert [without_clocks(c) for c in ours] == [without_clocks(c) for c in theirs]


def test_the_app_engine_against_the_cluster_answers_as_this_process(cluster, local):
    """`python app.py --engine URL` pointed at the cluster: a `RemoteEngine` connects (model card
    and tokenizer through the ingress), and a greedy conversation's answers are the ones in this
    process, token for token and level for level."""
    from triforce_core.serving.remote import RemoteChatSession, RemoteEngine
    from triforce_core.serving.session import ChatSession

    remote = RemoteEngine.connect(cluster["base"])
    try:
        assert remote.model_id == MODEL and remote.context_window == local.context_window
        doc = document(810, 150)
        here, there = ChatSession(local, doc), RemoteChatSession(remote, doc)
        here.document_end = lambda prompt: None  # a server prefills the prompt whole (test_remote_engine)
        for question in (words(6, 811), words(5, 812)):  # the follow-up resends the conversation
            for session in (here, there):
                list(session.ask(question, config(session.engine, 20)))
            t, u = here.turns[-1], there.turns[-1]
            assert t.token_ids and (t.token_ids, t.levels, t.answer) == (u.token_ids, u.levels, u.answer)
        assert there.turns[-1].stats.reused_tokens > 0  # the follow-up found its conversation's cache
    finally:
        remote.close()


# -- the page against the cluster, in a real browser ----------------------------------------------

def test_the_page_against_the_cluster_colours_tokens_by_level_and_inspects_one(cluster, local, tmp_path):
    """`python app.py --engine URL` on the cluster's ingress, in headless Chromium: a question
    asked with the teaching view on is answered with each token coloured by the level that
    proposed it, as the same conversation in this process, and a click on a checked token opens
    the inspector on it with its verifications' q(x) and p(x), those of this process."""
    from triforce_core.serving.session import ChatSession
    from ui.render import LEVEL_STYLE
    from ui.trace import AnswerTrace

    # a conversation whose answer has tokens of three levels (most of this tiny random pair's are the target's own)
    doc, question = document(825, 200), words(6, 826)
    here = ChatSession(local, doc)
    here.document_end = lambda prompt: None  # a server prefills the prompt whole (test_remote_engine)
    trace = AnswerTrace(local.detokenize)
    for event in here.ask(question, config(local, 24), inspect=True):
        trace.push(event)
    tokens = [s for s in trace.segments if s.kind == "token"]
    checked = [i for i, s in enumerate(tokens) if s.checks and s.drawn_from is None]  # proposals a verifier kept
    assert len({s.level for s in tokens}) >= 2 and checked, [(s.level, len(s.checks)) for s in tokens]
    k = checked[0]
    path = tmp_path / "words.txt"
    path.write_text(doc, encoding="utf-8")

    def answered(page) -> None:
        assert "served by " in page.inner_text("#tf-model-info") and MODEL in page.inner_text("#tf-model-info")
        page.check("#tf-teaching input[type=checkbox]")  # the inspector's p and q are recorded
        ask_on_page(page, path, question)
        shown = page.locator(".tf-assistant").last.locator(".tf-tok")
        classes = shown.evaluate_all("els => els.map(e => e.className)")
        assert classes == [f"tf-tok tf-{s.level}" for s in tokens]  # each token coloured by its level
        shown.nth(k).click()
        page.wait_for_function("document.querySelector('#tf-inspector').innerText.includes('p(x) = ')")
        text = page.inner_text("#tf-inspector")
        assert f"proposed by the {LEVEL_STYLE[tokens[k].level][0]} · round {tokens[k].round}" in text, text
        checks = tokens[k].checks
        labels = "|".join(label for label, _ in LEVEL_STYLE.values())
        assert re.findall(rf"({labels}) checked it: (accepted|rejected)", text) == [
            (LEVEL_STYLE[c.verifier][0], "accepted" if c.accepted else "rejected") for c in checks], text
        for name, values in (("q", [c.q for c in checks]), ("p", [c.p for c in checks])):
            # four decimals on the page, two processes' float32 roundings apart
            assert [float(x) for x in re.findall(rf"{name}\(x\) = (\d+\.\d+)", text)] == pytest.approx(
                values, abs=2e-4), text

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    cmd = [sys.executable, "app.py", "--engine", cluster["base"], "--port", str(port), "--mode", "triforce",
           "--max-new-tokens", "24", "--data-dir", str(tmp_path / "data")]
    with running_server(cmd, tmp_path / "app.log", lambda: httpx.get(url, timeout=2).status_code == 200, env,
                        "the app"):
        in_browser(url, answered)
