"""The HTTP API served by Ray Serve replicas (`serve --ray`): many engines, one API.

    ray.init(address=...)                       # start or join a cluster
    app = application(build, ClusterSpec(replicas=2, cpus_per_replica=1), access)
    serve.run(app, name="triforce", route_prefix="/")

Two deployments:

- `EngineReplica` (`replica`): an engine with its worker and cache slots, the work of `serve`
  in one process; `--replicas N` copies (or autoscaled between `--min-replicas` and
  `--max-replicas`), each reserving its share of the cores (`num_cpus`) and running as many
  torch threads. Serve calls its `check_health` and replaces a replica that fails it.
- `Ingress` (`ingress`): FastAPI behind the same guard as `serve`, on Serve's HTTP proxy. It
  keys each request by its content (`serving.routing`) and sends it to the engine replicas
  through Ray's `ConsistentHashRouter`, so a document's requests reach the replica that holds
  its cache; it counts the answers for `/metrics`.

Ray is an optional extra (`pip install '.[cluster]'`): this package imports it only inside
functions, and `require_ray` refuses in one line, saying how to install it, where it is missing.
May import serving's siblings and every wing below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

RAY_REQUIREMENT = "ray[serve]==2.60.0"
INSTALL = f"pip install '.[cluster]' in a checkout, or pip install '{RAY_REQUIREMENT}'"
APP_NAME = "triforce"
# Requests one replica takes at once before the router tries the next replica on the ring: the
# engine's worker interleaves them round by round, so a replica takes many; a low limit would
# send a busy document's requests away from its cache.
MAX_ONGOING_REQUESTS = 32
# Autoscaling's aim, in requests in flight per replica: the smallest number of clients whose
# answers per second on one replica come within 5% of the best (beyond it more requests only
# queue: each waits longer, no more are answered), so a replica is added when its requests would
# only wait. The sweep behind it: `python -m bench.cluster_load --sweep 1,2,4,8,16` on the demo
# pair, one replica of one core (docs/cluster.md).
TARGET_ONGOING_REQUESTS = 4.0
# Environment the replicas need from the command's: offline hub, cache folders, the engine's key
# (not the API key: the ingress holds it, the replicas take no requests but the ingress's).
PASSED_ENV_PREFIXES = ("TRIFORCE_", "HF_", "TRANSFORMERS_", "XDG_CACHE_HOME")
NOT_PASSED = {"TRIFORCE_API_KEY"}


class ClusterUnavailable(RuntimeError):
    """Ray Serve is not installed (one line saying how to install it)."""


def require_ray():
    """The `ray` module, or ClusterUnavailable saying how to install it."""
    try:
        import ray
        from ray import serve  # noqa: F401 - the [serve] extra, not only the core
        from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter  # noqa: F401
    except ImportError as e:
        raise ClusterUnavailable(f"serving on Ray needs Ray Serve ({RAY_REQUIREMENT}; {e.name or e} is missing): "
                                 f"{INSTALL}") from None
    return ray


@dataclass(frozen=True)
class ClusterSpec:
    """How many engine replicas, and the cores each reserves."""

    replicas: int | None = 1  # None: autoscaled between min_replicas and max_replicas
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = TARGET_ONGOING_REQUESTS  # autoscaling: requests per replica it aims at
    cpus_per_replica: float = 1.0
    block_tokens: int = 1024  # the prefill chunk: what the route key hashes at most
    env: dict[str, str] = field(default_factory=dict)  # passed to every replica

    def __post_init__(self):
        if self.replicas is None:
            if self.min_replicas is None or self.max_replicas is None:
                raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                                 f"{self.min_replicas} and {self.max_replicas}")
        elif self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not self.cpus_per_replica > 0:
            raise ValueError(f"--cpus-per-replica must be > 0, got {self.cpus_per_replica}")

    def scaling(self) -> dict:
        """`serve.deployment`'s arguments for the replica count."""
        if self.replicas is not None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.target_ongoing_requests}}


def passed_env(environ=os.environ) -> dict[str, str]:
    """The command's environment the replicas need, and the package's location when it runs
    from a checkout (not installed), so that a replica on this machine imports the same code."""
    env = {k: v for k, v in environ.items() if k.startswith(PASSED_ENV_PREFIXES) and k not in NOT_PASSED}
    root = Path(__file__).resolve().parents[3]
    if root.name not in ("site-packages", "dist-packages"):  # a checkout
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), environ.get("PYTHONPATH")) if p)
    return env


def join_auth(environ=os.environ) -> dict[str, str]:
    """The environment a driver needs to join a running cluster: Ray (2.60) starts clusters with
    token authentication on and writes the token to ~/.ray/auth_token, but a process joining
    one sends it only with RAY_AUTH_MODE=token; set it, where the user did not choose, whenever
    a token is there (as Ray decides for a cluster it starts; a cluster without authentication
    accepts a token too)."""
    if "RAY_AUTH_MODE" in environ:
        return {}
    token = environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH") or \
        (Path.home() / ".ray" / "auth_token").is_file()
    return {"RAY_AUTH_MODE": "token"} if token else {}


def application(build: Callable, spec: ClusterSpec, access):
    """The Serve application: the ingress bound to the engine deployment (`serve.run` it).
    `build()` runs in each replica and returns its `ChatCompletionsAPI`."""
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

    from .ingress import ingress_deployment
    from .replica import EngineReplica

    runtime_env = {"env_vars": dict(spec.env)} if spec.env else {}
    threads = max(1, int(spec.cpus_per_replica))
    engine = serve.deployment(
        name="engine",
        ray_actor_options={"num_cpus": spec.cpus_per_replica, "runtime_env": runtime_env},
        request_router_config=RequestRouterConfig(request_router_class=ConsistentHashRouter),
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        # Loading a model and a document's prefill hold the GIL for long stretches, and the
        # machine may be shared: generous health checks, so a busy replica is not taken for dead.
        health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=5,
        **spec.scaling(),
    )(EngineReplica)
    ingress = serve.deployment(
        name="ingress", num_replicas=1,
        # routing, tokenizing a conversation's beginning and relaying bytes: a fraction of a core
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env},
        max_ongoing_requests=1000,
    )(ingress_deployment(access))
    return ingress.bind(engine.bind(build, threads), spec.block_tokens)
