"""The hang-up watch (proxy/disconnect.py) on its own, over a real asyncio loop and an ASGI channel
fed by hand: it cancels the watched task on a disconnect until the last byte is out, takes back only
its own cancel (a server's shutdown still propagates), and is the channel's one reader."""

from __future__ import annotations

import asyncio

import pytest

from proxy.disconnect import CancelOnDisconnect, HangUpWatch

BODY = {"type": "http.request", "body": b"{}", "more_body": False}
DISCONNECT = {"type": "http.disconnect"}


def channel():
    """An ASGI receive fed from a queue, and a send that keeps what it is given."""
    incoming: asyncio.Queue = asyncio.Queue()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    return incoming, incoming.get, send, sent


def serve(app):
    """`app(scope, receive, send)` under the middleware, in a task of its own (as uvicorn runs it)."""
    scope = {"type": "http", "method": "POST", "path": "/"}

    async def run(receive, send):
        return await CancelOnDisconnect(app)(scope, receive, send)

    return run


async def _until_cancelled(steps: list[str], receive, send, *, start: bool = False):
    await receive()  # the body
    if start:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        steps.append("cancelled")
        raise


@pytest.mark.parametrize("started", [False, True])
def test_a_hang_up_before_the_last_byte_cancels_the_request_and_ends_it_quietly(started):
    async def main():
        steps: list[str] = []
        incoming, receive, send, sent = channel()

        async def app(scope, receive, send):
            await _until_cancelled(steps, receive, send, start=started)

        task = asyncio.ensure_future(serve(app)(receive, send))
        incoming.put_nowait(BODY)
        await asyncio.sleep(0.01)
        incoming.put_nowait(DISCONNECT)
        await asyncio.wait_for(task, 5)  # ends without raising: the cancel was the watch's own
        assert steps == ["cancelled"] and not task.cancelled() and task.cancelling() == 0

    asyncio.run(main())


def test_a_server_cancel_is_not_taken_for_a_hang_up():
    async def main():
        steps: list[str] = []
        incoming, receive, send, _ = channel()

        async def app(scope, receive, send):
            await _until_cancelled(steps, receive, send)

        task = asyncio.ensure_future(serve(app)(receive, send))
        incoming.put_nowait(BODY)
        await asyncio.sleep(0.01)
        task.cancel()  # the server stopping
        with pytest.raises(asyncio.CancelledError):
            await task
        assert steps == ["cancelled"]

    asyncio.run(main())


def test_a_hang_up_and_a_server_cancel_together_still_propagate():
    async def main():
        incoming, receive, send, _ = channel()

        async def app(scope, receive, send):
            await receive()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(serve(app)(receive, send))
        incoming.put_nowait(BODY)
        await asyncio.sleep(0.01)
        incoming.put_nowait(DISCONNECT)
        await asyncio.sleep(0)  # the watch reads the disconnect and cancels the task...
        task.cancel()  # ...and the server cancels it too, before it runs again
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_disconnect_after_the_last_byte_cancels_nothing_and_the_reader_is_the_only_one():
    async def main():
        incoming, receive, send, sent = channel()
        seen: list[dict] = []

        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done", "more_body": False})
            seen.append(await receive())  # the app asks again: it gets the watch's answer
            await asyncio.sleep(0.05)  # still running after the disconnect: not cancelled

        task = asyncio.ensure_future(serve(app)(receive, send))
        incoming.put_nowait(BODY)
        await asyncio.sleep(0.01)
        incoming.put_nowait(DISCONNECT)
        await asyncio.wait_for(task, 5)
        assert seen == [DISCONNECT] and sent[-1]["body"] == b"done" and incoming.empty()

    asyncio.run(main())


def test_the_watch_adds_to_the_head_it_sends_and_stops_reading_when_closed():
    async def main():
        incoming, receive, send, sent = channel()
        watch = HangUpWatch(receive, send, on_start=lambda m: m["headers"].append((b"x-a", b"1")))
        incoming.put_nowait(BODY)
        assert await asyncio.wait_for(watch.receive(), 5) == BODY
        await watch.send({"type": "http.response.start", "status": 200, "headers": []})
        watch.close()
        await asyncio.sleep(0)
        incoming.put_nowait(DISCONNECT)
        await asyncio.sleep(0.01)
        assert sent[0]["headers"] == [(b"x-a", b"1")] and incoming.qsize() == 1  # nobody read it

    asyncio.run(main())
