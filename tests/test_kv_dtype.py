"""16-bit K/V (`CacheConfig.kv_dtype`): exact against the same model decoding with the same K/V.

- The native kernel's float32 path over float16/bfloat16 keys and values equals, bit for bit,
  the kernel over those K/V widened to float32 (vector path and plain C build), is close to a
  float64 reference, and a row's result does not depend on the rows beside it.
- Every cache is allocated in the K/V dtype, the model's new K/V are rounded into it, chunk
  means stay float32.
- Greedy output of every mode equals our autoregressive decoding with the same K/V dtype
  (through PyTorch's attention and through the native kernel), and sampled output follows the
  target's exact law with a float16 cache (chi-square).
- The disk cache keeps a float16 prefill in float16, reads it back bit for bit, and never mixes
  dtypes.
"""

from __future__ import annotations

import functools
import json
import logging

import numpy as np
import pytest
import torch
from tests.helpers.cli import SMALL_CACHE_FLAGS, run_main
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.half_cache import MODES, PROMPT, greedy_reference, kv_config, model_pair
from tests.helpers.models import CPU, make_hf, to_ours, words
from tests.helpers.native import built, needs_compiler
from tests.helpers.disk_cache import (CHUNK, DOCUMENT, block_files, config as disk_config, document_end, new_engine,
                                      two_turns)
from tests.helpers.sampling import V, chi2_pvalue, sample_counts
from tests.helpers.sampling import law_models as chi_models

import triforce_core.models.native_attention as native_attention
from triforce_core import CacheConfig, ConfigError, GenerationConfig, SamplingConfig, TriForceEngine
from triforce_core.config import DEFAULT_KV_DTYPE, GGUF_KV_DTYPE
from triforce_core.decoding.events import Committed, Prefilled
from triforce_core.kv import FullCache, resolve_kv_dtype
from triforce_core.models.native_build import build as build_native
from triforce_core.serving.session import ChatSession
from triforce_core.serving.slots import Slot

HALF = [torch.float16, torch.bfloat16]
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# -- the native kernel -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel():
    return built(native_attention)


def _inputs(H, R, T, D, dtype, seed, room=37):
    """q [H, R, D] float32; k, v [H, T, D] in `dtype`, views into longer buffers (a head stride)."""
    g = torch.Generator().manual_seed(seed)
    kb = (torch.randn(H, T + room, D, generator=g) * 2).to(dtype)
    vb = torch.randn(H, T + room, D, generator=g).to(dtype)
    return torch.randn(H, R, D, generator=g), kb[:, :T], vb[:, :T]


SHAPES = [(4, 1, 4099, 64), (2, 7, 257, 64), (4, 16, 1000, 64), (1, 28, 2049, 128), (2, 5, 777, 48), (3, 3, 513, 32)]


@needs_compiler
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("H,R,T,D", SHAPES, ids=[f"h{h}-r{r}-t{t}-d{d}" for h, r, t, d in SHAPES])
def test_kernel_over_16_bit_kv_equals_it_over_the_widened_kv(kernel, dtype, H, R, T, D):
    q, k, v = _inputs(H, R, T, D, dtype, seed=H * 100 + R + T)
    limits = None if R == 1 else torch.arange(T - R + 1, T + 1)
    out, mass = kernel.attention(q, k, v, limits, D**-0.5, 8)
    wide_out, wide_mass = kernel.attention(q, k.float(), v.float(), limits, D**-0.5, 8)
    assert torch.equal(out, wide_out) and torch.equal(mass, wide_mass)  # widening is exact, the rest float32
    # ... and close to a float64 reference on the widened K/V
    lim = limits if limits is not None else torch.full((R,), T)
    s = torch.matmul(q.double() * D**-0.5, k.double().transpose(1, 2))
    s = s.masked_fill(torch.arange(T)[None, None, :] >= lim[None, :, None], float("-inf"))
    ref = torch.matmul(s.softmax(-1), v.double())
    assert (out.double() - ref).abs().max() < 2e-5


