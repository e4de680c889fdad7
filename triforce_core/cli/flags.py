"""The command line's shared flags: their definitions (models, decoding, the disk cache), their
checks, and what they build (the generation config, the engine, the served models).

`python app.py` shares the K/V cache, K/V dtype, --exact and models-dir flags. A bad flag is
reported as one line (`UsageError`), before any weights are loaded. Nothing here imports torch:
`--help` stays fast.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..config import (DEFAULT_KV_DTYPE, DEFAULT_MODE, GB, GGUF_KV_DTYPE, INT16_KV_MIN_HEAD, KV_CACHE_MAX_GB, KV_DTYPES, PAPER_METHOD, CacheConfig,
                      ConfigError, GenerationConfig, SamplingConfig, SpeculationConfig, check_exact,
                      default_kv_cache_folder, default_sampling, needs_draft)

_SPEC, _CACHE = SpeculationConfig(), CacheConfig()  # the defaults the flags show and fall back to
_INSTRUCT = default_sampling(instruct=True)
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty")


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """The command line's parsers: a bad argument raises `UsageError`."""

    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(message)


def add_model_args(g) -> None:
    """--target, --draft, --device, --dtype, --kv-dtype, --exact (every command that loads a model)."""
    models = g.add_argument_group("models")
    models.add_argument(
        "--target",
        help="target: hub id, local folder, a .gguf file (weights kept quantized), smollm2 (SmolLM2-135M-Instruct, "
        "installed by make) or gemma3-270m (Gemma 3 270M, a base model, installed by make and assembled once into "
        "the cache folder) (default: the embedded demo target)",
    )
    models.add_argument(
        "--draft",
        help="small draft sharing the target's vocabulary, in the same forms as --target (default: the embedded demo "
        "draft when --target is not given, else none)",
    )
    models.add_argument("--device", default="auto", help="auto|cpu|cuda (default auto: cuda when available)")
    models.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default auto: bf16 on cuda, fp32 on cpu)")
    add_kv_dtype_arg(models)
    add_exact_arg(models)


