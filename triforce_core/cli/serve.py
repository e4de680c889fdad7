"""`serve`: the OpenAI-compatible HTTP API alone, without the browser app; with `--ray`, the
same API from Ray Serve replicas (docs/cluster.md)."""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
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
    add_cluster_args(v)
    add_decoding_args(v, sampling=False)
    add_kv_cache_args(v)


def add_cluster_args(parser) -> None:
    """--ray and its flags: replicas of the engine on a Ray cluster (docs/cluster.md)."""
    g = parser.add_argument_group(
        "cluster (Ray Serve; pip install '.[cluster]')",
        "Serve the same API from engine replicas on a Ray cluster; each document's requests reach the replica "
        "holding its cache. Give every replica one --kv-cache-dir (a shared folder across machines).")
    g.add_argument("--ray", action="store_true",
                   help="serve from Ray Serve replicas: start a Ray cluster on this machine, or join --address")
    g.add_argument("--address", metavar="A", default=None,
                   help="a running cluster to join (from `ray start --head`: host:port, or auto); default: start one "
                   "here, which ends with the command")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="engine replicas, each loading the model (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="A",
                   help="autoscale the engine replicas between A and --max-replicas by requests in flight")
    g.add_argument("--max-replicas", type=int, default=None, metavar="B", help="see --min-replicas")
    g.add_argument("--cpus-per-replica", type=float, default=None, metavar="C",
                   help="cores each replica reserves, and its torch threads (default: the cluster's cores shared "
                   "evenly by --replicas, else 1)")


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


def build_api(args):
    """The `ChatCompletionsAPI` the flags ask for, its started model loaded (`serve`, and each
    replica of `serve --ray`). UsageError for a bad flag; ModelLoadError for a model that
    cannot be loaded."""
    from ..config import ConfigError
    from ..serving.openai import ChatCompletionsAPI
    from ..serving.worker import EngineWorker
    from .startup import collector_paused

    try:
        models = served_models(args, *model_names(args), slots=args.slots)
    except ValueError as e:  # a --models-dir that is no folder, before any model is loaded
        raise UsageError(str(e)) from None
    # the started model, which the registry never lets go of: loaded with the collector paused,
    # then frozen (see startup)
    with collector_paused():
        served = models.default()  # the started model (ModelLoadError: one line, exit 2)
    try:
        config = configs(args, has_draft=served.engine.draft is not None)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return ChatCompletionsAPI(served.engine, EngineWorker(), served.slots, model_name=served.id, base_config=config,
                              mode=args.mode, models=models)


def check_serve_flags(args) -> None:
    if args.slots < 0:
        raise UsageError(f"--slots must be >= 0, got {args.slots}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    cluster = [f for f in ("address", "replicas", "min_replicas", "max_replicas", "cpus_per_replica")
               if getattr(args, f) is not None]
    if cluster and not args.ray:
        raise UsageError(f"--{cluster[0].replace('_', '-')} needs --ray")
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        raise UsageError("--replicas and --min-replicas/--max-replicas exclude each other: a fixed count or autoscaling")
    check_flags(args)


def cmd_serve(args) -> int:
    from ..serving.openai import create_app, run_server

    check_serve_flags(args)
    access = access_policy(args)
    if args.ray:
        return cmd_serve_ray(args, access)
    api = build_api(args)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"serving {api.model_name!r} at {url}" + (" (API key required)" if args.api_key else ""), file=sys.stderr,
          flush=True)
    run_server(create_app(api, access), args.host, args.port)
    return 0


def cmd_serve_ray(args, access) -> int:
    """Deploy the engine replicas and the ingress on a Ray cluster; serve until interrupted."""
    from ..config import ConfigError
    from ..serving.cluster import (APP_NAME, ClusterSpec, ClusterUnavailable, application, join_auth, passed_env,
                                   require_ray)

    joined = args.address is not None
    if joined:  # before Ray is imported: it reads its authentication mode once
        os.environ.update(join_auth())
    try:
        ray = require_ray()
    except ClusterUnavailable as e:
        raise UsageError(str(e)) from None
    for flag, name in zip(("--target", "--draft"), model_names(args)):
        if name and _names_a_path(name) and not os.path.exists(os.path.expanduser(name)):
            raise UsageError(f"{flag} {name}: no such file or folder")  # before a cluster starts for it
    try:
        base = configs(args, has_draft=True)  # the decoding flags, checked before a cluster starts
    except ConfigError as e:
        raise UsageError(str(e)) from None
    from ray import serve

    autoscaled = args.min_replicas is not None or args.max_replicas is not None
    replicas = None if autoscaled else (args.replicas or 1)
    try:  # the counts, checked before a cluster starts
        ClusterSpec(replicas=replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                    cpus_per_replica=args.cpus_per_replica or 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # log_to_driver off, Serve's own logger to warnings: Serve logs every request of every replica;
    # they stay in Ray's log folder (`/tmp/ray/session_latest/logs`), and this command says what
    # went wrong in one line
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(address=args.address, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": passed_env()})
    stop = _stop_on_sigterm()
    try:
        cores = int(ray.cluster_resources().get("CPU", 1))
        cpus = args.cpus_per_replica or (max(1, cores // replicas) if replicas else 1)
        spec = ClusterSpec(replicas=replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                           cpus_per_replica=cpus, block_tokens=base.cache.prefill_chunk,
                           env=passed_env())
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(application(functools.partial(build_api, args), spec, access), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # the replicas could not start (a model that does not load, say)
            print(f"error: the engine replicas did not start: {_cause(_engine_status(serve) or str(e))}",
                  file=sys.stderr)
            return 1
        count = (f"{spec.replicas} engine replicas" if spec.replicas is not None
                 else f"{spec.min_replicas}-{spec.max_replicas} engine replicas (autoscaled)")
        print(f"serving at http://{args.host}:{args.port}/v1 from {count}, {spec.cpus_per_replica:g} cores each, on "
              f"{'the cluster at ' + args.address if joined else 'a Ray cluster started here'}"
              + (" (API key required)" if args.api_key else ""), file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        try:
            if joined:
                serve.delete(APP_NAME)  # the cluster and its other applications go on
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _names_a_path(name: str) -> bool:
    """A model name that can only be a file or folder (as the loader tells them from hub ids)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def _engine_status(serve) -> str:
    """Serve's message on the engine deployment (a failed replica's traceback), or ''."""
    from ..serving.cluster import APP_NAME

    try:
        return serve.status().applications[APP_NAME].deployments["engine"].message or ""
    except (KeyError, AttributeError, RuntimeError):
        return ""


def _cause(text: str) -> str:
    """The replica's own error in Serve's report of a failed deployment (its tracebacks nest
    the replica's): the last `SomeError: message` line that is not a wrapper's."""
    found = [m.group(1) for m in re.finditer(r"^(?:\S+\.)?(\w+(?:Error|Exception): .+)$", text, re.M)
             if not m.group(1).startswith(("RuntimeError: Traceback", "RayTaskError"))]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return found[-1] if found else (lines[-1] if lines else "no reason given")


def _stop_on_sigterm():
    """An event set by SIGTERM or SIGINT, so that `kill` and Ctrl-C both take the replicas down."""
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
