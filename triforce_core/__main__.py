"""Command line: `python -m triforce_core generate ...` (see `--help`).

Bad arguments, a missing model folder or an incompatible model pair give one line
`error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import CacheConfig, SpeculationConfig, default_sampling
from .cli.flags import add_kv_cache_args, add_kv_dtype_arg, add_models_dir_arg, apply_kv_cache_args, check_kv_cache_args
from .documents.picking import SectionError, parse_spec, section_tokens, selected_text, too_long_message

_SPEC, _CACHE = SpeculationConfig(), CacheConfig()  # the defaults the flags show and fall back to
_INSTRUCT = default_sampling(instruct=True)
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty")
LEVEL_COLOURS = {"lookup": "\x1b[33m", "draft": "\x1b[32m", "retrieval": "\x1b[34m", "target": "\x1b[31m"}


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(message)


def _add_model_args(g) -> None:
    models = g.add_argument_group("models")
    models.add_argument(
        "--target",
        help="target: hub id, local folder, a .gguf file (weights kept quantized), or smollm2 (SmolLM2-135M-Instruct, "
        "installed by make; default: the embedded demo target)",
    )
    models.add_argument(
        "--draft",
        help="small draft sharing the target's vocabulary, in the same forms as --target (default: the embedded demo "
        "draft when --target is not given, else none)",
    )
    models.add_argument("--device", default="auto", help="auto|cpu|cuda (default auto: cuda when available)")
    models.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default auto: bf16 on cuda, fp32 on cpu)")
    add_kv_dtype_arg(models)


def _add_decoding_args(g, mode: bool = True, sampling: bool = True) -> None:
    dec = g.add_argument_group("decoding")
    if mode:
        dec.add_argument(
            "--mode",
            choices=["triforce", "retrieval", "draft", "lookup", "autoregressive"],
            help="default: lookup, the fastest measured at every prompt length on this CPU (document chat at "
            "16K-64K; README, Long documents); triforce is TriForce's hierarchy with lookup in front",
        )
    else:
        g.set_defaults(mode=None)
    dec.add_argument("--max-new-tokens", type=int, default=_SPEC.max_new_tokens,
                     help=f"longest answer (default {_SPEC.max_new_tokens})" + ("" if sampling else "; a request's max_tokens overrides it"))
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
                         "level (default: 1 for the demo pair; an instruct model's measured default, "
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
    spec.add_argument("--lookup-start", type=int, default=_SPEC.lookup_start,
                      help=f"first lookup run after a miss; runs double while accepted (default {_SPEC.lookup_start})")
    spec.add_argument("--lookup-max", type=int, default=_SPEC.lookup_max,
                      help=f"longest lookup run per target forward (default {_SPEC.lookup_max})")
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
        "--small-draft", dest="small_draft", action=argparse.BooleanOptionalAction, default=None,
        help="triforce: whether the small draft proposes to the retrieval level when lookup has nothing "
        "(default: on with --no-lookup, as in the paper; otherwise the measured default, see README)",
    )
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        # the installed command (pyproject.toml) shows its own name; `python -m` would show __main__.py
        prog="triforce" if Path(sys.argv[0]).name == "triforce" else "python -m triforce_core",
        description="TriForce: lossless hierarchical speculative decoding for long contexts.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    g = sub.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        description=(
            "Generate a continuation of a prompt. Greedy output (--temperature 0) equals the target's "
            "own greedy output token for token in every mode; sampled output follows the target's law."
        ),
        epilog=(
            "Levels: tokens are labelled draft (small model + StreamingLLM cache), retrieval (target "
            "weights over the retrieved KV chunks) or target (the full verifier's own token). "
            "Without --json the text streams to stdout (coloured by level on a terminal) and the "
            "statistics go to stderr."
        ),
    )
    _add_model_args(g)
    prompt = g.add_argument_group("prompt (exactly one)")
    src = prompt.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized as is, no chat template)")
    src.add_argument("--prompt-file", help="file with the prompt text (UTF-8)")
    src.add_argument("--prompt-ids-file", help="JSON list of token ids, used as is")
    _add_decoding_args(g)
    g.add_argument("--num-samples", type=int, default=1, help="independent samples of the same prompt (one prefill)")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--inspect", action="store_true",
                   help="with --json: each sample adds \"verifications\", every verification with the values its "
                        "rule used for each checked token (q, p, the draw u, the decision, the top of p and q, "
                        "the residual after a rejection; see docs/method.md)")

    c = sub.add_parser(
        "chat",
        help="answer questions about a document, as one conversation",
        description=(
            "Answer questions about a document as one conversation, with the target's chat template. "
            "The document is prefilled once; each later question prefills only its own tokens "
            "(and the previous answer's), reusing the cached document."
        ),
        epilog=(
            "A conversation longer than the target's context window is refused with the numbers, "
            "unless --truncate is given (then the document's end is cut and the cut is reported). "
            "A document beyond the window is read, for each question, by the sections most relevant to it "
            "(--sections auto; each turn's sections_read on stderr, or in --json). A --sections all or "
            "3,5-7 selection that does not fit is refused before any prefill, with its size, the window "
            "and the sizes of its top-level sections to pick from."
        ),
    )
    _add_model_args(c)
    conv = c.add_argument_group("conversation")
    conv.add_argument("--document", metavar="FILE", help="txt, md, html, pdf, epub or docx (optional)")
    conv.add_argument("--question", action="append", required=True, metavar="Q",
                      help="a question; repeat for several turns, asked in order")
    conv.add_argument("--system", help="system prompt")
    conv.add_argument("--truncate", action="store_true",
                      help="cut the document's end when the conversation would not fit (reported)")
    conv.add_argument("--sections", metavar="LIST",
                      help="which sections of the document to read: auto (each question reads the sections most "
                      "relevant to it, ranked by BM25, whole, up to --reading-budget tokens; the default for a "
                      "document beyond the window), all (the whole document; refused with the numbers when it does "
                      "not fit), or numbers such as 3,5-7 (numbered from 1 as `ingest --json` lists them; a section "
                      "includes its subsections)")
    conv.add_argument("--reading-budget", type=int, default=None, metavar="TOKENS",
                      help="with --sections auto: tokens of the book each question reads at most (default 4096, "
                      "measured with the demo pair; never more than the window leaves)")
    conv.add_argument("--max-mb", type=float, default=50.0, help="largest document accepted, in MB (default 50)")
    _add_decoding_args(c)
    add_kv_cache_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    b = sub.add_parser(
        "bench",
        help="benchmark every decoding mode against Hugging Face on one long prompt",
        description=(
            "Benchmark our modes (triforce, retrieval, draft, lookup, autoregressive) against Hugging Face "
            "generate (hf-generate) and assisted generation with the same draft (hf-assisted): one "
            "process, one prompt, repeats interleaved after a warm-up, medians reported, next to "
            "the autoregressive roofline (memory bandwidth measured in the same run)."
        ),
        epilog="A progress line per run goes to stderr; --json OUT writes the report (see docs/results.md and docs/benchmarks.md).",
    )
    _add_model_args(b)
    src = b.add_argument_group("prompt").add_mutually_exclusive_group()
    src.add_argument("--document", metavar="FILE", help="a document (txt, md, html, pdf, epub, docx) + a question")
    src.add_argument("--context-tokens", type=int, metavar="N",
                     help="a prompt of N tokens from the bundled sample document (repeated as needed) + a question "
                     "(default 4096)")
    _add_decoding_args(b, mode=False)
    b.add_argument("--modes", default="all", metavar="LIST",
                   help="comma-separated modes: triforce,retrieval,draft,lookup,autoregressive,hf-generate,hf-assisted "
                   "(default all)")
    b.add_argument("--repeats", type=int, default=3, help="timed runs of every mode (default 3); medians are reported")
    b.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth measurement")
    b.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own; 1 is steadier on a shared CPU)")
    b.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT (- = stdout)")

    v = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API alone (no browser app)",
        description=(
            "Serve POST /v1/chat/completions (streaming and not) and GET /v1/models for OpenAI-compatible "
            "clients, headless. Sampling (temperature, top_p, seed), max_tokens and stop sequences come with "
            "each request; the flags below set the decoding mode and caches. A conversation resent whole "
            "each turn prefills only its new tokens (--slots idle caches are kept, least recently used evicted)."
        ),
        epilog=(
            "Example: python -m triforce_core serve --port 8000, then OpenAI(base_url='http://127.0.0.1:8000/v1', "
            "api_key='unused').chat.completions.create(model='triforce-demo', messages=[...]). "
            "Each response carries its speculation statistics under `triforce` (README, HTTP API)."
        ),
    )
    _add_model_args(v)
    net = v.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    net.add_argument("--api-key", default=os.environ.get("TRIFORCE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $TRIFORCE_API_KEY, else none)")
    net.add_argument("--slots", type=int, default=4,
                     help="idle conversations whose caches are kept for prefix reuse (default 4)")
    add_models_dir_arg(net)
    _add_decoding_args(v, sampling=False)
    add_kv_cache_args(v)

    i = sub.add_parser(
        "ingest",
        help="extract the text of a document (txt, md, html, pdf, epub, docx)",
        description=(
            "Extract the text of a document: .txt/.md (any encoding), .html (visible text), .pdf "
            "(page by page), .epub (spine order), .docx. The content is checked against the "
            "extension, archives are read with size caps, and extraction runs in a separate "
            "process with a time limit. Its sections (HTML: its own table of contents, a nav or nested "
            "list of links, or mdBook's toc.html beside the page, else headings; Markdown: headings; EPUB: the "
            "table of contents, else the spine; PDF: the outline, else the pages; DOCX: Title/Heading styles) "
            "come with --json."
        ),
        epilog="On failure: exit code 2 and one line `error: FILE: reason` on stderr.",
    )
    i.add_argument("file", metavar="FILE")
    i.add_argument("--json", action="store_true",
                   help='print {"text", "format", "chars", "pages", "sections": [{"title", "level", "start", "end"}]} '
                   "as JSON (sections numbered from 1 in this order for chat --sections; start/end: character "
                   "offsets into text, a section including its subsections)")
    i.add_argument("--max-mb", type=float, default=50.0, help="largest file accepted, in MB (default 50)")
    i.add_argument("--timeout", type=float, default=60.0, help="time limit for extraction in seconds (default 60)")
    return p


def cmd_ingest(args) -> int:
    from .documents import DocumentError, load_document

    if args.max_mb <= 0 or args.timeout <= 0:
        raise UsageError("--max-mb and --timeout must be positive")
    try:
        doc = load_document(args.file, max_bytes=int(args.max_mb * 1_000_000), timeout_s=args.timeout,
                            companion_toc=True)
    except DocumentError as e:
        raise UsageError(f"{args.file}: {e}") from None
    if args.json:
        print(json.dumps(doc.as_json(), ensure_ascii=False))
    else:
        sys.stdout.write(doc.text if doc.text.endswith("\n") else doc.text + "\n")
    return 0


def cmd_bench(args) -> int:
    """Thin wrapper over `triforce_core.cli.harness` (imported here: it pulls in torch and transformers)."""
    from .cli import harness as harness

    modes = harness.parse_modes(args.modes)
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.context_tokens is not None and args.context_tokens < 1:
        raise UsageError(f"--context-tokens must be >= 1, got {args.context_tokens}")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    _check_flags(args)
    text = None
    if args.document is not None:
        from .documents import DocumentError, load_document

        try:
            text = load_document(args.document).text
        except DocumentError as e:
            raise UsageError(f"{args.document}: {e}") from None
    # The bench compares with Hugging Face's generate, which knows none of our penalties: a model's
    # defaults are not applied here, only the flags given.
    engine, config = _load_engine(args, model_defaults=False)
    bench = harness.Bench(engine, *_model_names(args))
    context = args.context_tokens if args.document is None and args.context_tokens is not None else None
    prompt = bench.context_prompt(4096 if text is None and context is None else context, text)
    report = bench.run(prompt, config, modes, args.repeats, measure_bandwidth=not args.no_bandwidth,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    harness.print_table(report)
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json is not None:
        # minutes of measurement are not lost to a missing folder
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def cmd_serve(args) -> int:
    from .config import ConfigError
    from .cli.flags import served_models
    from .serving.openai_api import ChatCompletionsAPI, create_app, run_server
    from .serving.worker import EngineWorker

    if args.slots < 0:
        raise UsageError(f"--slots must be >= 0, got {args.slots}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    _check_flags(args)
    try:
        models = served_models(args, *_model_names(args), slots=args.slots)
    except ValueError as e:  # a --models-dir that is no folder, before any model is loaded
        raise UsageError(str(e)) from None
    served = models.default()  # the started model (ModelLoadError: one line, exit 2)
    engine, name = served.engine, served.id
    try:
        config = _configs(args, has_draft=engine.draft is not None)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    api = ChatCompletionsAPI(engine, EngineWorker(), served.slots, model_name=name, base_config=config,
                             mode=args.mode, api_key=args.api_key, models=models)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"serving {name!r} at {url}" + (" (API key required)" if args.api_key else ""), file=sys.stderr, flush=True)
    run_server(create_app(api), args.host, args.port)
    return 0


def _model_names(args) -> tuple[str, str | None]:
    from .models.loading import default_model_names

    return default_model_names(args.target, args.draft)


def _read_prompt(args, engine) -> list[int]:
    if args.prompt_ids_file is not None:
        try:
            ids = json.loads(Path(args.prompt_ids_file).read_text())
        except FileNotFoundError:
            raise UsageError(f"prompt ids file not found: {args.prompt_ids_file}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{args.prompt_ids_file} is not valid JSON: {e}") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UsageError(f"{args.prompt_ids_file} must hold a JSON list of integers")
        return ids
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"prompt file not found: {args.prompt_file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"prompt file is not UTF-8 text: {args.prompt_file}") from None
    else:
        text = args.prompt
    if engine.tokenizer is None:
        raise UsageError("the target has no tokenizer: use --prompt-ids-file")
    return engine.encode(text)


def _configs(args, has_draft: bool, prompt_tokens: int | None = None, defaults=None):
    """The generation config of the flags; without --mode, the default for `prompt_tokens`
    (`config.default_mode`: the measured best); sampling flags not given come from `defaults`
    (the model's `default_sampling()`; None: `SamplingConfig()`)."""
    from dataclasses import replace

    from .config import CacheConfig, GenerationConfig, SamplingConfig, default_mode

    mode = args.mode or default_mode(prompt_tokens)
    given = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}
    config = GenerationConfig(
        sampling=replace(defaults or SamplingConfig(), seed=args.seed, **given),
        speculation=SpeculationConfig(
            mode=mode, gamma1=args.gamma1, gamma2=args.gamma2, max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos, lookup=args.lookup or mode == "lookup", lookup_start=args.lookup_start,
            lookup_max=args.lookup_max, lookup_min_match=args.lookup_min_match, lookup_agree=args.lookup_agree,
            lookup_backoff=args.lookup_backoff, min_confidence=args.min_confidence, **_paper_levels(args),
        ),
        cache=CacheConfig(
            budget=args.budget, chunk_size=args.chunk_size, draft_window=args.draft_window,
            draft_sinks=args.draft_sinks, refresh_every=args.refresh_every, prefill_chunk=args.prefill_chunk,
            select_by=args.select_by, kv_dtype=args.kv_dtype,
        ),
    )
    if config.speculation.uses_draft_model and not has_draft:
        what = "mode draft" if mode == "draft" else "the small draft level (--small-draft or --no-lookup)"
        raise UsageError(f"{what} needs a small draft model: pass --draft")
    return config


