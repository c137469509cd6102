"""A Claude Code call's history: the messages on the chain of `parentUuid` links from its reply back to
the root (or a compact boundary), as Claude Code sends them (seen on the wire).

The file's lines are not held: the reader keeps where each line lies and its parent (`Line`), and
the lines a call's history needs are read back from the file (recorder/transcripts/lines.py
`LinesAt`). A call's history usually extends the previous call's, so the walk stops at the first
line whose history is already known (a few recent ones are kept) and only the lines after it are
read and converted: linear in the file, and every call's list shares the message objects.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from recorder.transcripts.claude_code_chain import attachment_message, with_parallel_results, with_preserved_segment
from recorder.transcripts.common import Transcript
from recorder.transcripts.lines import LinesAt

MESSAGE_TYPES = ("user", "assistant")
KNOWN_HISTORIES = 64  # histories kept by their last line: the recent calls' (a rewind further back reads again)
RECENT_LINES = 16  # lines kept as read back: the next call's history usually starts with the last reply's
MAX_TOKENS_NOTE = ("the user message Claude Code sends after a reply cut by max_tokens is not in the transcript: "
                   "the request after it ends with that reply")
CONCURRENT_NOTE = ("replies to concurrent requests are interleaved in the file (one reply's parent is another "
                   "reply): each request rebuilt without the replies that came back while it was in flight")


class Line(NamedTuple):
    """Where a line with a `uuid` lies and its parent: all the reader holds of it (a few dozen bytes
    a line: the index of a 500 MB file is tens of MB)."""

    start: int  # byte offset in the file
    parent: str | None


def is_message(obj: dict) -> bool:
    return obj.get("type") in MESSAGE_TYPES and isinstance(obj.get("message"), dict)


def reply_id(obj: dict) -> str:
    msg = obj["message"]
    return str(msg.get("id") or obj.get("requestId") or obj.get("uuid"))


def synthetic(obj: dict) -> bool:
    """A reply Claude Code wrote itself (an API error shown as a message, or the "No response
    requested." it puts after a local command on resuming): no model call."""
    return obj.get("type") == "assistant" and (obj["message"].get("model") == "<synthetic>"
                                               or bool(obj.get("isApiErrorMessage")))


def sent_synthetic(obj: dict) -> bool:
    """A synthetic reply Claude Code sends back in later requests (seen on the wire): every one but
    an API error, which it leaves out."""
    return synthetic(obj) and not obj.get("isApiErrorMessage")


def local_command_output(obj: dict) -> bool:
    """A local command's stdout (`/compact`, `/cost`, …): written as a `system` line, sent as a user
    message (seen on the wire)."""
    return obj.get("type") == "system" and obj.get("subtype") == "local_command" and isinstance(obj.get("content"), str)


def merged(lines: list[dict]) -> dict:
    """One reply from its lines (Claude Code writes a streamed reply one content block a line)."""
    msg = dict(lines[0]["message"])
    msg["content"] = [b for line in lines for b in blocks(line["message"].get("content"))]
    for line in lines:
        if isinstance(line["message"].get("usage"), dict):
            msg["usage"] = line["message"]["usage"]
        if line["message"].get("stop_reason"):
            msg["stop_reason"] = line["message"]["stop_reason"]
    return msg


def blocks(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


class Histories:
    """Each call's history. `lines` maps a line's uuid to where it lies; `local_outputs` a parent's
    uuid to the local command outputs written as its children, `results` to the tool-result lines
    written as its children (byte offsets, in file order)."""

    def __init__(self, lines: dict[str, Line], local_outputs: dict[str, list[int]], results: dict[str, list[int]],
                 at: LinesAt):
        self.lines = lines
        self.local_outputs = local_outputs
        self.results = results
        self.at = at
        self.known: OrderedDict[str, tuple[list[dict], str | None]] = OrderedDict()  # uuid -> (messages, stop)
        self.recent: OrderedDict[int, dict] = OrderedDict()  # byte offset -> the line read there

    def read_at(self, start: int) -> dict:
        """The line at `start`, read back (or kept from a moment ago)."""
        if start in self.recent:
            return self.recent[start]
        obj = self.recent[start] = self.at.get(start)
        if len(self.recent) > RECENT_LINES:
            self.recent.popitem(last=False)
        return obj

    def read(self, uuid: str) -> dict:
        """The line read back, its parent as the reader linked it (a file without links is linked in order)."""
        line = self.lines[uuid]
        obj = self.read_at(line.start)
        obj["parentUuid"] = line.parent
        return obj

    def line_of(self, uuid: str) -> dict | None:
        return self.read(uuid) if uuid in self.lines else None

    def results_of(self, uuid: str) -> list[dict]:
        """The tool-result lines whose parent is the line `uuid`."""
        return [self.read_at(start) for start in self.results.get(uuid, [])]

    def before(self, t: Transcript, parent: str | None, own: str | None) -> tuple[list[dict], bool]:
        """The messages sent with the call whose first reply line (uuid `own`) has `parent`, and whether
        the chain starts at a compact boundary (the call is the first after a compaction)."""
        key = parent
        chain: list[str] = []
        base: tuple[list[dict], str | None] = ([], None)
        seen = {own}
        while isinstance(parent, str):
            if parent in self.known:
                self.known.move_to_end(parent)
                base = self.known[parent]
                break
            if parent not in self.lines or parent in seen:
                t.note("the history before a message is missing from the file (its parent is not there)")
                break
            seen.add(parent)
            chain.append(parent)
            parent = self.lines[parent].parent
        lines = with_parallel_results(with_preserved_segment([self.read(uuid) for uuid in reversed(chain)],
                                                             self.line_of), reply_id, self.results_of)
        compacted = bool(lines) and parent is None and lines[0].get("type") == "system" \
            and lines[0].get("subtype") == "compact_boundary"
        if compacted:
            t.note("compacted: the history before the compact boundary was replaced by its summary, as sent")
        messages, stop = self._convert(t, lines, list(base[0]), base[1])
        if isinstance(key, str):
            self.known[key] = (messages, stop)
            if len(self.known) > KNOWN_HISTORIES:
                self.known.popitem(last=False)
        return _without_concurrent(t, messages, stop), compacted

    def _convert(self, t: Transcript, lines: list[dict], messages: list[dict], stop: str | None):
        """`lines` (a chain, in order) appended to `messages` as Claude Code sends them: a reply that
        was all empty text is not sent back, user lines that follow one another travel as one message."""
        attachments: list[dict] = []
        i = 0
        while i < len(lines):
            obj = lines[i]
            i += 1
            if (attached := attachment_message(obj)) is not None:
                attachments.append(attached)  # sent after the user message its run of user lines makes
                continue
            if local_command_output(obj):
                _add_user(messages, obj["content"])
                stop = None
                continue
            if not is_message(obj) or obj.get("isSidechain"):
                continue
            if synthetic(obj):
                if sent_synthetic(obj):
                    messages.extend(attachments)
                    attachments.clear()
                    messages.append({"role": "assistant", "content": blocks(obj["message"].get("content"))})
                    for start in self.local_outputs.get(obj.get("parentUuid") or "", []):
                        _add_user(messages, self.read_at(start)["content"])
                continue
            if obj["type"] == "user":
                _add_user(messages, obj["message"].get("content"))
                stop = None
                continue
            messages.extend(attachments)
            attachments.clear()
            group = [obj]
            while i < len(lines) and is_message(lines[i]) and lines[i]["type"] == "assistant" \
                    and reply_id(lines[i]) == reply_id(obj):
                group.append(lines[i])
                i += 1
            reply = merged(group)
            if all(b.get("type") == "text" and not b.get("text") for b in reply["content"]):
                continue
            if stop == "max_tokens":
                t.note(MAX_TOKENS_NOTE)
            messages.append({"role": "assistant", "content": reply["content"]})
            stop = reply.get("stop_reason")
        messages.extend(attachments)
        if stop == "max_tokens":
            t.note(MAX_TOKENS_NOTE)
        return messages, stop


def _add_user(messages: list[dict], content) -> None:
    """A user line's content as Claude Code sends it: user lines that follow one another are one
    message (the Messages API alternates roles), and where a text block meets a text block, the first
    gets a "\\n" (seen on the wire: the local-command caveat before the command, its stdout before the
    next prompt)."""
    if not messages or messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": content})
        return
    before, after = blocks(messages[-1]["content"]), blocks(content)
    if before and after and before[-1].get("type") == "text" and after[0].get("type") == "text":
        before[-1] = {**before[-1], "text": before[-1].get("text", "") + "\n"}
    messages[-1] = {"role": "user", "content": before + after}


def _without_concurrent(t: Transcript, messages: list[dict], stop: str | None) -> list[dict]:
    """Claude Code never sends a request ending with an assistant message (but after a reply cut by
    max_tokens, whose follow-up is not in the file). A chain ending with one is a reply to a request
    sent at the same time, written before this one's: it was not part of this request."""
    end = len(messages)
    if stop == "max_tokens":
        return list(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end < len(messages):
        t.note(CONCURRENT_NOTE)
    return messages[:end]
