"""Profile one mode's decoding at a long context: where do the milliseconds of a round go?

    python -m bench.profile_decode [--mode triforce] [--context-tokens 16000] [--max-new-tokens 64] \\
        [--top 25] [--torch]

Prefills the prompt once (not profiled), warms up, then decodes `--max-new-tokens` tokens under
cProfile (Python view: which functions of the loop cost what, cumulative) and, with --torch,
under torch.profiler (operator view: which kernels). Both tables go to stdout.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--mode", default="triforce")
    p.add_argument("--context-tokens", type=int, default=16000)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--torch", action="store_true", help="also run torch.profiler (operator table)")
    a = p.parse_args(argv)
    bench = load_bench(a.target, a.draft)
    prompt = bench.context_prompt(a.context_tokens)
    config = GenerationConfig(speculation=SpeculationConfig(mode=a.mode, max_new_tokens=a.max_new_tokens))
    t0 = time.perf_counter()
    full, _ = bench._prefix("ours", prompt, config)
    print(f"prefill {len(prompt)} tokens: {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    def decode(tokens: int):
        return bench._run_ours(a.mode, prompt, full, 0.0, config, tokens)

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
