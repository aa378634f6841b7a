"""Prometheus metrics of one API: `/metrics` in the Prometheus text format, with prometheus_client.

Three sources, one registry per `API` (a `CollectorRegistry` of its own, not
the process-wide one, so several APIs can live in one process):

- Per request (`ServeMetrics.watch`): requests by finish reason, prompt and
  generated tokens, time to first token, time per output token and the
  request's latency. They are measured in the request's event callback,
  which runs on the engine's thread as the engine commits the tokens: the
  clock starts when the request is queued on the engine (after parsing and
  tokenizing) and stops at the commit, so streamed and non-streamed
  requests on every route measure the same thing, a slow client or a busy
  event loop does not count, and the engine's warm-up (which does not go
  through the API) does not either. The time per output token is
  observed once per token after the first: a commit of n tokens d seconds
  after the request's previous one gives n observations of d / n (MTP
  commits several tokens at once), so the sum over a request is its last
  token's time minus its first's, and the count is its tokens minus one.
- Engine state (`EngineCollector`), read from `Engine.metrics()` at each
  scrape: running and waiting requests, KV slots and bytes, computed
  prefill tokens, cycles, drafts per position, K per batch size, and every
  `prefix_*` number of the prefix cache (tier label from the key).
- HTTP responses by route and status (`ResponseCounter`), refusals that
  never reach the engine (400, 401, 413) included.

Ratios (acceptance, hit rates, mean accepted length) are left to the
dashboard: rate() of the counters gives them over any window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtplx_ext.batching import Event

#: Seconds to the first token: from a cache hit's milliseconds to a long prompt's prefill on a loaded CPU.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
#: Seconds per output token after the first.
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
#: Seconds from queueing to the request's end.
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)

#: Engine counters: (`Engine.metrics()` key, metric name without `_total`, help).
COUNTERS = (
    ("prefill_tokens", "mtplx_prefill_tokens",
     "Prompt tokens the engine computed (positions loaded from the prefix cache not included)."),
    ("cycles", "mtplx_decode_cycles", "Decode cycles of the running batch (one verification forward each)."),
    ("row_forwards", "mtplx_decode_row_forwards",
     "Rows the decode forwards computed (finished rows not yet dropped included)."),
    ("recompositions", "mtplx_batch_recompositions",
     "Times the running batch was rebuilt (rows joined or left, K moved)."),
    ("stream_cycles", "mtplx_spec_decode_stream_cycles",
     "(request, cycle) pairs whose drafts were verified; accepted tokens / this = mean accepted length."),
)
#: Engine gauges: (key, metric name, help).
GAUGES = (
    ("live_streams", "mtplx_requests_running", "Requests decoding in the running batch."),
    ("batch_rows", "mtplx_batch_rows", "Rows of the running batch (finished ones not dropped yet included)."),
    ("waiting", "mtplx_requests_waiting", "Requests queued or prefilling, not in the running batch yet."),
    ("kv_slots", "mtplx_kv_cache_used_slots", "KV slots the running batch holds (rows times its capacity)."),
    ("kv_bytes", "mtplx_kv_cache_used_bytes", "Bytes of the running batch's attention KV buffers."),
    ("max_kv_slots", "mtplx_kv_cache_max_slots", "Most KV slots the running batch may hold."),
    ("max_batch", "mtplx_max_batch_size", "Most requests decoding at once."),
    ("depth", "mtplx_spec_decode_max_depth", "The deepest K (drafts per cycle) a batch may run; 0 without MTP."),
    ("batch_depth", "mtplx_spec_decode_running_depth", "The running batch's K."),
)
#: Per draft position 1..K: (key, metric name without `_total`, help).
PER_POSITION = (
    ("drafts_proposed", "mtplx_spec_decode_draft_tokens", "Drafts proposed at this draft position."),
    ("drafts_checked", "mtplx_spec_decode_verified_draft_tokens",
     "Drafts at this position whose verdict was used (every earlier draft accepted, the request going on)."),
    ("drafts_accepted", "mtplx_spec_decode_accepted_tokens", "Drafts accepted at this draft position."),
)
#: How a request ends (`Request.finish_reason`).
FINISH_REASONS = ("stop", "length", "cancelled", "error")
#: What the prefix cache's own numbers mean (other `prefix_*` keys get a generic help).
PREFIX_HELP = {
    "lookups": "Prompts looked up in the prefix cache.",
    "hits": "Lookups that loaded a stored prefix.",
    "tokens_reused": "Prompt positions loaded from the prefix cache instead of prefilled.",
    "evictions": "Entries dropped to stay within the cache's bytes.",
    "entries": "Prefixes stored.",
    "bytes": "Bytes of the stored prefixes' KV.",
}
#: Prefix-cache tiers a `prefix_*` key may name (`prefix_<tier>_<what>` or `prefix_<what>_<tier>`); else "ram".
TIERS = ("ram", "disk")
#: Prefix-cache numbers that are levels, not counts (the rest are counters; `*_rate` ratios are left out).
PREFIX_GAUGES = ("entries", "states", "bytes", "max_bytes")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def prefix_metric(key: str) -> tuple[str, str, bool] | None:
    """(metric name without `_total`, tier, is a counter) of a `prefix_*` key of `Engine.metrics()`, or None.

    `prefix_hits` -> ("mtplx_prefix_cache_hits", "ram", True); `prefix_disk_bytes` ->
    ("mtplx_prefix_cache_bytes", "disk", False). Ratios (`*_rate`) give None.
    """
    if not key.startswith("prefix_") or key.endswith("_rate"):
        return None
    parts = key[len("prefix_"):].split("_")
    tier = next((p for p in parts if p in TIERS), "ram")
    what = "_".join(p for p in parts if p != tier)
    if not what:
        return None
    return f"mtplx_prefix_cache_{what}", tier, what not in PREFIX_GAUGES


class EngineCollector(Collector):
    """The engine's state as metric families, read from `engine.metrics()` at each scrape.

    A key the engine does not report (a stand-in engine, an older one) is left out, not zero.
    """

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        for key, name, doc in COUNTERS:
            if _number(m.get(key)):
                yield CounterMetricFamily(name, doc, value=m[key])
        for key, name, doc in GAUGES:
            if _number(m.get(key)):
                yield GaugeMetricFamily(name, doc, value=m[key])
        for key, name, doc in PER_POSITION:
            if isinstance(m.get(key), list):
                fam = CounterMetricFamily(name, doc, labels=["position"])
                for i, v in enumerate(m[key]):
                    fam.add_metric([str(i + 1)], v)
                yield fam
        if isinstance(m.get("depth_per_batch_size"), dict):
            fam = GaugeMetricFamily("mtplx_spec_decode_depth",
                                    "K (drafts per cycle) a batch runs, by the largest batch size it applies to "
                                    "(a batch of B rows runs the K of the smallest batch_size >= B).",
                                    labels=["batch_size"])
            for size, k in m["depth_per_batch_size"].items():
                fam.add_metric([str(size)], k)
            yield fam
        yield from self.prefix_families(m)

    @staticmethod
    def prefix_families(m: dict[str, Any]) -> Iterator[Metric]:
        """Every `prefix_*` number, one family per metric with a `tier` label (`prefix_metric`)."""
        families: dict[str, Metric] = {}
        for key, v in m.items():
            spec = prefix_metric(key)
            if spec is None or not _number(v):
                continue
            name, tier, counter = spec
            fam = families.get(name)
            if fam is None:
                kind = CounterMetricFamily if counter else GaugeMetricFamily
                what = name[len("mtplx_prefix_cache_"):]
                doc = PREFIX_HELP.get(what, f"Prefix cache: {what.replace('_', ' ')}.")
                fam = families[name] = kind(name, doc, labels=["tier"])
            fam.add_metric([tier], v)
        yield from families.values()


class ServeMetrics:
    """The Prometheus registry of one API: per-request metrics it observes, the engine's it reads.

    Args:
        engine: the API's engine (anything with `metrics() -> dict`).
    """

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("mtplx_requests", "Requests that ended, by finish reason "
                                "(stop, length, cancelled, error).", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series from the start: rate() sees the first one too
            self.requests.labels(finish_reason=reason)
        self.prompt_tokens = Counter("mtplx_prompt_tokens", "Prompt tokens of the requests queued on the engine.",
                                     registry=r)
        self.generation_tokens = Counter("mtplx_generation_tokens", "Tokens generated (committed) for requests.",
                                         registry=r)
        self.ttft = Histogram("mtplx_time_to_first_token_seconds",
                              "Seconds from queueing a request on the engine to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mtplx_time_per_output_token_seconds",
                              "Seconds per output token after the first (a commit of n tokens d seconds after "
                              "the previous one: n observations of d / n).", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mtplx_e2e_request_latency_seconds",
                             "Seconds from queueing a request on the engine to its end.", buckets=E2E_BUCKETS,
                             registry=r)
        self.responses = Counter("mtplx_http_responses", "HTTP responses, by route (its template; `other` for "
                                 "no route) and status code.", ["route", "status"], registry=r)
        r.register(EngineCollector(engine))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """(the exposition, its content type) for a scraper's Accept header.

        prometheus_client's negotiation: the text format 0.0.4 unless the
        scraper asks for OpenMetrics (or text 1.0.0).
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def watch(self, prompt_tokens: int, on_event: Callable[[Event], None] | None) -> RequestWatch:
        """The event callback of a request about to be queued: it observes the request, then calls `on_event`.

        Call it right before `Engine.submit` (its clock starts here) and
        `queued` once the engine took the request.
        """
        return RequestWatch(self, prompt_tokens, on_event)


