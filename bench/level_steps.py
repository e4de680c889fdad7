"""What one forward of each level costs, against the bytes it reads: the native layers on and off.

For each context length: the target over its full cache (1 row: a decoding step; gamma2 + 1
rows: a verification), the target's weights over the retrieval cache (1 row; gamma1 + 1 rows:
the middle level checking the small draft) and the small draft over its StreamingLLM window
(1 row). Each forward runs with the native decoder layers (`native_layers`) on and off,
alternated, medians; the native attention kernel stays as the model uses it. Beside each time:
the bytes the forward must read (weights, one embedding row, the K/V it attends to) and the
time those bytes take at the memory's bandwidth, measured just before each level's timings (the
floor; on a shared machine the bandwidth moves between minutes).

The full cache holds random keys and values, not a prefilled document: a step's cost does not
depend on what the keys say, and a 64K-token prefill would take minutes. The retrieval level
selects its chunks for the last token's real queries, as after a prefill.

    python -m bench.level_steps [--context 16000,32000,64000] [--repeats 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from triforce_core import native_layers
from triforce_core.benchmark import Bench, cpu_model
from triforce_core.config import PAPER_METHOD, GenerationConfig, SpeculationConfig
from triforce_core.kv import FullCache
from triforce_core.roofline import decode_weight_bytes, measure_bandwidth


def _decoder(bench: Bench, tokens: int, seed: int):
    """A decoder of the paper's three levels whose target cache holds `tokens` random K/V."""
    engine = bench.engine
    cfg = GenerationConfig(speculation=SpeculationConfig(mode="triforce", max_new_tokens=16, **PAPER_METHOD))
    target = engine.target
    s = target.spec
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(16, target.vocab_size, (tokens,), generator=g).tolist()
    full = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, engine.capacity_for(tokens + 1, cfg), target.dtype,
                     target.device)
    full.k[:, :, :tokens].normal_(generator=g)
    full.v[:, :, :tokens].normal_(generator=g)
    full.length = tokens
    dec = engine.make_decoder(cfg, full.capacity, None, full_cache=full, history=history)
    dec.prefill(history + [history[-1]])  # feeds the last token: the retrieval selection needs its queries
    return dec, cfg


def _step_seconds(lane, rows: int) -> float:
    """One forward of `rows` new tokens, rolled back afterwards."""
    length, fed, pending = lane.cache.length, list(lane.fed), list(lane.pending)
    t0 = time.perf_counter()
    lane.advance([7] * (rows - len(pending)))
    dt = time.perf_counter() - t0
    lane.cache.truncate(length)
    lane.fed, lane.pending = fed, pending
    return dt


def measure(bench: Bench, contexts: list[int], repeats: int, say=print) -> dict:
    if native_layers.kernel() is None:
        raise SystemExit("error: the native layers are unavailable here (no C compiler, or TRIFORCE_NATIVE_LAYERS=0)")
    results, bandwidths = [], []
    for T in contexts:
        dec, cfg = _decoder(bench, T, seed=T)
        spec = cfg.speculation
        levels = [("target", dec.full, 1), ("target", dec.full, spec.gamma2 + 1),
                  ("retrieval", dec.retrieval, 1), ("retrieval", dec.retrieval, spec.gamma1 + 1), ("draft", dec.small, 1)]
        for level, lane, rows in levels:
            model = lane.model
            keys = lane.cache.length + rows
            read = decode_weight_bytes(model) + model.spec.kv_bytes(keys, model.embed.element_size())
            # measured beside each timing: on a shared machine it moves by half between minutes
            bandwidth = measure_bandwidth(torch.device("cpu"))
            bandwidths.append(bandwidth)
            times = {"native": [], "pytorch": []}
            for i in range(repeats + 2):
                for name in (list(times) if i % 2 == 0 else list(times)[::-1]):
                    with native_layers.switched(name == "native"):
                        t = _step_seconds(lane, rows)
                    if i >= 2:
                        times[name].append(t)
            med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
            floor = read / (bandwidth * 1e9) * 1e3
            row = {"context": T, "level": level, "rows": rows, "keys": keys, "bytes": read, "ms": med,
                   "bandwidth_gbs": bandwidth, "floor_ms": floor, "speedup": med["pytorch"] / med["native"]}
            results.append(row)
            say(f"[steps] {T} tokens, {level}, {rows} rows over {keys} keys ({read / 1e6:.1f} MB): "
                f"native {med['native']:.2f} ms, pytorch {med['pytorch']:.2f} ms ({row['speedup']:.2f}x); "
                f"floor {floor:.2f} ms at {bandwidth:.1f} GB/s ({med['native'] / floor:.2f}x it)")
        del dec
    return {"bandwidth_gbs": sorted(bandwidths)[len(bandwidths) // 2], "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (default: the embedded demo target)")
    p.add_argument("--draft", help="draft model (default: the embedded demo draft)")
    p.add_argument("--context", default="16000,32000,64000", help="comma-separated cache lengths in tokens (each at most the target's window less 64)")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per configuration (default 15)")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    try:
        contexts = [int(x) for x in a.context.split(",") if x.strip()]
    except ValueError:
        print(f"error: --context must be comma-separated integers, got {a.context!r}", file=sys.stderr)
        return 2
    if not contexts or min(contexts) < 1 or a.repeats < 1:
        print("error: --context needs positive lengths and --repeats must be >= 1", file=sys.stderr)
        return 2
    bench = Bench.load(a.target, a.draft)
    limit = bench.engine.target.spec.max_position_embeddings
    if max(contexts) + 64 > limit:
        print(f"error: the target reads at most {limit} tokens; --context {max(contexts)} leaves no room", file=sys.stderr)
        return 2
    report = measure(bench, contexts, a.repeats)
    report.update(machine={"cpu": cpu_model(), "threads": torch.get_num_threads(),
                           "cores": os.cpu_count()}, repeats=a.repeats)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