def add_decoding_args(g, mode: bool = True, sampling: bool = True, max_new: int = _SPEC.max_new_tokens) -> None:
    """The decoding and speculation flags; without `mode` (bench: every mode) no --mode, without
    `sampling` (serve: each request sets its own) no sampling flags; `max_new`: --max-new-tokens'
    default (chat: a chat answer's, `config.CHAT_MAX_NEW_TOKENS`)."""
    dec = g.add_argument_group("decoding")
    if mode:
        dec.add_argument(
            "--mode",
            choices=["triforce", "retrieval", "draft", "lookup", "autoregressive"],
            help="default: lookup, the fastest measured at every prompt length on this CPU (docs/results.md); "
            "triforce is TriForce's three levels (small draft, retrieval level, target; needs --draft) with lookup "
            "in front; retrieval, lookup and autoregressive run without a small draft",
        )
    else:
        g.set_defaults(mode=None)
    dec.add_argument("--max-new-tokens", type=int, default=max_new,
                     help=f"longest answer (default {max_new})" + ("" if sampling else "; a request's max_tokens overrides it"))
    if sampling:
        # Sampling flags default to None: the model's own defaults (`TriForceEngine.default_sampling`)
        # fill in what is not given, so an instruct target gets its repetition control.
        dec.add_argument("--temperature", type=float, default=None,
                         help="0 = greedy (default: 0, for every model)")
        dec.add_argument("--top-p", type=float, default=None, help="default 1 (off)")
        dec.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
        dec.add_argument("--seed", type=int, default=None)
        dec.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                         help="Hugging Face's repetition penalty over the answer's own tokens (never the prompt): "
                         "a seen token's logit / R when positive, * R when negative; 1 = off. Exact at every "
                         "level (default: 1 for the demo pair; a chat model's (SmolLM2, any GGUF file) measured default, "
                         f"{_INSTRUCT.repetition_penalty:g} -- see assets/models/README.md)")
        dec.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                         help="OpenAI's: minus F times a token's count in the answer so far, in [-2, 2] (default 0)")
        dec.add_argument("--presence-penalty", type=float, default=None, metavar="A",
                         help="OpenAI's: minus A once a token is in the answer, in [-2, 2] (default 0)")
        dec.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-sequence token")
    else:  # set by each request
        g.set_defaults(temperature=None, top_p=None, top_k=None, seed=None, ignore_eos=False, repetition_penalty=None,
                       frequency_penalty=None, presence_penalty=None)
    spec = g.add_argument_group("speculation")
    spec.add_argument("--budget", type=int, default=_CACHE.budget, help="retrieval budget in tokens (default %(default)s)")
    spec.add_argument("--chunk-size", type=int, default=_CACHE.chunk_size, help="retrieval chunk size (default %(default)s)")
    spec.add_argument("--draft-window", type=int, default=_CACHE.draft_window,
                      help="recent tokens in the draft's cache (default %(default)s)")
    spec.add_argument("--draft-sinks", type=int, default=_CACHE.draft_sinks,
                      help="attention-sink tokens in the draft's cache (default %(default)s)")
    spec.add_argument("--gamma1", type=int, default=_SPEC.gamma1,
                      help="small-draft tokens per retrieval verification (default %(default)s)")
    spec.add_argument("--gamma2", type=int, default=_SPEC.gamma2,
                      help="tokens the target verifies per round (default %(default)s)")
    spec.add_argument(
        "--no-lookup", dest="lookup", action="store_false",
        help="turn context lookup off (with --mode triforce: the paper's pure three-level method)",
    )
    spec.add_argument("--lookup-row-cost", type=float, default=_SPEC.lookup_row_cost,
                      help="what one more verification row costs, as a fraction of a step: a lookup proposal keeps a "
                           "token while the chance that it and those before it are accepted is at least this "
                           "(default: measured once on this machine for the model, and kept)")
    spec.add_argument("--lookup-max", type=int, default=_SPEC.lookup_max,
                      help=f"longest lookup proposal per target forward (default {_SPEC.lookup_max})")
    spec.add_argument(
        "--no-lookup-agree", dest="lookup_agree", action="store_false",
        help="never cut a lookup run where another earlier occurrence of the context continues differently",
    )
    spec.add_argument(
        "--no-lookup-backoff", dest="lookup_backoff", action="store_false",
        help="never propose a lookup token from a context one token shorter than --lookup-min-match",
    )
    spec.add_argument("--lookup-min-match", type=int, default=_SPEC.lookup_min_match,
                      help="tokens of the sequence's end that must recur for a lookup proposal "
                      f"(default {_SPEC.lookup_min_match})")
    spec.add_argument(
        "--adaptive-gamma", dest="adaptive_gamma", action=argparse.BooleanOptionalAction, default=None,
        help="whether the levels below the target draft as far as the target has been accepting (at most "
        "--gamma2; plain target steps after misses) instead of always --gamma2 tokens "
        "(default: on; off with --no-lookup, as in the paper)",
    )
    spec.add_argument(
        "--min-confidence", type=float, default=_SPEC.min_confidence,
        help="triforce: the retrieval level's own token joins a speculation only with at least this probability "
        f"(default {_SPEC.min_confidence:g}: always)",
    )
    spec.add_argument(
        "--draft-confidence", type=float, default=None,
        help="the small draft proposes a token only when its law gives some token at least this probability "
        f"(default {_SPEC.draft_confidence:g}; 0 with --no-lookup, as in the paper)",
    )
    spec.add_argument(
        "--refresh-every", type=int, default=_CACHE.refresh_every,
        help="re-select retrieval chunks every N tokens (0 = never; default %(default)s)"
    )
    spec.add_argument(
        "--select-by", choices=["queries", "attention"], default=_CACHE.select_by,
        help="what a refresh ranks retrieval chunks by: the attention the target gave each chunk in its recent "
        "verifications, or the target's latest query against each chunk's mean key (default %(default)s)"
    )
    spec.add_argument(
        "--prefill-chunk", type=int, default=_CACHE.prefill_chunk,
        help="prompt tokens per prefill forward, and per block of K/V kept on disk (default %(default)s)"
    )