class ResponseCounter:
    """ASGI middleware counting every HTTP response by route and status (`ServeMetrics.responses`).

    Put it outside the API-key check so refusals (401) count too. The route
    label is the matched route's template (bounded: one per route, `other`
    for unknown paths); a response that never started (the app raised) counts as 500.
    """

    def __init__(self, app: ASGIApp, counter: Counter, routes: list[BaseRoute]):
        self.app = app
        self.counter = counter
        self.routes = routes

    def route_of(self, scope: Scope) -> str:
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:  # PARTIAL: the path matched, the method did not (405)
                return str(getattr(route, "path", "other"))
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.counter.labels(route=self.route_of(scope), status=str(status)).inc()


class RequestWatch:
    """One request's observer (the engine thread calls it with each event; see the module docstring)."""

    def __init__(self, metrics: ServeMetrics, prompt_tokens: int, on_event: Callable[[Event], None] | None):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.on_event = on_event
        self.start = time.perf_counter()
        self.last: float | None = None  # the previous commit's time

    def queued(self) -> None:
        """The engine took the request: its prompt tokens count."""
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def __call__(self, ev: Event) -> None:
        now, m = time.perf_counter(), self.metrics
        if ev.kind == "tokens" and ev.tokens:
            n = len(ev.tokens)
            m.generation_tokens.inc(n)
            if self.last is None:
                m.ttft.observe(now - self.start)
                per, n = 0.0, n - 1  # tokens that came with the first one came at once
            else:
                per = (now - self.last) / n
            for _ in range(n):
                m.tpot.observe(per)
            self.last = now
        elif ev.kind in ("done", "error"):
            m.requests.labels(finish_reason=ev.finish_reason or "error").inc()
            m.e2e.observe(now - self.start)
        if self.on_event is not None:
            self.on_event(ev)


__all__ = ["E2E_BUCKETS", "TTFT_BUCKETS", "TPOT_BUCKETS", "EngineCollector", "RequestWatch", "ResponseCounter",
           "ServeMetrics", "prefix_metric"]
