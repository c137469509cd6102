"""An OTLP/HTTP trace receiver on 127.0.0.1 for tests/test_otel.py and bench/bench_proxy_overhead.py --otlp.

It decodes what the exporter really sends (protobuf `ExportTraceServiceRequest`, gzip or not) with the
official `opentelemetry-proto` messages, the same definitions any collector reads, and answers as a
collector does (`ExportTraceServiceResponse`). Arize Phoenix is the real collector this was checked
against (tests/test_otel.py::test_phoenix_receives_the_spans, where it is installed); it is not in the
test extra because it is 0.85 GB of packages and starts in 45-90 s (docs/OBSERVABILITY.md "Testing").
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """`with OtlpReceiver() as r:` listens on `r.url`; `r.spans` are dicts: name, kind, start_ns,
    end_ns, status, attributes, resource, scope, trace_id, span_id."""

    def __init__(self, path: str = "/v1/traces"):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                               ExportTraceServiceResponse)

        self.spans: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != path or "protobuf" not in (self.headers.get("content-type") or ""):
                    self.send_error(404 if self.path != path else 415)
                    return
                if (self.headers.get("content-encoding") or "") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                found = []
                for rs in request.resource_spans:
                    resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            found.append({"name": sp.name, "kind": sp.kind, "start_ns": sp.start_time_unix_nano,
                                          "end_ns": sp.end_time_unix_nano, "status": sp.status.code,
                                          "status_message": sp.status.message,
                                          "attributes": {a.key: _value(a.value) for a in sp.attributes},
                                          "resource": resource, "scope": ss.scope.name,
                                          "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex()})
                with receiver._lock:
                    receiver.spans.extend(found)
                    receiver.requests += 1
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def by_request_id(self) -> dict[str, dict]:
        with self._lock:
            return {s["attributes"].get("prefixtrace.request_id"): s for s in self.spans}
