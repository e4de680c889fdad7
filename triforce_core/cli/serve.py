"""`serve`: the OpenAI-compatible HTTP API alone, without the browser app."""

from __future__ import annotations

import os
import sys

from .flags import (UsageError, add_decoding_args, add_kv_cache_args, add_model_args, add_models_dir_arg, check_flags,
                    configs, model_names, served_models)


def add_parser(sub) -> None:
    """The `serve` subcommand and its flags."""
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
    add_model_args(v)
    net = v.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    net.add_argument("--api-key", default=os.environ.get("TRIFORCE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $TRIFORCE_API_KEY, else none)")
    net.add_argument("--slots", type=int, default=4,
                     help="idle conversations whose caches are kept for prefix reuse (default 4)")
    add_models_dir_arg(net)
    add_decoding_args(v, sampling=False)
    add_kv_cache_args(v)


def cmd_serve(args) -> int:
    from ..config import ConfigError
    from ..serving.openai import ChatCompletionsAPI, create_app, run_server
    from ..serving.worker import EngineWorker

    if args.slots < 0:
        raise UsageError(f"--slots must be >= 0, got {args.slots}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    check_flags(args)
    try:
        models = served_models(args, *model_names(args), slots=args.slots)
    except ValueError as e:  # a --models-dir that is no folder, before any model is loaded
        raise UsageError(str(e)) from None
    served = models.default()  # the started model (ModelLoadError: one line, exit 2)
    engine, name = served.engine, served.id
    try:
        config = configs(args, has_draft=engine.draft is not None)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    api = ChatCompletionsAPI(engine, EngineWorker(), served.slots, model_name=name, base_config=config,
                             mode=args.mode, api_key=args.api_key, models=models)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"serving {name!r} at {url}" + (" (API key required)" if args.api_key else ""), file=sys.stderr, flush=True)
    run_server(create_app(api), args.host, args.port)
    return 0