def _paper_levels(args) -> dict:
    """--small-draft, --adaptive-gamma and --draft-confidence when given; with --no-lookup the
    paper's setting for the ones not given (`config.PAPER_METHOD`), else the measured defaults."""
    from .config import PAPER_METHOD

    out = {}
    for name in ("small_draft", "adaptive_gamma", "draft_confidence"):
        given = getattr(args, name)
        if given is not None:
            out[name] = given
        elif not args.lookup:
            out[name] = PAPER_METHOD[name]
    return out


def _check_flags(args) -> None:
    """Validate every decoding flag before loading gigabytes of weights."""
    from .config import ConfigError

    try:
        _configs(args, has_draft=True)
        if hasattr(args, "no_kv_cache"):
            check_kv_cache_args(args)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None


def _load_engine(args, model_defaults: bool = True):
    """The engine for --target/--draft (default: the demo pair) and the config for its draft;
    sampling flags not given take the model's defaults (`model_defaults`), else `SamplingConfig()`'s."""
    from .config import ConfigError
    from .engine import TriForceEngine
    target, draft = _model_names(args)
    engine = TriForceEngine.from_pretrained(target, draft, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype)
    try:
        return engine, _configs(args, has_draft=engine.draft is not None, defaults=_defaults(engine, model_defaults))
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _defaults(engine, model_defaults: bool):
    from .config import SamplingConfig

    return engine.default_sampling() if model_defaults else SamplingConfig()


