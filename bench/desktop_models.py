"""GGUF files with real desktop models' shapes and random weights, quantized by llama.cpp.

Speed on a 135M model says little about the 1-8B models people run on a desktop; their weights
are gigabytes behind a licence click. Speed depends on the shapes, not on the numbers, so this
writes files with those models' exact shapes (layers, width, MLP width, heads, KV heads, head
size, rope base, norm epsilon, tied embeddings, Qwen2's q/k/v biases, Qwen3's and Gemma 3's
norms on each head's q and k, Gemma 3's sandwich norms and sliding window) and random weights,
with SmolLM2's tokenizer and vocabulary (49,152 tokens, copied with every tokenizer.* key from
the `smollm2` file): the vocabulary, and so the embedding and the head, is SmolLM2's size, not
the real model's (128,256 for Llama 3, 151,936 for Qwen2.5 and Qwen3, 262,144 for Gemma 3), so
the head and the embedding are smaller than the real models'. Their text is noise: for speed
only. The 8B shape's F16 file takes 14.8 GB of disk until it is quantized (4.47 GB at Q4_K_M).

Qwen3 (`qwen3-4b`) and Gemma 3 (`gemma-3-4b`, the text decoder) are written as llama.cpp's
converter writes them: the head size as `<arch>.attention.key_length`/`value_length` (theirs is
not width / heads), Gemma's `sliding_window` (readers take every sixth layer as a full one, the
others sliding; the local layers' rope base of 10K is implicit) and the full layers' rope
scaling (linear, factor 8, as Gemma 3 4B has). Transformers 5.24's reading of a gemma3 header,
which our loader goes through, ignores the rope scaling: the full layers then rotate with the
plain base, which changes no cost (speed only: it does not matter here).

Steps, per shape:
1. Write an F16 file with ggml's `gguf` writer, one tensor at a time (at most one tensor in
   memory: the 3B shape's largest is the 302 MB embedding). Weights ~ N(0, 0.02²) from a
   generator seeded by `--seed` and the tensor's name; norm weights 1 (Gemma's files store a
   norm as 1 + w: ones are w = 0, the weights Gemma's norms start from, which is fine for
   speed); biases ~ N(0, 0.02²).
2. Quantize it with llama.cpp's `llama-quantize` (built by `bench.llama_cpp`) to each type.
3. Delete the F16 file, unless `--keep-f16` (or F16 is one of `--types`).

A file that exists is not written again; each is written under a temporary name first.

    python -m bench.desktop_models [--shapes llama-3.2-1b,llama-3.2-3b] [--types Q4_K_M,Q8_0] \\
                                   [--out DIR] [--seed 0] [--keep-f16] [--llama-cpp-bin DIR]

Shapes: llama-3.2-1b, llama-3.2-3b (the default), llama-3.1-8b, qwen2.5-1.5b, qwen3-4b,
gemma-3-4b.

Files: `<out>/<shape>-shape.<type>.gguf`, e.g. `llama-3.2-1b-shape.Q4_K_M.gguf` (default out:
`cache_home()/desktop-models`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)

from triforce_core.config import cache_home
from triforce_core.models.gguf_file import GGUFError, resolve


# GGUF architectures whose header states the head size (key_length), as llama.cpp's converter writes it
OWN_HEAD_SIZE = ("qwen3", "gemma3")


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as GGUF's header states it."""
    label: str
    arch: str  # GGUF's architecture name: "llama", "qwen2", "qwen3" or "gemma3"
    layers: int
    width: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int
    qkv_bias: bool = False
    tied: bool = True
    qk_norm: bool = False  # a [head size] norm on each head's q and on its k (Qwen3, Gemma 3)
    sandwich: bool = False  # Gemma 3's norms on the attention's and the MLP's outputs (ffn_norm is the pre-MLP one)
    window: int | None = None  # the sliding-window layers' window (Gemma 3: every sixth layer is a full one)
    rope_scaling: tuple[str, float] | None = None  # the full layers' (type, factor), e.g. ("linear", 8.0)

    @property
    def key_length(self) -> int | None:
        """The head size as `<arch>.attention.key_length` states it, where the header has it:
        llama.cpp's converter writes it for Qwen3 and Gemma 3 (whose configs name a head size),
        and it must be there wherever the head size is not width / heads."""
        if self.arch in OWN_HEAD_SIZE or self.heads * self.head_dim != self.width:
            return self.head_dim
        return None


