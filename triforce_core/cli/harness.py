"""Benchmark harness: our four modes against Hugging Face `generate` and assisted generation.

    from triforce_core.cli.harness import Bench
    bench = Bench(engine, target, draft)                   # the engine and the names it was loaded from
    prompt = bench.context_prompt(16000)                   # the sample document, 16,000 tokens
    report = bench.run(prompt, config, modes, repeats=3)   # the JSON of `python -m triforce_core bench`

How the runs are made comparable
--------------------------------
* Every mode runs in this one process, on the same prompt ids, with the same weights in the
  same dtype. Hugging Face's models are loaded from the same checkpoint by
  `AutoModelForCausalLM` (its own forward and cache, SDPA attention).
* Repeats are interleaved (repeat r runs every mode once, in order), after one short warm-up
  run of every mode, so a disturbance on a shared machine hits every mode alike; every figure
  in the report is the median over the repeats.
* The prompt is prefilled once per side and reused: our four modes share one full target
  cache (each run re-feeds only the last prompt token, then does its own draft-window prefill
  and retrieval selection, timed per run); `hf-generate` starts each run from a copy of one
  `DynamicCache` of the prompt. `prefill_s` = the shared prefill (measured once) + the run's
  own prefill work. `hf-assisted` prefills target and assistant in every run: handed a
  prefilled target cache, transformers' assisted generation (5.23) leaves greedy search's
  output. Decoding speed, the figure this harness is for, is measured per run.
* Each run generates exactly `max_new_tokens` tokens: EOS is ignored on both sides (ours:
  `ignore_eos`; Hugging Face: no `eos_token_id`), so every mode decodes the same length.
* tokens_per_s = new tokens / decode seconds. Ours: decode starts after the prefill, whose last
  prompt token is fed by the first round. Hugging Face: the first `generate` step (the last
  prompt token, plus the assistant's own prefill when assisted) counts as prefill, and the
  tokens it produced are left out of tokens_per_s.
* Greedy (temperature 0): `output_identical_to_autoregressive` compares the token ids of every
  run with our autoregressive output. Sampling: null, since independent samples differ by
  design; that sampled output follows the target's law is what tests/test_sampling_exactness.py
  checks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..config import DRAFT_MODES, MODES as OUR_MODES, GenerationConfig
from ..engine import TriForceEngine
from ..decoding.events import Committed, Finished, Prefilled
from ..kv import kv_dtype_name
from ..models.loading import sync_device
from ..resources import SAMPLE_DOCUMENT
from ..models.roofline import Limit, measure_limit
from ..decoding.loop import make_generator
from .bench_report import RunResult, add_ratios, load_average, machine_info, settings, summarise

HF_MODES = ("hf-generate", "hf-assisted")
MODES = OUR_MODES + HF_MODES
QUESTION = "\n\nQuestion: How does Python find an attribute of an instance of a class?\nAnswer:"
WARMUP_TOKENS = 4


@functools.cache
def hf_cache_name() -> str:
    """The name of a Hugging Face model's KV cache, as an output field and a `generate` keyword:
    `cache` from transformers 5.24 on (where `past_key_values` is deprecated), before that
    `past_key_values`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


class BenchError(ValueError):
    """Bad benchmark input (the command line reports it as one line, exit code 2)."""


def parse_modes(text: str) -> tuple[str, ...]:
    """'triforce,autoregressive' or 'all' -> a tuple of known modes, in the given order."""
    if text.strip() == "all":
        return MODES
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise BenchError(f"unknown mode {unknown[0]!r}: use a comma-separated list of {', '.join(MODES)}, or all"
                         if unknown else "--modes is empty")
    if len(set(modes)) != len(modes):
        raise BenchError("--modes lists a mode twice")
    return modes


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new tokens arrive and how many they are."""

    def __init__(self):
        self.puts = 0
        self.first_at: float | None = None
        self.first_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first_at = time.perf_counter()
            self.first_tokens = int(value.numel())

    def end(self) -> None:
        pass


class _CallCounter:
    """Counts a Hugging Face model's forward calls (target verifications in assisted generation)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


