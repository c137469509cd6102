"""GET /metrics: Prometheus text format, parsed by prometheus_client's own parser."""

from __future__ import annotations

import httpx
import pytest

from proxy.metrics import Histogram, Metrics
from recorder.turn import Turn

parser = pytest.importorskip("prometheus_client.parser")

SYSTEM = "You are a careful coding assistant. Answer briefly. Clock: 10:00."


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in parser.text_string_to_metric_families(r.text)}


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    for s in families[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, sample, labels))


def test_metrics_parse_and_count_turns(engine_server):
    url, _ = engine_server
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a haiku."}]
    first = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    messages = [{"role": "system", "content": SYSTEM.replace("10:00", "10:05")}, messages[1],
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Another one."}]
    second = httpx.post(url + "/v1/chat/completions", timeout=60,
                        json={"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True})
    assert second.status_code == 200
    httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})

    m = scrape(url)
    # prometheus_client strips `_total` from counter family names.
    assert value(m, "prefixtrace_requests", "prefixtrace_requests_total", status="200",
                 endpoint="/v1/chat/completions") == 2
    assert value(m, "prefixtrace_requests", "prefixtrace_requests_total", status="400") == 1
    assert m["prefixtrace_requests"].type == "counter"
    prompt = sum(s.value for s in m["prefixtrace_prompt_tokens"].samples)
    assert prompt >= first["usage"]["prompt_tokens"] > 0
    assert sum(s.value for s in m["prefixtrace_generated_tokens"].samples) > 0
    assert 0 <= value(m, "prefixtrace_cache_hit_ratio") <= 1
    # The system prompt's clock changed: the live analysis names and prices the break.
    assert value(m, "prefixtrace_reprefill_tokens", "prefixtrace_reprefill_tokens_total", cause="system_rewrite") > 0
    assert value(m, "prefixtrace_prefix_breaks", "prefixtrace_prefix_breaks_total", cause="system_rewrite") == 1
    for hist in ("prefixtrace_ttft_seconds", "prefixtrace_request_duration_seconds"):
        assert m[hist].type == "histogram"
        assert value(m, hist, hist + "_count", endpoint="/v1/chat/completions") == 2
        assert value(m, hist, hist + "_bucket", le="+Inf", endpoint="/v1/chat/completions") == 2
    for gauge in ("running", "waiting", "paused", "prefilling"):
        assert m[f"prefixtrace_engine_requests_{gauge}"].type == "gauge"
        assert value(m, f"prefixtrace_engine_requests_{gauge}") == 0
    assert value(m, "prefixtrace_engine_memory_bytes") > 0
    assert value(m, "prefixtrace_engine_memory_ceiling_bytes") > value(m, "prefixtrace_engine_memory_bytes")
    assert value(m, "prefixtrace_engine_prefix_cache_disk_bytes") == 0
    assert value(m, "prefixtrace_engine_requests", "prefixtrace_engine_requests_total") == 2
    assert value(m, "prefixtrace_engine_cached_tokens", "prefixtrace_engine_cached_tokens_total") > 0
    for counter in ("pauses", "resumes", "aborts"):
        assert value(m, f"prefixtrace_engine_{counter}", f"prefixtrace_engine_{counter}_total") == 0


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = list(h.samples("x_seconds", {}))
    assert lines == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1.0"} 3', 'x_seconds_bucket{le="+Inf"} 4',
                     "x_seconds_sum 3.65", "x_seconds_count 4"]


def test_label_values_are_escaped():
    m = Metrics()
    m.observe(Turn("r", 0.0, '/v1/"odd"\npath', "up\\stream", {}, status=200, prompt_tokens=3, cached_tokens=1))
    families = {f.name: f for f in parser.text_string_to_metric_families(m.render())}
    sample = families["prefixtrace_requests"].samples[0]
    assert sample.labels == {"endpoint": '/v1/"odd"\npath', "upstream": "up\\stream", "status": "200"}
    assert families["prefixtrace_cache_hit_ratio"].samples[0].value == pytest.approx(1 / 3, abs=1e-5)
