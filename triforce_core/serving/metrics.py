"""A server's Prometheus metrics, for `GET /metrics` in the text exposition format.

    metrics = ServingMetrics()
    metrics.started("triforce-demo"); ...; metrics.answered("triforce-demo", "stop", usage, stats)
    body, content_type = metrics.exposition()

The names are vLLM's with our prefix (`vllm:x` -> `triforce:x`, as llama.cpp's server uses
`llamacpp:`), so a dashboard built for vLLM reads ours by changing the prefix. Every series
carries `model_name`; the speculative-decoding counters carry `level` as well, the *verifying*
level ("retrieval": the middle level checking the small draft's or context lookup's tokens;
"target": the full target checking what reaches it), since our hierarchy verifies twice:

| metric | what it counts |
|---|---|
| `triforce:request_success_total{finished_reason}` | answers sent (`stop`, `length`) |
| `triforce:request_abandoned_total` | requests that ended without an answer: client gone, or the generation failed |
| `triforce:num_requests_running` | generations running now |
| `triforce:prompt_tokens_total` | prompt tokens of the answered requests |
| `triforce:prompt_tokens_reused_total` | of those, tokens a cache already held (no prefill) |
| `triforce:prompt_tokens_from_disk_total` | of the reused, tokens read from the disk K/V cache |
| `triforce:generation_tokens_total` | tokens answered |
| `triforce:generation_tokens_by_level_total{level}` | tokens answered, by the level that proposed them |
| `triforce:time_to_first_token_seconds` | histogram |
| `triforce:e2e_request_latency_seconds` | histogram, request received to answer sent |
| `triforce:spec_decode_num_drafts_total{level}` | verifications of at least one proposed token |
| `triforce:spec_decode_num_draft_tokens_total{level}` | tokens proposed to `level` |
| `triforce:spec_decode_num_accepted_tokens_total{level}` | of those, accepted |
| `triforce:spec_decode_num_accepted_tokens_per_pos_total{level,position}` | accepted, by position in their draft (0 = first) |

Each figure is the sum of what the answers sent said of themselves (`usage` and the `triforce`
extension, `spec_decode` for the last four), so a scrape agrees with the clients' own
statistics to the token. The registry belongs to the instance, never the process: two servers
in one process (tests, the app and an API) count apart.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "triforce:"
# Seconds: from a cached prompt's tens of milliseconds to a long document prefilled on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


class ServingMetrics:
    """The counters of one server (see the module docstring); thread-safe, as prometheus_client is."""

    def __init__(self):
        self.registry = CollectorRegistry()
        m, r = ("model_name",), self.registry

        def counter(name, doc, labels=m):
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.success = counter("request_success", "Answers sent, by finish reason.", m + ("finished_reason",))
        self.abandoned = counter("request_abandoned",
                                 "Requests that ended without an answer (client gone, or the generation failed).")
        self.running = Gauge(PREFIX + "num_requests_running", "Generations running now.", m, registry=r)
        self.prompt = counter("prompt_tokens", "Prompt tokens of the answered requests.")
        self.reused = counter("prompt_tokens_reused", "Prompt tokens a cache already held (not prefilled).")
        self.disk = counter("prompt_tokens_from_disk", "Reused prompt tokens read from the disk K/V cache.")
        self.generated = counter("generation_tokens", "Tokens answered.")
        self.by_level = counter("generation_tokens_by_level", "Tokens answered, by the level that proposed them.",
                                m + ("level",))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first answered token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Request received to answer sent.", m,
                                 buckets=LATENCY_BUCKETS, registry=r)
        level = m + ("level",)
        self.drafts = counter("spec_decode_num_drafts", "Verifications of at least one proposed token.", level)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed to the verifying level.", level)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens the verifying level accepted.",
                                level)
        self.accepted_at = counter("spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted tokens by their position in the draft (0: first).", level + ("position",))

    def started(self, model: str) -> None:
        """A generation began."""
        self.running.labels(model).inc()

    def refused(self, model: str) -> None:
        """A request counted as started was refused before it ran (a relay learns it late)."""
        self.running.labels(model).dec()

    def abandoned_request(self, model: str) -> None:
        """A generation ended without an answer sent."""
        self.running.labels(model).dec()
        self.abandoned.labels(model).inc()

    def answered(self, model: str, finish_reason: str, usage: dict, stats: dict, seconds: float | None = None) -> None:
        """A generation's answer was sent, with these `usage` and `triforce` statistics (as sent)."""
        self.running.labels(model).dec()
        self.observe(model, finish_reason, usage, stats, seconds)

    def observe(self, model: str, finish_reason: str, usage: dict, stats: dict, seconds: float | None = None) -> None:
        """Count one answer from its own statistics (a server that relays answers counts them here)."""
        self.success.labels(model, finish_reason).inc()
        self.prompt.labels(model).inc(usage.get("prompt_tokens", 0))
        self.generated.labels(model).inc(usage.get("completion_tokens", 0))
        self.reused.labels(model).inc(stats.get("reused_tokens", 0))
        self.disk.labels(model).inc(stats.get("disk_tokens", 0))
        for level, n in (stats.get("tokens_by_level") or {}).items():
            self.by_level.labels(model, level).inc(n)
        if stats.get("time_to_first_token_s") is not None:
            self.ttft.labels(model).observe(stats["time_to_first_token_s"])
        if seconds is not None:
            self.latency.labels(model).observe(seconds)
        for level, c in (stats.get("spec_decode") or {}).items():
            self.drafts.labels(model, level).inc(c["drafts"])
            self.draft_tokens.labels(model, level).inc(c["draft_tokens"])
            self.accepted.labels(model, level).inc(c["accepted_tokens"])
            for pos, n in enumerate(c["accepted_per_position"]):
                self.accepted_at.labels(model, level, str(pos)).inc(n)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
