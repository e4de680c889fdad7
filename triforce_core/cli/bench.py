"""`bench`: every decoding mode against Hugging Face on one long prompt (the harness:
`cli/harness.py`, imported only when the command runs: it pulls in torch and transformers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .flags import UsageError, add_decoding_args, add_model_args, check_flags, load_engine, model_names


def add_parser(sub) -> None:
    """The `bench` subcommand and its flags."""
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
    add_model_args(b)
    src = b.add_argument_group("prompt").add_mutually_exclusive_group()
    src.add_argument("--document", metavar="FILE", help="a document (txt, md, html, pdf, epub, docx) + a question")
    src.add_argument("--context-tokens", type=int, metavar="N",
                     help="a prompt of N tokens from the bundled sample document (repeated as needed) + a question "
                     "(default 4096)")
    add_decoding_args(b, mode=False)
    b.add_argument("--modes", default="all", metavar="LIST",
                   help="comma-separated modes: triforce,retrieval,draft,lookup,autoregressive,hf-generate,hf-assisted "
                   "(default all)")
    b.add_argument("--repeats", type=int, default=3, help="timed runs of every mode (default 3); medians are reported")
    b.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth measurement")
    b.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own; 1 is steadier on a shared CPU)")
    b.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT (- = stdout)")


def cmd_bench(args) -> int:
    """Thin wrapper over `triforce_core.cli.harness` (imported here: it pulls in torch and transformers)."""
    from . import harness
    from .bench_report import print_table

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
    check_flags(args)
    text = None
    if args.document is not None:
        from ..documents import DocumentError, load_document

        try:
            text = load_document(args.document).text
        except DocumentError as e:
            raise UsageError(f"{args.document}: {e}") from None
    # The bench compares with Hugging Face's generate, which knows none of our penalties: a model's
    # defaults are not applied here, only the flags given.
    engine, config = load_engine(args, model_defaults=False)
    bench = harness.Bench(engine, *model_names(args))
    context = args.context_tokens if args.document is None and args.context_tokens is not None else None
    prompt = bench.context_prompt(4096 if text is None and context is None else context, text)
    report = bench.run(prompt, config, modes, args.repeats, measure_bandwidth=not args.no_bandwidth,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    print_table(report)
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json is not None:
        # minutes of measurement are not lost to a missing folder
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
