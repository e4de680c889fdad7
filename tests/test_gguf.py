"""GGUF checkpoints: weights kept as stored decode exactly.

- The native dequantization equals ggml's own package's (which transformers uses) bit for bit,
  for every type kept as stored.
- The quantized few-row products sum in one order whatever the rows beside: a 7-row forward
  (a verification) gives the logits of seven 1-token steps bit for bit.
- With `exact` (float32 K/V and float products), greedy output of every mode equals Hugging
  Face's on the same file (transformers dequantizes it), on a Llama with the Q4_K_M mix of types
  (Q4_K, Q6_K, Q5_K beside Q4_0/Q4_1/Q8_0), on Llamas of Q5_0 (q/k Q5_0 stacked with v Q8_0, as
  a Q4_K_M file keeps the projections whose rows are not a multiple of 256) and of Q5_1 (beside
  Q5_0), and a Qwen2 with biases, tied embeddings and F16/F32 matrices; so do the logits (and,
  the control, not the default's, with float16 K/V). Negative control: without undoing
  llama.cpp's row order of q and k, the output differs.
- By default a GGUF file keeps K/V in float16 (a Hugging Face folder in float32); greedy output
  of every mode on that path equals our own autoregressive decoding on it, token for token;
  negative control: a verifier that accepts every proposal is caught.
- Sampling from a quantized pair follows the target's law (chi-square), and a broken verifier
  is caught on it.
- Bad files are refused in one line; the command line runs a GGUF file, `--exact` equal to
  Hugging Face, and refuses `--exact` with 16-bit K/V or weights in one line.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers import ROOT
from tests.helpers.exactness import assert_verification_rows_equal_steps
from tests.helpers.models import CPU, make_hf
from tests.helpers.native import needs_compiler
from gguf import GGMLQuantizationType as Q
from gguf import quants
from tests.helpers.gguf_files import K_MIX, LLAMA, hf_from_gguf, random_blocks, write_gguf
from tests.helpers.sampling import break_verifier, chi2_pvalue, first_two_counts, first_two_law

import triforce_core.models.gguf_file as gguf_file
from triforce_core import CacheConfig, GenerationConfig, SamplingConfig, SpeculationConfig, TriForceEngine
from triforce_core.config import PAPER_METHOD
from triforce_core.models.loading import ModelLoadError, load_model
from triforce_core.models.quantized import Matrix, StoredTensor

pytestmark = needs_compiler
STORED_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
QWEN = dict(vocab_size=300)
QWEN_TYPES = {"attn_v.weight": Q.F16, "attn_output.weight": Q.F32}
# The 5-bit 32-weight types everywhere but v (Gemma 3 270M's Q4_K_M file: q and k Q5_0, v Q8_0)
Q5_0_MIX = {**{name: Q.Q5_0 for name in K_MIX}, "attn_v.weight": Q.Q8_0, "output.weight": Q.Q5_0}
Q5_1_MIX = {**{name: Q.Q5_1 for name in K_MIX}, "attn_v.weight": Q.Q5_0, "output.weight": Q.Q5_1}
LLAMA_MIXES = {"llama": K_MIX, "llama_q5_0": Q5_0_MIX, "llama_q5_1": Q5_1_MIX}
KINDS = ["llama", "qwen2", "llama_q5_0", "llama_q5_1"]
# each kind's layer 0 q/k/v parts
QKV_TYPES = {"llama": ["Q4_K", "Q4_K", "Q6_K"], "qwen2": ["Q8_0", "Q8_0", "F16"], "llama_q5_0": ["Q5_0", "Q5_0", "Q8_0"],
             "llama_q5_1": ["Q5_1", "Q5_1", "Q5_0"]}
PROMPT_LEN, NEW = 120, 32
TIE_GAP = 1e-4
CACHE = CacheConfig(budget=48, chunk_size=4, recent_tokens=12, draft_sinks=4, draft_window=24, refresh_every=16)
# (mode, the paper's method or lookup in front) of the greedy tests
MODES = [("autoregressive", True), ("lookup", False), ("triforce", True), ("triforce", False), ("retrieval", True),
         ("draft", True)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("qtype", STORED_TYPES, ids=lambda q: q.name)
def test_dequantization_equals_the_gguf_package_bit_for_bit(qtype):
    raw = random_blocks(qtype, 6, 512, np.random.default_rng(int(qtype)))
    got = StoredTensor(int(qtype), torch.from_numpy(raw), (6, 512)).dequantized()
    assert np.array_equal(got.numpy(), quants.dequantize(raw, qtype))


# Stacked matrices' parts (type, rows): a Q4_K_M file's q/k/v of K types beside Q8_0; one
# 5-bit type alone; q/k/v of Q5_0 and v Q8_0 (Gemma 3 270M's Q4_K_M file); Q5_1 beside Q5_0.
STACKS = {"k_types": ((Q.Q4_K, 40), (Q.Q6_K, 24), (Q.Q8_0, 17)), "q5_0": ((Q.Q5_0, 37),), "q5_1": ((Q.Q5_1, 37),),
          "q5_0_qkv": ((Q.Q5_0, 24), (Q.Q5_0, 8), (Q.Q8_0, 8)), "q5_1_q5_0": ((Q.Q5_1, 21), (Q.Q5_0, 19))}


def _stacked(rng, stack: str = "k_types") -> tuple[Matrix, torch.Tensor]:
    parts = [StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, 256, rng)), (rows, 256))
             for q, rows in STACKS[stack]]
    return Matrix(stored=tuple(parts)), torch.cat([p.dequantized() for p in parts])


@pytest.mark.parametrize("stack", list(STACKS))
def test_stacked_product_rows_are_independent_and_exact(stack):
    from triforce_core.models import native_layers

    kernel = native_layers.kernel()
    m, dense = _stacked(np.random.default_rng(3), stack)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(256)
    alone = [kernel.logits(x[i : i + 1], ones, 1e-6, m)[0] for i in range(17)]
    for n in range(2, 18):  # every size of the groups that share a dequantized block
        together = kernel.logits(x[:n], ones, 1e-6, m)
        for i in range(n):
            assert torch.equal(alone[i], together[i]), f"row {i} of {n}"
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(together.double(), h @ dense.double().t(), rtol=1e-5, atol=1e-4)


def test_the_avx512_path_equals_the_avx2_path_bit_for_bit(tmp_path):
    """Where the machine has AVX-512 the kernel takes 16-lane versions of the sums; they must
    give exactly the AVX2 path's results (the same library built without them), every type and
    row count."""
    from triforce_core.models import native_build, native_layers

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "avx512dq" not in cpuinfo.read_text():
        pytest.skip("no AVX-512 here: both builds would be the AVX2 path")
    wide = native_layers.kernel()
    narrow = native_layers.Layers(native_build.build(native_layers.SOURCE, native_layers.LAYER_FLAGS + ("-DTRIFORCE_NO_AVX512",),
                                                     tmp_path))
    rng = np.random.default_rng(4)
    parts = [StoredTensor(int(q), torch.from_numpy(random_blocks(q, rows, 256, rng)), (rows, 256))
             for q, rows in ((Q.Q4_0, 19), (Q.Q4_1, 21), (Q.Q5_0, 13), (Q.Q5_1, 15), (Q.Q8_0, 17), (Q.Q4_K, 9), (Q.Q5_K, 7),
                             (Q.Q6_K, 11))]
    m = Matrix(stored=tuple(parts))
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(1))
    ones = torch.ones(256)
    for n in (1, 2, 5, 9, 16, 17, 33):
        assert torch.equal(wide.logits(x[:n], ones, 1e-6, m), narrow.logits(x[:n], ones, 1e-6, m)), n


@functools.lru_cache(maxsize=None)
def _files(folder: Path, kind: str):
    """A target and a small draft of one vocabulary, written as GGUF; HF's model of the target
    file, ours of both, and HF's greedy reference."""
    over, types = (LLAMA, LLAMA_MIXES[kind]) if kind in LLAMA_MIXES else (QWEN, QWEN_TYPES)
    # llama_mha: GGUF metadata carries no llama3 rope scaling here
    hf_kind = "llama_mha" if kind in LLAMA_MIXES else "qwen2_tied"
    target = write_gguf(make_hf(hf_kind, seed=0, **over), folder / f"{kind}-target.gguf", types)
    draft = write_gguf(make_hf(hf_kind, seed=5, **{**over, "num_hidden_layers": 1}), folder / f"{kind}-draft.gguf", types)
    hf = hf_from_gguf(target)
    ids = torch.randint(3, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long), do_sample=False,
                          max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    ref = out.sequences[0, PROMPT_LEN:].tolist()
    gaps = [float(lg[0].topk(2).values[0] - lg[0].topk(2).values[1]) for lg in out.logits]
    t = load_model(str(target), CPU, torch.float32)
    d = load_model(str(draft), CPU, torch.float32)
    return t, d, ids.tolist(), ref, gaps