def _write_tokens(ev, detok) -> None:
    """Stream a Committed event's text; with a detokenizer (a terminal) each token's text is
    coloured by the level that proposed it."""
    if detok is None:
        sys.stdout.write(ev.text)
    else:
        sys.stdout.write("".join(LEVEL_COLOURS.get(level, "") + text + "\x1b[0m"
                                 for text, level in zip(detok.push(ev.token_ids), ev.levels) if text))
    sys.stdout.flush()


def _colour_detokenizer(engine, colour: bool):
    """Per-token text for colouring on a terminal (None: plain text, e.g. a pipe or NO_COLOR)."""
    from .detokenize import IncrementalDetokenizer

    return IncrementalDetokenizer(engine.detokenize) if colour and engine.tokenizer is not None else None


def _with_token_text(sample: dict, engine) -> dict:
    """Each inspected check gains `text`, its token decoded (when there is a tokenizer)."""
    if engine.tokenizer is not None:
        for v in sample.get("verifications", ()):
            for c in v["checks"]:
                c["text"] = engine.detokenize([c["token_id"]])
    return sample


def cmd_generate(args) -> int:
    from .decoding.events import Committed, Finished

    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    _check_flags(args)
    engine, config = _load_engine(args)
    prompt = _read_prompt(args, engine)
    if args.mode is None:  # the default mode depends on the prompt's length
        config = _configs(args, engine.draft is not None, len(prompt), defaults=engine.default_sampling())
    if args.inspect and not args.json:
        raise UsageError("--inspect needs --json (the checks are printed in the JSON object)")
    if args.json or args.num_samples > 1:
        results = engine.run_samples(prompt, config, args.num_samples, inspect=args.inspect)
        if args.json:
            out = {
                "samples": [{**_with_token_text(r.as_dict(), engine), "stats": r.stats.as_dict()} for r in results],
                "stats": _summary([r.stats for r in results]),
            }
            print(json.dumps(out))
        else:
            for i, r in enumerate(results):
                print(f"--- sample {i + 1}\n{r.text}")
            print(_stats_line(_summary([r.stats for r in results])), file=sys.stderr)
        return 0
    detok = _colour_detokenizer(engine, sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    for ev in engine.generate(prompt, config):
        if isinstance(ev, Committed):
            _write_tokens(ev, detok)
        elif isinstance(ev, Finished):
            sys.stdout.write("\n")
            print(_stats_line(ev.stats.as_dict()), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from .documents import DocumentError, load_document
    from .decoding.events import Committed, Finished, Prefilled
    from .serving.book import BookSession
    from .serving.session import ChatSession

    _check_flags(args)
    if any(not (q or "").strip() for q in args.question):
        raise UsageError("--question must not be empty")
    document = None
    if args.document is not None:
        try:
            document = load_document(args.document, max_bytes=int(args.max_mb * 1_000_000), companion_toc=True)
        except DocumentError as e:
            raise UsageError(f"{args.document}: {e}") from None
    spec = None if args.sections is None else args.sections.strip().lower()
    if spec is not None and document is None:
        raise UsageError("--sections needs --document")
    if args.reading_budget is not None and args.reading_budget < 64:
        raise UsageError(f"--reading-budget must be at least 64 tokens, got {args.reading_budget}")
    if args.truncate and spec == "auto":
        raise UsageError("--truncate and --sections auto exclude each other (auto reads what fits, whole)")
    picked = None
    if spec not in (None, "auto", "all"):
        try:
            picked = parse_spec(spec, len(document.sections))
        except SectionError as e:
            raise UsageError(f"--sections: {e}") from None
    engine, config = _load_engine(args)
    if engine.tokenizer is None:
        raise UsageError("the target has no tokenizer; chat needs one")
    apply_kv_cache_args(engine, args)
    session = _chat_session(engine, document, spec, picked, config, args)
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ and not args.json
    out_turns = []
    for q in args.question:
        if not args.json:
            print(f"Q: {q}\nA: ", end="", flush=True)
        detok = _colour_detokenizer(engine, colour)
        events = session.ask(q)
        if session.sections_read is not None and not args.json:
            print(_read_line(session.sections_read), file=sys.stderr, flush=True)
        for ev in events:
            if args.json:
                continue
            if isinstance(ev, Committed):
                _write_tokens(ev, detok)
            elif isinstance(ev, Finished):
                sys.stdout.write("\n\n")
                print(_stats_line(ev.stats.as_dict()), file=sys.stderr)
            elif isinstance(ev, Prefilled):
                disk = f" ({ev.disk_tokens} from disk)" if ev.disk_tokens else ""
                print(f"[prefilled {ev.tokens} tokens, reused {ev.reused_tokens}{disk}, {ev.seconds:.2f}s]", file=sys.stderr)
        turn = session.turns[-1]
        if turn.truncation is not None:
            print(f"note: {turn.truncation.message()}", file=sys.stderr)
        item = {
            "question": turn.question,
            "answer": turn.answer,
            "token_ids": turn.token_ids,
            "levels": turn.levels,
            "stats": turn.stats.as_dict(),
        }
        if turn.truncation is not None:
            item["truncation"] = vars(turn.truncation)
        if turn.sections_read is not None:
            item["sections_read"] = turn.sections_read
        item["passages"] = turn.passages
        if turn.passages and not args.json:
            print(_passages_line(turn.passages), file=sys.stderr)
        out_turns.append(item)
    if args.json:
        doc = {"chars": len(session.document), "tokens": session.document_tokens}
        if isinstance(session, BookSession):  # the book, not what the last turn read of it
            doc = {"chars": len(session.book.text), "tokens": session.book_tokens, "sections": "auto",
                   "reading_budget": session.reading_budget}
        print(json.dumps({"document": doc, "turns": out_turns}))
    return 0


def _chat_session(engine, document, spec: str | None, picked, config, args):
    """The conversation the --sections choice asks for: the whole document (it fits, or `all`),
    the listed sections, or a book read by the sections most relevant to each question (`auto`,
    the default for a document beyond the window)."""
    from .serving.book import DEFAULT_READING_BUDGET, BookSession, token_starts
    from .documents.reading import BookReader
    from .serving.session import ChatSession

    text = None
    if document is not None and spec in (None, "auto"):
        starts = token_starts(engine.tokenizer, document.text)
        fits = len(starts) + config.speculation.max_new_tokens <= engine.context_window
        if spec == "auto" or not (fits or args.truncate):
            budget = min(args.reading_budget or DEFAULT_READING_BUDGET, engine.context_window)
            reader = BookReader(document, starts, max_part_tokens=max(16, budget // 4))
            return BookSession(engine, document, reading_budget=budget, system_prompt=args.system, config=config,
                               reader=reader)
        text = document.text
    elif document is not None:
        text = document.text if picked is None else selected_text(document, picked)
        _check_fits(engine, document, text, config, None if spec == "all" else args.sections, args.truncate)
    return ChatSession(engine, text, system_prompt=args.system, config=config, allow_truncation=args.truncate)


def _passages_line(passages: list[dict]) -> str:
    """'[most-read passages: Section 16: What is Ownership? «…» (75% of heads); ...]', or
    '[quoted passages: «…» (40% of the answer); ...]' where the mode retrieved nothing."""
    quoted = all(p.get("kind") == "quoted" for p in passages)
    return f"[{'quoted' if quoted else 'most-read'} passages: " + "; ".join(
        (f"{p['section']} " if p["section"] else "") + f"«{p['text'][:80]}» "
        f"({p['share']:.0%} of {'the answer' if quoted else 'heads'})"
        for p in passages) + "]"


def _read_line(sections: list[dict]) -> str:
    """'[read 3 sections, 15,872 tokens: 15 Understanding Ownership, 16 What is Ownership? (part 2 of 2), ...]'."""
    names = [(f"{s['number']} " if s["number"] is not None else "") + s["title"]
             + (f" (part {s['part']})" if s["part"] else "") for s in sections]
    total = sum(s["tokens"] for s in sections)
    return f"[read {len(sections)} section{'s' if len(sections) != 1 else ''}, about {total:,} tokens: " + "; ".join(names) + "]"


def _check_fits(engine, document, text: str, config, spec: str | None, truncate: bool) -> None:
    """Refuse, before any prefill, a document (or selection) the window cannot hold, with the
    numbers and the sections to pick from."""
    window = engine.context_window
    tokens = len(engine.encode(text))
    if truncate or tokens + config.speculation.max_new_tokens <= window:
        return
    sizes = section_tokens(document, lambda t: len(engine.encode(t))) if document.sections else None
    what = "the document" if spec is None else f"the selection (sections {spec.replace(' ', '')})"
    raise UsageError(too_long_message(document, tokens, window, sizes, what, config.speculation.max_new_tokens))


def _summary(stats: list) -> dict:
    """Figures over all samples (the single sample's own figures when there is one)."""
    if len(stats) == 1:
        return stats[0].as_dict()
    proposed: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for s in stats:
        for k, v in s.proposed.items():
            proposed[k] = proposed.get(k, 0) + v
        for k, v in s.accepted.items():
            accepted[k] = accepted.get(k, 0) + v
    new = sum(s.new_tokens for s in stats)
    decode = sum(s.decode_s for s in stats)
    rounds = sum(s.rounds for s in stats)
    return {
        "samples": len(stats),
        "prompt_tokens": stats[0].prompt_tokens,
        "new_tokens": new,
        "prefill_s": stats[0].prefill_s,
        "decode_s": decode,
        "tokens_per_s": new / decode if decode else 0.0,
        "rounds": rounds,
        "mean_accepted": new / rounds if rounds else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": {k: accepted.get(k, 0) / v if v else 0.0 for k, v in proposed.items()},
        "mode": stats[0].mode,
    }


def _stats_line(s: dict) -> str:
    acc = ", ".join(f"{k} {v:.2f}" for k, v in s.get("acceptance", {}).items()) or "n/a"
    return (
        f"[{s['mode']}] {s['new_tokens']} tokens in {s['decode_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s), "
        f"prefill {s['prefill_s']:.2f}s, {s['mean_accepted']:.2f} tokens/target step, acceptance: {acc}"
    )


def _error(e: BaseException) -> int:
    """Report bad input as one `error:` line; exit code 2."""
    text = str(e)
    print(f"error: {text.splitlines()[0] if text else type(e).__name__}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return _error(e)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "ingest":  # no torch needed
        try:
            return cmd_ingest(args)
        except UsageError as e:
            return _error(e)
        except KeyboardInterrupt:
            return 130

    from torch import OutOfMemoryError as _OutOfMemory

    from .config import ConfigError
    from .engine import ContextLengthError
    from .models.loading import ModelLoadError
    from .serving.session import SessionError

    try:
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "bench":
            return cmd_bench(args)  # its BenchError is a ValueError: one line, exit 2
        if args.command == "serve":
            return cmd_serve(args)
        return cmd_generate(args)
    except (UsageError, ConfigError, ModelLoadError, ContextLengthError, SessionError) as e:
        return _error(e)
    except ValueError as e:  # e.g. a token id outside the vocabulary
        return _error(e)
    except (MemoryError, _OutOfMemory):
        print("error: out of memory; try a shorter prompt, a smaller --budget or --dtype bfloat16", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