SHAPES = {
    "llama-3.2-1b": Shape("Llama-3.2-1B", "llama", layers=16, width=2048, mlp=8192, heads=32, kv_heads=8,
                          head_dim=64, rope_theta=500000.0, rms_eps=1e-5, context=131072),
    "llama-3.2-3b": Shape("Llama-3.2-3B", "llama", layers=28, width=3072, mlp=8192, heads=24, kv_heads=8,
                          head_dim=128, rope_theta=500000.0, rms_eps=1e-5, context=131072),
    # the largest a 16 GB desktop runs at Q4_K_M (4.9 GB with its own vocabulary); untied head
    "llama-3.1-8b": Shape("Llama-3.1-8B", "llama", layers=32, width=4096, mlp=14336, heads=32, kv_heads=8,
                          head_dim=128, rope_theta=500000.0, rms_eps=1e-5, context=131072, tied=False),
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B", "qwen2", layers=28, width=1536, mlp=8960, heads=12, kv_heads=2,
                          head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, context=32768, qkv_bias=True),
    "qwen3-4b": Shape("Qwen3-4B", "qwen3", layers=36, width=2560, mlp=9728, heads=32, kv_heads=8,
                      head_dim=128, rope_theta=1000000.0, rms_eps=1e-6, context=40960, qk_norm=True),
    # the text decoder; the local layers' rope base (10K) is implicit in a gemma3 header
    "gemma-3-4b": Shape("Gemma-3-4B", "gemma3", layers=34, width=2560, mlp=10240, heads=8, kv_heads=4,
                        head_dim=256, rope_theta=1000000.0, rms_eps=1e-6, context=131072, qk_norm=True,
                        sandwich=True, window=1024, rope_scaling=("linear", 8.0)),
}
DEFAULT_SHAPES = ("llama-3.2-1b", "llama-3.2-3b")
# llama-quantize's types whose every tensor type our GGUF loader reads (ggml_types.TYPE_NAMES):
# the K mixes use Q4_K, Q5_K and Q6_K on these shapes (every width a multiple of 256)
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16")
DEFAULT_TYPES = ("Q4_K_M", "Q8_0")
# bits a weight in each type's file, a little over (the K mixes keep some tensors wider):
# what the disk must hold before a file is written
BITS = {"Q4_0": 4.6, "Q4_1": 5.1, "Q8_0": 8.6, "Q4_K_S": 4.7, "Q4_K_M": 5.0, "Q5_K_S": 5.6, "Q5_K_M": 5.8,
        "Q6_K": 6.7, "F16": 16.0}
STD = 0.02  # small enough that activations stay finite through 28 layers
CHUNK = 1 << 22  # numbers drawn at once (16 MB of float32)


class DesktopModelError(RuntimeError):
    """A file could not be written or quantized: reported as one line."""


def say(message: str) -> None:
    print(f"[desktop-models] {message}", file=sys.stderr, flush=True)


def file_name(key: str, qtype: str) -> str:
    return f"{key}-shape.{qtype}.gguf"


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and [rows, cols] (a vector: [n]), under llama.cpp's names, a
    layer's in the forward's order (q/k norms after the projections, Gemma's output norms after
    the attention's output and after the MLP's down projection). llama.cpp's converter writes
    them in the order of the checkpoint's own files; the order changes no tensor."""
    w, q, kv = shape.width, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (vocab, w))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (w,)), (b + "attn_q.weight", (q, w)), (b + "attn_k.weight", (kv, w)),
                (b + "attn_v.weight", (kv, w))]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if shape.qk_norm:
            out += [(b + "attn_q_norm.weight", (shape.head_dim,)), (b + "attn_k_norm.weight", (shape.head_dim,))]
        out.append((b + "attn_output.weight", (w, q)))
        if shape.sandwich:
            out.append((b + "post_attention_norm.weight", (w,)))
        out += [(b + "ffn_norm.weight", (w,)), (b + "ffn_gate.weight", (shape.mlp, w)),
                (b + "ffn_up.weight", (shape.mlp, w)), (b + "ffn_down.weight", (w, shape.mlp))]
        if shape.sandwich:
            out.append((b + "post_ffw_norm.weight", (w,)))
    out.append(("output_norm.weight", (w,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, w)))
    return out


