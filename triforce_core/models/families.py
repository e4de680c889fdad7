"""Which model families and features the engine runs, decided in one place: `refusal`.

    refusal("qwen3_moe", config, SUPPORTED_MODEL_TYPES)     # a Refusal: "... a mixture of experts ..."
    refusal("qwen3moe", header, ARCHITECTURES)              # the same for a GGUF file's header
    refusal("llama", config, SUPPORTED_MODEL_TYPES)         # None: the engine runs it

The engine runs dense decoders: every layer attention and one MLP, the cache a tensor whose
length is set back after a rejection. Three kinds of model do not fit that design and are
refused whatever their family: mixtures of experts (a router picks a few of many MLPs per
token), hybrid recurrent layers (a state-space or linear-attention state that cannot be rolled
back by setting a length), and vision towers (an image encoder beside the decoder). Gemma 2's
soft-capping of the attention scores is not implemented either. A dense family the forward does
not describe yet (Gemma 3 until it is added) is "not supported yet".

What is supported is the caller's list (`spec.SUPPORTED_MODEL_TYPES` for a Hugging Face config,
`gguf_file.ARCHITECTURES` for a GGUF header), so a family added there is accepted here at once;
the features are checked first, so a family's mixture-of-experts or multimodal variant stays
refused. Settings are read from a transformers config (attributes), a config.json's dict or a
GGUF header's scalar fields (a dict of "arch.key" names); nothing is loaded. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIXTURE = "mixture of experts"
RECURRENT = "recurrent layers"
VISION = "vision tower"
SOFT_CAPPING = "logit soft-capping"
NOT_YET = "not supported yet"

# Hugging Face model types and GGUF architectures (llama.cpp's names) by the feature that keeps
# them out. A family's dense and mixed variants have names of their own (qwen3, qwen3_moe).
FAMILY_FEATURES = {
    MIXTURE: ("mixtral", "qwen2_moe", "qwen2moe", "qwen3_moe", "qwen3moe", "qwen3_5_moe", "qwen35moe", "gpt_oss",
              "gpt-oss", "deepseek", "deepseek_v2", "deepseek_v3", "deepseek2", "dbrx", "olmoe", "phimoe",
              "granitemoe", "jetmoe", "glm4_moe", "glm4moe", "ernie4_5_moe", "ernie4_5-moe", "hunyuan_v1_moe",
              "hunyuan-moe", "minimax", "llama4", "lfm2_moe", "bailingmoe", "arctic", "grok"),
    RECURRENT: ("qwen3_next", "qwen3next", "qwen3_5", "qwen35", "jamba", "mamba", "mamba2", "falcon_mamba",
                "falcon_h1", "falcon-h1", "rwkv", "rwkv5", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
                "recurrent_gemma", "zamba", "zamba2", "bamba", "granitemoehybrid", "granitehybrid", "nemotron_h",
                "lfm2", "plamo2", "xlstm"),
    VISION: ("llava", "llava_next", "llava_onevision", "mllama", "paligemma", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
             "qwen3_vl_moe", "idefics3", "smolvlm", "mistral3", "pixtral", "lfm2_vl", "clip", "siglip"),
}
# Dense families the forward does not describe yet: refused as such while the caller's list lacks them.
NOT_YET_FAMILIES = {"qwen3": "Qwen3", "gemma3": "Gemma 3", "gemma3_text": "Gemma 3", "phi3": "Phi-3",
                    "gemma": "Gemma", "gemma2": "Gemma 2", "gemma4": "Gemma 4", "gemma4_text": "Gemma 4",
                    "gemma3n": "Gemma 3n", "phi": "Phi-2", "phi2": "Phi-2"}
# Attention kinds a dense decoder's layers have (transformers' `layer_types`); any other (a
# "linear_attention" or "mamba" layer) is a recurrent one.
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# GGUF header keys (after "<arch>.") that only a recurrent layer's settings have.
RECURRENT_KEYS = ("ssm.", "wkv.", "full_attention_interval", "shortconv.")
# Sub-configurations a config may keep the decoder's settings in.
NESTED = ("text_config", "ffn_config", "llm_config")


@dataclass(frozen=True)
class Refusal:
    """Why a model stays out: `feature` (one of MIXTURE, RECURRENT, VISION, SOFT_CAPPING,
    NOT_YET, or None for an architecture the engine has never heard of) and the one `line`."""

    kind: str | None  # the model type or GGUF architecture as the file names it
    feature: str | None
    line: str

    @property
    def short(self) -> str:
        """A few words for a picker's label: "not supported: mixture of experts"."""
        if self.feature == NOT_YET:
            return NOT_YET
        return f"not supported: {self.feature or f'architecture {self.kind!r}'}"

    def __str__(self) -> str:
        return self.line


