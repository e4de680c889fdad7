"""A document reopened from the shared disk cache by a replica that never saw it (`serve --ray`).

    python -m bench.cluster_reopen                        # the demo pair, a ~30K-token document
    python -m bench.cluster_reopen --json bench/results/cluster-reopen.json

Starts a local Ray cluster (`--cpus`, default 2), deploys `serve --ray --address ... --replicas 2`
on it (the command line, as a user runs it) with a fresh `--kv-cache-dir`, then:

1. asks a question about the document (the sample chapters, repeated to `--tokens`), streamed,
   greedy: the replica the document's key maps to prefills it and writes it to the folder;
2. kills that replica (`ray.kill`, as a crash would) and asks the same question again: the
   router sends it to the other replica, which never saw the document and reads it back from
   the folder instead of prefilling it.

Reported: for both answers, the replica, the time to the first streamed token (from the request
sent), `prefill_tokens`, `disk_tokens` and whether the two answers are equal (greedy decoding
is exact, so they must be); and the machine. A timing run, not a test: nothing here asserts a
speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.servers import ROOT, started

SAMPLES = sorted((ROOT / "assets" / "sample").glob("python-tutorial-*.txt"))


def document(tokenizer, tokens: int) -> str:
    """The sample chapters, repeated until the text is `tokens` tokens, cut at a paragraph."""
    text, parts = "", itertools.cycle([p.read_text(encoding="utf-8") for p in SAMPLES])
    while len(tokenizer.encode(text)) < tokens:
        text += next(parts) + "\n\n"
    paragraphs = text.split("\n\n")
    while len(paragraphs) > 1 and len(tokenizer.encode("\n\n".join(paragraphs))) > tokens:
        paragraphs.pop()
    return "\n\n".join(paragraphs)


def ask(base: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy question: replica, seconds to the first token, text, statistics."""
    body = {"model": "triforce-demo", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": True}
    start = time.perf_counter()
    first, text, stats = None, "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-triforce-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter() - start
                text += delta
            stats = chunk.get("triforce", stats)
    return {"replica": replica, "time_to_first_token_s": round(first, 3), "prefill_tokens": stats["prefill_tokens"],
            "disk_tokens": stats["disk_tokens"], "reused_tokens": stats["reused_tokens"], "text": text}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=30_000, help="document length in the demo tokenizer's tokens")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (one per replica)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from triforce_core.models.loading import DEMO_TARGET

    doc = document(AutoTokenizer.from_pretrained(DEMO_TARGET), args.tokens)
    messages = [{"role": "user", "content": doc + "\n\nWhat is a class?"}]
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    folder = tempfile.mkdtemp(prefix="cluster-reopen-kv-")
    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "triforce_core", "serve", "--ray", "--address", ray.get_runtime_context().gcs_address,
           "--replicas", "2", "--cpus-per-replica", str(max(1, args.cpus // 2)), "--port", str(port),
           "--kv-cache-dir", folder]
    base = f"http://127.0.0.1:{port}"
    try:
        with started(cmd, base, "serve --ray"):
            first = ask(base, messages, args.max_tokens)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::triforce#engine#{first['replica']}", namespace="serve"),
                     no_restart=True)
            again = ask(base, messages, args.max_tokens)
    finally:
        ray.shutdown()
    report = {
        "document_tokens": len(AutoTokenizer.from_pretrained(DEMO_TARGET).encode(doc)),
        "first": {k: v for k, v in first.items() if k != "text"},
        "after_the_kill": {k: v for k, v in again.items() if k != "text"},
        "answers_equal": first["text"] == again["text"],
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Ray cluster of {args.cpus} CPUs",
        "command": "python -m bench.cluster_reopen " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
