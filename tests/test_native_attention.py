"""The native few-row attention kernel (`triforce_core.models.native_attention`) is exact.

- Against a float64 reference: outputs and per-chunk attention mass, over row counts, key
  counts around the block size, head sizes with and without the vector path, causal limits,
  caches with a head stride (views into a larger buffer).
- Through the model: forcing the kernel at every length, greedy output equals Hugging Face's
  across the model zoo and modes, and sampled output follows the target's law (chi-square).
- Negative controls: a kernel that lets each row see one key too many (a causal leak) fails
  the reference comparison and the chi-square test. (The zoo's near-uniform random attention
  hides such a leak from greedy decoding; the chi-square models' sharp attention does not.)
"""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.native import built, needs_compiler
from tests.helpers.attention import attention_reference
from tests.helpers.greedy import CACHE, TARGETS, assert_same_as_hf, greedy_config, hf_greedy
from tests.helpers.sampling import FOLLOWING, chi2_pvalue, exact_joint, sample_counts

import triforce_core.models.native_attention as native_attention
from triforce_core import TriForceEngine
from triforce_core.models.transformer import Transformer

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernel():
    return built(native_attention)


@pytest.fixture
def forced(monkeypatch, kernel):
    """The kernel at every cache length (the tests' prompts are short), called per layer from
    Python (the path of windowed layers; the one-call forward, which calls it from C, has its
    own tests in test_native_layers); counts its calls."""
    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)
    monkeypatch.setattr(Transformer, "one_call", False)
    calls = []
    original = native_attention.Kernel.attention

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(native_attention.Kernel, "attention", counting)
    return calls


@pytest.fixture
def leaking(monkeypatch, forced):
    """The negative control: every row sees one key past its limit (where there is one)."""
    original = native_attention.Kernel.attention

    def leak(self, q, k, v, limits, scale, chunk=0):
        leaked = None if limits is None else (limits + 1).clamp(max=k.shape[1])  # None: every key already
        return original(self, q, k, v, leaked, scale, chunk)

    monkeypatch.setattr(native_attention.Kernel, "attention", leak)


SHAPES = [  # (Hkv, R, T, D)
    (4, 1, 1, 64), (4, 1, 4099, 64), (4, 7, 300, 64), (2, 7, 256, 64), (2, 7, 257, 64), (4, 16, 1000, 64),
    (1, 28, 2049, 128), (2, 5, 777, 48), (3, 3, 513, 32), (2, 64, 600, 64),
]


@pytest.mark.parametrize("H,R,T,D", SHAPES, ids=[f"h{h}-r{r}-t{t}-d{d}" for h, r, t, d in SHAPES])
@pytest.mark.parametrize("chunk", [0, 8])
def test_kernel_matches_float64_reference(kernel, H, R, T, D, chunk):
    g = torch.Generator().manual_seed(H * 1000 + R * 10 + T)
    room = 37  # a cache buffer longer than the view: the heads are not contiguous
    kb, vb = torch.randn(H, T + room, D, generator=g) * 2, torch.randn(H, T + room, D, generator=g)
    k, v = kb[:, :T], vb[:, :T]
    q = torch.randn(H, R, D, generator=g)
    # causal among the last rows (a verification); a single row sees everything
    limits = torch.tensor([max(1, T - R + 1 + r) for r in range(R)])
    scale = D**-0.5
    # one row sees every key: the kernel's "no limits" form
    out, mass = kernel.attention(q, k, v, None if R == 1 else limits, scale, chunk)
    ref_out, ref_mass = attention_reference(q, k, v, limits, scale, chunk or 8)
    assert out.shape == (H, R, D)
    assert (out.double() - ref_out).abs().max() < 2e-5
    if chunk:
        assert mass.shape == ref_mass.shape
        assert mass.numel() == 0 or (mass.double() - ref_mass).abs().max() < 2e-6
    else:
        assert mass is None


@pytest.mark.parametrize("R,T,window,dtype", [(1, 700, 300, torch.float32), (7, 700, 300, torch.float16),
                                              (16, 1300, 512, torch.float32), (3, 260, 100, torch.bfloat16)])
