"""Sweep: decoding speed of every mode over context lengths, and TriForce over budget x chunk size.

    python -m bench.sweep [--target T --draft D] [--contexts 2048,4096,8192,16000] \\
        [--budgets 1024,2048,4096] [--chunk-sizes 4,8,16] [--grid-context 16000] \\
        [--max-new-tokens 64] [--repeats 3] [--out artifacts/bench]

Writes OUT/sweep.json (every report of `triforce_core.cli.harness`, the grid and the break-even context),
OUT/sweep.html (the figures, self-contained) and OUT/*.png when kaleido can render (it drives a
local Chrome/Chromium; without one the PNGs are skipped and the HTML is still written).
The models are loaded and each prompt is prefilled once; the grid reuses the prefill of its
context. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.loading import load_bench
from triforce_core.cli.bench_report import print_table
from triforce_core.cli.harness import MODES, BenchError, parse_modes

SPECULATIVE = ("triforce", "retrieval", "draft")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def break_even(reports: list[dict], mode: str = "triforce") -> dict:
    """The context length where `mode` starts beating our autoregressive decoding.

    Linear interpolation of the speedup between the two measured contexts around 1.0; None
    when `mode` never wins (or always wins: then the smallest context measured is reported,
    flagged as an upper bound).
    """
    points = []
    for rep in sorted(reports, key=lambda r: r["context_tokens"]):
        by = {r["mode"]: r for r in rep["runs"]}
        if mode in by and "autoregressive" in by and by["autoregressive"]["tokens_per_s"] > 0:
            points.append((rep["context_tokens"], by[mode]["tokens_per_s"] / by["autoregressive"]["tokens_per_s"]))
    result = {"mode": mode, "speedups": points, "context_tokens": None, "upper_bound": False}
    if not points:
        return result
    if points[0][1] >= 1.0:
        result.update(context_tokens=points[0][0], upper_bound=True)
        return result
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if s0 < 1.0 <= s1:
            result["context_tokens"] = round(c0 + (1.0 - s0) * (c1 - c0) / (s1 - s0))
            return result
    return result


def figures(reports: list[dict], grid: list[dict], grid_context: int | None):
    import plotly.graph_objects as go

    figs = {}
    ctx = [r["context_tokens"] for r in reports]
    speed = go.Figure()
    for mode in MODES:
        ys = [next((run["tokens_per_s"] for run in r["runs"] if run["mode"] == mode), None) for r in reports]
        if any(y is not None for y in ys):
            speed.add_trace(go.Scatter(x=ctx, y=ys, mode="lines+markers", name=mode))
    if all("limit" in r for r in reports):
        speed.add_trace(go.Scatter(x=ctx, y=[r["limit"]["tokens_per_s"] for r in reports], mode="lines",
                                   name="autoregressive roofline", line=dict(dash="dash", color="black")))
    speed.update_layout(title="Decoding speed by context length (medians)", xaxis_title="context tokens",
                        yaxis_title="tokens / s", xaxis_type="log")
    figs["speed_by_context"] = speed

    ratio = go.Figure()
    for mode in MODES:
        ys = [next((run.get("speedup_vs_autoregressive") for run in r["runs"] if run["mode"] == mode), None)
              for r in reports]
        if mode != "autoregressive" and any(y is not None for y in ys):
            ratio.add_trace(go.Scatter(x=ctx, y=ys, mode="lines+markers", name=mode))
    ratio.add_hline(y=1.0, line_dash="dot")
    ratio.update_layout(title="Speedup over our autoregressive decoding", xaxis_title="context tokens",
                        yaxis_title="x autoregressive", xaxis_type="log")
    figs["speedup_by_context"] = ratio

    if grid:
        budgets = sorted({g["budget"] for g in grid})
        chunks = sorted({g["chunk_size"] for g in grid})
        z = [[next((g["tokens_per_s"] for g in grid if g["budget"] == b and g["chunk_size"] == c), None)
              for c in chunks] for b in budgets]
        heat = go.Figure(go.Heatmap(z=z, x=[str(c) for c in chunks], y=[str(b) for b in budgets],
                                    colorbar_title="tok/s", texttemplate="%{z:.1f}"))
        heat.update_layout(title=f"TriForce tokens/s at {grid_context} tokens: budget x chunk size",
                           xaxis_title="chunk size", yaxis_title="budget (tokens)")
        figs["triforce_budget_chunk"] = heat
    return figs


def write_figures(figs: dict, out: Path) -> list[str]:
    """One self-contained HTML page with every figure; PNGs when kaleido can render. Returns notes."""
    parts = []
    for i, fig in enumerate(figs.values()):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    (out / "sweep.html").write_text("<html><head><meta charset='utf-8'><title>TriForce sweep</title></head><body>"
                                    + "\n".join(parts) + "</body></html>\n", encoding="utf-8")
    notes = []
    for name, fig in figs.items():
        try:
            fig.write_image(str(out / f"{name}.png"), width=900, height=520)
        except (ImportError, RuntimeError, OSError, ValueError) as e:  # no kaleido, or no browser
            notes.append(f"PNG export skipped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            break
    return notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--contexts", type=_ints, default=[2048, 4096, 8192, 16000])
    p.add_argument("--modes", default="all")
    p.add_argument("--budgets", type=_ints, default=[1024, 2048, 4096])
    p.add_argument("--chunk-sizes", type=_ints, default=[4, 8, 16])
    p.add_argument("--grid-context", type=int, default=None, help="context of the budget x chunk grid (default: the largest)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--out", type=Path, default=Path("artifacts") / "bench")
    a = p.parse_args(argv)
    if a.threads is not None:
        import torch

        torch.set_num_threads(max(1, a.threads))

    from triforce_core.config import GenerationConfig, SamplingConfig, SpeculationConfig

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        modes = parse_modes(a.modes)
        bench = load_bench(a.target, a.draft, a.device, a.dtype)
        base = GenerationConfig(
            sampling=SamplingConfig(temperature=a.temperature, seed=0 if a.temperature > 0 else None),
            speculation=SpeculationConfig(max_new_tokens=a.max_new_tokens),
        )
        reports = []
        for n in a.contexts:
            say(f"[sweep] context {n}")
            rep = bench.run(bench.context_prompt(n), base, modes, a.repeats, progress=say)
            print_table(rep)
            reports.append(rep)
        grid_context = a.grid_context or max(a.contexts)
        grid = []
        prompt = bench.context_prompt(grid_context)
        for budget in a.budgets:
            for chunk in a.chunk_sizes:
                cfg = replace(base, cache=replace(base.cache, budget=budget, chunk_size=chunk))
                say(f"[sweep] grid: budget {budget}, chunk {chunk} at {grid_context} tokens")
                rep = bench.run(prompt, cfg, ("triforce",), a.repeats, measure_bandwidth=False, progress=say)
                run = rep["runs"][0]
                grid.append({"budget": budget, "chunk_size": chunk, "tokens_per_s": run["tokens_per_s"],
                             "mean_accepted": run["mean_accepted"], "acceptance": run["acceptance"],
                             "output_identical_to_autoregressive": run["output_identical_to_autoregressive"]})
    except (BenchError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python -m bench.sweep " + " ".join(argv if argv is not None else sys.argv[1:]),
        "contexts": reports,
        "grid_context": grid_context,
        "grid": grid,
        "break_even": {m: break_even(reports, m) for m in SPECULATIVE if m in modes and "autoregressive" in modes},
    }
    notes = write_figures(figures(reports, grid, grid_context), a.out)
    result["notes"] = notes
    (a.out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    for m, be in result["break_even"].items():
        say(f"[sweep] break-even {m}: {be['context_tokens']} tokens{' (upper bound)' if be['upper_bound'] else ''}")
    for note in notes:
        say(f"[sweep] {note}")
    say(f"[sweep] wrote {a.out / 'sweep.json'} and {a.out / 'sweep.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
