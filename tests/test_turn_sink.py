"""The recorder is one declared protocol (recorder/sink.py `TurnSink`): the real Recorder and every
sink wrapper implement each member themselves, no class forwards to a sink through `__getattr__`,
and no caller probes a recorder with getattr/hasattr."""
import ast
import asyncio
import inspect
from pathlib import Path

import pytest

from recorder.sink import SINK_MEMBERS, TappedSink, TurnSink
from recorder.sources import load_turns
from recorder.store import Recorder
from recorder.turn import Turn

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("proxy", "prefixtrace", "recorder", "analyzer", "engine")
SINK_NAMES = {"recorder", "sink", "rec"}  # what a recorder is called where it is passed around


def _sources():
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def _names_a_sink(node: ast.expr) -> bool:
    """`recorder`, `self.sink`, `app.state.recorder`, ...: an expression whose last name is a sink's."""
    if isinstance(node, ast.Name):
        return node.id in SINK_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in SINK_NAMES
    return False


def test_no_class_forwards_to_a_sink_through_getattr():
    found = []
    for path, tree in _sources():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
                    if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
                           and n.args and _names_a_sink(n.args[0]) for n in ast.walk(fn)):
                        found.append(f"{path.relative_to(ROOT)}: {cls.name}.__getattr__")
    assert found == []


def test_no_caller_probes_a_recorder_with_getattr_or_hasattr():
    found = []
    for path, tree in _sources():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                    and n.args and _names_a_sink(n.args[0])):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert found == []


def _declared(cls) -> set[str]:
    """Members a class declares itself or inherits from a real base (not from the Protocol)."""
    names = set()
    for base in cls.__mro__:
        if base is object or getattr(base, "_is_protocol", False):
            continue
        names |= set(vars(base))
        names |= set(getattr(base, "__annotations__", {}))
    return names


@pytest.mark.parametrize("cls", [Recorder, TappedSink])
def test_each_sink_declares_every_member_of_the_protocol(cls):
    members = {n for n in vars(TurnSink) if not n.startswith("_")} | set(TurnSink.__annotations__)
    assert members == set(SINK_MEMBERS)
    missing = [m for m in SINK_MEMBERS if m not in _declared(cls)]
    if cls is Recorder:  # an attribute set in __init__, not at class level
        missing = [m for m in missing if f"self.{m} =" not in inspect.getsource(cls.__init__)]
    assert missing == []
    for name in ("record_async", "enqueue"):
        assert inspect.iscoroutinefunction(getattr(cls, name))


def test_the_recorder_and_the_app_sink_satisfy_the_protocol(tmp_path):
    from proxy.app import create_app
    from proxy.upstream_backend import UpstreamBackend

    with Recorder(tmp_path / "r.db") as rec:
        assert isinstance(rec, TurnSink)
        app = create_app(UpstreamBackend("http://127.0.0.1:9"), rec)
        assert app.state.recorder is rec
        tapped = TappedSink(rec, [])
        assert isinstance(tapped, TurnSink)
        assert tapped.redactor is rec.redactor and tapped.pending == rec.pending == 0
        assert tapped.health() == rec.health() and tapped.spool_state() == rec.spool_state()


def test_taps_run_in_order_once_the_turn_is_recorded_and_a_failing_tap_costs_no_turn(tmp_path):
    seen = []

    def committed(request_id: str) -> bool:
        return request_id in {t.request_id for t in load_turns(tmp_path / "r.db")}

    def first(turn):
        seen.append(("first", turn.request_id))

    def broken(turn):
        raise RuntimeError("tap bug")

    def last(turn):
        seen.append(("last", turn.request_id, committed(turn.request_id)))

    async def record_then_respond(sink, turn):
        await sink.record_async(turn)
        seen.append(("response", turn.request_id))  # what waited for the commit goes first, then the taps
        await asyncio.sleep(0)

    with Recorder(tmp_path / "r.db") as rec:
        sink = TappedSink(rec, [first, broken, last])
        asyncio.run(record_then_respond(sink, _turn("a")))
        sink.record(_turn("b")).result(10)  # no loop runs here: the taps run at once, after the hand-over
        asyncio.run(_enqueue_and_wait(sink, _turn("c")))
        assert rec.flush(10)
    assert seen[:3] == [("response", "a"), ("first", "a"), ("last", "a", True)]
    assert [s[:2] for s in seen[3:]] == [("first", "b"), ("last", "b"), ("first", "c"), ("last", "c")]
    assert sorted(t.request_id for t in load_turns(tmp_path / "r.db")) == ["a", "b", "c"]


def _turn(request_id: str) -> Turn:
    return Turn(request_id=request_id, started_at=0.0, endpoint="/v1/chat/completions", upstream="test",
                request_body={"messages": [{"role": "user", "content": "hi"}]}, status=200)


async def _enqueue_and_wait(sink, turn):
    done = await sink.enqueue(turn)
    await asyncio.wrap_future(done)


class _BrokenFeed:
    """An OTLP feed (the third dashboard observer) whose wake raises on every turn."""

    def attach(self, live) -> None:
        pass

    def wake(self, turn) -> None:
        raise RuntimeError("feed bug")


def test_a_failing_observer_costs_no_response_and_no_turn_through_the_app(tmp_path):
    import httpx

    from proxy.app import create_app
    from tests.conftest import rows, running_server
    from tests.test_proxy_fast_path import scripted_stream

    chunks = [{"id": "x", "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": "stop"}]}]
    with Recorder(tmp_path / "a.db") as rec:
        with running_server(create_app(scripted_stream(chunks), rec, turn_feed=_BrokenFeed())) as url:
            r = httpx.post(url + "/s/run-1/v1/chat/completions", timeout=10,
                           json={"stream": True, "messages": [{"role": "user", "content": "hi"}]})
            metrics = httpx.get(url + "/metrics", timeout=10).text
        assert r.status_code == 200 and "hello" in r.text
        recorded = rows(rec)
    assert [(t["status"], t["session_id"]) for t in recorded] == [(200, "run-1")]
    # the observers before the broken one still saw the turn
    assert any(line.startswith("prefixtrace_requests_total{") and 'status="200"' in line and line.endswith(" 1")
               for line in metrics.splitlines())
