"""Load run of the OpenAI-compatible HTTP API: concurrent clients chatting about a long document.

    python -m bench.api_load                                  # 8 clients, 3 minutes, the demo pair
    python -m bench.api_load --clients 4 --duration 60 --json bench/results/api-load.json

Starts `python app.py` (the browser app and the HTTP API on one port) on a free port, then:

1. alone: each of `--conversations` two-turn conversations about the document (a quote
   question, then a follow-up; the client resends the whole conversation, as chat clients
   do) is answered once, greedy, with nothing else running: the reference answers;
2. load: `--clients` threads, each with its own `openai` client, run those conversations
   round after round for `--duration` seconds, streaming, and compare every answer with
   its reference (greedy decoding is deterministic, so they must be equal).

With `--hostile` (the soak): after each conversation every client also sends one request a
web page or a careless caller could send, in turn: a foreign Host (DNS rebinding), a foreign
Origin as a text/plain "simple request" and as JSON, a body that is not JSON, a 20 MB body
sent in chunks, an unknown model, a model file that lies about itself (a damaged GGUF file
in a `--models-dir` made for the run), out-of-range sampling values. Each must be refused
(4xx) and the server must keep serving; the good answers must still equal the quiet run's.

Reported: requests served, errors, answers different from alone, time to first token (p50,
p95, by turn: the first turn may prefill the whole document, the second reuses it), decode
tokens/s from the responses' `triforce` statistics, hostile requests by kind and status, and
the server's resident memory (VmRSS) after the alone phase, each minute, at the end, and its
peak (VmHWM). A timing run, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.chat import DOCUMENT, quote_questions
from bench.servers import stop

ROOT = Path(__file__).resolve().parent.parent
FOLLOW_UPS = ("And what comes after that?", "Why does that matter?", "Give an example.", "Say it more briefly.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and its peak so far (VmHWM), in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    env.pop("TRIFORCE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port),
                             "--data-dir", tempfile.mkdtemp(prefix="triforce-api-load-data-"), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the app exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("error: the app did not start within 300 s")


HOSTILE = ("foreign-host", "foreign-origin-text", "foreign-origin-json", "not-json", "oversized", "unknown-model",
           "lying-model-file", "bad-values")


def hostile(kind: str, base: str, model: str) -> int:
    """Send one hostile request of `kind`; its HTTP status (a refusal is 4xx)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
    url = base + "/chat/completions"
    port = base.split(":")[2].split("/")[0]
    json_type = {"Content-Type": "application/json"}
    if kind == "foreign-host":
        r = httpx.post(url, json=body, headers={"Host": f"rebind.example:{port}"}, timeout=60)
    elif kind == "foreign-origin-text":
        r = httpx.post(url, content=json.dumps(body), headers={"Origin": "http://evil.example",
                                                               "Content-Type": "text/plain"}, timeout=60)
    elif kind == "foreign-origin-json":
        r = httpx.post(url, json=body, headers={"Origin": "http://evil.example"}, timeout=60)
    elif kind == "not-json":
        r = httpx.post(url, content=b"{not json", headers=json_type, timeout=60)
    elif kind == "oversized":
        def chunks():
            yield b'{"model": "x", "messages": [{"role": "user", "content": "'
            for _ in range(20):
                yield b"a" * (1 << 20)
            yield b'"}]}'
        try:
            r = httpx.post(url, content=chunks(), headers=json_type, timeout=60)
        except httpx.HTTPError:  # the server may close the connection once it has refused
            return 413
    elif kind == "unknown-model":
        r = httpx.post(url, json={**body, "model": "no-such-model"}, timeout=60)
    elif kind == "lying-model-file":
        r = httpx.post(url, json={**body, "model": "lying"}, timeout=300)
    elif kind == "bad-values":
        r = httpx.post(url, json={**body, "temperature": -1, "max_tokens": 10**12}, timeout=60)
    else:
        raise ValueError(kind)
    return r.status_code


