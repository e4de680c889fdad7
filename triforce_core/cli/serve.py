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
            "Each response carries its speculation statistics under `triforce` (README, HTTP API). Requests "
            "with a foreign Host or Origin, or a body that is not JSON, are refused; --allowed-hosts, "
            "--allowed-origins and --host widen that (docs/security.md)."
        ),
    )
    add_model_args(v)
    net = v.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_access_args(net)
    net.add_argument("--slots", type=int, default=4,
                     help="idle conversations whose caches are kept for prefix reuse (default 4)")
    add_models_dir_arg(net)
    add_decoding_args(v, sampling=False)
    add_kv_cache_args(v)


def add_access_args(g) -> None:
    """--api-key, --allowed-hosts, --allowed-origins: who may call (`serve` and `python app.py`;
    docs/security.md)."""
    g.add_argument("--api-key", default=os.environ.get("TRIFORCE_API_KEY"),
                   help="require this key for everything served: 'Authorization: Bearer KEY', or in a browser the "
                   "login form or a link with ?key=KEY (an HttpOnly cookie) (default: $TRIFORCE_API_KEY, else none)")
    g.add_argument("--allowed-hosts", default=os.environ.get("TRIFORCE_ALLOWED_HOSTS"), metavar="HOSTS",
                   help="comma list of further Host names to serve, e.g. a reverse proxy's name; * serves any "
                   "(default: $TRIFORCE_ALLOWED_HOSTS, else only loopback names and the bound address; bound to "
                   "0.0.0.0, also any IP address and this machine's name)")
    g.add_argument("--allowed-origins", default=os.environ.get("TRIFORCE_ALLOWED_ORIGINS"), metavar="ORIGINS",
                   help="comma list of web origins (scheme://host[:port]) whose pages may call the server, answered "
                   "with CORS headers; * allows any (default: $TRIFORCE_ALLOWED_ORIGINS, else only the server's "
                   "own pages; clients that send no Origin, such as SDKs and curl, are always served)")


def access_policy(args, max_body: int | None = None):
    """The `AccessPolicy` the flags ask for (`max_body`: the limit outside /v1); UsageError if one is bad."""
    from ..serving.guard import AccessPolicy, split_list

    extra = {} if max_body is None else {"max_body": max_body}
    try:
        return AccessPolicy(bind_host=args.host, allowed_hosts=split_list(args.allowed_hosts),
                            allowed_origins=split_list(args.allowed_origins), api_key=args.api_key, **extra)
    except ValueError as e:
        raise UsageError(f"{e}") from None


def cmd_serve(args) -> int:
    from ..config import ConfigError
    from ..serving.openai import ChatCompletionsAPI, create_app, run_server
    from ..serving.worker import EngineWorker

    if args.slots < 0:
        raise UsageError(f"--slots must be >= 0, got {args.slots}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    check_flags(args)
    access = access_policy(args)
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
                             mode=args.mode, models=models)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"serving {name!r} at {url}" + (" (API key required)" if args.api_key else ""), file=sys.stderr, flush=True)
    run_server(create_app(api, access), args.host, args.port)
    return 0
