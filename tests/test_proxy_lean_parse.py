"""Two cuts on the proxy's path to the first byte (issue 17, session 8) that must change nothing:
the request body parsed by one decoder made once (`proxy.request_limits._loads`) exactly as
`json.loads(raw, parse_constant=...)` parses it, and the upstream response's content type, coding
and framing read off its raw head (`UpstreamResponse.head`) exactly as `httpx.Headers` reads them."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.request_limits import _loads, _no_constant
from proxy.upstream_http import UpstreamResponse, _Undecodable


def _reference(raw):
    try:
        return "ok", json.loads(raw, parse_constant=_no_constant)
    except (ValueError, TypeError) as exc:
        return type(exc), None


def _lean(raw):
    try:
        return "ok", _loads(raw)
    except (ValueError, TypeError) as exc:
        return type(exc), None


@pytest.mark.parametrize("raw", [
    b'{"a":1}', b'  {"a": [1, 2.5, "x\\u2028"]}\n', b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": Infinity}',
    b"\xef\xbb\xbf{}", '{"a":1}'.encode("utf-16"), '{"a":1}'.encode("utf-16-le"), '{"a":1}'.encode("utf-32"),
    b'{"a": "\\ud800"}', b"\xff\xfe", b"", b"{", b'{"a":1} x', "\ufeff{}", '{"a": "é"}', b'{"big": 1' + b"0" * 400 + b"}",
])
def test_the_body_parses_as_json_loads_parses_it(raw):
    assert _lean(raw) == _reference(raw)
    if isinstance(raw, bytes) and _reference(raw)[0] == "ok":
        assert repr(_loads(raw)) == repr(json.loads(raw, parse_constant=_no_constant))


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                 max_leaves=8).map(lambda v: json.dumps(v).encode()),
))
def test_any_bytes_parse_or_fail_the_same_way(raw):
    lean, reference = _lean(raw), _reference(raw)
    assert lean[0] == reference[0]
    assert repr(lean[1]) == repr(reference[1])


NAMES = st.sampled_from([b"content-type", b"Content-Type", b"CONTENT-TYPE", b"content-encoding",
                         b"Content-Encoding", b"content-length", b"Content-Length", b"transfer-encoding",
                         b"Transfer-Encoding", b"date", b"server", b"x-other"])
VALUES = st.sampled_from([b"text/event-stream; charset=utf-8", b"application/json", b"gzip", b" GZip ",
                          b"deflate", b"identity", b"br", b"chunked", b"12", b"", b"caf\xc3\xa9", b"\xe9t\xe9"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(NAMES, VALUES), max_size=6), st.booleans())
def test_the_head_reads_what_httpx_headers_read(raw_headers, keep_alive):
    response = UpstreamResponse(None, None, None)
    response.raw_headers = list(raw_headers)
    response.head(200, keep_alive)
    reference = httpx.Headers(raw_headers)
    assert response.framed_by_close == ("content-length" not in reference and "transfer-encoding" not in reference)
    content_type = response.content_type_header
    assert (content_type if content_type is not None else "application/json") == \
        reference.get("content-type", "application/json")
    coding = reference.get("content-encoding", "identity").strip().lower()
    if coding in ("gzip", "x-gzip", "deflate"):
        assert response._decoder is not None and not isinstance(response._decoder, _Undecodable)
    elif coding in ("identity", ""):
        assert response._decoder is None
    else:
        assert isinstance(response._decoder, _Undecodable) and response._decoder.coding == coding
    assert list(response.headers.raw) == list(reference.raw)  # the whole set, when asked for