def test_a_band_of_keys_matches_the_float64_reference(kernel, R, T, window, dtype):
    """A sliding window's band (row r sees keys firsts[r] <= t < limits[r]), the keys in the
    cache's dtype; the negative control: the same call without the firsts sees older keys."""
    g = torch.Generator().manual_seed(R * 7 + T)
    H, D = 2, 64
    q = torch.randn(H, R, D, generator=g)
    k, v = (torch.randn(H, T, D, generator=g) * 2).to(dtype), torch.randn(H, T, D, generator=g).to(dtype)
    limits = torch.arange(T - R + 1, T + 1)
    firsts = (limits - window).clamp(min=0)
    out, mass = kernel.attention(q, k, v, limits, 0.125, 8, firsts=firsts)
    ref_out, ref_mass = attention_reference(q, k.float(), v.float(), limits, 0.125, 8, firsts)
    assert (out.double() - ref_out).abs().max() < 2e-5
    assert (mass.double() - ref_mass).abs().max() < 2e-6
    blind, _ = kernel.attention(q, k, v, limits, 0.125)
    assert (blind.double() - ref_out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="first keys come with limits"):
        kernel.attention(q, k, v, None, 0.125, firsts=firsts)


@pytest.mark.parametrize("D", [64, 48])  # the vector path for every product; a scalar weighted sum
def test_a_row_is_the_same_bit_for_bit_whatever_the_rows_beside_it(kernel, D):
    """Rows run in groups that share each key loaded; a row's result must not depend on its
    group, so a verification row equals the decoding step it stands for (and greedy outputs
    do not move with the number of drafted tokens)."""
    g = torch.Generator().manual_seed(D)
    H, R, T = 3, 16, 1500
    q, k, v = torch.randn(H, R, D, generator=g), torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    limits = torch.arange(T - R + 1, T + 1)
    outs = {}
    for rows in (1, 2, 3, 5, 7, 16):  # every group size, and groups with a remainder
        for start in range(0, R, rows):
            stop = min(start + rows, R)
            out, mass = kernel.attention(q[:, start:stop], k, v, limits[start:stop], 0.125, chunk=16)
            for r in range(start, stop):
                outs.setdefault(r, []).append((out[:, r - start], mass[:, r - start]))
    for r, seen in outs.items():
        assert all(torch.equal(o, seen[0][0]) and torch.equal(m, seen[0][1]) for o, m in seen), f"row {r}"


@pytest.mark.parametrize("kv", ["float16", "int16"])
def test_the_same_bits_on_one_thread_and_on_two(kernel, kv):
    """The jobs and the merge are split over the threads (the merge by head and row, above a
    size: here 4 heads x 16 rows x 17 blocks x 64); each piece is one thread's, so the output
    and the chunk masses do not move with the threads."""
    from triforce_core.models import int16_kv

    g = torch.Generator().manual_seed(11)
    H, R, T, D = 4, 16, 4300, 64
    q, k, v = torch.randn(H, R, D, generator=g), torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    limits = torch.arange(T - R + 1, T + 1)
    heads = int16_kv.pack(k, v) if kv == "int16" else None
    runs = []
    for threads in (1, 2):
        one = native_attention.Kernel(kernel.lib, threads=threads)
        if heads is not None:
            if "vnni" not in one.integer_paths():
                pytest.skip("no VNNI here")
            runs.append(one.integer_attention(q, heads, limits, 0.125, chunk=16))
        else:
            runs.append(one.attention(q, k.half(), v.half(), limits, 0.125, chunk=16))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_negative_control_a_leaked_key_is_caught(kernel):
    g = torch.Generator().manual_seed(5)
    H, R, T, D = 4, 7, 3000, 64
    q, k, v = (torch.randn(H, n, D, generator=g) for n in (R, T, T))
    limits = torch.arange(T - R + 1, T + 1)
    out, _ = kernel.attention(q, k, v, (limits + 1).clamp(max=T), 0.125)
    ref_out, _ = attention_reference(q, k, v, limits, 0.125, 8)
    assert (out.double() - ref_out).abs().max() > 1e-3


