"""The engine served by Ray Serve against `serve` in one process, then under load with a replica
killed: answers, cache reuse, hangs, errors, memory and `/metrics`.

    python -m bench.cluster_load [--target demo|smollm2|PATH] [--clients 8] [--minutes 3] \\
        [--json bench/results/cluster-load-demo.json]

1. **Answers.** Four documents (slices of the sample chapters, `--doc-tokens` each), five
   questions each: a first question and four follow-ups in the same conversation, greedy,
   not streamed. Asked of `serve` in one process, then of `serve --ray --replicas 2` on a local
   Ray cluster (`--cpus`, one per replica) with a fresh shared `--kv-cache-dir`, with the same
   model flags. Reported: whether every answer is identical, and the share of follow-ups whose
   prompt reused the conversation's cached prefix (`reused_tokens` > 0).
2. **Load.** `--clients` threads for `--minutes`, each a conversation over its document that
   starts afresh every `--turns` questions, streamed and not streamed in turn; halfway through,
   the replica that answered last is killed (`ray.kill`, as a crash would), and Serve starts
   another. Every request has a `--hang-s` bound: one that passes it is a hang. Reported: the
   requests by kind and outcome (answered; a stream ended by an error chunk; an HTTP error; a
   hang), and the resident memory of the engine replicas every 10 s.
3. **Metrics.** `/metrics` of the ingress before and after the load: the rise of each counter
   against the sum of the answers' own statistics.

`--sweep 1,2,4,8`: instead, one replica of one core under each number of clients in turn
(`--minutes` each, no kill, every document read once before): answers and generated tokens per
second, counted over the answers that ended within the minutes, and their latency (median and
95th percentile), the measurement behind autoscaling's target of requests in flight per replica
(`ClusterSpec.target_ongoing_requests`).

A measurement, not a test: nothing here asserts a speed; `tests/test_cluster.py` is the test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.servers import ROOT, started

SAMPLES = sorted((ROOT / "assets" / "sample").glob("python-tutorial-*.txt"))
QUESTIONS = ["What is this part about?", "What is a class?", "Give an example from the text.",
             "What does the text say about modules?", "Summarise it in one sentence."]
REPLICA_PREFIX = "SERVE_REPLICA::triforce#engine#"


def documents(tokenizer, n: int, tokens: int) -> list[str]:
    """`n` slices of the sample chapters, each about `tokens` tokens, cut at paragraphs."""
    paragraphs = [p for s in SAMPLES for p in s.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out, at = [], 0
    for _ in range(n):
        doc = []
        while at < len(paragraphs) and len(tokenizer.encode("\n\n".join(doc))) < tokens:
            doc.append(paragraphs[at])
            at += 1
        out.append("\n\n".join(doc))
    if len(out[-1]) == 0:
        raise SystemExit("the sample chapters are too short for that many documents of that size")
    return out


def request(base: str, model: str, messages: list[dict], max_tokens: int, stream: bool, hang_s: float) -> dict:
    """One greedy question. Returns outcome ("answered", "error chunk", "http error", "hang"),
    the answer's text, usage, `triforce` statistics, replica and seconds."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out = {"stream": stream, "outcome": "answered", "text": "", "usage": None, "stats": None, "replica": None}
    t0 = time.perf_counter()
    try:
        if not stream:
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=hang_s)
            out["replica"] = r.headers.get("x-triforce-replica")
            if r.status_code != 200:
                out.update(outcome="http error", error=f"{r.status_code}: {r.text[:200]}")
            else:
                j = r.json()
                out.update(text=j["choices"][0]["message"]["content"], usage=j["usage"], stats=j["triforce"])
        else:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=hang_s) as r:
                out["replica"] = r.headers.get("x-triforce-replica")
                if r.status_code != 200:
                    out.update(outcome="http error", error=f"{r.status_code}: {r.read()[:200]!r}")
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if time.perf_counter() - t0 > hang_s:
                        raise httpx.ReadTimeout("the stream ran past the bound")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        out.update(outcome="error chunk", error=chunk["error"].get("message", ""))
                        break
                    if chunk.get("choices"):
                        out["text"] += chunk["choices"][0]["delta"].get("content") or ""
                        out["stats"] = chunk.get("triforce", out["stats"])
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
                if out["outcome"] == "answered" and r.status_code == 200 and out["stats"] is None:
                    out.update(outcome="error chunk", error="the stream ended without its final chunk")
    except httpx.TimeoutException:
        out.update(outcome="hang")
    except httpx.HTTPError as e:
        out.update(outcome="http error", error=f"{type(e).__name__}: {e}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["ended"] = time.monotonic()  # for a sweep's window
    return out


def conversation(base: str, model: str, doc: str, questions: list[str], max_tokens: int, hang_s: float,
                 stream_from: int = 0) -> list[dict]:
    """The questions asked in turn in one conversation over `doc` (the document leads the first
    message); request i is streamed where (i + stream_from) is odd."""
    messages, out = [], []
    for i, q in enumerate(questions):
        messages.append({"role": "user", "content": f"{doc}\n\n{q}" if i == 0 else q})
        r = request(base, model, messages, max_tokens, stream=(i + stream_from) % 2 == 1, hang_s=hang_s)
        out.append(r)
        if r["outcome"] != "answered":
            break
        messages.append({"role": "assistant", "content": r["text"]})
    return out


def replica_memory_mb() -> dict[str, float]:
    """Resident memory of each engine replica process of this process's cluster (by its Ray
    process title, under the raylet this process started), in MB."""
    import psutil

    out, me = {}, os.getpid()
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if ("ServeReplica:triforce:engine" in cmd and p.info["memory_info"] is not None
                    and any(a.pid == me for a in p.parents())):
                out[str(p.info["pid"])] = round(p.info["memory_info"].rss / 1e6, 1)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def metric_sums(answers: list[dict]) -> dict[str, int]:
    """What /metrics should have risen by: the sums of the answers' own statistics."""
    sums = {"triforce:generation_tokens_total": 0, "triforce:prompt_tokens_total": 0,
            "triforce:prompt_tokens_reused_total": 0}
    for a in answers:
        sums["triforce:generation_tokens_total"] += a["usage"]["completion_tokens"]
        sums["triforce:prompt_tokens_total"] += a["usage"]["prompt_tokens"]
        sums["triforce:prompt_tokens_reused_total"] += a["stats"].get("reused_tokens", 0)
        for level, c in (a["stats"].get("spec_decode") or {}).items():
            for field in ("drafts", "draft_tokens", "accepted_tokens"):
                key = f"triforce:spec_decode_num_{field}_total{{level={level}}}"
                sums[key] = sums.get(key, 0) + c[field]
    return sums


def scrape(base: str, model: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", timeout=60)
    r.raise_for_status()
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.labels.get("model_name") == model:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="demo", help="demo (the embedded pair), smollm2, or a model path")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (one per replica)")
    p.add_argument("--doc-tokens", type=int, default=1500, help="tokens of each document (the target's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--turns", type=int, default=3, help="questions per conversation under load")
    p.add_argument("--hang-s", type=float, default=600.0, help="a request still open after this long is a hang")
    p.add_argument("--no-kill", action="store_true", help="load without killing a replica (the control)")
    p.add_argument("--sweep", help="comma-separated client counts: one replica's throughput and latency under each")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from triforce_core.models.loading import default_model_names

    target = None if args.target == "demo" else args.target
    model_id = "triforce-demo" if target is None else None
    tokenizer = AutoTokenizer.from_pretrained(default_model_names(target, None)[0]) if target != "smollm2" else None
    if tokenizer is None:
        from triforce_core.engine import TriForceEngine

        tokenizer = TriForceEngine.from_pretrained(*default_model_names("smollm2", None)).tokenizer
    docs = documents(tokenizer, 4, args.doc_tokens)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    model_flags = [] if target is None else ["--target", target]
    folder = Path(tempfile.mkdtemp(prefix="cluster-load-"))
    port = 18000 + os.getpid() % 1000
    report: dict = {"target": args.target, "documents": [len(tokenizer.encode(d)) for d in docs]}

    # 1. the 20 answers, in one process and through the cluster
    def answers(base: str) -> list[list[dict]]:
        return [conversation(base, model, d, QUESTIONS, args.max_tokens, args.hang_s) for d in docs]

    if args.sweep:
        report["sweep"] = sweep(docs, args, port, folder, model_flags, model_id, log)
        return finish(report, args, argv)
    base = f"http://127.0.0.1:{port}"
    with started([sys.executable, "-m", "triforce_core", "serve", "--port", str(port), *model_flags], base, "serve",
                 folder / "serve.log"):
        model = model_id or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        t0 = time.perf_counter()
        alone = answers(base)
        log(f"serve: 20 answers in {time.perf_counter() - t0:.0f} s")
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    try:
        cmd = [sys.executable, "-m", "triforce_core", "serve", "--ray", "--address",
               ray.get_runtime_context().gcs_address, "--replicas", "2", "--cpus-per-replica",
               str(max(1, args.cpus // 2)), "--port", str(port + 1), "--kv-cache-dir", str(folder / "kv"), *model_flags]
        base = f"http://127.0.0.1:{port + 1}"
        with started(cmd, base, "serve --ray", folder / "serve-ray.log"):
            t0 = time.perf_counter()
            served = answers(base)
            log(f"serve --ray: 20 answers in {time.perf_counter() - t0:.0f} s")
            pairs = [(a, b) for ca, cb in zip(alone, served) for a, b in zip(ca, cb)]
            follow = [b for cb in served for b in cb[1:]]
            report["answers"] = {
                "asked": sum(map(len, served)),
                "identical": sum(a["outcome"] == b["outcome"] == "answered" and a["text"] == b["text"] for a, b in pairs),
                "follow_ups": len(follow),
                "follow_ups_reusing": sum(bool(b["stats"] and b["stats"].get("reused_tokens", 0) > 0) for b in follow),
                "replicas": sorted({b["replica"] for b in follow if b["replica"]}),
            }
            log(f"answers: {report['answers']}")
            report["load"] = load(base, model, docs, args, log)
    finally:
        ray.shutdown()
    return finish(report, args, argv)


def finish(report: dict, args, argv) -> int:
    cpus = 1 if args.sweep else args.cpus  # a sweep's cluster is its one replica's core
    report["machine"] = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"Ray cluster of {cpus} CPU{'s' if cpus > 1 else ''}")
    report["command"] = "python -m bench.cluster_load " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


def sweep(docs: list[str], args, port: int, folder: Path, model_flags: list[str], model_id, log) -> list[dict]:
    """One replica of one core on a local cluster, loaded by each number of clients in turn."""
    import ray

    rows = []
    ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        cmd = [sys.executable, "-m", "triforce_core", "serve", "--ray", "--address",
               ray.get_runtime_context().gcs_address, "--replicas", "1", "--cpus-per-replica", "1",
               "--port", str(port), "--kv-cache-dir", str(folder / "kv"), *model_flags]
        base = f"http://127.0.0.1:{port}"
        with started(cmd, base, "serve --ray", folder / "serve-ray.log"):
            model = model_id or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            for d in docs:  # every document in the cache first: the sweep measures answering, not first reads
                conversation(base, model, d, QUESTIONS[:1], args.max_tokens, args.hang_s)
            for clients in [int(c) for c in args.sweep.split(",")]:
                run = load(base, model, docs, argparse.Namespace(**{**vars(args), "clients": clients, "no_kill": True}),
                           log, keep=True)
                # Counted: the answers that ended inside the window, while all the clients were
                # asking (a conversation begun before its end runs on after it, with fewer clients).
                window = 60 * args.minutes
                answered = [r for r in run.pop("answered") if r["usage"] and r["ended"] <= run["stop_at"]]
                seconds = sorted(r["seconds"] for r in answered)
                rows.append({"clients": clients, "answers": len(answered),
                             "answers_per_s": round(len(answered) / window, 3),
                             "tokens_per_s": round(sum(r["usage"]["completion_tokens"] for r in answered) / window, 2),
                             "latency_median_s": seconds[len(seconds) // 2] if seconds else None,
                             "latency_p95_s": seconds[int(0.95 * (len(seconds) - 1))] if seconds else None,
                             "outcomes": run["outcomes"]})
                log(f"sweep: {rows[-1]}")
    finally:
        ray.shutdown()
    return rows


def load(base: str, model: str, docs: list[str], args, log, keep: bool = False) -> dict:
    """`args.clients` conversations at once for `args.minutes`, a replica killed halfway (unless
    `args.no_kill`); with `keep`, the answered requests too (under "answered")."""
    import ray

    before = scrape(base, model)
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 60 * args.minutes

    def client(k: int) -> None:
        rng, n = random.Random(k), 0
        while time.monotonic() < stop_at:
            qs = rng.sample(QUESTIONS, args.turns)
            for r in conversation(base, model, docs[k % len(docs)], qs, args.max_tokens, args.hang_s, stream_from=k + n):
                r["client"] = k
                with lock:
                    results.append(r)
            n += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    memory, killed, t0 = [], None, time.monotonic()
    while any(t.is_alive() for t in threads):
        memory.append({"s": round(time.monotonic() - t0), "mb": replica_memory_mb()})
        if killed is None and not args.no_kill and time.monotonic() - t0 >= 30 * args.minutes:
            with lock:
                last = next((r["replica"] for r in reversed(results) if r["replica"]), None)
            if last:
                ray.kill(ray.get_actor(REPLICA_PREFIX + last, namespace="serve"), no_restart=True)
                killed = {"replica": last, "at_s": round(time.monotonic() - t0), "after_requests": len(results)}
                log(f"killed replica {last} after {len(results)} requests")
        for t in threads:
            t.join(timeout=10 / max(1, len(threads)))
    after = scrape(base, model)
    answered = [r for r in results if r["outcome"] == "answered"]
    outcomes: dict[str, dict[str, int]] = {}
    for r in results:
        kind = "streamed" if r["stream"] else "not streamed"
        outcomes.setdefault(kind, {}).setdefault(r["outcome"], 0)
        outcomes[kind][r["outcome"]] += 1
    rises = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    sums = metric_sums(answered)
    log(f"load: {outcomes}")
    return {
        **({"answered": answered, "stop_at": stop_at} if keep else {}),
        "clients": args.clients, "minutes": args.minutes, "killed": killed, "requests": len(results),
        "outcomes": outcomes,
        "errors": sorted({r.get("error", "")[:160] for r in results if r["outcome"] != "answered"}),
        "seconds_median": sorted(r["seconds"] for r in answered)[len(answered) // 2] if answered else None,
        "seconds_max": max((r["seconds"] for r in results), default=None),
        "memory_mb": memory,
        "metrics": {k: {"rise": rises.get(k, 0.0), "answers_sum": v, "equal": rises.get(k, 0.0) == v}
                    for k, v in sorted(sums.items())},
    }


if __name__ == "__main__":
    raise SystemExit(main())