def parameter_count(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(dims)) for _, dims in tensors(shape, vocab))


def random_tensor(name: str, dims: tuple[int, ...], seed: int) -> np.ndarray:
    """A matrix as float16 ~ N(0, STD²), drawn a few rows at a time (float32 only per chunk); a
    norm's vector (q/k norms too) as float32 ones, a bias's ~ N(0, STD²). Gemma's files store a
    norm as 1 + w, so its ones are w = 0 (the weights Gemma's norms start from): as good as any
    for speed. The same numbers for the same seed and name, whatever else the file holds."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(dims) == 1:
        if "norm" in name:
            return np.ones(dims, dtype=np.float32)
        return rng.standard_normal(dims, dtype=np.float32) * np.float32(STD)
    rows, cols = dims
    out = np.empty(dims, dtype=np.float16)
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        block *= np.float32(STD)
        out[r:r + step] = block
    return out


def copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Every tokenizer.* key of `source` into `writer`, as stored (strings as their bytes); the
    vocabulary's size."""
    reader = GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            value = [bytes(field.parts[i]) for i in field.data] if sub == GGUFValueType.STRING else field.contents()
            writer.add_key_value(key, value, vtype, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif vtype == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
        else:
            writer.add_key_value(key, field.contents(), vtype)
    if not vocab:
        raise DesktopModelError(f"{source.name} has no tokenizer.ggml.tokens: no vocabulary to copy")
    return vocab


def write_f16(shape: Shape, path: Path, tokenizer_from: Path, seed: int = 0, progress=None) -> Path:
    """Write `shape` with random weights as an F16 GGUF file at `path` (via `path`.tmp), with
    `tokenizer_from`'s tokenizer. `progress(done_bytes, total_bytes)` after each tensor."""
    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(tmp, shape.arch)
    writer.add_name(f"{shape.label} shape, random weights (seed {seed})")
    writer.add_description(f"{shape.label}'s shapes with random weights and SmolLM2's vocabulary: "
                           "for speed measurements only (bench/desktop_models.py)")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.width)
    writer.add_feed_forward_length(shape.mlp)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.key_length is not None:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    writer.add_rope_freq_base(shape.rope_theta)
    if shape.rope_scaling is not None:
        kind, factor = shape.rope_scaling
        writer.add_rope_scaling_type(RopeScalingType(kind))
        writer.add_rope_scaling_factor(factor)
    if shape.window is not None:
        writer.add_sliding_window(shape.window)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    vocab = copy_tokenizer(writer, tokenizer_from)
    writer.add_vocab_size(vocab)
    layout = tensors(shape, vocab)
    for name, dims in layout:
        f16 = len(dims) == 2
        nbytes = int(np.prod(dims)) * (2 if f16 else 4)
        writer.add_tensor_info(name, dims, np.dtype(np.float16 if f16 else np.float32), nbytes,
                               raw_dtype=GGMLQuantizationType.F16 if f16 else GGMLQuantizationType.F32)
    total = sum(int(np.prod(d)) * (2 if len(d) == 2 else 4) for _, d in layout)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for name, dims in layout:
            data = random_tensor(name, dims, seed)
            writer.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, total)
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


QUANTIZE_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")


def quantize(tool: Path, source: Path, path: Path, qtype: str, threads: int, log: Path, progress=None) -> Path:
    """`llama-quantize source path qtype threads` (via `path`.tmp), its output appended to `log`;
    `progress(done, total)` as it reports tensors."""
    tmp = path.with_name(path.name + ".tmp")
    cmd = [str(tool), str(source), str(tmp), qtype, str(threads)]
    last = ""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        try:
            for line in proc.stdout:
                out.write(line)
                last = line.strip() or last
                m = QUANTIZE_LINE.match(line)
                if progress and m:
                    progress(int(m.group(1)), int(m.group(2)))
            rc = proc.wait()
        except BaseException:  # Ctrl-C: no half-written file left behind
            proc.kill()
            proc.wait()
            tmp.unlink(missing_ok=True)
            raise
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise DesktopModelError(f"llama-quantize to {qtype} failed (exit {rc}): {last[:200]} (log: {log})")
    os.replace(tmp, path)
    return path


