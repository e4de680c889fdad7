"""The command line's parser and entry point: `python -m triforce_core COMMAND ...` (see `--help`).

Each subcommand's module registers its own flags (`add_parser`) and runs it (`cmd_*`). Bad
arguments, a missing model folder or an incompatible model pair give one line `error: ...` on
stderr and exit code 2. Importing this module imports neither torch nor transformers, so
`--help` and `ingest` stay fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import bench, chat, generate, ingest, serve
from .flags import Parser, UsageError


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        # the installed command (pyproject.toml) shows its own name; `python -m` would show __main__.py
        prog="triforce" if Path(sys.argv[0]).name == "triforce" else "python -m triforce_core",
        description="TriForce: lossless hierarchical speculative decoding for long contexts.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in (generate, chat, bench, serve, ingest):  # the order `--help` lists them in
        command.add_parser(sub)
    return p


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
            return ingest.cmd_ingest(args)
        except UsageError as e:
            return _error(e)
        except KeyboardInterrupt:
            return 130

    from .startup import collector_paused

    with collector_paused():  # the libraries' imports: a second or more of collector passes otherwise
        import transformers  # noqa: F401 - every model's config and tokenizer are read through it

        from torch import OutOfMemoryError as _OutOfMemory

        from ..config import ConfigError
        from ..engine import ContextLengthError
        from ..models.loading import ModelLoadError
        from ..serving.session import SessionError

    try:
        if args.command == "chat":
            return chat.cmd_chat(args)
        if args.command == "bench":
            return bench.cmd_bench(args)  # its BenchError is a ValueError: one line, exit 2
        if args.command == "serve":
            return serve.cmd_serve(args)
        return generate.cmd_generate(args)
    except (UsageError, ConfigError, ModelLoadError, ContextLengthError, SessionError) as e:
        return _error(e)
    except ValueError as e:  # e.g. a token id outside the vocabulary
        return _error(e)
    except (MemoryError, _OutOfMemory):
        print("error: out of memory; try a shorter prompt, a smaller --budget or --dtype bfloat16", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
