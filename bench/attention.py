"""Few-row attention over a long cache: the native kernel against PyTorch's path, one process.

For each cache length and row count (1 row: a decoding step; 7: a verification of six drafted
tokens and the bonus), the attention of one layer of the demo target (4 KV heads of 64) as the
model runs it (`attention.attend`, causal among the new rows), with the kernel on and off
(PyTorch's path: two matrix products up to 8 rows, two flash passes past that), alternated,
medians; with the bytes of K/V each reads and the memory's measured bandwidth, so each time
stands against its roofline. With `--kv-dtypes`, the same for each K/V dtype (a row each), every
dtype's calls alternated with the others' (PyTorch's path widens 16-bit K/V to float32 first).
With `--integer`, also the same K/V as an int16 cache (`int16_kv`) read by the integer kernel
(`Kernel.integer_attention`) on each of its vector paths that run here (`vnni`, `tiles`), in the
same alternation (row `int16`).

    python -m bench.attention [--keys 16384,32768,65536] [--rows 1,7,16] [--kv-dtypes float32,float16]
                              [--integer] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bench.reports import write_json
from triforce_core.models import int16_kv, native_attention
from triforce_core.models.attention import NATIVE_QUERY_ROWS, attend, attention_mask
from triforce_core.cli.bench_report import cpu_model
from triforce_core.config import KV_DTYPES
from triforce_core.models.roofline import measure_bandwidth


def timed_attend(q, k, v, mask, scale, path: str) -> float:
    """Seconds for one `attend` call on `path`: "native" (the kernel) or "pytorch" (the kernel off),
    in inference mode as a forward calls it (PyTorch's path widens 16-bit K/V into a per-thread
    buffer that a forward may have made)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        attend(q, k, v, mask, scale, native=path != "pytorch")
        return time.perf_counter() - t0


def timed_integer(kernel, q, heads: int16_kv.Int16Heads, mask, scale, path: str) -> float:
    """Seconds for one integer-kernel call on `path`, causal as `attend`'s."""
    t0 = time.perf_counter()
    kernel.integer_attention(q, heads, None if mask is None else mask.limits, scale, path=path)
    return time.perf_counter() - t0


def measure(keys: list[int], rows: list[int], heads: int, head_dim: int, repeats: int, say=print,
            kv_dtypes: tuple[str, ...] = ("float32",), integer: bool = False) -> dict:
    kernel = native_attention.kernel()
    if kernel is None:
        raise SystemExit("error: the native kernel is unavailable here (no C compiler)")
    bandwidth = measure_bandwidth(torch.device("cpu"))

    integer_paths = tuple(p for p in kernel.integer_paths() if p != "scalar") if integer else ()
    dtypes = kv_dtypes + (("int16",) if integer_paths else ())

    def paths(dt: str) -> tuple[str, ...]:
        """The kernel's float32 path and PyTorch's; the integer kernel's vector paths over the int16 cache."""
        return integer_paths if dt == "int16" else ("native", "pytorch")

    results = []
    for T in keys:
        k, v = torch.randn(heads, T, head_dim), torch.randn(heads, T, head_dim)
        kv = {dt: (k.to(getattr(torch, dt)), v.to(getattr(torch, dt))) for dt in kv_dtypes}  # the same K/V, rounded
        packed = int16_kv.pack(k, v) if integer_paths else None
        for R in rows:
            q = torch.randn(heads, R, head_dim)
            mask = attention_mask(R, T, 0, None, 1, q.device)  # causal among the R new rows
            times = {(dt, path): [] for dt in dtypes for path in paths(dt)}
            for i in range(repeats + 2):
                for dt, path in (list(times) if i % 2 == 0 else list(times)[::-1]):
                    if dt == "int16":
                        t = timed_integer(kernel, q, packed, mask, head_dim**-0.5, path)
                    else:
                        t = timed_attend(q, *kv[dt], mask, head_dim**-0.5, path)
                    if i >= 2:  # two warm-up passes
                        times[dt, path].append(t)
            for dt in dtypes:
                med = {path: sorted(times[dt, path])[len(times[dt, path]) // 2] * 1e3 for path in paths(dt)}
                if dt == "int16":
                    read = 2 * packed.k[:, : T * 2 * head_dim].numel() + 2 * 4 * T * heads  # planes and scales
                    row = {"keys": T, "rows": R, "kv_dtype": dt, "kv_bytes": read, "ms": med,
                           "floor_ms": read / (bandwidth * 1e9) * 1e3}
                    results.append(row)
                    say(f"[attention] {T} keys, {R} rows, int16 K/V (integer kernel): "
                        + ", ".join(f"{path} {ms:.2f} ms" for path, ms in med.items())
                        + f"; memory floor {row['floor_ms']:.2f} ms ({read / 1e6:.0f} MB)")
                    continue
                read = 2 * kv[dt][0].numel() * kv[dt][0].element_size()
                row = {"keys": T, "rows": R, "kv_dtype": dt, "kv_bytes": read, "ms": med,
                       "floor_ms": read / (bandwidth * 1e9) * 1e3, "speedup": med["pytorch"] / med["native"]}
                results.append(row)
                say(f"[attention] {T} keys, {R} rows, {dt} K/V: native {med['native']:.2f} ms, pytorch "
                    f"{med['pytorch']:.2f} ms ({row['speedup']:.2f}x); memory floor {row['floor_ms']:.2f} ms "
                    f"({read / 1e6:.0f} MB)")
    return {"bandwidth_gb_per_s": bandwidth, "heads": heads, "head_dim": head_dim, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="16384,32768,65536", help="comma-separated cache lengths (default: %(default)s)")
    p.add_argument("--rows", default="1,7,16", help="comma-separated query rows (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="KV heads (default: the demo target's, %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=21, help="timed calls per path (default: %(default)s)")
    p.add_argument("--kv-dtypes", default="float32",
                   help=f"comma-separated K/V dtypes, of {', '.join(KV_DTYPES)}, measured alternately (default: %(default)s)")
    p.add_argument("--integer", action="store_true",
                   help="also an int16 cache read by the integer kernel, on its vector paths that run here")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    try:
        keys = [int(x) for x in a.keys.split(",") if x.strip()]
        rows = [int(x) for x in a.rows.split(",") if x.strip()]
    except ValueError:
        print("error: --keys and --rows take comma-separated integers", file=sys.stderr)
        return 2
    kv_dtypes = tuple(x.strip() for x in a.kv_dtypes.split(",") if x.strip())
    if not kv_dtypes or any(d not in KV_DTYPES for d in kv_dtypes) or len(set(kv_dtypes)) != len(kv_dtypes):
        print(f"error: --kv-dtypes takes distinct names of {', '.join(KV_DTYPES)}", file=sys.stderr)
        return 2
    if not keys or not rows or min(keys) < native_attention.MIN_KEYS or min(rows) < 1 or max(rows) > NATIVE_QUERY_ROWS:
        print(f"error: --keys must be >= {native_attention.MIN_KEYS} and --rows in 1..{NATIVE_QUERY_ROWS} "
              "(where the model runs the kernel)", file=sys.stderr)
        return 2
    if a.integer and a.head_dim % 64:
        print("error: --integer needs a head size that is a multiple of 64", file=sys.stderr)
        return 2
    report = measure(keys, rows, a.heads, a.head_dim, a.repeats, kv_dtypes=kv_dtypes, integer=a.integer)
    report["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "python": platform.python_version(), "load_average_1min": os.getloadavg()[0]}
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