def test_build_is_cached_and_leaves_nothing_else(tmp_path):
    first = native_attention.build(tmp_path)
    assert native_attention.build(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    out, _ = native_attention.Kernel(first, threads=1).attention(
        torch.ones(1, 1, 8), torch.ones(1, 3, 8), torch.arange(24.0).reshape(1, 3, 8), torch.tensor([3]), 1.0)
    assert torch.allclose(out, torch.arange(24.0).reshape(3, 8).mean(0))  # equal scores: the mean value


def test_an_arithmetic_without_the_kernel_takes_pytorchs_path_and_the_environment_decides_nothing(forced, kernel,
                                                                                                   monkeypatch):
    """`attend(native=False)` (a model's `Arithmetic.native_attention` off, the benchmarks'
    comparison) never calls the kernel; an environment variable turns nothing off."""
    from triforce_core.models.attention import attend

    monkeypatch.setenv("TRIFORCE_NATIVE_ATTENTION", "0")
    assert native_attention.kernel() is kernel
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 3, 64, generator=g), torch.randn(2, 50, 64, generator=g), torch.randn(2, 50, 64, generator=g)
    off, _ = attend(q, k, v, None, 0.125, native=False)
    assert forced == []
    on, _ = attend(q, k, v, None, 0.125)
    assert forced == [3] and torch.allclose(on, off, atol=1e-5)


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("mode,lookup", [("autoregressive", False), ("triforce", False), ("retrieval", True)])
def test_greedy_matches_hf_through_the_kernel(forced, kind, mode, lookup):
    _, t, d, ids, ref, gaps = hf_greedy(kind)
    res = TriForceEngine(t, d).run(ids, greedy_config(mode, 2, 6, lookup=lookup))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert forced and (mode == "autoregressive" or max(forced) > 1)  # the kernel ran, verifications included


def test_greedy_with_attention_selection_matches_hf_through_the_kernel(forced):
    _, t, d, ids, ref, gaps = hf_greedy("llama_gqa_llama3")
    cache = CACHE.__class__(**{**CACHE.__dict__, "select_by": "attention", "refresh_every": 1, "refresh_acceptance": 0.0})
    res = TriForceEngine(t, d).run(ids, greedy_config("retrieval", 1, 4, cache=cache))
    assert_same_as_hf(res.token_ids, ref, gaps)
    assert res.stats.refreshes > 5


def test_sampling_through_the_kernel_is_exact(forced):
    """The retrieval level under the target, its chunks chosen from the target's attention
    (the kernel's per-chunk mass) after every round."""
    p = chi2_pvalue(sample_counts("retrieval", 1.0, gammas=(1, 1), cache=FOLLOWING), exact_joint(1.0))
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    assert max(forced) > 1


def test_negative_control_leaking_kernel_fails_the_chi_square(leaking):
    p = chi2_pvalue(sample_counts("retrieval", 1.0), exact_joint(1.0))
    assert p < 1e-3, f"the leaking kernel was not detected (p = {p:.2e})"


def test_attention_bench_reports_both_paths_and_refuses_bad_input(tmp_path, kernel, capsys):
    from bench import attention

    out = tmp_path / "attention.json"
    assert attention.main(["--keys", "2048", "--rows", "1,3", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["keys"], r["rows"]) for r in report["results"]] == [(2048, 1), (2048, 3)]
    assert all(set(r["ms"]) == {"native", "pytorch"} and r["kv_bytes"] == 2 * 4 * 2048 * 64 * 4 for r in report["results"])
    # over float16 K/V, the same two paths
    assert attention.main(["--keys", "2048", "--rows", "4", "--repeats", "1", "--kv-dtypes", "float16",
                           "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert set(row["ms"]) == {"native", "pytorch"}
    # with --integer, the int16 cache on the integer kernel's vector paths that run here
    assert attention.main(["--keys", "2048", "--rows", "4,1", "--repeats", "1", "--kv-dtypes", "float16", "--integer",
                           "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]  # 4 rows, then 1 (no mask); each row count's dtypes in turn
    vector = set(kernel.integer_paths()) - {"scalar"}
    dtypes = ["float16"] + (["int16"] if vector else [])  # no int16 rows where only the scalar path runs
    assert [(r["rows"], r["kv_dtype"]) for r in results] == [(n, d) for n in (4, 1) for d in dtypes]
    rows = results[:2]
    assert not vector or (set(rows[1]["ms"]) == vector and rows[1]["kv_bytes"] == 2 * 2 * 4 * 2048 * 64 + 2 * 4 * 4 * 2048)
    assert attention.main(["--keys", "4096", "--rows", "140"]) == 2
    assert "--rows in 1..136" in capsys.readouterr().err
    assert attention.main(["--keys", "4096", "--integer", "--head-dim", "48"]) == 2
    assert "multiple of 64" in capsys.readouterr().err