def _same(got, ref, gaps) -> bool:
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            return gaps[i] < TIE_GAP  # a genuine tie: the continuations may differ from here on
    return len(got) == len(ref)


def _run(t, d, ids, mode: str, paper: bool, exact: bool = True):
    """Greedy output of `mode` (`exact`: as Hugging Face computes; else the default's fast path)."""
    spec = dict(PAPER_METHOD) if paper else {"lookup": True}
    cfg = GenerationConfig(speculation=SpeculationConfig(mode=mode, max_new_tokens=NEW, ignore_eos=True, **spec),
                           cache=CACHE)
    return TriForceEngine(t.model, d.model, exact=exact).run(ids, cfg).token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_kept_as_stored(folder, kind):
    t, _, _, _, _ = _files(folder, kind)
    layer = t.model.layers[0]
    assert t.model.quantized
    assert layer.wqkv.type_names() == QKV_TYPES[kind]
    assert t.tokenizer is not None and t.tokenizer.chat_template


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,paper", MODES)
def test_greedy_equals_hf_on_the_same_file(folder, kind, mode, paper):
    t, d, ids, ref, gaps = _files(folder, kind)
    got = _run(t, d, ids, mode, paper, exact=True)
    assert _same(got, ref, gaps), f"{mode}: {got} != {ref}"