def add_kv_dtype_arg(parser) -> None:
    """--kv-dtype (a parser or an argument group)."""
    parser.add_argument(
        "--kv-dtype", choices=[*KV_DTYPES, "auto"], default=None,
        help=f"what the caches keep keys and values in (default auto: {GGUF_KV_DTYPE} for a GGUF file on the CPU, as "
        f"llama.cpp, int16 for the target of one with heads of {INT16_KV_MIN_HEAD} or more (3B-8B models) where the "
        f"integer kernel's vector paths run; {DEFAULT_KV_DTYPE} for another float32 model on the CPU, where greedy output equals Hugging "
        f"Face's; else the model's dtype; --exact: {DEFAULT_KV_DTYPE}). float16 is much faster on the CPU (about 0.6x "
        "float32's step at 16K-64K) and changes an answer now and then; int16 keeps the target's cache as 16-bit "
        "integers read in integer arithmetic (head sizes a multiple of 64): 5x closer to float32 than float16 on "
        "SmolLM2, a verification's extra rows cost less, a step with heads of 64 a few per cent more. Greedy output equals autoregressive decoding with the "
        "same K/V dtype")


def add_exact_arg(parser) -> None:
    """--exact (a parser or an argument group)."""
    parser.add_argument(
        "--exact", action="store_true",
        help="float32 K/V and arithmetic: equal to Hugging Face token for token; slower (GGUF files otherwise keep "
        f"K/V in {GGUF_KV_DTYPE} or int16, top-1 agreement with Hugging Face 99.93%% on SmolLM2). Not with a 16-bit "
        "--kv-dtype or --dtype")


def check_exact_args(args) -> None:
    """UsageError for --exact with a 16-bit --kv-dtype or --dtype (before any model is loaded)."""
    try:
        check_exact(getattr(args, "exact", False), args.kv_dtype, args.dtype, ("--exact", "--kv-dtype", "--dtype"))
    except ConfigError as e:
        raise UsageError(str(e)) from None


def add_kv_cache_args(parser) -> None:
    """--kv-cache-dir, --no-kv-cache, --kv-cache-max-gb (a parser or an argument group)."""
    g = parser.add_argument_group("prefill kept on disk") if isinstance(parser, argparse.ArgumentParser) else parser
    g.add_argument("--kv-cache-dir", metavar="DIR", default=None,
                   help="keep documents' prefilled K/V here and read them back when the same text is opened "
                   f"again, after a restart too (default: {default_kv_cache_folder()}; $XDG_CACHE_HOME/triforce-studio/kv, "
                   "else ~/.cache/triforce-studio/kv)")
    g.add_argument("--no-kv-cache", action="store_true", help="neither read nor write prefilled K/V on disk")
    g.add_argument("--kv-cache-max-gb", type=float, default=KV_CACHE_MAX_GB, metavar="GB",
                   help="size cap of that folder; least recently used blocks are deleted (default %(default)g)")


def check_kv_cache_args(args) -> None:
    """Raise ValueError for bad values (before any model is loaded)."""
    if not args.kv_cache_max_gb > 0:
        raise ValueError(f"--kv-cache-max-gb must be > 0, got {args.kv_cache_max_gb}")
    if args.no_kv_cache and args.kv_cache_dir is not None:
        raise ValueError("--kv-cache-dir and --no-kv-cache contradict each other")


def apply_kv_cache_args(engine, args) -> None:
    """Give `engine` the disk cache the flags ask for (none with --no-kv-cache)."""
    check_kv_cache_args(args)
    if not args.no_kv_cache:
        engine.use_disk_cache(args.kv_cache_dir, int(args.kv_cache_max_gb * GB))


def add_models_dir_arg(parser) -> None:
    """--models-dir DIR, repeatable (the app and `serve`)."""
    parser.add_argument(
        "--models-dir", metavar="DIR", action="append", default=[],
        help="a folder of GGUF files to offer besides the started model (repeatable); the app's model picker and "
        "GET /v1/models also list those found where LM Studio, Ollama and the Hugging Face cache keep models. The "
        "browser may open files under these folders only")
    parser.add_argument(
        "--max-loaded-models", type=int, default=None, metavar="N",
        help="models held in memory at once, the started one included (default: one per 4 GB of memory, at least "
        "2); a switch that would pass it lets go of an unused model first, else is refused with the numbers")
    parser.add_argument(
        "--max-model-gb", type=float, default=None, metavar="GB",
        help="weights of the loaded models at most, in GB (default: half the machine's memory)")