@needs_compiler
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_a_row_over_16_bit_kv_is_the_same_bit_for_bit_whatever_the_rows_beside_it(kernel, dtype):
    H, R, T, D = 3, 16, 1500, 64
    q, k, v = _inputs(H, R, T, D, dtype, seed=9)
    limits = torch.arange(T - R + 1, T + 1)
    outs: dict[int, list] = {}
    for rows in (1, 2, 3, 7, 16):
        for start in range(0, R, rows):
            stop = min(start + rows, R)
            out, mass = kernel.attention(q[:, start:stop], k, v, limits[start:stop], 0.125, chunk=16)
            for r in range(start, stop):
                outs.setdefault(r, []).append((out[:, r - start], mass[:, r - start]))
    for r, seen in outs.items():
        assert all(torch.equal(o, seen[0][0]) and torch.equal(m, seen[0][1]) for o, m in seen), f"row {r}"


@needs_compiler
def test_plain_c_build_widens_16_bit_kv_exactly(tmp_path):
    """The scalar path (no vector instructions), half -> float by bit manipulation: subnormal,
    zero and negative values included."""
    flags = ("-O2", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
    plain = native_attention.Kernel(build_native(native_attention.SOURCE, flags, tmp_path), threads=1)
    H, R, T, D = 2, 3, 300, 64
    for dtype in HALF:
        q, k, v = _inputs(H, R, T, D, dtype, seed=3)
        k[:, :40] = k[:, :40].float().mul(1e-6).to(dtype)  # float16 subnormals (below 6.1e-5)
        k[:, 40:44] = 0.0
        v[:, :20] = -v[:, :20].float().abs().mul(1e-7).to(dtype)
        limits = torch.arange(T - R + 1, T + 1)
        out, mass = plain.attention(q, k, v, limits, 0.125, 4)
        wide_out, wide_mass = plain.attention(q, k.float(), v.float(), limits, 0.125, 4)
        assert torch.equal(out, wide_out) and torch.equal(mass, wide_mass), dtype


@needs_compiler
def test_kernel_refuses_mixed_or_unknown_dtypes(kernel):
    q, k, v = _inputs(1, 1, 64, 64, torch.float16, seed=1)
    with pytest.raises(ValueError, match="one dtype"):
        kernel.attention(q, k, v.float(), None, 0.125)
    with pytest.raises(ValueError, match="float32 queries"):
        kernel.attention(q.half(), k, v, None, 0.125)
    with pytest.raises(ValueError):
        kernel.attention(q, k.double(), v.double(), None, 0.125)


# -- configuration -----------------------------------------------------------------------------
def test_kv_dtype_setting_is_validated_and_resolved():
    assert CacheConfig(kv_dtype="auto").kv_dtype is None
    assert CacheConfig(kv_dtype="bfloat16").kv_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="kv_dtype"):
        CacheConfig(kv_dtype="int8")
    assert resolve_kv_dtype(None, torch.float32, "cpu") == getattr(torch, DEFAULT_KV_DTYPE)
    assert resolve_kv_dtype(None, torch.float32, "cpu", quantized=True) == getattr(torch, GGUF_KV_DTYPE) == torch.float16
    assert resolve_kv_dtype("float32", torch.float32, "cpu", quantized=True) == torch.float32  # named: it wins
    assert resolve_kv_dtype(None, torch.bfloat16, "cuda", quantized=True) == torch.bfloat16
    assert resolve_kv_dtype(None, torch.bfloat16, "cpu") == torch.bfloat16  # 16-bit weights: their own dtype
    assert resolve_kv_dtype(None, torch.float16, "cuda") == torch.float16
    assert resolve_kv_dtype("float32", torch.float32, "cpu") == torch.float32
    with pytest.raises(ValueError, match="kv_dtype"):
        TriForceEngine(to_ours(make_hf("llama_gqa_llama3")), kv_dtype="float8")