class Bench:
    """Our engine and, for the hf-* modes, Hugging Face's models of the same checkpoints."""

    def __init__(self, engine: TriForceEngine, target_name: str, draft_name: str | None):
        self.engine = engine
        self.target_name = target_name
        self.draft_name = draft_name
        self._hf: dict[str, torch.nn.Module] = {}
        self._prefixes: dict[str, tuple] = {}  # side -> (prompt, cache, seconds): one prefill per prompt

    # -- prompts ---------------------------------------------------------------------------
    def context_prompt(self, context_tokens: int | None, document_text: str | None = None) -> list[int]:
        """A prompt of exactly `context_tokens` ids: the document (repeated when too short, cut
        when too long) followed by a question. Without a count: the whole document + question."""
        tok = self.engine.tokenizer
        if tok is None:
            raise BenchError("the target has no tokenizer; the benchmark builds its prompt from text")
        text = document_text if document_text is not None else SAMPLE_DOCUMENT.read_text(encoding="utf-8")
        question = list(tok.encode(QUESTION, add_special_tokens=False))
        body = list(tok.encode(text.rstrip()))
        if context_tokens is None:
            return body + question
        if context_tokens <= len(question) + 1:
            raise BenchError(f"--context-tokens must be more than {len(question) + 1} (the question), got {context_tokens}")
        need = context_tokens - len(question)
        plain = list(tok.encode("\n\n" + text.strip(), add_special_tokens=False))
        if not plain:
            raise BenchError("the document has no text")
        while len(body) < need:
            body += plain
        return body[:need] + question

    # -- Hugging Face side -----------------------------------------------------------------
    def hf_model(self, which: str) -> torch.nn.Module:
        """transformers' own model of the target or the draft, same dtype and device as ours."""
        if which not in self._hf:
            from transformers import AutoModelForCausalLM

            name = self.target_name if which == "target" else self.draft_name
            if name is None:
                raise BenchError("hf-assisted needs a draft model (--draft)")
            ours = self.engine.target
            hf = AutoModelForCausalLM.from_pretrained(os.path.expanduser(name), dtype=ours.dtype).to(ours.device).eval()
            gc = hf.generation_config
            gc.eos_token_id = None  # every mode decodes exactly max_new_tokens (EOS ignored)
            if gc.pad_token_id is None:
                gc.pad_token_id = 0
            self._hf[which] = hf
        return self._hf[which]

    def _prefix(self, side: str, prompt: list[int], config: GenerationConfig):
        """The prefilled cache of `prompt` for "ours" (in `config`'s K/V dtype) or "hf", made once
        and reused (sweeps)."""
        held = self._prefixes.get(side)
        kv = self.engine.kv_dtype_for(config) if side == "ours" else None
        if held is None or held[0] != (prompt, kv):
            self._prefixes.pop(side, None)  # free the old cache first
            make = self._our_prefill if side == "ours" else self._hf_prefill
            self._prefixes[side] = ((list(prompt), kv), *make(prompt, config))
        return self._prefixes[side][1:]

    @torch.inference_mode()
    def _hf_prefill(self, prompt: list[int], config: GenerationConfig):
        hf = self.hf_model("target")
        ids = torch.tensor([prompt[:-1]], device=hf.device)
        t0 = time.perf_counter()
        cache = getattr(hf(input_ids=ids, use_cache=True), hf_cache_name())
        sync_device(hf.device)
        return cache, time.perf_counter() - t0

    @torch.inference_mode()
    def _run_hf(self, mode: str, prompt: list[int], prefix_cache, prefix_s: float, config: GenerationConfig,
                max_new_tokens: int) -> RunResult:
        hf = self.hf_model("target")
        s = config.sampling
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=not s.greedy, num_beams=1)
        if not s.greedy:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
            torch.manual_seed(s.seed if s.seed is not None else int(time.time_ns() % 2**31))
        if mode == "hf-assisted":
            # Assisted generation starts from the bare prompt: given a prefilled target cache
            # (transformers 5.23) it diverges from greedy search, so it prefills in every run.
            kwargs["assistant_model"] = self.hf_model("draft")
            prefix_cache, prefix_s = None, 0.0
        else:
            kwargs[hf_cache_name()] = copy.deepcopy(prefix_cache)
        ids = torch.tensor([prompt], device=hf.device)
        clock = _FirstTokenClock()
        counter = _CallCounter(hf)
        try:
            t0 = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
            sync_device(hf.device)
            t1 = time.perf_counter()
        finally:
            counter.handle.remove()
        new = out[0, len(prompt):].tolist()
        first_at = clock.first_at if clock.first_at is not None else t1
        rounds = max(counter.calls, 1)
        return RunResult(
            mode=mode,
            token_ids=new,
            prefill_s=prefix_s + (first_at - t0),
            decode_s=t1 - first_at,
            decoded_tokens=len(new) - clock.first_tokens,
            acceptance=None,
            mean_accepted=len(new) / rounds if mode == "hf-assisted" else 1.0,
        )

    # -- our side --------------------------------------------------------------------------
    def _our_prefill(self, prompt: list[int], config: GenerationConfig):
        """Fill one full target cache with the prompt; every run of ours starts from it."""
        engine = self.engine
        cfg = _with_mode(config, "autoregressive")
        engine.check_prompt(prompt, cfg)
        dec = engine.make_loop(cfg, engine.capacity_for(len(prompt), cfg), None)
        pre = dec.prefill(prompt)
        return dec.full.cache, pre.seconds

    def _run_ours(self, mode: str, prompt: list[int], full_cache, prefix_s: float, config: GenerationConfig,
                  max_new_tokens: int) -> RunResult:
        engine = self.engine
        cfg = _with_mode(config, mode, max_new_tokens)
        engine.check_prompt(prompt, cfg)
        generator = make_generator(cfg.sampling.seed, engine.target.device)
        dec = engine.make_loop(cfg, engine.capacity_for(len(prompt), cfg), generator,
                                  full_cache=full_cache, history=list(prompt))
        pre = None
        ids: list[int] = []
        stats = None
        for ev in dec.generate(prompt):
            if isinstance(ev, Prefilled):
                pre = ev
            elif isinstance(ev, Committed):
                ids += ev.token_ids
            elif isinstance(ev, Finished):
                stats = ev.stats
        assert stats is not None
        spec = mode != "autoregressive"
        return RunResult(
            mode=mode,
            token_ids=ids,
            prefill_s=prefix_s + pre.seconds,
            decode_s=stats.decode_s,
            decoded_tokens=stats.new_tokens,
            acceptance=dict(stats.acceptance) if spec else None,
            mean_accepted=stats.mean_accepted,
        )

    # -- the benchmark ---------------------------------------------------------------------
    def run(
        self,
        prompt: Sequence[int],
        config: GenerationConfig,
        modes: Sequence[str],
        repeats: int,
        measure_bandwidth: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> dict:
        """Warm up, run every mode `repeats` times interleaved, and report medians (see module doc)."""
        if repeats < 1:
            raise BenchError(f"--repeats must be >= 1, got {repeats}")
        prompt = [int(i) for i in prompt]
        max_new = config.speculation.max_new_tokens
        say = progress or (lambda line: None)
        self.engine.check_prompt(prompt, _with_mode(config, "autoregressive"))
        needing = [m for m in modes if m in (*DRAFT_MODES, "hf-assisted")]
        if needing and self.engine.draft is None:
            raise BenchError(f"modes {', '.join(needing)} need a small draft model (--draft); modes "
                             f"{', '.join(m for m in MODES if m not in needing)} run without one")
        greedy = config.sampling.greedy
        load = load_average()

        ours_cache = hf_cache = None
        ours_prefix_s = hf_prefix_s = 0.0
        if any(m in OUR_MODES for m in modes) or greedy:
            ours_cache, ours_prefix_s = self._prefix("ours", prompt, config)
            say(f"[bench] prefill (ours, shared): {len(prompt)} tokens in {ours_prefix_s:.2f}s")
        if "hf-generate" in modes:
            hf_cache, hf_prefix_s = self._prefix("hf", prompt, config)
            say(f"[bench] prefill (hf, shared): {len(prompt)} tokens in {hf_prefix_s:.2f}s")

        def one(mode: str, tokens: int) -> RunResult:
            if mode in OUR_MODES:
                return self._run_ours(mode, prompt, ours_cache, ours_prefix_s, config, tokens)
            return self._run_hf(mode, prompt, hf_cache, hf_prefix_s, config, tokens)

        for mode in modes:  # warm-up: allocators, kernels, lazy imports
            if mode == "hf-assisted":  # it prefills in every run: warm it up on the prompt's tail
                tail = prompt[-min(len(prompt), 512):]
                self._run_hf(mode, tail, None, 0.0, config, min(WARMUP_TOKENS, max_new))
            else:
                one(mode, min(WARMUP_TOKENS, max_new))
        reference = None
        if greedy and "autoregressive" not in modes:
            reference = one("autoregressive", max_new).token_ids
        results: dict[str, list[RunResult]] = {m: [] for m in modes}
        for r in range(repeats):
            for mode in modes:
                res = one(mode, max_new)
                results[mode].append(res)
                if mode == "autoregressive" and reference is None:
                    reference = res.token_ids
                say(
                    f"[bench] repeat {r + 1}/{repeats} {mode}: {len(res.token_ids)} tokens, "
                    f"{res.tokens_per_s:.1f} tok/s, decode {res.decode_s:.2f}s, prefill {res.prefill_s:.2f}s"
                )
        runs = [summarise(mode, results[mode], reference if greedy else None) for mode in modes]
        add_ratios(runs)
        report = {
            "machine": machine_info(self.engine, load, load_average()),
            "context_tokens": len(prompt),
            "max_new_tokens": max_new,
            "temperature": config.sampling.temperature,
            "repeats": repeats,
            "settings": {**settings(config), "kv_dtype": kv_dtype_name(self.engine.kv_dtype_for(config)),
                         "arithmetic": self.engine.arithmetic_for(config)},
            "runs": runs,
        }
        if measure_bandwidth:
            limit: Limit = measure_limit(self.engine.target, len(prompt), self.engine.kv_dtype_for(config))
            report["limit"] = limit.as_dict()
            ar = next((run for run in runs if run["mode"] == "autoregressive"), None)
            if ar is not None and limit.tokens_per_s > 0:
                report["limit"]["autoregressive_tokens_per_s"] = ar["tokens_per_s"]
                report["limit"]["autoregressive_fraction_of_roofline"] = ar["tokens_per_s"] / limit.tokens_per_s
            say(f"[bench] bandwidth {limit.bandwidth_gbs:.1f} GB/s, {limit.bytes_per_token / 1e6:.1f} MB/token, "
                f"roofline {limit.tokens_per_s:.0f} tok/s")
        return report


def _with_mode(config: GenerationConfig, mode: str, max_new_tokens: int | None = None) -> GenerationConfig:
    spec = replace(config.speculation, mode=mode, ignore_eos=True,
                   max_new_tokens=max_new_tokens or config.speculation.max_new_tokens)
    return replace(config, speculation=spec)
