"""The app's settings: one definition that names them, holds their defaults, validates them
and builds the settings accordion's controls.

`Settings` holds the names, the defaults (the engine's, from `triforce_core.config`) and,
through `config()`, the validation; `SETTING_ROWS` lays the controls out and
`setting_control` builds one. Handlers receive the values in `SETTING_NAMES` order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import gradio as gr

from triforce_core.config import (
    CHAT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    MODES,
    PAPER_METHOD,
    CacheConfig,
    ConfigError,
    GenerationConfig,
    SamplingConfig,
    SpeculationConfig,
)


@dataclass(frozen=True)
class Settings:
    """What the settings accordion holds (defaults = the engine's defaults)."""

    mode: str = DEFAULT_MODE
    temperature: float = SamplingConfig.temperature
    top_p: float = SamplingConfig.top_p
    # An instruct model's default comes from its engine (`for_model`); 1 = off.
    repetition_penalty: float = SamplingConfig.repetition_penalty
    max_new_tokens: int = CHAT_MAX_NEW_TOKENS  # a chat answer's limit (Continue goes on past it)
    budget: int = CacheConfig.budget
    chunk_size: int = CacheConfig.chunk_size
    gamma1: int = SpeculationConfig.gamma1
    gamma2: int = SpeculationConfig.gamma2
    draft_window: int = CacheConfig.draft_window
    seed: int | None = None
    lookup: bool = True  # off: the paper's pure method (`PAPER_METHOD`; in mode triforce its three levels alone)

    def config(self) -> GenerationConfig:
        return GenerationConfig(
            sampling=SamplingConfig(
                temperature=float(self.temperature), top_p=float(self.top_p),
                repetition_penalty=float(self.repetition_penalty),
                seed=None if self.seed is None or self.seed < 0 else int(self.seed),
            ),
            speculation=SpeculationConfig(
                mode=self.mode, gamma1=int(self.gamma1), gamma2=int(self.gamma2), max_new_tokens=int(self.max_new_tokens),
                **({"lookup": True} if self.lookup or self.mode == "lookup" else PAPER_METHOD),
            ),
            cache=CacheConfig(budget=int(self.budget), chunk_size=int(self.chunk_size), draft_window=int(self.draft_window)),
        )


    def for_model(self, engine) -> "Settings":
        """These settings with the sampling defaults of `engine`'s model (`default_sampling()`)."""
        d = engine.default_sampling()
        return replace(self, temperature=d.temperature, top_p=d.top_p, repetition_penalty=d.repetition_penalty)


SETTING_NAMES = [f.name for f in fields(Settings)]  # the order handlers receive the values in
# The accordion: one control per `Settings` field, two to a row (the labels are sentences: five to
# a row clipped them), a row wrapping where its two do not fit side by side.
SETTING_ROWS = (
    ("mode", "max_new_tokens"),
    ("temperature", "top_p"),
    ("repetition_penalty", "seed"),
    ("budget", "chunk_size"),
    ("gamma1", "gamma2"),
    ("draft_window", "lookup"),
)
_SLIDERS = {  # name: (low, high, step, label)
    "temperature": (0.0, 2.0, 0.05, "Temperature (0 = greedy: always the likeliest token)"),
    "top_p": (0.05, 1.0, 0.05, "Top-p: sample among the likeliest tokens that make up this share"),
    "repetition_penalty": (1.0, 2.0, 0.05, "Repetition penalty (1 = off)"),
    "max_new_tokens": (1, 2048, 1, "Max new tokens: the longest an answer may be"),
    "budget": (64, 16384, 64, "Retrieval budget: tokens of cache the retrieval level reads"),
    "chunk_size": (1, 64, 1, "Chunk size: tokens per retrieval chunk"),
    "gamma1": (1, 8, 1, "Tokens the small draft proposes per check (γ1)"),
    "gamma2": (1, 16, 1, "Tokens per target check (γ2)"),
    "draft_window": (16, 2048, 16, "Draft window: recent tokens the small draft sees"),
}
# A sentence under a control whose label names a symbol or a term a person may not know.
SETTING_INFO = {
    "mode": "The full target checks every token proposed, so the text is its own. triforce: "
            "small draft → retrieval level → full target; retrieval: the retrieval level drafts; draft: the small "
            "draft drafts; lookup: text copied from the context; autoregressive: no speculation.",
    "repetition_penalty": "Makes a token the answer already holds less likely (exact at every level: the text is "
                          "the penalised target's).",
    "budget": "The retrieval level attends to this many tokens of the cache: the chunks most relevant to the "
              "recent tokens, with the first chunk and the most recent tokens.",
    "gamma1": "γ1: how many tokens the small draft guesses before the retrieval level checks them.",
    "gamma2": "γ2: the most tokens the full target checks in one forward pass (with context lookup on, fewer "
              "while it keeps rejecting them).",
    "draft_window": "The small draft attends to the first tokens and this many of the newest, so it stays fast "
                    "over a long document.",
    "lookup": "Proposes what followed an earlier match in the context (a quote from the document). Off: the "
              "paper's pure method.",
}
_ELEM_IDS = {"mode": "tf-mode", "max_new_tokens": "tf-max-new", "lookup": "tf-lookup", "temperature": "tf-temperature",
             "repetition_penalty": "tf-repetition-penalty", "budget": "tf-budget"}
assert sorted(n for row in SETTING_ROWS for n in row) == sorted(SETTING_NAMES), "every setting has one control"


def slider_range(name: str) -> tuple[float, float, float]:
    """(low, high, step) of a setting's slider, e.g. the budget's."""
    low, high, step, _label = _SLIDERS[name]
    return low, high, step


# The narrowest a control gets before its row wraps: a slider's number box, its reset button and
# its range's ends side by side.
MIN_WIDTH = 220

# Under a remote engine these are the server's own flags (a request cannot change them): shown,
# not editable.
SERVER_SETTINGS = ("budget", "chunk_size", "gamma1", "gamma2", "draft_window", "lookup")


def setting_control(name: str, value, modes: list[str], remote: bool = False):
    """The accordion's control for one `Settings` field, showing `value` (`remote`: the settings
    a served engine keeps to itself are shown as the server's, not editable)."""
    elem_id = _ELEM_IDS.get(name)
    fixed = remote and name in SERVER_SETTINGS
    extra, suffix = ({"interactive": False}, " (the server's)") if fixed else ({}, "")
    info = SETTING_INFO.get(name)
    if name == "mode":
        return gr.Dropdown(modes, value=value, label="Mode: which levels draft the answer", info=info, elem_id=elem_id, min_width=MIN_WIDTH)
    if name == "seed":
        return gr.Number(value=-1 if value is None else value, label="Seed for sampling (-1 = random)", precision=0,
                         min_width=MIN_WIDTH)
    if name == "lookup":
        return gr.Checkbox(value, label="Context lookup: propose text copied from the context" + suffix, info=info,
                           elem_id=elem_id, min_width=MIN_WIDTH, **extra)
    low, high, step, label = _SLIDERS[name]
    if fixed:  # the server's value, wherever the slider would stop a person
        low, high, step = min(low, value), max(high, value), 1
    return gr.Slider(low, high, value=value, step=step, label=label + suffix, info=info, elem_id=elem_id,
                     min_width=MIN_WIDTH, **extra)


def retrieval_budget(budget, mode: str) -> int | None:
    """The retrieval budget `mode` reads within, for the context gauge: None in a mode without a
    retrieval level (lookup, draft, autoregressive), where every step reads the whole context."""
    return int(budget) if SpeculationConfig(mode=mode).uses_retrieval else None


def settings_from(values: dict) -> Settings:
    """Settings from the accordion's values; raises ConfigError with a clear message."""
    s = Settings(**{k: v for k, v in values.items() if k in Settings.__dataclass_fields__})
    if s.mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}")
    s.config()  # validates every field
    return s
