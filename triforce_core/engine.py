"""The Python entry point: `TriForceEngine`.

    engine = TriForceEngine.from_pretrained("meta-llama/Llama-3.1-8B-Instruct",
                                            draft="meta-llama/Llama-3.2-1B-Instruct")
    for event in engine.generate(engine.encode("..."), GenerationConfig()):
        ...  # Prefilled, ChunksSelected, Drafted, Verified, Committed, ..., Finished

`generate` is a generator of events (see `triforce_core.decoding.events`); close it to stop. `run`
collects one generation into a `GenerationResult`; `run_samples` draws several independent
samples of one prompt and prefills it only once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence


import torch

from .config import (EXACT_DTYPE, KV_DTYPES, GenerationConfig, SamplingConfig, check_exact, default_kv_cache_folder,
                     default_sampling, needs_draft)
from .decoding.events import Committed, Event, Finished, GenerationStats, Prefilled, Verified
from .kv import DiskCache, model_fingerprint, resolve_kv_dtype
from .models.arithmetic import EXACT
from .models.loading import LoadedModel, is_instruct, load_draft, load_model, resolve_device, resolve_dtype
from .models.transformer import Transformer
from .decoding.loop import SpeculationLoop, make_generator


class ContextLengthError(ValueError):
    """Prompt + new tokens exceed the target's context window."""


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens only
    levels: list[str]  # levels[i] = level that proposed token_ids[i]
    text: str
    stats: GenerationStats
    verifications: list[Verified] = field(default_factory=list)  # with inspect: every Verified event

    def as_dict(self) -> dict:
        out = {"token_ids": self.token_ids, "levels": self.levels, "text": self.text}
        if self.verifications:
            out["verifications"] = [asdict(v) for v in self.verifications]
        return out


