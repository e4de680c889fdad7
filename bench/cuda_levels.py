"""Each level's forward on a GPU at 32K-128K tokens, against the bytes it reads.

A random target shaped like Llama-3.1-8B (32 layers, width 4,096, 32 query and 8 KV heads of 128,
MLP 14,336, vocabulary 128,256, llama3 rope, 131,072-token window) and a random small draft shaped
like the paper's 68M Llama (2 layers, width 768) over the target's vocabulary, both in bfloat16.
No checkpoint of that size comes with the project, and a forward's cost does not depend on what
its weights or keys say: the full cache holds random K/V, as in `bench.level_steps`.

For each context length, each level's forward (the target's step, its gamma2 + 1-row
verification and a lookup run's lookup_max + 1 rows over the full cache, the target's weights over the
retrieval cache, the draft over its StreamingLLM window) is timed:
- on each attention path (`--paths`, see `attention_path`: ours, PyTorch's own kernel choice,
  PyTorch's flash kernel; a shape the flash kernel takes no mask for is reported as such),
  alternated; beside each, the host's part (until the forward returned, before waiting for the
  device), and ours again with Python's garbage collector off;
- as a CUDA graph captured at the cache's length and replayed (what a forward costs without
  Python and kernel launches between its kernels);
beside the time the bytes it must read take at the bandwidth measured on the device (the
floor). Also the projections alone, as products with the weights stored [in, out] (how the
model keeps them) and [out, in] (`F.linear`), 1 and gamma2 + 1 rows.

    python -m bench.cuda_levels [--shape llama3-8b] [--context 32768,65536,130000] [--repeats 20]
                                [--paths ours,pytorch,pytorch-flash] [--json OUT]

`--shape tiny --device cpu` runs the same code on a small model in a second (the test suite does).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.level_steps import forward_times, parse_contexts, random_cache_decoder
from bench.reports import write_json
from triforce_core.models import attention
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import sync_device
from triforce_core.models.transformer import Transformer
from triforce_core.models.roofline import decode_weight_bytes, measure_bandwidth

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {
    # (target, small draft)
    "llama3-8b": (
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE),
        dict(vocab_size=128256, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
             rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    "tiny": (
        dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 512}),
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
}
PATHS = ("ours", "pytorch", "pytorch-flash")


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> Transformer:
    """A Llama decoder of `shape` with N(0, 0.02) weights drawn on `device` (no checkpoint)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**shape)
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, hd = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def w(*size):
        return torch.randn(size, generator=g, device=device, dtype=dtype).mul_(0.02)

    def norm():
        return torch.ones(h, device=device, dtype=dtype)

    state = {"model.embed_tokens.weight": w(config.vocab_size, h), "lm_head.weight": w(config.vocab_size, h),
             "model.norm.weight": norm()}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                      p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                      p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                      p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter)})
    model = Transformer(config, state, device, dtype)
    del state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


@contextlib.contextmanager
def attention_path(name: str):
    """The model's attention on one path: "ours" (`attention.cuda_few_rows` for few rows, the
    default), "pytorch" (PyTorch's scaled-dot-product attention, its own kernel choice) or
    "pytorch-flash" (the same restricted to its flash kernel: one a shape has none for fails)."""
    saved = attention.CUDA_FEW_ROWS
    if name != "ours":
        attention.CUDA_FEW_ROWS = 0
    try:
        if name == "pytorch-flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                yield
        else:
            yield
    finally:
        attention.CUDA_FEW_ROWS = saved


def graph_seconds(lane, rows: int, repeats: int) -> list[float]:
    """The lane's forward of `rows` tokens captured once as a CUDA graph at the cache's length,
    then replayed (each replay rewrites the same slots with the same values)."""
    model, cache = lane.model, lane.cache
    length, start = cache.length, lane.covered + len(lane.fed)
    ids = torch.full((rows,), 7, dtype=torch.long, device=model.device)
    positions = cache.positions(start, rows)

    def forward():
        out = model.forward(ids, positions, cache, logits_rows=slice(0, None))
        cache.truncate(length)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del graph
    return times


