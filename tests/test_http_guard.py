"""Who may talk to the servers, for real: `python -m triforce_core serve` and `python app.py`
behind the guard (`triforce_core.serving.guard`, docs/security.md), driven by httpx, raw
sockets, the official `openai` client, `gradio_client` and headless Chromium.

A web page the user visits can make the browser send requests to a local server: "simple"
ones (a text/plain POST) without asking first, and, through DNS rebinding, with a foreign
`Host` and readable answers. Each refusal here is checked to come before any generation (the
server's count of served requests and its jobs stay as they were).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers.cli import SMALL_CACHE_FLAGS
from tests.helpers.models import CHAT_TEMPLATE, make_hf, make_tokenizer, save_checkpoint
from tests.helpers.servers import free_port, running_server

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
KEY = "guard-key-5678"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "guard-target"
PROXY = "proxy.example"  # --allowed-hosts
TOOL = "http://tools.example:3000"  # --allowed-origins: a web page allowed to call the API
EVIL = "http://evil.example"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "w7 w8 w9"}], "temperature": 0, "max_tokens": 8}
LONG = {**ASK, "max_tokens": 400, "ignore_eos": True}  # what a refused request would have cost

# Both servers are started once for the module: its tests share one pytest worker (make test).
pytestmark = pytest.mark.xdist_group("guard")


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    target = save_checkpoint(root / MODEL, make_hf("llama_gqa_llama3", seed=0), tok)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(root / "home"))
    cmd = [sys.executable, "-m", "triforce_core", "serve", "--target", target, "--port", str(port),
           "--mode", "autoregressive", "--slots", "1", "--api-key", KEY, "--allowed-hosts", PROXY,
           "--allowed-origins", f"{TOOL}, https://other.example", *SMALL_CACHE_FLAGS]
    base = f"http://127.0.0.1:{port}"
    probe = lambda: httpx.get(f"{base}/v1/health", headers=AUTH, timeout=2).status_code == 200  # noqa: E731
    with running_server(cmd, root / "serve.log", probe, env):
        yield {"base": base, "port": port, "log": root / "serve.log"}


def call(server, method: str, path: str, *, host: str | None = None, origin: str | None = None, key: bool = True,
         body: dict | None = None, content: bytes | None = None, ctype: str | None = "application/json",
         headers: dict | None = None) -> httpx.Response:
    h = dict(AUTH if key else {})
    if host is not None:
        h["Host"] = host
    if origin is not None:
        h["Origin"] = origin
    if ctype is not None and (body is not None or content is not None):
        h["Content-Type"] = ctype
    h.update(headers or {})
    data = json.dumps(body).encode() if body is not None else content
    return httpx.request(method, server["base"] + path, headers=h, content=data, timeout=60)


def health(server) -> dict:
    return httpx.get(server["base"] + "/v1/health", headers=AUTH, timeout=10).json()


def assert_refused(r: httpx.Response, status: int, code: str, api: bool = True) -> str:
    """The refusal's one line, checked to have the status and the shape of its place."""
    assert r.status_code == status, r.text
    body = r.json()
    if api:
        err = body["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error"
        message = err["message"]
    else:
        message = body["error"]
        assert isinstance(message, str)
    assert message and "\n" not in message
    return message


def nothing_ran(server, before: dict) -> None:
    after = health(server)
    assert after["jobs"] == 0 and after["requests_served"] == before["requests_served"]


# -- the policy alone ------------------------------------------------------------------------------

def test_the_policy_decides_by_name_address_and_port():
    from triforce_core.serving.guard import AccessPolicy

    local = AccessPolicy(allowed_hosts=("Proxy.Example", "pinned.example:8443"), allowed_origins=(TOOL + "/",))
    assert [local.host_allowed(h) for h in ("localhost", "127.0.0.2:80", "[::1]", "proxy.example:1", "proxy.example.",
                                            "pinned.example:8443", None)] == [True] * 7
    assert not any(local.host_allowed(h) for h in ("rebind.example", "192.168.1.5", "pinned.example:80",
                                                   "localhost.rebind.example", "[::2]"))
    wild = AccessPolicy(bind_host="0.0.0.0")
    assert wild.host_allowed("192.168.1.5:7860") and wild.host_allowed("[fe80::1]")
    assert wild.host_allowed(socket.gethostname()) and not wild.host_allowed("rebind.example")
    named = AccessPolicy(bind_host="studio.lan")
    assert named.host_allowed("studio.lan:7860") and not named.host_allowed("192.168.1.5")
    host = "127.0.0.1:7860"
    assert local.origin_allowed("http://127.0.0.1:7860", host) and local.origin_allowed("http://localhost:7860", host)
    assert local.origin_allowed("http://tools.example:3000", host) and local.cross_origin_allowed(TOOL)
    assert not any(local.origin_allowed(o, host) for o in ("http://localhost:7861", "null", "http://127.0.0.1",
                                                           "https://tools.example:3000", "file://", EVIL))
    assert not local.origin_allowed("http://localhost:7860", "studio.lan:7860")  # another machine's page
    assert AccessPolicy(allowed_origins=("*",)).origin_allowed("null", host)
    with pytest.raises(ValueError, match="not an origin"):
        AccessPolicy(allowed_origins=("tools.example:3000",))
    assert KEY not in repr(AccessPolicy(api_key=KEY))


def test_a_bad_flag_is_one_line_before_any_model_is_loaded():
    from tests.helpers.cli import run_main

    code, _, err = run_main(["serve", "--target", "/nonexistent", "--allowed-origins", "tools.example"])
    assert code == 2 and err.count("\n") == 1 and "not an origin" in err


# -- Host ------------------------------------------------------------------------------------------

def test_a_foreign_host_is_refused_before_anything_runs(serve):
    before = health(serve)
    for host in ("rebind.example", f"rebind.example:{serve['port']}", "127.0.0.1.rebind.example"):
        r = call(serve, "POST", "/v1/chat/completions", host=host, body=LONG)
        assert "rebind.example" in assert_refused(r, 403, "host_not_allowed")
        streamed = call(serve, "POST", "/v1/chat/completions", host=host, body={**LONG, "stream": True})
        assert_refused(streamed, 403, "host_not_allowed")
    assert_refused(call(serve, "GET", "/", host="rebind.example"), 403, "", api=False)  # not /v1: plain JSON
    nothing_ran(serve, before)


def test_loopback_names_the_bound_address_and_allowed_hosts_are_served(serve):
    port = serve["port"]
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", PROXY,
                 f"{PROXY}:8443"):
        r = call(serve, "GET", "/v1/models", host=host)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, (host, r.text)
    assert_refused(call(serve, "GET", "/v1/models", host=f"sub.{PROXY}"), 403, "host_not_allowed")