# -- caches and the model ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_every_cache_is_in_the_kv_dtype_and_new_kv_are_rounded_into_it(dtype):
    t, d = model_pair()
    engine = TriForceEngine(t, d)
    cfg = kv_config("triforce", NAMES[dtype])
    dec = engine.make_loop(cfg, engine.capacity_for(len(PROMPT), cfg), None)
    dec.prefill(PROMPT)
    for lane in (dec.full, dec.retrieval, dec.small):
        assert lane.cache.k.dtype == lane.cache.v.dtype == dtype
    assert dec.full.cache.chunk_means(4, 8).dtype == torch.float32
    # Layer 0's keys and values do not depend on attention: the 16-bit cache holds float32's, rounded.
    wide = FullCache(t.spec.num_layers, t.spec.num_kv_heads, t.spec.head_dim, 200, torch.float32, CPU)
    t.forward(torch.tensor(PROMPT[:-1]), torch.arange(len(PROMPT) - 1), wide, logits_rows=None)
    n = len(PROMPT) - 1
    assert torch.equal(dec.full.cache.k[0, :, :n], wide.k[0, :, :n].to(dtype))
    assert torch.equal(dec.full.cache.v[0, :, :n], wide.v[0, :, :n].to(dtype))
    assert not torch.equal(dec.full.cache.k[1, :, :n].float(), wide.k[1, :, :n])  # layer 1 attended to rounded K/V


def _assert_same(got: list[int], ref: list[int], gaps: list[float], tie: float = 1e-4) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < tie, f"diverged at token {i} ({a} != {b}) with top-2 gap {gaps[i]:.3g}"
            return


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "mistral_window"])
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_greedy_every_mode_equals_autoregressive_with_the_same_kv_dtype(kind, dtype):
    t, d = model_pair(kind)
    ref, gaps = greedy_reference(t, PROMPT, 40, dtype)
    engine = TriForceEngine(t, d)
    auto = engine.run(PROMPT, kv_config("autoregressive", NAMES[dtype]))
    assert auto.token_ids == ref  # the engine's own autoregressive decoding: the same forwards
    for mode, lookup in MODES:
        res = engine.run(PROMPT, kv_config(mode, NAMES[dtype], lookup=lookup))
        _assert_same(res.token_ids, ref, gaps)
        # (a model whose every layer slides keeps its window exactly in the retrieval level,
        # which the target then accepts whole: `kv.retrieval`)
        if not lookup and not (kind == "mistral_window" and mode != "draft"):
            assert res.stats.acceptance["target"] < 0.9  # proposals really were rejected


@needs_compiler
@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_greedy_through_the_kernel_equals_autoregressive_bit_for_bit(monkeypatch, kernel, dtype):
    """The kernel at every length and the native layers (forwards of up to 16 rows: lookup runs
    of at most 8 here): a verification's rows equal the steps they stand for bit for bit, so the
    outputs are equal with no tie tolerated."""
    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)
    t, d = model_pair()
    assert_verification_rows_equal_steps(t, PROMPT, dtype)
    ref, _ = greedy_reference(t, PROMPT, 40, dtype)
    engine = TriForceEngine(t, d)
    for mode, lookup in MODES:
        cfg = kv_config(mode, NAMES[dtype], lookup=lookup, **({"lookup_max": 8} if lookup else {}))
        assert engine.run(PROMPT, cfg).token_ids == ref, mode


def test_engine_default_and_config_precedence():
    t, d = model_pair()
    engine = TriForceEngine(t, d, kv_dtype="bfloat16")
    assert engine.kv_dtype_for(GenerationConfig()) == torch.bfloat16
    assert engine.kv_dtype_for(kv_config("autoregressive", "float32")) == torch.float32  # the config's wins
    assert TriForceEngine(t, d).kv_dtype_for(GenerationConfig()) == getattr(torch, DEFAULT_KV_DTYPE)


def test_a_slot_does_not_hand_a_cache_to_another_kv_dtype():
    """A chat whose K/V dtype changes prefills again (a float32 cache is not a float16
    prefill), and answers as a fresh float16 run does."""
    t, d = model_pair()
    engine = TriForceEngine(t, d)
    slot = Slot(engine)
    list(slot.generate(PROMPT, kv_config("lookup", "float32", new=8, lookup=True)))
    assert slot.loop.full.cache.k.dtype == torch.float32
    events = list(slot.generate(PROMPT, kv_config("lookup", "float16", new=8, lookup=True)))
    assert slot.loop.full.cache.k.dtype == torch.float16
    assert isinstance(events[0], Prefilled) and events[0].reused_tokens == 0
    fresh = TriForceEngine(t, d).run(PROMPT, kv_config("lookup", "float16", new=8, lookup=True))
    assert [tok for ev in events if isinstance(ev, Committed) for tok in ev.token_ids] == fresh.token_ids


