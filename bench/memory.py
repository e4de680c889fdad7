"""A GGUF model's memory: what loading it leaves resident, and the peaks of loading and of a
short generation. Each figure comes from a fresh process (a process's heap never shrinks back
to what it was), in MiB (2^20 bytes):

- imports: the resident set (VmRSS) after importing torch, transformers and triforce_core;
- baseline: the same, then the file's config and tokenizer read (`gguf_file.config_and_tokenizer`,
  from its cache entry): transformers imports some 700 more modules there (accelerate, PIL,
  sympy...), 50 to 100 MB that are the libraries', not the model's;
- loaded: the same imports, then `load_model` (CPU, float32: the weights kept as stored);
  `load_peak` is that process's VmHWM, `weights` the model's `weight_bytes()`;
- resident after load = loaded - baseline: the weights and whatever loading them left behind
  (the target: at most the file's size + 5 %); loaded - imports adds the tokenizer and the
  transformers modules;
- generate_peak: the command line's "Maximum resident set size" (as `/usr/bin/time -v` reports
  it: the child's ru_maxrss) for `python -m triforce_core generate --target FILE --prompt Hello
  --max-new-tokens 4`, a later start (one start before it, not measured, has kept the price of a
  verification row where the cache had none; the target: at most the file's size + 0.5 GB,
  476.8 MiB).
- first_start_peak: the same for the model's first start on this machine, when the price of a
  verification row is not yet kept (`triforce_core.decoding.row_cost`) and is measured: a few
  forwards over a cache of 8K random tokens, which the model holds beside its weights for that
  time. The child finds every other thing this project keeps under `config.cache_home()` (links
  into a temporary `XDG_CACHE_HOME`), so nothing else is rebuilt.

    python -m bench.memory [--targets smollm2,PATH.gguf,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.reports import write_json

MIB = 2**20
HALF_GB = 0.5e9  # bytes
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import torch, transformers, triforce_core
from triforce_core.models import gguf_file, loading

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

stage, target = sys.argv[1], sys.argv[2]
out = {}
if stage == "baseline":
    gguf_file.config_and_tokenizer(gguf_file.resolve(target))
elif stage == "loaded":
    loaded = loading.load_model(target, torch.device("cpu"), torch.float32)  # held while measured
    out["weights"] = loaded.model.weight_bytes()
print(json.dumps({**out, **status()}))
"""


def _run(args: list[str], env: dict | None = None) -> tuple[dict | None, int]:
    """A child's last JSON line (None if it printed none) and its peak resident set in bytes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:4])}... exited {proc.returncode}: {text[-2000:]}")
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def first_start_env(tmp: Path) -> dict:
    """An environment whose `config.cache_home()` (under `tmp`) holds every entry of this user's
    but the kept prices of a verification row: a child started in it measures that price as a
    model's first start does, and builds nothing else again."""
    from triforce_core.config import cache_home

    home = tmp / cache_home().name
    home.mkdir(parents=True)
    if cache_home().is_dir():
        for entry in cache_home().iterdir():
            if entry.name != "row-cost":
                (home / entry.name).symlink_to(entry)
    return {"XDG_CACHE_HOME": str(tmp)}


def measure(target: str) -> dict:
    """One target's figures (see the module's docstring), in MiB."""
    from triforce_core.models import gguf_file

    file_bytes = gguf_file.resolve(target).stat().st_size
    child = [sys.executable, "-c", CHILD]
    imports, _ = _run([*child, "imports", target])
    baseline, _ = _run([*child, "baseline", target])
    loaded, _ = _run([*child, "loaded", target])
    generate = [sys.executable, "-m", "triforce_core", "generate", "--target", target, "--prompt", "Hello",
                "--max-new-tokens", "4"]
    with tempfile.TemporaryDirectory() as tmp:
        _, first_start_peak = _run(generate, first_start_env(Path(tmp)))
    _run(generate)  # keeps the row's price where this user's cache had none: the next start is a later one
    _, generate_peak = _run(generate)
    resident = loaded["VmRSS"] - baseline["VmRSS"]
    row = {"target": target, "file": file_bytes, "imports": imports["VmRSS"], "baseline": baseline["VmRSS"],
           "loaded": loaded["VmRSS"], "load_peak": loaded["VmHWM"], "weights": loaded["weights"],
           "resident_after_load": resident, "loaded_minus_imports": loaded["VmRSS"] - imports["VmRSS"],
           "generate_peak": generate_peak, "first_start_peak": first_start_peak}
    row = {k: (round(v / MIB, 1) if isinstance(v, int) else v) for k, v in row.items()}
    row["resident_within_file_plus_5pct"] = resident <= 1.05 * file_bytes
    row["generate_peak_within_file_plus_half_gb"] = generate_peak <= file_bytes + HALF_GB
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--targets", default="smollm2", help="comma-separated GGUF files (or smollm2)")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    if not Path("/proc/self/status").exists():
        print("bench.memory reads /proc/self/status: Linux only", file=sys.stderr)
        return 2
    rows = []
    cols = ("file", "weights", "resident_after_load", "loaded_minus_imports", "load_peak", "generate_peak", "first_start_peak")
    print(f"{'target':42s}" + "".join(f"{c:>21s}" for c in cols) + "   (MiB)")
    for target in args.targets.split(","):
        row = measure(target)
        rows.append(row)
        print(f"{Path(target).name:42s}" + "".join(f"{row[c]:21.1f}" for c in cols) +
              f"   within +5 %: {row['resident_within_file_plus_5pct']}, within +0.5 GB: "
              f"{row['generate_peak_within_file_plus_half_gb']}", flush=True)
    write_json(args.json, {"unit": "MiB", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