class Steps:
    """`say`s a task's progress each time it passes another `every` percent."""

    def __init__(self, label: str, every: int, say=say):
        self.label, self.every, self.say, self.shown = label, every, say, -1

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct // self.every > self.shown:
            self.shown = pct // self.every
            self.say(f"  {self.label}: {pct}%")


def make(keys: list[str], types: list[str], out: Path, seed: int, keep_f16: bool, tokenizer_from: Path,
         bin_dir: Path | None = None, say=say) -> list[Path]:
    """Every file of `keys` × `types` in `out` (those already there kept); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "quantize.log"
    tool = None
    made = []
    for key in keys:
        shape = SHAPES[key]
        wanted = {t: out / file_name(key, t) for t in types}
        missing = [t for t, p in wanted.items() if not p.is_file()]
        for t in types:
            if t not in missing:
                say(f"{wanted[t].name} exists: kept")
        if not missing:
            made += wanted.values()
            continue
        f16 = out / file_name(key, "F16")
        vocab = len(GGUFReader(tokenizer_from).fields["tokenizer.ggml.tokens"].data)
        count = parameter_count(shape, vocab)
        check_space(out, shape, count, missing, write_f16=not f16.is_file())
        if not f16.is_file():
            say(f"writing {f16.name}: {shape.label}'s shape, {count / 1e9:.2f}B parameters (vocabulary {vocab}), "
                f"{count * 2 / 1e9:.1f} GB")
            t0 = time.perf_counter()
            write_f16(shape, f16, tokenizer_from, seed, Steps(f16.name, 10, say))
            say(f"  written in {time.perf_counter() - t0:.0f}s")
        for t in missing:
            if t == "F16":
                continue
            if tool is None:
                tool = _quantize_tool(bin_dir, say)
            say(f"quantizing to {wanted[t].name}")
            t0 = time.perf_counter()
            quantize(tool, f16, wanted[t], t, os.cpu_count() or 1, log, Steps(wanted[t].name, 25, say))
            say(f"  {wanted[t].name}: {wanted[t].stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f}s")
        if "F16" not in types and not keep_f16:
            f16.unlink()
            say(f"removed {f16.name} (--keep-f16 keeps it)")
        made += wanted.values()
    return made


def check_space(out: Path, shape: Shape, count: int, missing: list[str], write_f16: bool) -> None:
    """Refuse before writing anything when `out`'s disk cannot hold the F16 file (if it is still
    to be written) beside every missing file: an 8B's F16 alone is 15 GB, and a disk filled
    half-way through costs minutes for nothing."""
    need = sum(count * BITS[t] / 8 for t in missing if t != "F16") + (count * 2 if write_f16 else 0)
    free = shutil.disk_usage(out).free
    if need > free:
        raise DesktopModelError(f"{shape.label}'s files need about {need / 1e9:.1f} GB free in {out} "
                                f"(the F16 file they are made from included), which has {free / 1e9:.1f} GB")


def _quantize_tool(bin_dir: Path | None, say) -> Path:
    from bench.llama_cpp import PeerError, find_or_build

    try:
        tools = find_or_build(bin_dir, say=lambda m: say(f"llama.cpp: {m}"))
    except PeerError as e:
        raise DesktopModelError(str(e)) from None
    if "llama-quantize" not in tools:
        raise DesktopModelError(f"{tools['llama-bench'].parent} has no llama-quantize")
    return tools["llama-quantize"]


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise DesktopModelError(f"unknown {what} {', '.join(unknown) or '(none given)'}: choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.desktop_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"comma-separated, from {', '.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES),
                   help=f"comma-separated llama-quantize types, from {', '.join(TYPES)} (default {','.join(DEFAULT_TYPES)})")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <cache>/desktop-models)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 file the quantized ones are made from")
    p.add_argument("--tokenizer-from", default="smollm2",
                   help="the GGUF file whose tokenizer and vocabulary are copied (default smollm2)")
    p.add_argument("--llama-cpp-bin", type=Path, help="a folder with ready llama.cpp binaries, llama-quantize among them")
    a = p.parse_args(argv)
    try:
        keys = _names(a.shapes, SHAPES, "shape")
        types = _names(a.types, TYPES, "type")
        out = a.out or cache_home() / "desktop-models"
        paths = make(keys, types, out, a.seed, a.keep_f16, resolve(a.tokenizer_from), a.llama_cpp_bin)
    except (DesktopModelError, GGUFError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
