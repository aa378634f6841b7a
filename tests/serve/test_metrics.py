"""`/metrics` in the Prometheus text format, read with prometheus_client's own parser after real requests.

The counts are checked against what the clients saw (the responses' usage,
their finish reasons, their wall times), the draft counters against their
order (accepted <= verified <= proposed, non-increasing over positions) and
against `/metrics.json`; a deliberately double-counting exposition must be
caught by the same checks.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import _seed

prometheus_client = pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from _serve import KEY, AppThread, ScriptedEngine  # noqa: E402

import mtplx_ext  # noqa: E402
from mtplx_ext.serve import API, load_chat_tokenizer  # noqa: E402
from mtplx_ext.serve.metrics import EngineCollector, RequestWatch, ServeMetrics, prefix_metric  # noqa: E402
from mtplx_ext.shipped import SHIPPED_MODEL, eos_ids  # noqa: E402

MODEL = "tiny-qwen3-mtp"
H = {"Authorization": f"Bearer {KEY}"}
SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
            "for i in range(10):", "def main(argv):", "# helpers\n"]


@pytest.fixture(scope="module")
def server(live_server):
    base, key = live_server
    assert key == KEY
    return base


# -- reading the exposition ------------------------------------------------------------------------------------


def scrape(base: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of `/metrics`, parsed by prometheus_client's text parser."""
    r = httpx.get(base + "/metrics", headers=H if headers is None else headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers["content-type"]
    return parse(r.text)


def parse(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def series(m: dict, name: str, label: str) -> dict[str, float]:
    """{label value: value} of every sample `name` labelled `label`."""
    return {dict(k)[label]: v for (n, k), v in m.items() if n == name and label in dict(k)}


@dataclass
class Sent:
    """What a client saw of one request."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # the engine's: "stop" or "length"
    seconds: float  # the client's wall time, request to full response
    mtp: dict | None = None  # the response's `mtp` field (its cycles, accepted drafts)


def check_requests(before: dict, after: dict, sent: list[Sent]) -> None:
    """The per-request metrics moved by exactly what `sent` saw; histograms are well formed."""
    d = lambda name, **lb: val(after, name, **lb) - val(before, name, **lb)  # noqa: E731
    for reason in ("stop", "length", "cancelled", "error"):
        want = sum(s.finish_reason == reason for s in sent)
        assert d("mtplx_requests_total", finish_reason=reason) == want, reason
    assert d("mtplx_prompt_tokens_total") == sum(s.prompt_tokens for s in sent)
    assert d("mtplx_generation_tokens_total") == sum(s.completion_tokens for s in sent)
    with_tokens = [s for s in sent if s.completion_tokens > 0]
    counts = {"mtplx_time_to_first_token_seconds": len(with_tokens),
              "mtplx_time_per_output_token_seconds": sum(s.completion_tokens - 1 for s in with_tokens),
              "mtplx_e2e_request_latency_seconds": len(sent)}
    for hist, n in counts.items():
        assert d(hist + "_count") == n, hist
        buckets = sorted(((float(le), v) for le, v in series(after, hist + "_bucket", "le").items()))
        assert buckets[-1] == (math.inf, val(after, hist + "_count")), hist
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), (hist, buckets)  # cumulative
    # Seconds, measured inside each request's own wall time (milliseconds would be 1000 times too large).
    wall = sum(s.seconds for s in sent)
    for hist in ("mtplx_time_to_first_token_seconds", "mtplx_e2e_request_latency_seconds"):
        assert 0 < d(hist + "_sum") <= wall, hist
    assert 0 <= d("mtplx_time_per_output_token_seconds_sum") <= wall


def check_drafts(before: dict, after: dict, sent: list[Sent], depth: int) -> None:
    """Per position 1..depth: accepted <= verified <= proposed, each non-increasing over positions; the
    responses' `mtp` fields account for the accepted drafts, and (every request at the server's fixed K) for
    K drafts proposed per position per cycle of each request."""
    rows = []
    for name in ("draft_tokens", "verified_draft_tokens", "accepted_tokens"):
        a, b = (series(m, f"mtplx_spec_decode_{name}_total", "position") for m in (after, before))
        assert sorted(a, key=int) == [str(i) for i in range(1, depth + 1)], name
        rows.append([a[str(i)] - b.get(str(i), 0.0) for i in range(1, depth + 1)])
    proposed, verified, accepted = rows
    assert all(0 <= a <= v <= p for a, v, p in zip(accepted, verified, proposed)), rows
    for row in rows:
        assert all(x >= y for x, y in zip(row, row[1:])), rows
    assert sum(accepted) == sum(s.mtp["accepted_drafts"] for s in sent), rows
    assert proposed == [sum(s.mtp["cycles"] for s in sent)] * depth, rows


def wait_idle(base: str) -> dict:
    deadline = time.time() + 30
    while True:
        m = scrape(base)
        names = ("mtplx_requests_running", "mtplx_requests_waiting", "mtplx_batch_rows", "mtplx_kv_cache_used_slots")
        if all(val(m, name) == 0 for name in names):  # finished rows left the batch too
            return m
        assert time.time() < deadline, "the engine did not go idle"
        time.sleep(0.02)


# -- the live server -------------------------------------------------------------------------------------------


def _openai(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _request(base: str, i: int, prompt: str, max_tokens: int) -> Sent:
    """Request i through one of the routes (chat, completions streamed with usage, Anthropic messages)."""
    t0 = time.perf_counter()
    kind = i % 3
    if kind == 0:
        r = _openai(base).chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                                  messages=[{"role": "user", "content": prompt}])
        u, reason = r.usage, r.choices[0].finish_reason
        return Sent(u.prompt_tokens, u.completion_tokens, reason, time.perf_counter() - t0, r.model_extra["mtp"])
    if kind == 1:
        reason, usage, mtp = None, None, None
        for chunk in _openai(base).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0.7, seed=i, stream=True,
                                                      stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
            mtp = (chunk.model_extra or {}).get("mtp") or mtp
        return Sent(usage.prompt_tokens, usage.completion_tokens, reason, time.perf_counter() - t0, mtp)
    msg = anthropic.Anthropic(base_url=base, api_key=KEY, timeout=120, max_retries=0).messages.create(
        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}])
    reason = "length" if msg.stop_reason == "max_tokens" else "stop"
    return Sent(msg.usage.input_tokens, msg.usage.output_tokens, reason, time.perf_counter() - t0,
                msg.model_extra["mtp"])


def test_counts_match_what_the_clients_saw_over_every_route(server):
    rng = _seed.rng()
    before = wait_idle(server)
    jobs = [(i, SNIPPETS[int(rng.integers(len(SNIPPETS)))] * int(rng.integers(1, 3)), int(rng.integers(4, 40)))
            for i in range(int(rng.integers(6, 10)))]
    with cf.ThreadPoolExecutor(4) as pool:  # concurrent: the batch holds several rows
        sent = list(pool.map(lambda job: _request(server, *job), jobs))
    after = wait_idle(server)
    check_requests(before, after, sent)
    check_drafts(before, after, sent, 2)
    assert sum(s.mtp["accepted_drafts"] for s in sent) > 0  # the shipped head's drafts are accepted
    assert val(after, "mtplx_decode_cycles_total") > val(before, "mtplx_decode_cycles_total")
    assert val(after, "mtplx_spec_decode_max_depth") == 2
    assert set(series(after, "mtplx_spec_decode_depth", "batch_size").values()) <= {0.0, 1.0, 2.0}
    assert val(after, "mtplx_kv_cache_used_slots") == 0 and val(after, "mtplx_kv_cache_used_bytes") == 0
    assert val(after, "mtplx_kv_cache_max_slots") > 0 and val(after, "mtplx_max_batch_size") == 4
    # The Prometheus counters are the JSON's numbers (both read with the engine idle).
    js = httpx.get(server + "/metrics.json", headers=H, timeout=30).json()
    for key, name in (("drafts_proposed", "draft_tokens"), ("drafts_checked", "verified_draft_tokens"),
                      ("drafts_accepted", "accepted_tokens")):
        assert js[key] == [series(after, f"mtplx_spec_decode_{name}_total", "position")[str(i + 1)]
                           for i in range(2)], key
    assert js["prefill_tokens"] == val(after, "mtplx_prefill_tokens_total")
    assert js["cycles"] == val(after, "mtplx_decode_cycles_total")


def test_a_repeated_prompt_is_a_prefix_cache_hit_in_the_ram_tier(server):
    rng = _seed.rng()
    prompt = "".join(SNIPPETS[int(i)] for i in rng.integers(0, len(SNIPPETS), 6))
    before = wait_idle(server)
    client = _openai(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    after = wait_idle(server)
    d = lambda name: val(after, name, tier="ram") - val(before, name, tier="ram")  # noqa: E731
    assert d("mtplx_prefix_cache_lookups_total") == 2
    assert d("mtplx_prefix_cache_hits_total") >= 1
    assert d("mtplx_prefix_cache_tokens_reused_total") > 0
    assert val(after, "mtplx_prefix_cache_bytes", tier="ram") > 0
    assert val(after, "mtplx_prefix_cache_entries", tier="ram") >= 1


def test_a_dropped_stream_counts_as_cancelled_and_every_response_by_route_and_status(server):
    before, js_before = wait_idle(server), httpx.get(server + "/metrics.json", headers=H, timeout=30).json()
    body = {"prompt": "def main():", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=H, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(6))
    bad = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=H, timeout=30)
    assert bad.status_code == 400
    assert httpx.get(server + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server + "/nope", headers=H, timeout=30).status_code == 404
    want = {("/v1/completions", "200"): 1, ("/v1/completions", "400"): 1, ("/v1/models", "401"): 1,
            ("other", "404"): 1}
    deadline = time.time() + 30
    while True:  # the dropped stream's handler ends (and its response counts) once the engine cancelled it
        after = wait_idle(server)
        moved = {k: val(after, "mtplx_http_responses_total", route=k[0], status=k[1])
                 - val(before, "mtplx_http_responses_total", route=k[0], status=k[1]) for k in want}
        if moved == want or time.time() > deadline:
            break
        time.sleep(0.05)
    assert moved == want
    d = lambda name, **lb: val(after, name, **lb) - val(before, name, **lb)  # noqa: E731
    ended = [d("mtplx_requests_total", finish_reason=f) for f in ("cancelled", "stop", "length", "error")]
    assert ended == [1, 0, 0, 0]
    assert d("mtplx_e2e_request_latency_seconds_count") == 1 and d("mtplx_time_to_first_token_seconds_count") == 1
    js = httpx.get(server + "/metrics.json", headers=H, timeout=30).json()
    generated = js["generated_tokens"] - js_before["generated_tokens"]
    assert 0 < d("mtplx_generation_tokens_total") == generated < 3000
    assert d("mtplx_time_per_output_token_seconds_count") == generated - 1


def test_metrics_need_the_key_and_answer_get_only(server):
    for path in ("/metrics", "/metrics.json"):
        assert httpx.get(server + path, timeout=30).status_code == 401
        assert httpx.get(server + path, headers={"x-api-key": KEY}, timeout=30).status_code == 200
    r = httpx.post(server + "/metrics", headers=H, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"]
    # A scraper asking for OpenMetrics gets it (prometheus_client's content negotiation).
    r = httpx.get(server + "/metrics", headers={**H, "Accept": "application/openmetrics-text; version=1.0.0"},
                  timeout=30)
    assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")


# -- a scripted engine: exact token counts, chunks of several tokens, a broken variant ------------------------


class TwiceWatch(RequestWatch):
    """A request observer that counts every generated token twice."""

    def __call__(self, ev: Any) -> None:
        if ev.kind == "tokens":
            self.metrics.generation_tokens.inc(len(ev.tokens))
        super().__call__(ev)


class DoubleCounting(ServeMetrics):
    """The metrics with `TwiceWatch`: the checks must catch it."""

    def watch(self, prompt_tokens: int, on_event: Any) -> RequestWatch:
        return TwiceWatch(self, prompt_tokens, on_event)


@pytest.fixture(scope="module")
def tokenizer():
    return mtplx_ext.load(SHIPPED_MODEL).tokenizer


def _scripted_run(tokenizer: Any, metrics_class: type, rng: Any) -> tuple[dict, dict, list[Sent]]:
    eng = ScriptedEngine(tokenizer)
    eng.reply = " ".join(SNIPPETS[int(i)] for i in rng.integers(0, len(SNIPPETS), 8))
    api = API(eng, "stub", tokenizer, load_chat_tokenizer(SHIPPED_MODEL), None, eos_ids(tokenizer))
    api.prometheus = metrics_class(eng)
    with AppThread(api) as a:
        before = scrape(a.base, {})
        sent = []
        client = openai.OpenAI(base_url=a.base + "/v1", api_key="none", timeout=60, max_retries=0)
        for _ in range(int(rng.integers(3, 7))):
            n = int(rng.integers(2, 60))
            t0 = time.perf_counter()
            r = client.completions.create(model="stub", prompt=SNIPPETS[int(rng.integers(len(SNIPPETS)))], max_tokens=n)
            sent.append(Sent(r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason,
                             time.perf_counter() - t0))
        return before, scrape(a.base, {}), sent


def test_token_chunks_of_a_scripted_engine_count_exactly(tokenizer, rng):
    before, after, sent = _scripted_run(tokenizer, ServeMetrics, rng)
    check_requests(before, after, sent)
    assert "mtplx_requests_running" not in {k[0] for k in after}  # a stand-in engine reports no engine state


def test_a_double_counting_exposition_is_caught(tokenizer, rng):
    before, after, sent = _scripted_run(tokenizer, DoubleCounting, rng)
    with pytest.raises(AssertionError):
        check_requests(before, after, sent)
    assert val(after, "mtplx_generation_tokens_total") == 2 * sum(s.completion_tokens for s in sent)


# -- the engine collector over fresh numbers -------------------------------------------------------------------


class _Engine:
    def __init__(self, m: dict):
        self.m = m

    def metrics(self) -> dict:
        return self.m


def test_prefix_keys_map_to_families_with_a_tier_label(rng):
    assert prefix_metric("prefix_hits") == ("mtplx_prefix_cache_hits", "ram", True)
    assert prefix_metric("prefix_disk_bytes") == ("mtplx_prefix_cache_bytes", "disk", False)
    assert prefix_metric("prefix_hits_disk") == ("mtplx_prefix_cache_hits", "disk", True)
    assert prefix_metric("prefix_hit_rate") is None and prefix_metric("kv_bytes") is None
    nums = {k: int(rng.integers(0, 10**9)) for k in ("prefix_lookups", "prefix_hits", "prefix_bytes",
                                                      "prefix_disk_hits", "prefix_disk_bytes", "prefix_disk_writes")}
    per = [int(x) for x in sorted(rng.integers(0, 1000, 3))[::-1]]
    registry = prometheus_client.CollectorRegistry()
    registry.register(EngineCollector(_Engine({**nums, "prefix_hit_rate": 0.5, "drafts_accepted": per,
                                               "depth_per_batch_size": {"1": 3, "8": 1}, "waiting": 2})))
    m = parse(prometheus_client.generate_latest(registry).decode())
    assert val(m, "mtplx_prefix_cache_hits_total", tier="ram") == nums["prefix_hits"]
    assert val(m, "mtplx_prefix_cache_hits_total", tier="disk") == nums["prefix_disk_hits"]
    assert val(m, "mtplx_prefix_cache_bytes", tier="disk") == nums["prefix_disk_bytes"]
    assert val(m, "mtplx_prefix_cache_writes_total", tier="disk") == nums["prefix_disk_writes"]
    assert val(m, "mtplx_prefix_cache_lookups_total", tier="ram") == nums["prefix_lookups"]
    assert not any("rate" in name for name, _ in m)
    assert series(m, "mtplx_spec_decode_accepted_tokens_total", "position") == {
        str(i + 1): v for i, v in enumerate(per)}
    assert series(m, "mtplx_spec_decode_depth", "batch_size") == {"1": 3, "8": 1}
    assert val(m, "mtplx_requests_waiting") == 2
