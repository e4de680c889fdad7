"""What a benchmark run measured and the report made of it: one run's figures (`RunResult`),
the medians over the repeats, the speedups over the baselines, the settings, the machine the
run was made on, and the table printed to stderr.

Used by the harness (`cli/harness.py`) and by the scripts of bench/, which state their machine
with `cpu_model` and `machine_info`. Imports no torch until `machine_info` asks for its version.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import GenerationConfig

if TYPE_CHECKING:
    from ..engine import TriForceEngine


@dataclass
class RunResult:
    """One timed run of one mode."""

    mode: str
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    decoded_tokens: int  # tokens counted in tokens_per_s
    acceptance: dict | None
    mean_accepted: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _median_dict(dicts: list[dict]) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys}


def summarise(mode: str, runs: list[RunResult], reference: list[int] | None) -> dict:
    """A mode's row of the report: medians over its repeats; whether every run's tokens equal
    `reference` (our autoregressive output; None when sampling)."""
    identical = None
    if reference is not None:
        identical = all(r.token_ids == reference for r in runs)
    acc = [r.acceptance for r in runs if r.acceptance is not None]
    means = [r.mean_accepted for r in runs if r.mean_accepted is not None]
    return {
        "mode": mode,
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "decode_s": statistics.median(r.decode_s for r in runs),
        "prefill_s": statistics.median(r.prefill_s for r in runs),
        "acceptance": _median_dict(acc) if acc else None,
        "mean_accepted": statistics.median(means) if means else None,
        "output_identical_to_autoregressive": identical,
        "new_tokens": len(runs[0].token_ids),
        "tokens_per_s_each": [round(r.tokens_per_s, 3) for r in runs],
    }


def add_ratios(runs: list[dict]) -> None:
    """speedup_vs_<mode> for the two baselines, where they ran."""
    by_mode = {r["mode"]: r["tokens_per_s"] for r in runs}
    for base in ("autoregressive", "hf-generate"):
        if by_mode.get(base):
            for r in runs:
                r[f"speedup_vs_{base.replace('-', '_')}"] = r["tokens_per_s"] / by_mode[base]


def settings(config: GenerationConfig) -> dict:
    """The decoding settings a report states beside its figures."""
    spec, cc, s = config.speculation, config.cache, config.sampling
    return {
        "gamma1": spec.gamma1, "gamma2": spec.gamma2, "budget": cc.budget, "chunk_size": cc.chunk_size,
        "draft_window": cc.draft_window, "draft_sinks": cc.draft_sinks, "refresh_every": cc.refresh_every, "select_by": cc.select_by,
        "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
    }


def cpu_model() -> str:
    """The processor's name, with its family and model and its widest vector extension: a
    virtual machine often names only the vendor, and results from two generations differ."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        flags = set(fields.get("flags", "").split())
        vector = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), None)
        detail = [f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields else None, vector]
        name = fields.get("model name")
        if name:
            extra = ", ".join(d for d in detail if d)
            return f"{name} ({extra})" if extra else name
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def machine_info(engine: TriForceEngine, load_before: float | None = None, load_after: float | None = None) -> dict:
    """The machine, library versions, device, dtype and threads of a report."""
    import torch
    import transformers

    from ..models.loading import DTYPES

    dev = engine.target.device
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(dev),
        "dtype": next(k for k, v in DTYPES.items() if v == engine.target.dtype),
        "threads": torch.get_num_threads(),
        "load_average_1min": [load_before, load_after],  # > cores before/after: the machine was shared
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def print_table(report: dict, file=sys.stderr) -> None:
    """A human-readable summary of a report."""
    print(f"context {report['context_tokens']} tokens, {report['max_new_tokens']} new, "
          f"T={report['temperature']}, medians of {report['repeats']}", file=file)
    print(f"{'mode':<16}{'tok/s':>9}{'vs AR':>8}{'vs HF':>8}{'mean acc':>10}  identical", file=file)
    for r in report["runs"]:
        ar = r.get("speedup_vs_autoregressive")
        hf = r.get("speedup_vs_hf_generate")
        ma = r["mean_accepted"]
        print(f"{r['mode']:<16}{r['tokens_per_s']:>9.1f}{(f'{ar:.2f}x' if ar else '-'):>8}"
              f"{(f'{hf:.2f}x' if hf else '-'):>8}{(f'{ma:.2f}' if ma is not None else '-'):>10}  "
              f"{r['output_identical_to_autoregressive']}", file=file)
    lim = report.get("limit")
    if lim:
        print(f"roofline: {lim['bandwidth_gbs']:.1f} GB/s / {lim['bytes_per_token'] / 1e6:.1f} MB per token = "
              f"{lim['tokens_per_s']:.0f} tok/s", file=file)
