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
import sys
import time

import httpx
import pytest

from conftest import (CHAT_TEMPLATE, free_port, make_hf, make_tokenizer, perturbed, running_server, save_checkpoint,
                      scrape_metrics, words)
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.prompting import render_prompt

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
         "--prefill-chunk", str(CHUNK), "--mode", "triforce", "--small-draft", "--slots", "4", "--device", "cpu"]
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
def reference(models):
    """The served pair loaded in this process: answers run alone."""
    from triforce_core.engine import TriForceEngine

    engine = TriForceEngine.from_pretrained(models["target"], models["draft"], device="cpu")

    def answer(messages, max_tokens):
        _, ids = render_prompt(engine.tokenizer, messages)
        cfg = GenerationConfig(sampling=engine.default_sampling(),
                               speculation=SpeculationConfig(mode="triforce", max_new_tokens=max_tokens, gamma2=4,
                                                             small_draft=True),
                               cache=CacheConfig(**CACHE))
        return engine.run(ids, cfg).text

    return answer


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
    """A replica killed mid-stream: the stream ends, with an error in the protocol's shape, and
    the cluster answers the next request."""
    body = {"model": MODEL, "messages": ask(document(600, 40), words(4, 601)), "temperature": 0,
            "max_tokens": WINDOW - 200, "ignore_eos": True, "stream": True}
    contents, tail = 0, []
    with httpx.stream("POST", cluster["base"] + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
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
