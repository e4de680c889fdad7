"""TriForce Studio: chat with a long document in the browser and watch speculative decoding work.

    python app.py                                   # SmolLM2 with its small draft, http://127.0.0.1:7860
    python app.py --target demo                     # the embedded demo pair (a 64K-window copier)
    python app.py --target Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct --device cuda
    python app.py --engine http://gpu-box:8000       # the page here, the model on a served engine

The same port serves an OpenAI-compatible API at /v1 (chat completions, models); `python -m
triforce_core serve` serves the API alone, without the browser app.

Nothing happens on import; the app is built and launched only under `__main__`.
"""

from __future__ import annotations

import argparse
import os
import sys


def parser() -> argparse.ArgumentParser:
    from triforce_core.config import CHAT_MAX_NEW_TOKENS, CacheConfig  # light: no torch
    from triforce_core.cli.flags import add_exact_arg, add_kv_cache_args, add_kv_dtype_arg, add_models_dir_arg
    from triforce_core.cli.serve import add_access_args

    p = argparse.ArgumentParser(
        description="TriForce Studio: chat with a long document; every token is coloured by the speculation "
        "level that proposed it.",
        epilog="The same port serves an OpenAI-compatible API: POST /v1/chat/completions, GET /v1/models "
        "(not with --engine: the engine's server serves it). "
        "Secure defaults: binds 127.0.0.1, no share link, uploads up to --max-upload-mb, no monitoring "
        "endpoint, no file access beyond uploads; models open only from the model folders (--models-dir); "
        "requests with a foreign Host or Origin are refused (docs/security.md).",
    )
    p.add_argument("--target", help="hub id, local folder, a .gguf file, smollm2, gemma3-270m (Gemma 3 270M, a base "
                   "model), or demo (the embedded demo pair, "
                   "a 64K-window copier for demonstrations) (default: smollm2, SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="small draft sharing the target's vocabulary, in the same forms (default: the "
                   "draft shipped with smollm2 or the demo pair, none for other targets)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default auto)")
    add_kv_dtype_arg(p)
    add_exact_arg(p)
    p.add_argument("--mode", choices=["triforce", "retrieval", "draft", "lookup", "autoregressive"],
                   help="default decoding mode of the app and the HTTP API (default: lookup, the fastest measured on "
                   "document chat; the retrieval map shows a selection in triforce or retrieval mode)")
    p.add_argument("--max-new-tokens", type=int, default=CHAT_MAX_NEW_TOKENS,
                   help="default answer length limit (default %(default)s)")
    p.add_argument("--budget", type=int, default=CacheConfig.budget,
                   help="default retrieval budget in tokens (default %(default)s)")
    p.add_argument("--max-upload-mb", type=int, default=50, help="largest accepted upload (default 50 MB)")
    p.add_argument("--max-cached-sessions", type=int, default=4,
                   help="users whose KV caches stay in memory between questions (default 4)")
    p.add_argument("--max-cache-gb", type=float, default=3.0,
                   help="memory the users' cached sessions may hold together; least recently used ones are freed "
                   "beyond it (default %(default)g; a 64K-token session of the demo pair holds about 0.3 GB with float16 K/V, "
                   "0.6 GB with float32)")
    add_access_args(p)
    p.add_argument("--api-slots", type=int, default=4,
                   help="idle conversations whose caches the HTTP API and the chat endpoint keep, least recently "
                   "used evicted (default 4)")
    add_models_dir_arg(p)
    add_kv_cache_args(p)
    p.add_argument("--engine", metavar="URL", help="run the page against a served engine (python -m triforce_core "
                   "serve, or another python app.py) instead of loading a model here: every answer runs there, on "
                   "its model, tokenizer, caches and speculation settings, and the page serves no /v1 API of its "
                   "own; only the page's flags apply (--host, --port, --mode, --max-new-tokens, --max-upload-mb, "
                   "--max-cached-sessions, the access flags), the others are refused (docs/app.md)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="the app's data folder, where every conversation is kept (an SQLite database, readable by "
                   "this user only) (default: $XDG_DATA_HOME/triforce-studio, else ~/.local/share/triforce-studio)")
    p.add_argument("--keep-documents-mb", type=float, default=200,
                   help="the documents kept with the conversations, together at most this size; the least recently "
                   "used are let go first, their conversations stay (default %(default)g MB)")
    p.add_argument("--engine-key", default=os.environ.get("TRIFORCE_ENGINE_KEY"), metavar="KEY",
                   help="the served engine's API key, if it has one (default: $TRIFORCE_ENGINE_KEY); sent to that "
                   "URL only")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


# What a served engine decides for itself: these flags are refused with --engine, never ignored.
ENGINE_FLAGS = ("target", "draft", "models_dir", "device", "dtype", "kv_dtype", "exact", "budget", "max_cache_gb",
                "api_slots", "max_loaded_models", "max_model_gb", "kv_cache_dir", "no_kv_cache", "kv_cache_max_gb")


def engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The flags of `ENGINE_FLAGS` given other values than their defaults, as typed."""
    defaults = parse_args([])
    return ["--" + d.replace("_", "-") for d in ENGINE_FLAGS if getattr(args, d) != getattr(defaults, d)]


def open_history(args: argparse.Namespace):
    """The conversation store of `--data-dir`, and why there is none: (store, '') or (None, the
    reason, also printed). A refused store does not stop the app: it serves without saving."""
    from triforce_core.serving.history import ConversationStore, HistoryError, default_data_dir

    if not args.keep_documents_mb >= 0:
        raise ValueError(f"--keep-documents-mb must be >= 0, got {args.keep_documents_mb}")
    folder = args.data_dir or default_data_dir()
    try:
        store = ConversationStore.open(folder, int(args.keep_documents_mb * 1_000_000))
        store.purge()  # what was deleted before this start is gone for good
    except HistoryError as e:
        note = f"Conversations are not saved: {e}"
        print(f"warning: {note}", file=sys.stderr)
        return None, note
    return store, ""


def main_remote(args: argparse.Namespace) -> int:
    """`--engine URL`: the page here, every answer on the served engine."""
    from dataclasses import replace

    from triforce_core import ConfigError
    from triforce_core.config import DEFAULT_MODE
    from triforce_core.cli.flags import UsageError
    from triforce_core.cli.serve import access_policy
    from triforce_core.serving.remote import RemoteEngine, RemoteError
    from ui.settings import Settings
    from ui.server import build_remote_server, run_server

    try:
        given = engine_flags_given(args)
        if given:
            raise ValueError(f"{', '.join(given)}: with --engine, the engine's own flags decide (set them on its "
                             "server)")
        access = access_policy(args, max_body=(args.max_upload_mb + 1) * 1_000_000)
        engine = RemoteEngine.connect(args.engine, api_key=args.engine_key)
        defaults = Settings(mode=args.mode or DEFAULT_MODE, max_new_tokens=args.max_new_tokens)
        defaults = replace(defaults.for_model(engine), **engine.speculation)  # the server's own settings
        defaults.config()
        history, history_note = open_history(args)
        app = build_remote_server(engine, defaults=defaults, access=access, max_upload_mb=args.max_upload_mb,
                                  max_cached_sessions=args.max_cached_sessions, history=history,
                                  history_note=history_note)
    except (RemoteError, ConfigError, ValueError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}"
    print(f"TriForce Studio on {url}/ ; answers by the engine at {engine.url} (model {engine.model_id!r})",
          file=sys.stderr)
    run_server(app, args.host, args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine is not None:
        return main_remote(args)
    from triforce_core.cli.startup import collector_paused

    with collector_paused():  # the libraries' imports (torch, transformers, gradio): see startup
        import transformers  # noqa: F401 - every model's config and tokenizer are read through it

        from triforce_core import ConfigError, ModelLoadError
        from triforce_core.config import DEFAULT_MODE, GB
        from triforce_core.cli.flags import UsageError, check_exact_args, check_kv_cache_args, served_models
        from triforce_core.cli.serve import access_policy
        from triforce_core.serving.registry import app_model_names
        from ui.settings import Settings
        from ui.server import build_server, run_server

    try:
        # everything but /v1 (whose bodies have the API's limit): an upload and the form around it
        access = access_policy(args, max_body=(args.max_upload_mb + 1) * 1_000_000)
        check_kv_cache_args(args)
        check_exact_args(args)
        if not args.max_cache_gb > 0:
            raise ValueError(f"--max-cache-gb must be > 0, got {args.max_cache_gb}")
        target, draft = app_model_names(args.target, args.draft)
        if args.api_slots < 0:
            raise ValueError(f"--api-slots must be >= 0, got {args.api_slots}")
        models = served_models(args, target, draft, slots=args.api_slots)
        history, history_note = open_history(args)
        print(f"loading {target}" + (f" with draft {draft}" if draft else "") + " ...", file=sys.stderr)
        # the started model (which the registry never lets go of) and the app live as long as the
        # process: made with the collector paused, then frozen (see startup)
        with collector_paused():
            started = models.default()  # the started model, loaded now: a bad one stops here
            name = started.id
            defaults = Settings(mode=args.mode or DEFAULT_MODE, max_new_tokens=args.max_new_tokens,
                                budget=args.budget)
            defaults = defaults.for_model(started.engine)  # an instruct model's repetition control
            defaults.config()
            app = build_server(models=models, defaults=defaults, api_mode=args.mode, access=access,
                               api_slots=args.api_slots, max_upload_mb=args.max_upload_mb,
                               max_cached_sessions=args.max_cached_sessions,
                               max_cache_bytes=int(args.max_cache_gb * GB), history=history,
                               history_note=history_note)
    except (ModelLoadError, ConfigError, ValueError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}"
    print(f"TriForce Studio on {url}/ ; OpenAI-compatible API at {url}/v1 (model {name!r}"
          + (", API key required: open the page and enter it, or send 'Authorization: Bearer KEY'"
             if args.api_key else "") + ")", file=sys.stderr)
    run_server(app, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