def _teacher_forced(model, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Our logits [n, V] for `ids` in one forward over a fresh cache of `kv_dtype`."""
    from triforce_core.kv import FullCache

    s = model.spec
    cache = FullCache(s.num_layers, s.num_kv_heads, s.head_dim, len(ids), kv_dtype, CPU)
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), cache).logits


@pytest.mark.parametrize("kind", KINDS)
def test_default_kv_is_float16_for_a_gguf_file_and_exact_keeps_float32(folder, kind, tiny_pair_dir):
    """The default's K/V dtype: float16 for a GGUF file (as llama.cpp), float32 for a Hugging Face
    folder; `exact` keeps float32, and its logits are Hugging Face's where the default's, with
    float16 K/V, are not (the control: the setting really changes the arithmetic)."""
    t, d, ids, _, _ = _files(folder, kind)
    cfg = GenerationConfig()
    fast, exact = TriForceEngine(t.model, d.model), TriForceEngine(t.model, d.model, exact=True)
    assert fast.kv_dtype_for(cfg) == torch.float16 and fast.arithmetic_for(cfg) == "fast"
    assert exact.kv_dtype_for(cfg) == torch.float32 and exact.arithmetic_for(cfg) == "exact"
    hf_folder = TriForceEngine.from_pretrained(tiny_pair_dir["target"], tiny_pair_dir["draft"], device="cpu")
    assert not hf_folder.target.quantized and hf_folder.kv_dtype_for(cfg) == torch.float32
    assert hf_folder.arithmetic_for(cfg) == "exact"  # a folder's default is already Hugging Face's arithmetic
    with torch.no_grad():
        want = hf_from_gguf(folder / f"{kind}-target.gguf")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_teacher_forced(t.model, ids, exact.kv_dtype_for(cfg)), want, rtol=1e-4, atol=1e-4)
    assert (_teacher_forced(t.model, ids, fast.kv_dtype_for(cfg)) - want).abs().max() > 1e-3


def test_exact_and_the_kv_dtype_are_checked(folder):
    t, d, _, _, _ = _files(folder, "qwen2")
    from triforce_core import ConfigError

    for kv in ("float16", "bfloat16"):
        with pytest.raises(ConfigError, match=f"exact computes and keeps K/V in float32: it cannot take kv_dtype {kv}"):
            TriForceEngine(t.model, d.model, kv_dtype=kv, exact=True)
        with pytest.raises(ConfigError, match="exact"):  # before loading the weights
            TriForceEngine.from_pretrained(str(folder / "qwen2-target.gguf"), device="cpu", kv_dtype=kv, exact=True)
        engine = TriForceEngine(t.model, d.model, exact=True)
        with pytest.raises(ConfigError, match="exact"):  # a generation's config cannot undo it either
            engine.run([3, 4, 5], GenerationConfig(cache=CacheConfig(kv_dtype=kv)))
    with pytest.raises(ConfigError, match="cannot take dtype bfloat16"):
        TriForceEngine.from_pretrained(str(folder / "qwen2-target.gguf"), device="cpu", dtype="bfloat16", exact=True)
    explicit = TriForceEngine(t.model, d.model, kv_dtype="float32")  # an explicit K/V dtype wins over the default
    assert explicit.kv_dtype_for(GenerationConfig()) == torch.float32
    assert TriForceEngine(t.model, d.model, exact=True).kv_dtype_for(GenerationConfig()) == torch.float32


@pytest.fixture
def row_by_row(monkeypatch):
    """The few-row attention at any length, so that every forward's arithmetic is row by row and
    a verification's rows equal the steps bit for bit (no tie tolerated)."""
    import triforce_core.models.native_attention as native_attention

    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,paper", MODES)
def test_greedy_on_the_default_path_equals_its_autoregressive_decoding(folder, kind, mode, paper, row_by_row):
    t, d, ids, _, _ = _files(folder, kind)
    assert TriForceEngine(t.model, d.model).kv_dtype_for(GenerationConfig()) == torch.float16
    reference = _run(t, d, ids, "autoregressive", True, exact=False)
    assert _run(t, d, ids, mode, paper, exact=False) == reference, mode


def test_negative_control_accepting_every_proposal_is_caught_on_the_default_path(folder, monkeypatch, row_by_row):
    import triforce_core.decoding.loop as loop
    from triforce_core.decoding.sampling import VerifyResult, row_argmax

    def accept_all(draft_tokens, p_logits):
        return VerifyResult(accepted=len(draft_tokens), token=row_argmax(p_logits)[-1], bonus=True)

    t, d, ids, _, _ = _files(folder, "llama")
    reference = _run(t, d, ids, "autoregressive", True, exact=False)
    monkeypatch.setattr(loop, "verify_greedy", accept_all)
    assert _run(t, d, ids, "draft", True, exact=False) != reference


def test_negative_control_llama_row_order_not_undone(folder, monkeypatch):
    _, _, ids, ref, gaps = _files(folder, "llama")
    monkeypatch.setattr(gguf_file, "_unpermute_rows", lambda rows, heads: np.arange(rows))
    t = load_model(str(folder / "llama-target.gguf"), CPU, torch.float32)
    assert not _same(_run(t, t, ids, "autoregressive", True), ref, gaps)


def test_a_verification_row_equals_the_step_it_stands_for(folder, monkeypatch):
    import triforce_core.models.native_attention as native_attention

    monkeypatch.setattr(native_attention, "MIN_KEYS", 0)  # the few-row attention at this short length
    t, _, ids, _, _ = _files(folder, "llama")
    assert_verification_rows_equal_steps(t.model, ids)


# --- sampling on a quantized pair ------------------------------------------------------------
V, SAMPLES = 16, 3000
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.5, bos_token_id=None, eos_token_id=None)
SMALL_CACHE = CacheConfig(budget=16, chunk_size=4, recent_tokens=4, draft_sinks=2, draft_window=8, refresh_every=0)