def _get(settings: Any, key: str) -> Any:
    if isinstance(settings, Mapping):
        return settings.get(key)
    return getattr(settings, key, None)


def _layers(settings: Any) -> list[Any]:
    """The config and the sub-configurations that hold its decoder's settings."""
    out = [settings]
    for key in NESTED:
        inner = _get(settings, key)
        if inner is not None and not isinstance(inner, (str, int, float, bool)):
            out.append(inner)
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _experts(settings: Any) -> int:
    """How many experts per layer the settings declare (0 when none)."""
    if isinstance(settings, Mapping) and any(isinstance(k, str) and "." in k for k in settings):  # a GGUF header
        return max((_count(v) for k, v in settings.items() if isinstance(k, str) and k.endswith(".expert_count")),
                   default=0)
    found = 0
    for layer in _layers(settings):
        found = max([found, *(_count(_get(layer, k)) for k in EXPERT_KEYS)])
        if _get(layer, "enable_moe_block") is True:
            found = max(found, 2)
    return found


def _recurrent(settings: Any) -> str | None:
    """The first layer kind that is not attention, or a GGUF key only recurrent layers have."""
    if isinstance(settings, Mapping):
        for k in settings:
            rest = k.split(".", 1)[1] if isinstance(k, str) and "." in k else ""
            if rest.startswith(RECURRENT_KEYS):
                return k
    for layer in _layers(settings):
        for key in ("layer_types", "layers_block_type"):
            types = _get(layer, key)
            if isinstance(types, (list, tuple)):
                other = next((t for t in types if isinstance(t, str) and t not in ATTENTION_LAYERS), None)
                if other is not None:
                    return f"{other} layers"
    return None


def _vision(settings: Any) -> bool:
    if _get(settings, "vision_config"):
        return True
    return isinstance(settings, Mapping) and any(isinstance(k, str) and k.startswith("clip.") for k in settings)


def _soft_capping(settings: Any) -> bool:
    if isinstance(settings, Mapping) and any(isinstance(k, str) and k.endswith("attn_logit_softcapping")
                                             and settings[k] for k in settings):
        return True
    return any(_get(layer, "attn_logit_softcapping") for layer in _layers(settings))


def refusal(kind: str | None, settings: Any, supported: Sequence[str]) -> Refusal | None:
    """Why the engine cannot run a model of `kind` (a Hugging Face model type or a GGUF
    architecture) with `settings` (its config, config.json's dict, or a GGUF header's scalar
    fields), given the `supported` names of that source; None when it can."""
    names = ", ".join(supported)
    tail = f"supported are {names} (dense decoders)"
    said = f"unsupported architecture {kind!r}"
    experts = _experts(settings)
    recurrent = _recurrent(settings)
    if kind in FAMILY_FEATURES[MIXTURE] or experts > 1:
        detail = f" ({experts} experts a layer)" if experts > 1 else ""
        return Refusal(kind, MIXTURE, f"{said}: a {MIXTURE}{detail}, which this engine does not run; {tail}")
    if kind in FAMILY_FEATURES[RECURRENT] or recurrent:
        detail = "state-space or linear attention" if kind in FAMILY_FEATURES[RECURRENT] else recurrent
        return Refusal(kind, RECURRENT, f"{said}: {RECURRENT} ({detail}), whose state cannot be rolled back after a "
                                        f"rejection, which this engine does not run; {tail}")
    if kind in FAMILY_FEATURES[VISION] or _vision(settings):
        return Refusal(kind, VISION, f"{said}: a model with a {VISION} (images), which this engine does not run; "
                                     f"use its text-only decoder; {tail}")
    if _soft_capping(settings):
        return Refusal(kind, SOFT_CAPPING, f"{said}: attention {SOFT_CAPPING} (Gemma 2), which this engine does "
                                           f"not run; {tail}")
    if kind in supported:
        return None
    if kind in NOT_YET_FAMILIES:
        return Refusal(kind, NOT_YET, f"{said}: {NOT_YET_FAMILIES[kind]} is {NOT_YET}; {tail}")
    return Refusal(kind, None, f"{said}: {tail}")
