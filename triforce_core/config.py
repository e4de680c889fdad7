"""Frozen configuration objects shared by the engine, the command line and the UI.

Every field has a default and is validated on construction, so a bad value fails where it is
made, with a message that names the field, instead of deep inside the decoding loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("triforce", "retrieval", "draft", "lookup", "autoregressive")


# The mode used when the user picks none (the app, `generate`, `chat`, the HTTP API): lookup
# alone, the fastest measured on document chat at every prompt length (docs/results.md).
DEFAULT_MODE = "lookup"

# The longest answer of a chat turn where the user set none (the app's page and `chat` endpoint,
# the `chat` command): a limit that most of SmolLM2's answers over the bundled sample end within
# on their own, measured in docs/results.md ("How long a chat answer is"). One generation's own
# default (`SpeculationConfig.max_new_tokens`: `generate`, the HTTP API, the benchmarks) stays.
CHAT_MAX_NEW_TOKENS = 320


# The disk cache of prefilled K/V (`triforce_core.kv.disk`): its folder and size cap.
KV_CACHE_MAX_GB = 8.0
GB = 1024**3


def cache_home() -> Path:
    """`$XDG_CACHE_HOME/triforce-studio`, else `~/.cache/triforce-studio`: every folder this
    project writes on its own (the disk cache of K/V, the native kernel, the measured price of a
    verification row) is under it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "triforce-studio"


def default_kv_cache_folder() -> Path:
    """`$XDG_CACHE_HOME/triforce-studio/kv`, else `~/.cache/triforce-studio/kv`."""
    return cache_home() / "kv"


SELECT_BY = ("queries", "attention")

# What the caches may keep keys and values in (`CacheConfig.kv_dtype`). The model computes in its
# own dtype; its new keys and values are rounded into the cache's when written, and every
# attention path reads them back from there (widened to float32 on the CPU), so every level and
# every path sees the same rounded K/V and greedy output stays equal to autoregressive decoding
# with the same K/V dtype. "int16" keeps the target's full cache as 16-bit integers on a grid per
# vector, read by the integer attention kernel (`kv.int16`; a float32 model on the CPU, head sizes
# a multiple of 64): closer to float32 than float16 (mean KL to Hugging Face 1.8e-7 against
# 9.0e-7 on SmolLM2, `bench.kv_formats`) and its rows are integer products; the retrieval
# level and the draft keep float16.
KV_DTYPES = ("float32", "float16", "bfloat16", "int16")
# The K/V dtype of a float32 Hugging Face model (a folder, a hub id, the demo pair) on the CPU when
# none is asked for (auto): float32, so that greedy output equals Hugging Face's (16-bit K/V
# changes an answer now and then: docs/benchmarks.md, "16-bit K/V"). Other models (CUDA, 16-bit
# weights) keep K/V in their own dtype.
DEFAULT_KV_DTYPE = "float32"
# A GGUF file's K/V dtype on the CPU (float32, the native kernels) when none is asked for: float16,
# as llama.cpp keeps it: close to float32 (`python -m bench.fidelity`) and much faster to read
# (docs/results.md). `exact` (`--exact`) keeps float32.
GGUF_KV_DTYPE = "float16"
# ... and for a GGUF file whose heads are at least this wide (a multiple of 64 up to 256: Llama
# 3.2 3B, Llama 3.1 8B, Qwen2.5 7B, Mistral 7B), where the integer attention kernel's vector
# paths run: int16 (`kv.int16`), closer to float32 than float16 and faster there; heads of 64
# keep float16, where it was not (docs/results.md, `python -m bench.level_steps`).
INT16_KV_MIN_HEAD = 128
# What `exact` (`--exact`, `TriForceEngine(exact=True)`) computes and keeps K/V in: greedy output
# equals Hugging Face's token for token.
EXACT_DTYPE = "float32"


class ConfigError(ValueError):
    """An invalid configuration value (the CLI reports it with exit code 2)."""