# -- sampling ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def exact_joint_with_cache(dtype: torch.dtype, temperature: float) -> np.ndarray:
    """P(x1, x2) under the target decoding with a `dtype` cache (our forward: the law the
    speculative modes must follow with that cache): [V, V]."""
    _, t, _, prompt = chi_models()
    s = t.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(prompt) + 2, dtype, CPU)
    n = len(prompt)
    logits = t.forward(torch.tensor(prompt), torch.arange(n), cache, logits_rows=slice(-1, None)).logits[0]
    p1 = (logits.double() / temperature).softmax(-1)
    p2 = torch.empty(V, V, dtype=torch.float64)
    for x in range(V):
        cache.truncate(n)
        p2[x] = (t.forward(torch.tensor([x]), torch.tensor([n]), cache).logits[0].double() / temperature).softmax(-1)
    joint = (p1[:, None] * p2).numpy()
    return joint / joint.sum()


def test_sampling_with_a_float16_cache_follows_the_targets_law():
    cache = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=0,
                        kv_dtype="float16")
    p = chi2_pvalue(sample_counts("retrieval", 1.0, cache=cache), exact_joint_with_cache(torch.float16, 1.0))
    assert p > 1e-3, f"chi-square p = {p:.2e}"


# -- the disk cache ----------------------------------------------------------------------------
def _disk_config(mode: str, kv: str) -> GenerationConfig:
    cfg = disk_config(mode)
    return GenerationConfig(sampling=cfg.sampling, speculation=cfg.speculation,
                            cache=CacheConfig(**{**cfg.cache.__dict__, "kv_dtype": kv}))


def test_disk_cache_round_trip_in_float16_and_no_mixing(weights, tmp_path, caplog):
    f16, f32 = _disk_config("triforce", "float16"), _disk_config("triforce", "float32")
    reference, _, _ = two_turns(new_engine(weights), f16)  # no disk cache
    written, stats, _ = two_turns(new_engine(weights, tmp_path), f16)
    assert written == reference and stats[0].disk_tokens == 0
    files = block_files(tmp_path)
    end = document_end(new_engine(weights), f16)
    assert len(files) == end // CHUNK + 1  # the whole blocks and the document's tail
    for path in files:
        raw = path.read_bytes()
        assert b'"dtype": "float16"' in raw
    read, stats, _ = two_turns(new_engine(weights, tmp_path), f16)  # after a restart: read back
    assert read == reference and stats[0].disk_tokens == end
    # A float32 cache finds none of the float16 blocks (another key) and writes its own.
    _, stats, _ = two_turns(new_engine(weights, tmp_path), f32)
    assert stats[0].disk_tokens == 0
    assert len(block_files(tmp_path)) == 2 * len(files)
    sizes = sorted(p.stat().st_size for p in block_files(tmp_path))
    assert sizes[-1] > 1.9 * sizes[0]  # float32 blocks are twice the float16 ones
    # A float16 file read into a float32 cache (as if the keys collided) is refused, not converted.
    engine = new_engine(weights, tmp_path)
    body = ChatSession(engine, DOCUMENT, config=f16).prompt_ids(words(6, 12))[:-1]
    block = engine.disk_cache.blocks(body, CHUNK, torch.float16, arithmetic=engine.target.arithmetic)[0]
    s = engine.target.spec
    wide = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, 64, torch.float32, CPU)
    with caplog.at_level(logging.WARNING, logger="triforce_core.kv.disk"):
        assert engine.disk_cache._read(block, wide) is None
    assert "dtype" in caplog.records[-1].getMessage()


@pytest.fixture(scope="module")
def weights():
    from tests.helpers.models import perturbed

    hf = make_hf("llama_gqa_llama3", seed=0)
    return hf, perturbed(hf, 0.02)