class Load:
    """The clients' shared record of what happened."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.errors: list[str] = []
        self.hostile: dict[str, dict[int, int]] = {}  # kind -> status -> count
        self.mismatches = 0
        self.ttft: dict[int, list[float]] = {1: [], 2: []}
        self.decode_tps: list[float] = []
        self.reused: dict[int, list[int]] = {1: [], 2: []}

    def add(self, turn: int, ttft: float, stats: dict, same: bool) -> None:
        with self.lock:
            self.requests += 1
            self.ttft[turn].append(ttft)
            self.decode_tps.append(stats.get("decode_tokens_per_s", 0.0))
            self.reused[turn].append(stats.get("reused_tokens", 0))
            self.mismatches += not same


def ask(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float, dict]:
    """Stream one greedy answer: (text, seconds to its first token, the `triforce` statistics)."""
    t0 = time.perf_counter()
    first = None
    parts, stats = [], {}
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True)
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content
            if delta:
                first = first or time.perf_counter() - t0
                parts.append(delta)
            if chunk.choices[0].finish_reason:
                stats = (chunk.model_extra or {}).get("triforce", {})
    return "".join(parts), first if first is not None else time.perf_counter() - t0, stats


def conversation_turns(document: str, question: str, follow_up: str, first_answer: str | None):
    turn1 = [{"role": "user", "content": f"{document}\n\n{question}"}]
    if first_answer is None:
        return turn1, None
    return turn1, turn1 + [{"role": "assistant", "content": first_answer}, {"role": "user", "content": follow_up}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--duration", type=float, default=180, help="seconds of load (default 180)")
    p.add_argument("--conversations", type=int, default=4, help="distinct two-turn conversations (default 4)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    p.add_argument("--document", default=str(DOCUMENT), help="the document (default: the held-out sample)")
    p.add_argument("--seed", type=int, default=0, help="picks the quote questions (default 0)")
    p.add_argument("--app-args", default="", help="extra arguments for app.py, e.g. '--api-slots 8'")
    p.add_argument("--hostile", action="store_true",
                   help="the soak: each client also sends one hostile request after each conversation")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.conversations < 1 or args.max_tokens < 1:
        p.error("--clients, --duration, --conversations and --max-tokens must be positive")

    import httpx
    import openai

    from triforce_core.documents import load_document

    document = load_document(args.document).text.strip()
    questions = quote_questions(document, args.conversations, args.seed)
    load_before = os.getloadavg()[0]  # > cores: the machine was shared during the run
    port = free_port()
    print(f"starting app.py on port {port} ...", file=sys.stderr)
    extra = args.app_args.split()
    if args.hostile:  # a models folder holding one file that lies about itself
        import tempfile

        models_dir = Path(tempfile.mkdtemp(prefix="soak-models-"))
        (models_dir / "lying.gguf").write_bytes(b"GGUF" + os.urandom(4096))
        extra += ["--models-dir", str(models_dir)]
    proc = start_server(port, extra)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        # 1. alone: the reference answers, one request at a time.
        expected: list[tuple[list[dict], str, list[dict], str]] = []
        alone_ttft: dict[int, list[float]] = {1: [], 2: []}
        prompt_tokens = 0
        for i, q in enumerate(questions):
            turn1, _ = conversation_turns(document, q, "", None)
            a1, t1, stats1 = ask(client, model, turn1, args.max_tokens)
            prompt_tokens = stats1.get("prefill_tokens", 0) + stats1.get("reused_tokens", 0)
            _, turn2 = conversation_turns(document, q, FOLLOW_UPS[i % len(FOLLOW_UPS)], a1)
            a2, t2, _ = ask(client, model, turn2, args.max_tokens)
            expected.append((turn1, a1, turn2, a2))
            alone_ttft[1].append(t1)
            alone_ttft[2].append(t2)
            print(f"alone {i + 1}/{len(questions)}: first token {t1:.2f} s, follow-up {t2:.2f} s", file=sys.stderr)
        mem_start = memory_mb(proc.pid)
        samples = [(0.0, mem_start["VmRSS"])]

        # 2. load: every client runs the conversations round after round.
        load = Load()
        t_start = time.perf_counter()
        deadline = t_start + args.duration

        def client_loop(c: int) -> None:
            me = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=900)
            k = c
            while time.perf_counter() < deadline:
                turn1, a1, turn2, a2 = expected[k % len(expected)]
                k += 1
                for turn, messages, want in ((1, turn1, a1), (2, turn2, a2)):
                    try:
                        text, ttft, stats = ask(me, model, messages, args.max_tokens)
                        load.add(turn, ttft, stats, text == want)
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        with load.lock:
                            load.errors.append(f"{type(e).__name__}: {e}")
                        break
                if args.hostile:
                    kind = HOSTILE[(k + c) % len(HOSTILE)]
                    try:
                        status = hostile(kind, base, model)
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        status = -1
                        with load.lock:
                            load.errors.append(f"hostile {kind}: {type(e).__name__}: {e}")
                    with load.lock:
                        by_status = load.hostile.setdefault(kind, {})
                        by_status[status] = by_status.get(status, 0) + 1
                        if not 400 <= status < 500:
                            load.errors.append(f"hostile {kind}: status {status}, not a refusal")

        threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()
        next_sample = 60.0
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            elapsed = time.perf_counter() - t_start
            if elapsed >= next_sample:
                samples.append((round(elapsed), memory_mb(proc.pid)["VmRSS"]))
                next_sample += 60.0
                with load.lock:
                    print(f"{elapsed:.0f} s: {load.requests} requests, {len(load.errors)} errors, "
                          f"{load.mismatches} different", file=sys.stderr)
        wall = time.perf_counter() - t_start
        mem_end = memory_mb(proc.pid)
        samples.append((round(wall), mem_end["VmRSS"]))
        health = httpx.get(base + "/health", timeout=30).json()
    finally:
        stop(proc, timeout_s=30)

    def ms(v):
        return None if v is None else round(1000 * v)

    report = {
        "machine": {"cores": os.cpu_count(), "load_average_1min": [load_before, os.getloadavg()[0]],
                    "python": sys.version.split()[0]},
        "model": model,
        "document": Path(args.document).name,
        "prompt_tokens_turn1": prompt_tokens,
        "clients": args.clients,
        "conversations": len(expected),
        "max_tokens": args.max_tokens,
        "app_args": args.app_args,
        "duration_s": round(wall, 1),
        "requests": load.requests,
        "requests_per_minute": round(60 * load.requests / wall, 1),
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "different_from_alone": load.mismatches,
        "hostile_by_kind_and_status": load.hostile,
        "ttft_ms": {f"turn{t}": {"p50": ms(percentile(v, 0.5)), "p95": ms(percentile(v, 0.95)), "n": len(v)}
                    for t, v in load.ttft.items()},
        "ttft_alone_ms": {f"turn{t}": {"p50": ms(percentile(v, 0.5))} for t, v in alone_ttft.items()},
        "reused_tokens_median": {f"turn{t}": statistics.median(v) if v else None for t, v in load.reused.items()},
        "decode_tokens_per_s_median": round(statistics.median(load.decode_tps), 1) if load.decode_tps else None,
        "memory_mb": {"rss_after_alone": round(mem_start["VmRSS"]), "peak_after_alone": round(mem_start["VmHWM"]),
                      "rss_end": round(mem_end["VmRSS"]), "peak_end": round(mem_end["VmHWM"]),
                      "rss_by_minute": [(t, round(v)) for t, v in samples]},
        "server_health_end": health,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if load.errors or load.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