class TriForceEngine:
    """A target model, an optional small draft sharing its vocabulary, and the tokenizer.

    `kv_dtype` ("float32", "float16", "bfloat16", "int16": the target's cache as integers read in
    integer arithmetic, `kv.int16`; None or "auto": the default, see
    `kv.resolve_kv_dtype`: float16 for a GGUF file on the CPU, as llama.cpp, float32 for another
    float32 model there): what the caches keep keys and values in when a generation's
    `CacheConfig.kv_dtype` names none (the app's `--kv-dtype` sets it here, for every user).

    `exact` (`--exact`): float32 arithmetic and K/V, float products, so that greedy output equals
    Hugging Face's token for token; slower on GGUF files. It takes float32 models, and a 16-bit
    `kv_dtype` (here or in a generation's config) is refused (ConfigError). The engine sets its
    models' `arithmetic` (`models.arithmetic`): `EXACT` with it, else the default measured for
    this processor (`Transformer.default_arithmetic`); two engines over one model share it.
    """

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None = None,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        kv_dtype: str | None = None,
        instruct: bool = False,
        exact: bool = False,
    ):
        if kv_dtype == "auto":
            kv_dtype = None
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or auto, got {kv_dtype!r}")
        check_exact(exact, kv_dtype)
        models = [m for m in (target, draft) if m is not None]
        if exact and any(m.dtype != torch.float32 for m in models):
            raise ValueError(f"exact computes in {EXACT_DTYPE}: the models are "
                             f"{', '.join(str(m.dtype).removeprefix('torch.') for m in models)}")
        for model in models:  # per model: the disk cache's key reads it too
            model.arithmetic = EXACT if exact else model.default_arithmetic()
        self.exact = exact
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.kv_dtype = kv_dtype or (EXACT_DTYPE if exact else None)
        self.instruct = instruct  # gets a chat model's default sampling (`loading.is_instruct`)
        self.disk_cache: DiskCache | None = None  # see `use_disk_cache`
        self.source: str | None = None  # what the target was loaded from (`from_pretrained`'s name)

    def use_disk_cache(self, folder: str | None = None, max_bytes: int | None = None) -> DiskCache:
        """Keep prefilled K/V blocks in `folder` (default `config.default_kv_cache_folder()`) and read them
        back in later prefills, in this process or another (see `triforce_core.kv.disk`)."""
        kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
        key = model_fingerprint(self.target, source=self.source)
        self.disk_cache = DiskCache(folder or default_kv_cache_folder(), key, **kwargs)
        return self.disk_cache

    @classmethod
    def from_pretrained(
        cls, target: str, draft: str | None = None, device: str = "auto", dtype: str = "auto",
        kv_dtype: str | None = None, exact: bool = False,
    ) -> "TriForceEngine":
        """Load from hub ids, local folders or GGUF files (`exact`: in float32 on any device, see
        the class). Raises ModelLoadError for missing/incompatible models."""
        if kv_dtype not in (None, "auto", *KV_DTYPES):  # before loading gigabytes
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or auto, got {kv_dtype!r}")
        check_exact(exact, kv_dtype, dtype)
        dev = resolve_device(device)
        dt = resolve_dtype(EXACT_DTYPE if exact else dtype, dev)
        t: LoadedModel = load_model(target, dev, dt)
        d = None
        if draft is not None:
            d = load_draft(draft, t, dev, dt)
        engine = cls(t.model, d.model if d else None, t.tokenizer, t.eos_token_ids, kv_dtype=kv_dtype,
                     instruct=is_instruct(target, t.tokenizer), exact=exact)
        engine.source = target
        return engine

    # -- text ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def context_window(self) -> int:
        return self.target.spec.max_position_embeddings

    def default_sampling(self) -> SamplingConfig:
        """The sampling this model gets where the user set none (`config.default_sampling`):
        an instruct model's repetition control, else greedy decoding."""
        return default_sampling(self.instruct)

    # -- generation ------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        """Raise ValueError/ContextLengthError for a prompt this engine cannot run with `config`."""
        speculation = config.speculation
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        bad = [i for i in prompt_ids if not 0 <= int(i) < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        new = speculation.max_new_tokens
        if n + new > self.context_window:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_new_tokens ({new}) = {n + new} "
                f"exceeds the target's context window of {self.context_window} tokens"
            )
        refused = self.target.rotary.refusal(n, new)  # longrope past its switch (`models.rotary`)
        if refused is not None:
            raise ContextLengthError(refused)
        if speculation.uses_draft_model and self.draft is None:
            raise ValueError(needs_draft(speculation.mode))

    def kv_dtype_for(self, config: GenerationConfig) -> torch.dtype:
        """The torch dtype the target's cache keeps K/V in under `config` (the config's
        kv_dtype, else this engine's, else the default for the target). ConfigError for a 16-bit
        one on an `exact` engine."""
        check_exact(self.exact, config.cache.kv_dtype)
        t = self.target
        return resolve_kv_dtype(config.cache.kv_dtype or self.kv_dtype, t.dtype, t.device, t.quantized,
                                t.spec.head_dim, config.cache.chunk_size, t.spec.windowed)

    def arithmetic_for(self, config: GenerationConfig) -> str:
        """"exact" when a generation under `config` computes as `exact` does (float32 weights and
        K/V, float products: greedy output equals Hugging Face's token for token), else "fast"."""
        t = self.target
        same = (t.dtype == torch.float32 and self.kv_dtype_for(config) == torch.float32
                and not (t.quantized and t.arithmetic.products))
        return "exact" if self.exact or same else "fast"

    def make_loop(self, config: GenerationConfig, capacity: int, generator, **handover) -> SpeculationLoop:
        """A loop with caches for `capacity` tokens (`handover`: full_cache/history of an earlier
        one, not used when its K/V dtype is not this config's)."""
        check_exact(self.exact, config.cache.kv_dtype)
        detok = self.detokenize if self.tokenizer is not None else None
        return SpeculationLoop(self.target, self.draft, config, capacity, self.eos_token_ids, generator, detok,
                       disk=self.disk_cache, kv_dtype=self.kv_dtype, **handover)

    @staticmethod
    def capacity_for(prompt_len: int, config: GenerationConfig) -> int:
        """Cache slots a generation of `config` needs after a prompt of `prompt_len` tokens."""
        speculation = config.speculation
        return prompt_len + speculation.max_new_tokens + speculation.cache_margin

    def _loop(self, prompt_ids: Sequence[int], config: GenerationConfig, generator) -> SpeculationLoop:
        self.check_prompt(prompt_ids, config)
        return self.make_loop(config, self.capacity_for(len(prompt_ids), config), generator)

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig = GenerationConfig(),
        on_prefill_progress: Callable[[int, int], None] | None = None,
        progress_events: bool = False,
        inspect: bool = False,
    ) -> Iterator[Event]:
        """Yield the events of one generation (see `triforce_core.decoding.events`); with `inspect`,
        each `Verified` event carries the verification rule's values (`TokenCheck`s)."""
        generator = make_generator(config.sampling.seed, self.target.device)
        loop = self._loop(prompt_ids, config, generator)
        return loop.generate([int(i) for i in prompt_ids], on_prefill_progress, progress_events, inspect)

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig(),
            inspect: bool = False) -> GenerationResult:
        """Generate to the end and collect the result (with `inspect`, its verifications too)."""
        return _collect(self.generate(prompt_ids, config, inspect=inspect))

    def run_samples(
        self, prompt_ids: Sequence[int], config: GenerationConfig, num_samples: int, inspect: bool = False
    ) -> list[GenerationResult]:
        """`num_samples` independent samples; the prompt is prefilled once and restored between samples."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        generator = make_generator(config.sampling.seed, self.target.device)
        loop = self._loop(prompt_ids, config, generator)
        loop.set_inspect(inspect)
        prefilled = loop.prefill([int(i) for i in prompt_ids])
        loop.mark()
        results = []
        for i in range(num_samples):
            if i:
                loop.restore()
                prefilled = Prefilled(tokens=0, seconds=0.0, reused_tokens=len(prompt_ids))
            results.append(_collect(loop.run(prefilled)))
        return results


def _collect(events: Iterator[Event]) -> GenerationResult:
    ids: list[int] = []
    levels: list[str] = []
    text: list[str] = []
    stats = None
    verifications: list[Verified] = []
    for ev in events:
        if isinstance(ev, Verified) and ev.checks:
            verifications.append(ev)
        elif isinstance(ev, Committed):
            ids += ev.token_ids
            levels += ev.levels
            text.append(ev.text)
        elif isinstance(ev, Finished):
            stats = ev.stats
    assert stats is not None, "generation ended without Finished"
    return GenerationResult(ids, levels, "".join(text), stats, verifications)