def projection_rates(model: Transformer, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """GB/s of one product with each projection's weights, stored [in, out] and [out, in]."""
    layer = model.layers[0]
    named = {"qkv": layer.wqkv.dense_t(), "o": layer.wo.dense_t(), "gate_up": layer.w_gate_up.dense_t(),
             "down": layer.w_down.dense_t()}
    out = []
    for name, w_t in named.items():  # w_t: [in, out]
        w = w_t.t().contiguous()  # [out, in]
        for r in rows:
            x = torch.randn(r, w_t.shape[0], device=model.device, dtype=model.dtype)
            times: dict[str, list[float]] = {"in_out": [], "out_in": []}
            for i in range(repeats + 2):
                for layout in (times if i % 2 == 0 else list(times)[::-1]):
                    sync_device(model.device)
                    t0 = time.perf_counter()
                    for _ in range(10):
                        x @ w_t if layout == "in_out" else F.linear(x, w)
                    sync_device(model.device)
                    if i >= 2:
                        times[layout].append((time.perf_counter() - t0) / 10)
            nbytes = w.numel() * w.element_size()
            row = {"matrix": name, "shape": list(w_t.shape), "rows": r}
            for layout, ts in times.items():
                med = statistics.median(ts)
                row[layout] = {"us": med * 1e6, "gbs": nbytes / med / 1e9}
            out.append(row)
        del w
    return out


def measure(shape: str, device: torch.device, dtype: torch.dtype, contexts: list[int], repeats: int,
            paths: tuple[str, ...], say=print) -> dict:
    target_shape, draft_shape = SHAPES[shape]
    t0 = time.perf_counter()
    target = random_model(target_shape, device, dtype, seed=1)
    draft = random_model(draft_shape, device, dtype, seed=2)
    engine = TriForceEngine(target, draft)
    say(f"[cuda-levels] models drawn in {time.perf_counter() - t0:.1f} s: target {target.weight_bytes() / 1e9:.2f} GB, "
        f"draft {draft.weight_bytes() / 1e9:.3f} GB, {dtype}")
    bandwidth = measure_bandwidth(device)
    say(f"[cuda-levels] read bandwidth {bandwidth:.0f} GB/s")
    cuda = device.type == "cuda"
    if not cuda:
        paths = ("ours",)
    report: dict = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "bandwidth_gbs": bandwidth,
                    "target": target_shape, "draft": draft_shape, "results": []}
    report["projections"] = projection_rates(target, (1, 7), repeats)
    for p in report["projections"]:
        say(f"[cuda-levels] {p['matrix']} {p['shape']} x {p['rows']} rows: [in, out] {p['in_out']['us']:.1f} us "
            f"({p['in_out']['gbs']:.0f} GB/s), [out, in] {p['out_in']['us']:.1f} us ({p['out_in']['gbs']:.0f} GB/s)")
    for T in contexts:
        t0 = time.perf_counter()
        dec, cfg = random_cache_decoder(engine, T, seed=T)
        say(f"[cuda-levels] {T} tokens ready in {time.perf_counter() - t0:.1f} s")
        spec = cfg.speculation
        levels = [("target", "full", 1), ("target", "full", spec.gamma2 + 1), ("target", "full", spec.lookup_max + 1),
                  ("retrieval", "retrieval", 1),
                  ("retrieval", "retrieval", spec.gamma1 + 1), ("draft", "small", 1)]
        for level, attr, rows in levels:
            lane = getattr(dec, attr)
            times: dict[str, list[float]] = {k: [] for k in paths}
            host: dict[str, list[float]] = {k: [] for k in paths}
            failed: dict[str, str] = {}
            for i in range(repeats + 2):
                for k in (paths if i % 2 == 0 else paths[::-1]):
                    if k in failed:
                        continue
                    try:
                        with attention_path(k):
                            t, h = forward_times(lane, rows)
                    except RuntimeError as e:  # no kernel of that kind for this shape or mask
                        failed[k] = str(e).splitlines()[0][:160]
                        continue
                    if i >= 2:
                        times[k].append(t)
                        host[k].append(h)
            # the default path again with Python's garbage collector off (is the host's part the collector?)
            gc.collect()
            gc.disable()
            try:
                no_gc = [forward_times(lane, rows)[0] for _ in range(repeats + 2)][2:]
            finally:
                gc.enable()
            model = lane.model
            keys = lane.cache.length + rows
            read = decode_weight_bytes(model) + model.spec.kv_bytes(keys, lane.cache.k.element_size())
            floor = read / (bandwidth * 1e9)
            row = {"context": T, "level": level, "rows": rows, "keys": keys, "bytes": read, "floor_ms": floor * 1e3,
                   "ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if v},
                   "host_ms": {k: statistics.median(v) * 1e3 for k, v in host.items() if v},
                   "no_gc_ms": statistics.median(no_gc) * 1e3, "no_kernel": failed}
            if cuda:
                try:  # on the default path
                    row["graph_ms"] = statistics.median(graph_seconds(lane, rows, repeats)) * 1e3
                except RuntimeError as e:
                    row["graph_error"] = str(e).splitlines()[0][:200]
            report["results"].append(row)
            best = min(row["ms"].values())
            kernels_text = ", ".join(f"{k} {v:.2f} (host {row['host_ms'][k]:.2f})" for k, v in row["ms"].items())
            kernels_text += f"; ours without the collector {row['no_gc_ms']:.2f}"
            graph = f"; graph {row['graph_ms']:.2f} ms ({row['graph_ms'] / (floor * 1e3):.2f}x floor)" if "graph_ms" in row else ""
            say(f"[cuda-levels] {T} tokens, {level}, {rows} rows over {keys} keys ({read / 1e9:.2f} GB): {kernels_text} ms"
                f"{graph}; floor {floor * 1e3:.2f} ms ({best / (floor * 1e3):.2f}x it eager)"
                + (f"; no kernel: {', '.join(failed)}" if failed else ""))
        del dec, lane
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        report["device"] = torch.cuda.get_device_name(device)
        report["torch"] = torch.__version__
        report["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="the random pair's shapes (default llama3-8b)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --shape tiny: a check that the code runs)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="weights and K/V (default bfloat16)")
    p.add_argument("--context", default="32768,65536,130000", help="comma-separated cache lengths in tokens")
    p.add_argument("--repeats", type=int, default=20, help="timed forwards per configuration (default 20)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"attention paths to compare, of {', '.join(PATHS)} (see attention_path)")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    try:
        contexts = parse_contexts(a.context, a.repeats)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = tuple(k.strip() for k in a.paths.split(",") if k.strip())
    if not paths or any(k not in PATHS for k in paths):
        print(f"error: --paths takes names of {', '.join(PATHS)}", file=sys.stderr)
        return 2
    window = SHAPES[a.shape][0]["max_position_embeddings"]
    if max(contexts) + 256 > window:
        print(f"error: the {a.shape} target reads at most {window} tokens; --context {max(contexts)} leaves no room",
              file=sys.stderr)
        return 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here (use --device cpu --shape tiny to check the code)", file=sys.stderr)
        return 2
    report = measure(a.shape, device, getattr(torch, a.dtype), contexts, a.repeats, paths)
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
