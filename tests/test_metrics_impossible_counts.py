"""/metrics with an upstream that reports impossible counts: more cached tokens than prompt tokens.

A real upstream on loopback answers with usage `prompt_tokens: 1, cached_tokens: 200000` (it once
made the hit ratio 200000); the ratio stays within 0..1 and the turn is counted as flagged.
"""

from __future__ import annotations

import httpx

import tests.test_nonfinite_usage as usage
from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder import Recorder
from tests.conftest import running_server


def _value(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_more_cached_than_prompt_tokens_is_clamped_and_flagged(tmp_path, monkeypatch):
    monkeypatch.setitem(usage.USAGES, "impossible", b'{"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,'
                                                    b' "prompt_tokens_details": {"cached_tokens": 200000}}')
    with running_server(usage.usage_upstream) as up, Recorder(tmp_path / "t.db") as rec, \
            running_server(create_app(UpstreamBackend(up), rec)) as url:
        for name in ("impossible", "fine"):
            body = {"model": "m", "messages": [{"role": "user", "content": name}]}
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(url + "/metrics", timeout=30).text
    ratio = _value(text, "prefixtrace_cache_hit_ratio")
    assert 0 <= ratio <= 1, text
    assert ratio == round((1 + 3) / (1 + 7), 6)  # the impossible turn counted as wholly cached, the other as sent
    assert _value(text, "prefixtrace_usage_impossible_total") == 1