# -- Origin ----------------------------------------------------------------------------------------

def test_a_foreign_origin_is_refused_whatever_the_content_type(serve):
    """The page's "simple" request (text/plain, no preflight) and a JSON one, with or without
    the key (a page may learn it), and its preflight: all 403, nothing generated."""
    before = health(serve)
    text = json.dumps(LONG).encode()
    for origin in (EVIL, "null", f"http://127.0.0.1:{serve['port'] + 1}", TOOL.replace("3000", "3001")):
        for key in (False, True):
            plain = call(serve, "POST", "/v1/chat/completions", origin=origin, key=key, content=text,
                         ctype="text/plain")
            assert "refused" in assert_refused(plain, 403, "origin_not_allowed")
            as_json = call(serve, "POST", "/v1/chat/completions", origin=origin, key=key, body=LONG)
            assert_refused(as_json, 403, "origin_not_allowed")
        preflight = call(serve, "OPTIONS", "/v1/chat/completions", origin=origin, key=False,
                         headers={"Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    nothing_ran(serve, before)


def test_an_allowed_origin_gets_its_preflight_answered_and_its_requests_served(serve):
    asked = "authorization, content-type, x-stainless-lang"
    pre = call(serve, "OPTIONS", "/v1/chat/completions", origin=TOOL, key=False,
               headers={"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == TOOL and "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == asked and "origin" in pre.headers["vary"].lower()
    r = call(serve, "POST", "/v1/chat/completions", origin=TOOL, body=ASK)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert r.headers["access-control-allow-origin"] == TOOL
    assert "access-control-allow-credentials" not in r.headers  # cookies are never shared across origins
    assert call(serve, "GET", "/v1/models", origin="https://other.example").status_code == 200
    # the key still applies to an allowed origin
    assert_refused(call(serve, "POST", "/v1/chat/completions", origin=TOOL, key=False, body=ASK), 401,
                   "invalid_api_key")


def test_the_servers_own_origin_and_a_loopback_alias_on_its_port_are_served(serve):
    port = serve["port"]
    for host, origin in ((f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
                         (f"127.0.0.1:{port}", f"http://localhost:{port}"),
                         (f"localhost:{port}", f"http://[::1]:{port}"),
                         (f"{PROXY}:443", f"https://{PROXY}")):  # behind a TLS proxy
        r = call(serve, "GET", "/v1/models", host=host, origin=origin)
        assert r.status_code == 200, (host, origin, r.text)
        assert "access-control-allow-origin" not in r.headers  # same origin: no CORS needed
    # a loopback origin does not vouch for a request that came to another name
    assert_refused(call(serve, "GET", "/v1/models", host=PROXY, origin=f"http://localhost:{port}"), 403,
                   "origin_not_allowed")


# -- bodies ----------------------------------------------------------------------------------------

def test_only_json_bodies_are_accepted_at_v1(serve):
    before = health(serve)
    text = json.dumps(LONG).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = call(serve, "POST", "/v1/chat/completions", content=text, ctype=ctype)
        assert "application/json" in assert_refused(r, 415, "unsupported_media_type")
    nothing_ran(serve, before)
    ok = call(serve, "POST", "/v1/chat/completions", body=ASK, ctype="application/json; charset=utf-8")
    assert ok.status_code == 200, ok.text


def raw_request(port: int, head: str, chunks=(), timeout: float = 30) -> tuple[int, str]:
    """Send a request head and body pieces over a socket, never ending a chunked body; return the
    status and body of the response that comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode())
        for chunk in chunks:
            s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        data = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            data += part
            if b"\r\n\r\n" in data:
                head_end = data.index(b"\r\n\r\n")
                length = [line for line in data[:head_end].split(b"\r\n") if line.lower().startswith(b"content-length")]
                if length and len(data) - head_end - 4 >= int(length[0].split(b":")[1]):
                    break
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode()


def test_an_oversized_body_is_refused_without_reading_it_whole(serve):
    from triforce_core.serving.openai.schemas import MAX_BODY_BYTES

    before = health(serve)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{serve['port']}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n")
    # A Content-Length over the limit: refused up front, not one byte of the body sent.
    t = time.time()
    status, body = raw_request(serve["port"], head + f"Content-Length: {MAX_BODY_BYTES * 100}\r\n\r\n")
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large" and time.time() - t < 10
    # A chunked body that never ends: refused as soon as its bytes pass the limit.
    piece = b" " * 1_000_000
    chunks = [piece] * (MAX_BODY_BYTES // len(piece)) + [b" " * 1000]
    status, body = raw_request(serve["port"], head + "Transfer-Encoding: chunked\r\n\r\n", chunks)
    err = json.loads(body)["error"]
    assert status == 413 and err["code"] == "request_too_large" and f"{MAX_BODY_BYTES:,}" in err["message"]
    nothing_ran(serve, before)
    assert "Traceback" not in serve["log"].read_text()


# -- clients without Origin ------------------------------------------------------------------------

def test_sdks_and_curl_like_clients_without_origin_are_served_as_before(serve):
    client = openai.OpenAI(base_url=serve["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=ASK["messages"], temperature=0, max_tokens=8)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK["messages"], temperature=0, max_tokens=8,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    plain = httpx.post(serve["base"] + "/v1/chat/completions", json=ASK, headers=AUTH, timeout=60)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=serve["base"] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert_refused(httpx.get(serve["base"] + "/v1/health"), 401, "invalid_api_key")  # everything is guarded


# -- the app ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app_server(tmp_path_factory):
    """`python app.py --api-key KEY` on the embedded demo pair."""
    port = free_port()
    log = tmp_path_factory.mktemp("guard-app") / "app.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    cmd = [sys.executable, str(ROOT / "app.py"), "--target", "demo", "--port", str(port), "--max-new-tokens", "8",
           "--api-key", KEY, "--data-dir", str(log.parent / "data")]
    url = f"http://127.0.0.1:{port}/"
    with running_server(cmd, log, lambda: httpx.get(url, timeout=2).status_code == 401, env, "the app"):
        yield {"url": url, "base": url.rstrip("/"), "port": port, "log": log}


def test_the_app_and_its_gradio_api_need_the_key(app_server):
    from gradio_client import Client
    from ui.server import mount_options

    assert mount_options()["show_error"] is False  # a handler's own gr.Error line only, never a traceback
    url, page = app_server["url"], {"Accept": "text/html"}
    login = httpx.get(url, headers=page)
    assert login.status_code == 401 and "name='key'" in login.text and "gradio" not in login.text.lower()
    assert_refused(call(app_server, "GET", "/gradio_api/info", key=False), 401, "", api=False)
    assert_refused(call(app_server, "POST", "/gradio_api/queue/join", key=False, body={"data": ["hi", None]}), 401,
                   "", api=False)
    with pytest.raises(Exception, match="credentials|401"):  # noqa: PT011 - gradio_client's own error
        Client(url, verbose=False)
    assert "incorrect" in httpx.get(url + "?key=wrong", headers=page).text
    # A link with the key: a cookie (HttpOnly, this site only) and the page without the key.
    r = httpx.get(url + "?key=" + KEY + "&__theme=dark")
    assert r.status_code == 303 and r.headers["location"] == "/?__theme=dark"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie
    name, _, value = cookie.partition(";")[0].partition("=")
    assert name == f"triforce_key_{app_server['port']}"
    served = httpx.get(url, headers={**page, "Cookie": f"{name}={value}"})
    assert served.status_code == 200 and "gradio" in served.text.lower()
    # gradio_client with the key in a header: the named `chat` endpoint answers.
    answer = Client(url, verbose=False, headers=AUTH).predict("Hello", None, api_name="/chat")
    assert isinstance(answer, str) and answer.strip()
    assert call(app_server, "GET", "/v1/models").json()["data"][0]["id"] == "triforce-demo"


def test_the_app_checks_host_origin_and_body_size(app_server):
    port = app_server["port"]
    assert_refused(call(app_server, "GET", "/", host="rebind.example"), 403, "", api=False)
    assert_refused(call(app_server, "GET", "/v1/models", host="rebind.example"), 403, "host_not_allowed")
    text = json.dumps({**ASK, "model": "triforce-demo"}).encode()
    assert_refused(call(app_server, "POST", "/v1/chat/completions", origin=EVIL, content=text, ctype="text/plain"),
                   403, "origin_not_allowed")
    assert_refused(call(app_server, "POST", "/gradio_api/queue/join", origin=EVIL, body={"data": []}), 403, "",
                   api=False)
    assert_refused(call(app_server, "POST", "/v1/chat/completions", content=text, ctype="text/plain"), 415,
                   "unsupported_media_type")
    own = call(app_server, "GET", "/gradio_api/info", origin=f"http://localhost:{port}")
    assert own.status_code == 200
    # an upload over the limit (--max-upload-mb 50, plus room for the form) is refused up front
    head = (f"POST /gradio_api/upload HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 60000000\r\n\r\n")
    status, body = raw_request(port, head)
    assert status == 413 and "51,000,000" in json.loads(body)["error"]


def test_the_login_form_opens_the_app_in_a_browser(app_server):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")

    def browse():
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
            try:
                page = browser.new_page()
                page.set_default_timeout(60_000)
                page.goto(app_server["url"])
                page.fill("input[name=key]", "wrong")
                page.click("button[type=submit]")
                assert "incorrect API key" in page.inner_text("#tf-login-error")
                page.fill("input[name=key]", KEY)
                page.click("button[type=submit]")
                page.wait_for_selector("#tf-send")  # the page, its config and its queue, with the cookie
                page.fill("#tf-message textarea", "Hello")
                page.click("#tf-send")
                page.wait_for_selector(".tf-assistant .tf-tok", state="attached")  # an answer through the guarded queue
                cookies = {c["name"]: c for c in page.context.cookies()}
                jar = cookies[f"triforce_key_{app_server['port']}"]
                assert jar["httpOnly"] and jar["sameSite"] == "Strict"
            finally:
                browser.close()

    # In a thread of its own: another module's page may hold this thread's Playwright loop.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(browse).result(timeout=240)