def configs(args, has_draft: bool, defaults=None):
    """The generation config of the flags; without --mode, `config.DEFAULT_MODE`; sampling flags
    not given come from `defaults` (the model's `default_sampling()`; None: `SamplingConfig()`)."""
    mode = args.mode or DEFAULT_MODE
    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}
    config = GenerationConfig(
        sampling=replace(defaults or SamplingConfig(), seed=args.seed, **given),
        speculation=SpeculationConfig(
            mode=mode, gamma1=args.gamma1, gamma2=args.gamma2, max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos, lookup=args.lookup or mode == "lookup",
            lookup_max=args.lookup_max, lookup_min_match=args.lookup_min_match, lookup_agree=args.lookup_agree,
            lookup_backoff=args.lookup_backoff, lookup_row_cost=args.lookup_row_cost,
            min_confidence=args.min_confidence, **_paper_levels(args),
        ),
        cache=CacheConfig(
            budget=args.budget, chunk_size=args.chunk_size, draft_window=args.draft_window,
            draft_sinks=args.draft_sinks, refresh_every=args.refresh_every, prefill_chunk=args.prefill_chunk,
            select_by=args.select_by, kv_dtype=args.kv_dtype,
        ),
    )
    if config.speculation.uses_draft_model and not has_draft:
        raise UsageError(f"{needs_draft(mode)}; or pass --draft")
    return config


def _paper_levels(args) -> dict:
    """--adaptive-gamma and --draft-confidence when given; with --no-lookup the paper's setting
    for the ones not given (`config.PAPER_METHOD`), else the defaults."""
    out = {}
    for name in ("adaptive_gamma", "draft_confidence"):
        given = getattr(args, name)
        if given is not None:
            out[name] = given
        elif not args.lookup:
            out[name] = PAPER_METHOD[name]
    return out


def check_flags(args) -> None:
    """Validate every decoding flag before loading gigabytes of weights."""
    check_exact_args(args)
    try:
        configs(args, has_draft=True)
        if hasattr(args, "no_kv_cache"):
            check_kv_cache_args(args)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None


def load_engine(args, model_defaults: bool = True):
    """The engine for --target/--draft (default: the demo pair) and the config for its draft;
    sampling flags not given take the model's defaults (`model_defaults`), else `SamplingConfig()`'s."""
    from ..engine import TriForceEngine  # here: it imports torch
    from .startup import collector_paused

    target, draft = model_names(args)
    # a command's one engine: reading a model's config and tokenizer imports some 700 more modules
    # (transformers' GGUF and tokenizer code, sympy, accelerate), which the collector's passes
    # would walk again and again; the engine then lives as long as the process
    with collector_paused():
        engine = TriForceEngine.from_pretrained(target, draft, device=args.device, dtype=args.dtype,
                                                kv_dtype=args.kv_dtype, exact=args.exact)
    try:
        return engine, configs(args, has_draft=engine.draft is not None, defaults=_defaults(engine, model_defaults))
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _defaults(engine, model_defaults: bool):
    return engine.default_sampling() if model_defaults else SamplingConfig()


def model_names(args) -> tuple[str, str | None]:
    """--target and --draft, or the embedded demo pair."""
    from ..models.loading import default_model_names

    return default_model_names(args.target, args.draft)


def served_models(args, target: str, draft: str | None, slots: int):
    """The models a server offers (`serving.registry.ServedModels`), each loaded with the flags'
    device, dtype, K/V dtype, --exact and disk cache (the started model and every one a request or
    the app's picker switches to). Raises ValueError for a --models-dir that is no folder."""
    from ..engine import TriForceEngine
    from ..models.folders import ModelFolders
    from ..serving.registry import ServedModels
    from .startup import collector_paused

    def load(choice):
        # paused as a command's load is (load_engine), but nothing frozen: a model the registry
        # lets go of must stay collectable
        with collector_paused(freeze=False):
            engine = TriForceEngine.from_pretrained(choice.target, choice.draft, device=args.device, dtype=args.dtype,
                                                    kv_dtype=args.kv_dtype, exact=args.exact)
        apply_kv_cache_args(engine, args)
        return engine

    max_gb = getattr(args, "max_model_gb", None)
    return ServedModels(load, ModelFolders.default(args.models_dir), started=(target, draft), slots=slots,
                        max_loaded=getattr(args, "max_loaded_models", None),
                        max_bytes=None if max_gb is None else int(max_gb * GB))