# -- command line ------------------------------------------------------------------------------
def test_command_line_kv_dtype(tiny_pair_dir, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT[:100]))
    base = ["generate", "--target", tiny_pair_dir["target"], "--draft", tiny_pair_dir["draft"], *SMALL_CACHE_FLAGS,
            "--prompt-ids-file", str(ids), "--ignore-eos", "--max-new-tokens", "12", "--json"]
    outs = {}
    for kv in ("bfloat16", "float32"):
        for mode in ("lookup", "autoregressive"):
            code, out, err = run_main(base + ["--mode", mode, "--kv-dtype", kv])
            assert code == 0, err
            outs[kv, mode] = json.loads(out)["samples"][0]["token_ids"]
    assert outs["bfloat16", "lookup"] == outs["bfloat16", "autoregressive"]
    assert outs["float32", "lookup"] == outs["float32", "autoregressive"]
    code, out, err = run_main(base + ["--kv-dtype", "int8"])
    assert code == 2 and err.startswith("error: ") and "--kv-dtype" in err and len(err.splitlines()) == 1
    from triforce_core.__main__ import main

    for command in ("generate", "chat", "serve", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        assert "--kv-dtype" in help_text and "--exact" in help_text, command
        assert "equal to Hugging Face token for token" in " ".join(help_text.split()), command
    # --exact keeps float32: a 16-bit --kv-dtype contradicts it (one line, exit 2, before loading)
    for kv in ("bfloat16", "float16"):
        code, out, err = run_main(base + ["--exact", "--kv-dtype", kv])
        assert (code, out) == (2, "") and err == f"error: --exact computes and keeps K/V in float32: it cannot take --kv-dtype {kv}\n"
    code, out, err = run_main(base + ["--exact", "--mode", "lookup"])
    assert code == 0, err
    assert json.loads(out)["samples"][0]["token_ids"] == outs["float32", "autoregressive"]  # a folder: float32 either way


def test_app_takes_kv_dtype_and_exact(capsys):
    import app

    assert app.parse_args(["--kv-dtype", "bfloat16"]).kv_dtype == "bfloat16"
    assert app.parse_args([]).kv_dtype is None
    assert app.parse_args(["--exact"]).exact is True and app.parse_args([]).exact is False
    assert app.main(["--exact", "--kv-dtype", "float16"]) == 2  # refused before any model is loaded
    assert capsys.readouterr().err == "error: --exact computes and keeps K/V in float32: it cannot take --kv-dtype float16\n"


# -- the document-chat bench ---------------------------------------------------------------------
def test_bench_chat_runs_configurations_in_several_kv_dtypes(chat_engine, one_thread):
    from bench import chat

    assert chat.split_name("lookup+kv_dtype-bfloat16+budget-64") == ("lookup", {"+kv_dtype-bfloat16", "+budget-64"})
    assert chat.make_config("lookup+kv_dtype-bfloat16", SamplingConfig(), 8).cache.kv_dtype == "bfloat16"
    with pytest.raises(chat.ChatBenchError, match="kv_dtype must be one of"):
        chat.make_config("lookup+kv_dtype-int8", SamplingConfig(), 8)
    text = words(200, seed=3)
    turns = chat.workload(text, quotes=1, open_count=1, seed=1)
    names = ["lookup+kv_dtype-float32", "lookup", "autoregressive+kv_dtype-float32", "autoregressive"]
    report = chat.run(chat_engine, text, turns, names, SamplingConfig(), 8, say=lambda line: None)
    kinds = {n: c["kv_dtype"] for n, c in report["configs"].items()}
    assert kinds == {"lookup+kv_dtype-float32": "float32", "lookup": DEFAULT_KV_DTYPE,
                     "autoregressive+kv_dtype-float32": "float32", "autoregressive": DEFAULT_KV_DTYPE}
    assert report["results"]["lookup"]["identical_to_autoregressive"] is True
    assert all(row["new_tokens"][n] > 0 for row in report["turns"] for n in names)
    prefills = report["prefill_by_kv_dtype"]  # each dtype's own prefill of the document
    assert set(prefills) == set(kinds.values()) and all(p["tokens"] > 0 and p["tokens_per_s"] > 0
                                                        for p in prefills.values())