@functools.lru_cache(maxsize=None)
def _small(folder: Path):
    types = {"attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_1, "ffn_down.weight": Q.Q4_0}
    target = write_gguf(make_hf("llama_mha", seed=21, **SMALL), folder / "small-target.gguf", types)
    draft = write_gguf(make_hf("llama_mha", seed=22, **{**SMALL, "num_hidden_layers": 1}), folder / "small-draft.gguf", types)
    prompt = torch.randint(0, V, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    joint = first_two_law(hf_from_gguf(target), prompt)
    return load_model(str(target), CPU, torch.float32), load_model(str(draft), CPU, torch.float32), prompt, joint


def _counts(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    t, d, prompt, joint = _small(folder)
    cfg = GenerationConfig(
        sampling=SamplingConfig(temperature=1.0, seed=0),
        speculation=SpeculationConfig(mode="triforce", gamma1=2, gamma2=2, max_new_tokens=2, ignore_eos=True,
                                      **{k: v for k, v in PAPER_METHOD.items() if k != "lookup"}, lookup=False),
        cache=SMALL_CACHE,
    )
    return first_two_counts(TriForceEngine(t.model, d.model, exact=True), prompt, cfg, SAMPLES), joint


def test_sampling_from_a_quantized_pair_is_exact(folder):
    counts, joint = _counts(folder)
    assert chi2_pvalue(counts, joint) > 1e-3


def test_negative_control_broken_verifier_is_caught_on_a_quantized_pair(folder, monkeypatch):
    break_verifier(monkeypatch)
    counts, joint = _counts(folder)
    assert chi2_pvalue(counts, joint) < 1e-3


# --- bad files and the command line ----------------------------------------------------------
def test_unsupported_tensor_type_is_refused_in_one_line(folder):
    path = write_gguf(make_hf("llama_mha", seed=1, **QWEN), folder / "iq4_nl.gguf", {"ffn_up.weight": Q.IQ4_NL})
    with pytest.raises(ModelLoadError, match=r"ffn_up.weight is IQ4_NL, which is not supported \(supported: F32, F16, "
                                             r"Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16\)") as e:
        load_model(str(path), CPU, torch.float32)
    assert "\n" not in str(e.value)


def test_damaged_and_missing_files_are_refused_in_one_line(folder):
    bad = folder / "damaged.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    for name in (str(bad), str(folder / "absent.gguf")):
        with pytest.raises(ModelLoadError) as e:
            load_model(name, CPU, torch.float32)
        assert "\n" not in str(e.value)


def test_cli_generates_from_a_gguf_file(folder):
    _files(folder, "qwen2")
    cmd = [sys.executable, "-m", "triforce_core", "generate", "--target", str(folder / "qwen2-target.gguf"),
           "--prompt", "ab cd", "--max-new-tokens", "5", "--ignore-eos", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    sample = json.loads(out.stdout)["samples"][0]
    assert len(sample["token_ids"]) == 5
    bad = subprocess.run([*cmd[:5], str(folder / "absent.gguf"), *cmd[6:]], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "absent.gguf" in bad.stderr


def test_cli_exact_equals_hf_and_refuses_16_bit_kv_or_weights(folder, tmp_path):
    from tests.helpers.cli import run_main

    _, _, ids, ref, gaps = _files(folder, "qwen2")
    prompt = tmp_path / "ids.json"
    prompt.write_text(json.dumps(ids))
    base = ["generate", "--target", str(folder / "qwen2-target.gguf"), "--prompt-ids-file", str(prompt), "--device", "cpu",
            "--mode", "lookup", "--max-new-tokens", str(NEW), "--ignore-eos", "--repetition-penalty", "1", "--json"]
    code, out, err = run_main(base + ["--exact"])
    assert code == 0, err
    got = json.loads(out)["samples"][0]["token_ids"]
    assert _same(got, ref, gaps), f"{got} != {ref}"
    for flag, value in (("--kv-dtype", "float16"), ("--kv-dtype", "bfloat16"), ("--dtype", "bfloat16")):
        code, out, err = run_main(base + ["--exact", flag, value])
        assert (code, out) == (2, "") and err == f"error: --exact computes and keeps K/V in float32: it cannot take {flag} {value}\n"
    code, _, err = run_main(base + ["--exact", "--kv-dtype", "float32", "--max-new-tokens", "2"])
    assert code == 0, err  # float32 named is what --exact keeps: no contradiction


def test_pytorch_layers_give_the_native_layers_answer(folder, monkeypatch):
    """Where the native layers do not build (no compiler) the stored weights are dequantized for
    PyTorch's products: the same greedy answer."""
    from triforce_core.models import native_layers

    t, d, ids, ref, gaps = _files(folder, "qwen2")
    monkeypatch.setattr(native_layers, "kernel", lambda: None)
    got = _run(t, d, ids, "lookup", False)
    assert _same(got, ref, gaps)


def test_disk_cache_and_sessions_work_on_a_gguf_model(folder, tmp_path):
    """A chat session over a GGUF model writes its prefill to disk; after a "restart" (a new
    engine from the same file) the blocks are read back and the answers are the same."""
    from triforce_core.decoding.events import Committed
    from triforce_core.serving.session import ChatSession

    path = str(folder / "qwen2-target.gguf")
    _files(folder, "qwen2")
    cfg = GenerationConfig(speculation=SpeculationConfig(mode="lookup", max_new_tokens=8, ignore_eos=True),
                           cache=CacheConfig(prefill_chunk=32))
    document = " ".join("ab cd ef gh ij kl mn op".split() * 40)

    def turn():
        engine = TriForceEngine.from_pretrained(path, device="cpu")
        engine.use_disk_cache(str(tmp_path))
        session = ChatSession(engine, document, config=cfg)
        answer = [t for ev in session.ask("ab cd?") if isinstance(ev, Committed) for t in ev.token_ids]
        return answer, session.turns[0].stats.disk_tokens

    first, wrote = turn()
    second, read = turn()
    assert wrote == 0 and read >= 32 and first == second


@pytest.mark.parametrize("pre", ["smollm", "default"])
def test_a_digits_first_vocabulary_splits_digits_before_spaces(tmp_path, pre):
    """SmolLM2's type ("smollm") cuts every digit off first, as llama.cpp and the original
    tokenizer do: the spaces before a digit stay one piece. Any other type keeps transformers'
    conversion (GPT-2's split joins the last space to the digit): the control."""
    from triforce_core.models import gguf_file

    path = write_gguf(make_hf("llama_mha", seed=0, **LLAMA), tmp_path / f"{pre}.gguf", {}, pre=pre)
    _, tokenizer = gguf_file.config_and_tokenizer(path)
    pieces = [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x\n    2")]
    # byte-level pieces: "\u010a" is the newline, "\u0120" a space
    assert pieces == (["x", "\u010a    ".replace(" ", "\u0120"), "2"] if pre == "smollm" else ["x", "\u010a\u0120\u0120\u0120", "\u01202"])
    again = gguf_file.config_and_tokenizer(path)[1]  # read back from the cache folder: the same
    assert again.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x\n    2") == tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x\n    2")
