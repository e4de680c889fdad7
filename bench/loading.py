"""The benchmark harness on a model pair named on a bench script's command line."""

from __future__ import annotations

from triforce_core.cli.harness import Bench
from triforce_core.engine import TriForceEngine
from triforce_core.models.loading import default_model_names


def load_bench(target: str | None, draft: str | None, device: str = "auto", dtype: str = "auto",
               kv_dtype: str | None = None) -> Bench:
    """`Bench` on the engine of --target/--draft (None: the embedded demo pair)."""
    t, d = default_model_names(target, draft)
    return Bench(TriForceEngine.from_pretrained(t, d, device=device, dtype=dtype, kv_dtype=kv_dtype), t, d)
