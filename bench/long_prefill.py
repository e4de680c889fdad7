"""A book-length prefill: its rate against this processor's matrix-multiply rate, and re-opening
the same document from the disk cache, as after a restart.

    python -m bench.long_prefill [--context-tokens 32768,65536] [--target DIR] [--json OUT]

For each length N: the float32 matrix-multiply rate (2048^2, median of 5) is measured; the
prefill attention of one 1024-token chunk against N keys is timed both ways (the split
cached/new flash passes the model uses, and one flash pass with a mask over the whole cache),
interleaved; then a chat session over an N-token document (the bundled sample documents,
repeated) answers one question with a disk cache in a temporary folder (the prefill's rate
is its arithmetic, `roofline.prefill_flops`, over its time); then a new engine, loaded
afresh, opens the same document from that folder and answers again (time to the first answer
token, tokens read from disk, answers equal). A target whose window is shorter than N gets
its rope stretched (YaRN factor scaled, window scaled) in a temporary copy: a step's cost does
not depend on the weights. Long: ~3 minutes at 64K on 2 cores; run it alone.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from triforce_core.config import CacheConfig, GenerationConfig, SpeculationConfig
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import default_model_names
from triforce_core.models.roofline import measure_matmul_gflops, prefill_flops
from triforce_core.serving.session import ChatSession

SAMPLES = Path(__file__).resolve().parent.parent / "assets" / "sample"
QUESTION = "What is this document about?"


def stretched(target: str, tokens: int, workdir: Path) -> str:
    """`target` as is when its window holds `tokens`, else a copy with the rope stretched."""
    config = json.loads((Path(target) / "config.json").read_text())
    window = config["max_position_embeddings"]
    if tokens <= window:
        return target
    k = math.ceil(tokens / window)
    out = workdir / f"stretched-{window * k}"
    if not out.exists():
        shutil.copytree(target, out)
        rope = dict(config.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
        if rope.get("rope_type") == "yarn":
            rope["factor"] = rope.get("factor", 1.0) * k
        else:
            rope.update(rope_type="yarn", factor=float(k), original_max_position_embeddings=window)
        config.update(max_position_embeddings=window * k, rope_parameters=rope)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def document(engine: TriForceEngine, tokens: int) -> str:
    """The bundled sample documents, repeated, cut to about `tokens` tokens."""
    text = "\n\n".join(p.read_text(encoding="utf-8").strip() for p in sorted(SAMPLES.glob("*.txt")))
    ids = engine.encode(text)
    out = []
    while len(out) < tokens:
        out += ids
    return engine.detokenize(out[:tokens])


def attention_ms(heads: int, head_dim: int, keys: int, chunk: int = 1024, reps: int = 3) -> dict:
    """One prefill chunk's attention (one layer) both ways, interleaved: ms each (minimum)."""
    from triforce_core.models.attention import FLASH_LSE, attention_mask, split_attention

    q = torch.randn(heads, chunk, head_dim)
    k = torch.randn(heads, keys, head_dim)
    v = torch.randn(heads, keys, head_dim)
    mask = attention_mask(chunk, keys, 0, None, 1, q.device)
    ways = {"masked": lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask.visible)}
    if FLASH_LSE is not None:
        ways["split"] = lambda: split_attention(q, k, v, mask.new_bias, head_dim**-0.5)
    times = {name: [] for name in ways}
    for _ in range(reps + 1):
        for name, run in ways.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    flops = 4.0 * head_dim * heads * chunk * (keys - chunk + (chunk + 1) / 2)
    return {name: {"ms": 1e3 * min(t[1:]), "gflops": flops / min(t[1:]) / 1e9} for name, t in times.items()}