def check_exact(exact: bool, kv_dtype: str | None = None, dtype: str | None = None,
                names: tuple[str, str, str] = ("exact", "kv_dtype", "dtype")) -> None:
    """ConfigError when `exact` meets a K/V dtype or a model dtype other than float32 (None and
    "auto" are the defaults, which `exact` resolves to float32). `names`: how the message names
    the three settings (the command line's flags)."""
    if not exact:
        return
    for name, value in zip(names[1:], (kv_dtype, dtype)):
        if value not in (None, "auto", EXACT_DTYPE):
            raise ConfigError(f"{names[0]} computes and keeps K/V in {EXACT_DTYPE}: it cannot take {name} {value}")


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line, for the message of an error a user reads (a model that
    will not load, a document that will not parse): its first line, else its type's name."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:limit]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is drawn from logits.

    temperature == 0 means greedy decoding (argmax); otherwise logits are divided by the
    temperature, then top-k, then top-p (nucleus) filtering is applied -- the same order as
    Hugging Face's logits warpers. The same warping is applied to every level's law.

    Repetition control (`triforce_core.decoding.penalties`), over the answer's own tokens (never the
    prompt), applied to the logits before everything above, greedy or not, at every level and
    for each row from its own prefix, so decoding stays exact:
    repetition_penalty  Hugging Face's: a seen token's logit / r when positive, * r when negative (1 = off)
    frequency_penalty   OpenAI's: minus f times the token's count so far (0 = off)
    presence_penalty    OpenAI's: minus a once the token has appeared (0 = off)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):  # OpenAI's range
            _check(-2.0 <= getattr(self, name) <= 2.0, f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The sampling a chat model (`loading.is_instruct`: SmolLM2-135M-Instruct, any GGUF file, base
# models' too) gets when the user sets none; the demo pair keeps `SamplingConfig()` (greedy, no penalty).
# Repetition penalty 1.2: the mildest that stopped the looping answers measured on SmolLM2
# (`scripts.measure_loops`), with greedy decoding, which keeps an answer reproducible and equal to
# autoregressive decoding (assets/models/README.md, "Default sampling").
INSTRUCT_SAMPLING = dict(repetition_penalty=1.2)


def default_sampling(instruct: bool) -> SamplingConfig:
    """The sampling a model gets by default: INSTRUCT_SAMPLING for an instruct model."""
    return SamplingConfig(**INSTRUCT_SAMPLING) if instruct else SamplingConfig()


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the three caches.

    budget         tokens the retrieval level attends to (sink chunk + retrieved chunks + recent tokens)
    chunk_size     tokens per retrieval chunk; a chunk is represented by the mean of its keys
    recent_tokens  most recent tokens always kept by the retrieval level (None = budget // 8)
    refresh_every  re-select chunks after this many committed tokens (0 = only on a new prompt)
    refresh_acceptance  also re-select when the target's acceptance over the last 4 rounds falls
                   below this fraction (0 = off)
    draft_sinks    attention-sink tokens kept by the small draft's StreamingLLM cache
    draft_window   recent tokens kept by the small draft's StreamingLLM cache
    prefill_chunk  tokens per forward during prefill (bounds attention memory to O(chunk * L))
    select_by      what a refresh ranks chunks by: "attention" (the attention mass the full target
                   really gave each chunk in its recent verifications, decayed per round; measured
                   on CPU for verifications of up to 64 query rows, without sliding windows;
                   otherwise the queries rank) or "queries" (the target's latest query against
                   each chunk's mean key)
    kv_dtype       what every cache keeps keys and values in: "float32", "float16", "bfloat16",
                   "int16" (the target's full cache only: see KV_DTYPES), or
                   None ("auto" is read as None): the engine's K/V dtype, by default float32
                   with `exact`, GGUF_KV_DTYPE for a GGUF file on the CPU, DEFAULT_KV_DTYPE for
                   another float32 model on the CPU and the model's own dtype elsewhere
                   (`kv.resolve_kv_dtype`). Queries, outputs and the retrieval level's
                   chunk means stay float32.
    """

    budget: int = 4096
    chunk_size: int = 8
    recent_tokens: int | None = None
    refresh_every: int = 256
    refresh_acceptance: float = 0.5
    draft_sinks: int = 16
    draft_window: int = 240
    prefill_chunk: int = 1024
    # raised the retrieval level's acceptance over the queries' ranking (`python -m bench.selection`)
    select_by: str = "attention"
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype == "auto":
            object.__setattr__(self, "kv_dtype", None)
        _check(self.kv_dtype is None or self.kv_dtype in KV_DTYPES,
               f"kv_dtype must be one of {', '.join(KV_DTYPES)} or auto, got {self.kv_dtype!r}")
        _check(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _check(
            self.budget >= 3 * self.chunk_size,
            f"budget ({self.budget}) must be at least 3 chunks ({3 * self.chunk_size} tokens): "
            "the sink chunk, one retrieved chunk and the recent tokens",
        )
        _check(
            self.recent_tokens is None or 1 <= self.recent_tokens <= self.budget - 2 * self.chunk_size,
            f"recent_tokens must be in [1, budget - 2*chunk_size = {self.budget - 2 * self.chunk_size}], "
            f"got {self.recent_tokens}",
        )
        _check(self.refresh_every >= 0, f"refresh_every must be >= 0, got {self.refresh_every}")
        _check(self.select_by in SELECT_BY, f"select_by must be one of {', '.join(SELECT_BY)}, got {self.select_by!r}")
        _check(0.0 <= self.refresh_acceptance <= 1.0, "refresh_acceptance must be in [0, 1]")
        _check(self.draft_sinks >= 0, f"draft_sinks must be >= 0, got {self.draft_sinks}")
        _check(self.draft_window >= 1, f"draft_window must be >= 1, got {self.draft_window}")
        _check(self.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @property
    def recent(self) -> int:
        """Recent tokens the retrieval level keeps verbatim (whole chunks, at least one)."""
        if self.recent_tokens is not None:
            return self.recent_tokens
        return max(self.chunk_size, (self.budget // 8) // self.chunk_size * self.chunk_size)


# The fields that turn the defaults into the paper's method (with mode `triforce`): no context
# lookup, fixed gamma1/gamma2 drafts, no confidence gates.
PAPER_METHOD = {"lookup": False, "adaptive_gamma": False, "min_confidence": 0.0, "draft_confidence": 0.0}

# The modes that need a small draft model, and those that run without one.
DRAFT_MODES = ("triforce", "draft")
DRAFTLESS_MODES = tuple(m for m in MODES if m not in DRAFT_MODES)


def needs_draft(mode: str) -> str:
    """The one line that refuses `mode` on a target without a small draft model."""
    return (f"mode {mode} needs a small draft model and this target has none; "
            f"the modes that run without one: {', '.join(DRAFTLESS_MODES)}")


@dataclass(frozen=True)
class SpeculationConfig:
    """Which levels run and how far each one speculates.

    mode              triforce (small draft -> retrieval level -> target), retrieval, draft, lookup or
                      autoregressive (`MODES`; default `DEFAULT_MODE`, the measured fastest, as in the app
                      and on the command line)
    gamma1            tokens the small draft proposes before the retrieval level verifies them (triforce)
    gamma2            tokens the full target verifies per round (every speculative mode)
    max_new_tokens    the longest answer
    ignore_eos        keep decoding past an end-of-sequence token
    lookup            context lookup (`decoding.lookup`) proposes where the sequence's last tokens recur
                      in the context: straight to the target at a round's start, in front of the small
                      draft inside the middle level; off, `triforce` is the paper's three levels alone;
                      mode `lookup` is lookup alone, `autoregressive` ignores it
    lookup_min_match  tokens of the sequence's end that must recur for a lookup proposal
    lookup_max        the longest lookup proposal the target verifies in one forward
    lookup_agree      a lookup proposal stops where a nearly as long earlier match continues
                      differently (`lookup.ContextIndex`'s rivals; at least one token is kept)
    lookup_backoff    with no match, one token where every occurrence of the last
                      `lookup_min_match - 1` tokens continues alike (`lookup.ContextIndex`)
    lookup_row_cost   what one more verification row costs, as a fraction of a target step: a lookup
                      proposal keeps a token while the chance that it and those before it are accepted
                      is at least this (`schedule.LookupLength`); None: measured per machine and model
                      (`decoding.row_cost`)
    adaptive_gamma    the levels below the target draft as far as the target has been accepting (at
                      most gamma2; plain steps after misses: `schedule.DraftSchedule`); off: always gamma2
    min_confidence    triforce: the retrieval level's own token joins a proposal only when its law gives
                      it at least this probability (0 = always)
    draft_confidence  the small draft proposes a token only when its law gives some token at least this
                      probability (0 = always, the paper's)

    A proposal's length may depend on anything the proposer computed, so every setting keeps
    decoding exact. The paper's method is `SpeculationConfig(mode="triforce", **PAPER_METHOD)`; the measurements
    behind the defaults are in docs/results.md and docs/benchmarks.md.
    """

    mode: str = DEFAULT_MODE
    gamma1: int = 2
    gamma2: int = 6
    max_new_tokens: int = 128
    ignore_eos: bool = False
    lookup: bool = True
    lookup_min_match: int = 3
    lookup_max: int = 8
    lookup_agree: bool = True
    lookup_backoff: bool = True
    lookup_row_cost: float | None = None
    adaptive_gamma: bool = True
    min_confidence: float = 0.0
    draft_confidence: float = 0.5

    def __post_init__(self) -> None:
        _check(self.mode in MODES, f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        _check(self.gamma1 >= 1, f"gamma1 must be >= 1, got {self.gamma1}")
        _check(self.gamma2 >= 1, f"gamma2 must be >= 1, got {self.gamma2}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.lookup_min_match >= 1, f"lookup_min_match must be >= 1, got {self.lookup_min_match}")
        _check(self.lookup_max >= 1, f"lookup_max must be >= 1, got {self.lookup_max}")
        _check(self.lookup_row_cost is None or 0.0 <= self.lookup_row_cost <= 10.0,
               f"lookup_row_cost must be in [0, 10] (a fraction of a step) or None (measured), got {self.lookup_row_cost}")
        _check(self.mode != "lookup" or self.lookup, "mode 'lookup' needs lookup=True")
        _check(0.0 <= self.min_confidence <= 1.0, f"min_confidence must be in [0, 1], got {self.min_confidence}")
        _check(0.0 <= self.draft_confidence <= 1.0,
               f"draft_confidence must be in [0, 1], got {self.draft_confidence}")

    @property
    def uses_draft_model(self) -> bool:
        return self.mode in DRAFT_MODES

    @property
    def uses_lookup(self) -> bool:
        return self.lookup and self.mode != "autoregressive"

    @property
    def cache_margin(self) -> int:
        """Cache slots a round may write past the committed sequence (speculation + slack)."""
        longest = max(self.gamma2, self.lookup_max if self.uses_lookup else 0)
        return self.gamma1 + longest + 8

    @property
    def uses_retrieval(self) -> bool:
        return self.mode in ("triforce", "retrieval")


@dataclass(frozen=True)
class GenerationConfig:
    """Everything one call of `TriForceEngine.generate` needs besides the prompt."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
