"""Bit-level fingerprints of the default paths: greedy answers and logits, to compare two trees.

A change that prunes or renames code must leave every default result as it was, bit for bit.
This records, for each model and K/V dtype, the greedy tokens of every mode the model runs and
the raw logits of a prefill, a one-row step and a seven-row verification (SHA-256 of their
float32 bytes, with a few values for reading), so the JSON of one tree can be diffed against
another's:

    python -m bench.fingerprint --target smollm2 --json before.json
    python -m bench.fingerprint --target smollm2 --json after.json --compare before.json

`--compare` prints every entry that differs and exits 1 when one does. Modes are recorded under
what they run (`lookup`, `autoregressive`, `retrieval`, `draft`, and the three levels as
`triforce`), so a renamed mode still compares with its old self.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from triforce_core import GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import CacheConfig

PROMPT = ("The retrieval level of TriForce keeps a small slice of the key-value cache: chunks of eight tokens, "
          "each scored by the mean of its keys against the current query. ")


def _digest(t: torch.Tensor) -> dict:
    t = t.detach().float().contiguous()
    return {"sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest(), "shape": list(t.shape),
            "first": [round(float(x), 6) for x in t.reshape(-1)[:4]]}


def _forwards(engine: TriForceEngine, ids: list[int], kv_dtype: str | None) -> dict:
    """Logits of a prefill's last row, a step and a 7-row verification over a fresh cache."""
    from triforce_core.kv import new_full_cache, resolve_kv_dtype
    model = engine.target
    s = model.spec
    dtype = resolve_kv_dtype(kv_dtype or engine.kv_dtype, model.dtype, model.device, model.quantized, s.head_dim, 8, s.windowed)
    cache = new_full_cache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids) + 16, dtype, model.device)
    out = {}
    n = len(ids) - 8
    pos = torch.arange(n)
    r = model.forward(torch.tensor(ids[:n]), pos, cache, logits_rows=slice(-1, None))
    out["prefill"] = _digest(r.logits)
    r = model.forward(torch.tensor(ids[n:n + 1]), torch.arange(n, n + 1), cache)
    out["step"] = _digest(r.logits)
    r = model.forward(torch.tensor(ids[n + 1:n + 8]), torch.arange(n + 1, n + 8), cache)
    out["verification"] = _digest(r.logits)
    return out


def fingerprint(target: str, draft: str | None, kv_dtypes: list[str], new_tokens: int, repeat: int,
                exact: bool) -> dict:
    from triforce_core.models.loading import default_model_names
    target_name, draft = default_model_names(None if target == "demo" else target, draft)
    engine = TriForceEngine.from_pretrained(target_name, draft=draft, exact=exact)
    text = PROMPT * repeat
    ids = engine.encode(text)
    # the draft by its folder's name: two checkouts of one tree hold it under different paths
    result: dict = {"target": target, "draft": draft and Path(draft).name, "prompt_tokens": len(ids), "exact": exact,
                    "runs": {}}
    modes = ["autoregressive", "lookup", "retrieval"] + (["draft", "triforce"] if engine.draft is not None else [])
    for kv in kv_dtypes:
        kv_name = None if kv == "default" else kv
        entry = {"forwards": _forwards(engine, ids, kv_name), "modes": {}}
        for mode in modes:
            spec = {"mode": mode, "max_new_tokens": new_tokens}
            if mode == "triforce" and "small_draft" in SpeculationConfig.__dataclass_fields__:
                spec["small_draft"] = True  # the three levels, whatever the field's default
            config = GenerationConfig(sampling=SamplingConfig(temperature=0.0), speculation=SpeculationConfig(**spec),
                                      cache=CacheConfig(budget=256, chunk_size=8, kv_dtype=kv_name))
            r = engine.run(ids, config)
            entry["modes"][mode] = {"token_ids": r.token_ids, "levels": r.levels}
            print(f"[fingerprint] {target} kv {kv} {mode}: {len(r.token_ids)} tokens", file=sys.stderr)
        result["runs"][kv] = entry
    return result


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k in ("levels",):  # who proposed a token may change with a mode's proposer; tokens may not
                continue
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'after' if k in b else 'before'}")
            else:
                out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", required=True,
                    help="a model (repeatable; `demo` the embedded pair, `smollm2` with its draft)")
    ap.add_argument("--draft", action="append", default=None, help="its draft, in the order of --target ('-': none)")
    ap.add_argument("--kv-dtypes", default="default", help="comma-separated: default, float16, float32, int16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=12, help="copies of the prompt's sentence")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="a fingerprint to compare with; exit 1 when one differs")
    a = ap.parse_args(argv)
    drafts = a.draft or [None] * len(a.target)
    out = {}
    for t, d in zip(a.target, drafts):
        key = f"{t}{' exact' if a.exact else ''}"
        out[key] = fingerprint(t, None if d in (None, "-") else d, a.kv_dtypes.split(","), a.new_tokens, a.repeat,
                               a.exact)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    if a.compare:
        diffs = _diff(json.loads(a.compare.read_text()), out)
        for line in diffs:
            print(line)
        print(f"{len(diffs)} differences")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