def resident_gb() -> float:
    """This process's resident memory (Linux: VmRSS), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def one_length(target: str, draft: str | None, tokens: int, workdir: Path, say, sessions: int = 4) -> dict:
    path = stretched(target, tokens + 256, workdir)
    engine = TriForceEngine.from_pretrained(path, draft, device="cpu", dtype="float32")
    spec = engine.target.spec
    matmul = [measure_matmul_gflops(torch.device("cpu"))]
    att = attention_ms(spec.num_heads, spec.head_dim, tokens)
    say(f"[{tokens}] matmul {matmul[0]:.0f} GFLOP/s; one chunk's attention: "
        + ", ".join(f"{k} {v['ms']:.0f} ms ({v['gflops']:.0f} GFLOP/s)" for k, v in att.items()))
    folder = workdir / f"kv-{tokens}"
    engine.use_disk_cache(folder)
    config = GenerationConfig(speculation=SpeculationConfig(max_new_tokens=16, ignore_eos=True),
                              cache=CacheConfig())
    text = document(engine, tokens)
    first = ChatSession(engine, text, config=config)
    prompt = len(first.prompt_ids(QUESTION))
    t0 = time.perf_counter()
    list(first.ask(QUESTION))
    first_s = time.perf_counter() - t0
    s1 = first.turns[-1].stats
    matmul.append(measure_matmul_gflops(torch.device("cpu")))
    rate = prefill_flops(spec, 0, prompt) / s1.prefill_s / 1e9
    say(f"[{tokens}] prefill {prompt} tokens in {s1.prefill_s:.1f}s: {rate:.0f} GFLOP/s, "
        f"{rate / statistics.median(matmul):.0%} of the matrix-multiply rate; first answer {first_s:.1f}s")
    answer = first.turns[-1].token_ids
    del first, engine  # the first engine's caches go before the second engine's come
    # A restart: the weights loaded again, the caches empty, the same folder.
    t_load = time.perf_counter()
    again = TriForceEngine.from_pretrained(path, draft, device="cpu", dtype="float32")
    again.use_disk_cache(folder)
    load_s = time.perf_counter() - t_load
    second = ChatSession(again, text, config=config)
    list(second.ask(QUESTION))
    s2 = second.turns[-1].stats
    same = second.turns[-1].token_ids == answer
    say(f"[{tokens}] re-opened: engine loaded in {load_s:.1f}s, first answer token {s2.first_token_s:.2f}s "
        f"({s2.disk_tokens} tokens from disk, {s2.prefill_tokens} prefilled); answer identical: {same}")
    # Several users on the same book, as the app keeps them: one session (caches) each.
    held, rss = [second], [resident_gb()]
    for _ in range(sessions - 1):
        other = ChatSession(again, text, config=config)
        list(other.ask(QUESTION))
        held.append(other)
        rss.append(resident_gb())
    per_session = [h.cache_bytes() / 1e9 for h in held]
    say(f"[{tokens}] {len(held)} sessions: caches {', '.join(f'{g:.2f}' for g in per_session)} GB each; "
        f"resident {rss[-1]:.2f} GB (after each: {', '.join(f'{g:.2f}' for g in rss)})")
    return {
        "context_tokens": tokens, "prompt_tokens": prompt,
        "target": Path(path).name + ("" if path == target else ", rope stretched (YaRN) to the length"),
        "matmul_gflops": matmul, "chunk_attention": att,
        "prefill_s": s1.prefill_s, "prefill_gflops": rate,
        "prefill_vs_matmul": rate / statistics.median(matmul),
        "first_answer_s": s1.first_token_s,
        "reopen": {"engine_load_s": load_s, "first_token_s": s2.first_token_s, "prefill_s": s2.prefill_s,
                   "disk_tokens": s2.disk_tokens, "prefill_tokens": s2.prefill_tokens, "answer_identical": same},
        "sessions": {"count": len(held), "cache_gb": per_session, "resident_gb_after_each": rss},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="a local model folder (default: the embedded demo target)")
    p.add_argument("--context-tokens", default="32768,65536", help="comma-separated lengths (default %(default)s)")
    p.add_argument("--sessions", type=int, default=4,
                   help="sessions opened on the re-opened document, for the resident memory (default 4)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    a = p.parse_args(argv)
    if a.sessions < 1:
        p.error("--sessions must be at least 1")
    target, _ = default_model_names(a.target, None)
    lengths = [int(x) for x in a.context_tokens.split(",") if x.strip()]

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = []
    with tempfile.TemporaryDirectory(prefix="long-prefill-") as tmp:
        for n in lengths:
            results.append(one_length(str(target), None, n, Path(tmp), say, a.sessions))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
