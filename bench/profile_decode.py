"""Profile one mode's decoding at a long context: where do the milliseconds of a round go?

    python -m bench.profile_decode [--mode triforce] [--context-tokens 16000] [--max-new-tokens 64] \\
        [--top 25] [--torch]

Prefills the prompt once (not profiled), warms up, then decodes `--max-new-tokens` tokens under
cProfile (Python view: which functions of the loop cost what, cumulative) and, with --torch,
under torch.profiler (operator view: which kernels). Both tables go to stdout.

With --outside, no profiler: the same decoding timed around the native kernels' calls (the
layers' few-row functions and the attention's), each round's time split into the kernels' and
the rest (Python, PyTorch's small operators, sampling, detokenizing), the split a profiler
distorts. After a forward has streamed the weights through the caches, the rest runs cold: on a
1B-shape GGUF file it measured 6-16 % of a token.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from bench.loading import load_bench
from triforce_core.config import GenerationConfig, SpeculationConfig
from triforce_core.decoding.events import Committed, Prefilled
from triforce_core.engine import make_generator
from triforce_core.models import native_attention, native_layers

# The native entry points a decoding round calls from Python (the one-call forward, the
# per-layer sides, the head, the attention kernels).
NATIVE_CALLS = {"layers": ("decode_layers", "layer_in", "layer_out", "final_logits", "parts_product", "dequantize_rows"),
                "attention": ("attention", "integer_attention", "integer_write_strided")}


def outside_native(bench, mode: str, prompt: list[int], full_cache, config: GenerationConfig, tokens: int) -> dict:
    """Decode `tokens` after `prompt` (its K/V in `full_cache`) with each native call timed:
    the rounds, their time, and the part spent outside the native calls, per round."""
    libs = {"layers": native_layers.kernel(), "attention": native_attention.kernel()}
    if libs["layers"] is None:
        raise SystemExit("error: --outside needs the native layers (a C compiler)")
    spent = [0.0]
    saved = []
    for kind, names in NATIVE_CALLS.items():
        lib = libs[kind].lib if libs[kind] is not None else None
        for name in names if lib is not None else ():
            f = getattr(lib, name)

            def timed(*args, _f=f):
                t0 = time.perf_counter()
                try:
                    return _f(*args)
                finally:
                    spent[0] += time.perf_counter() - t0

            saved.append((lib, name, f))
            setattr(lib, name, timed)
    engine = bench.engine
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=tokens),
                           sampling=config.sampling, cache=config.cache)
    engine.check_prompt(prompt, cfg)
    loop = engine.make_loop(cfg, engine.capacity_for(len(prompt), cfg), make_generator(cfg.sampling.seed, engine.target.device),
                            full_cache=full_cache, history=list(prompt))
    rounds, new, t0 = 0, 0, None
    try:
        for ev in loop.generate(prompt):
            if isinstance(ev, Prefilled):  # the decoding starts here
                spent[0], t0 = 0.0, time.perf_counter()
            elif isinstance(ev, Committed):
                rounds += 1
                new += len(ev.token_ids)
        wall = time.perf_counter() - t0
    finally:
        for lib, name, f in saved:
            setattr(lib, name, f)
    return {"mode": mode, "rounds": rounds, "tokens": new, "ms_per_round": wall / rounds * 1e3,
            "native_ms_per_round": spent[0] / rounds * 1e3, "outside_ms_per_round": (wall - spent[0]) / rounds * 1e3,
            "outside_share": (wall - spent[0]) / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--mode", default="triforce")
    p.add_argument("--context-tokens", type=int, default=16000)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--torch", action="store_true", help="also run torch.profiler (operator table)")
    p.add_argument("--outside", action="store_true",
                   help="no profiler: time each round's native calls and report the rest (Python, small operators)")
    a = p.parse_args(argv)
    if a.context_tokens < 1 or a.max_new_tokens < 1 or a.top < 1:
        print("error: --context-tokens, --max-new-tokens and --top must be positive", file=sys.stderr)
        return 2
    bench = load_bench(a.target, a.draft)
    prompt = bench.context_prompt(a.context_tokens)
    config = GenerationConfig(speculation=SpeculationConfig(mode=a.mode, max_new_tokens=a.max_new_tokens))
    t0 = time.perf_counter()
    full, _ = bench._prefix("ours", prompt, config)
    print(f"prefill {len(prompt)} tokens: {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    def decode(tokens: int):
        return bench._run_ours(a.mode, prompt, full, 0.0, config, tokens)

    if a.outside:
        decode(8)  # warm-up
        r = outside_native(bench, a.mode, prompt, full, config, a.max_new_tokens)
        print(f"{r['mode']}: {r['tokens']} tokens in {r['rounds']} rounds, {r['ms_per_round']:.2f} ms a round: native "
              f"calls {r['native_ms_per_round']:.2f} ms, outside them {r['outside_ms_per_round']:.2f} ms "
              f"({100 * r['outside_share']:.1f} %)")
        return 0

    decode(8)  # warm-up
    res = decode(a.max_new_tokens)
    print(f"{a.mode}: {res.tokens_per_s:.1f} tok/s unprofiled, mean accepted {res.mean_accepted:.2f}, "
          f"acceptance {res.acceptance}", file=sys.stderr)
    prof = cProfile.Profile()
    prof.enable()
    decode(a.max_new_tokens)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())
    if a.torch:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            decode(a.max_new_tokens)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
