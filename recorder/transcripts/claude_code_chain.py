"""Lines Claude Code sends that the `parentUuid` chain back from a call does not pass through:
what its own loader puts back (seen on the wire, fixtures/transcripts/claude/real/). Pure functions
over a chain of lines (oldest first) and a lookup, so the whole-file and the streamed reader share them.

- Parallel tool calls: a reply is written one content block a line, and each call's result line has
  that call's own line as its parent: 2.0.x writes the results after the reply's last line, so the
  chain back from the next call passes only the last result; 2.1.x writes each result as its call
  runs, between the reply's lines, so the chain passes the reply in pieces. Sent as one reply, then
  its results in the order of its calls.
- A compact boundary's `compactMetadata.preservedSegment`: the messages the compaction kept (from
  `headUuid` to `tailUuid`, on the old chain) are sent after its `anchorUuid` (the summary).
- A file Claude Code attached (an `attachment` line of type `file`, as it re-attaches the files it
  read after a compaction) is sent as a `system` message saying the Read tool was called, after the
  user message its run of user lines makes.
"""

from __future__ import annotations

import json
from collections.abc import Callable


def result_ids(line: dict) -> list[str]:
    """The tool calls a user line answers (its `tool_result` blocks' ids)."""
    content = (line.get("message") or {}).get("content")
    if not isinstance(content, list):
        return []
    return [b.get("tool_use_id") for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def _calls(group: list[dict]) -> list[str]:
    out = []
    for line in group:
        content = (line.get("message") or {}).get("content")
        if line.get("type") == "assistant" and isinstance(content, list):
            out += [b.get("id") for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
    return out


def with_parallel_results(chain: list[dict], reply_id: Callable[[dict], str],
                          results_of: Callable[[str], list[dict]]) -> list[dict]:
    """`chain` with each reply's lines together, then the results of its calls in the order of its
    calls. `results_of(uuid)` gives the tool-result lines whose parent is that line."""
    out: list[dict] = []
    i = 0
    while i < len(chain):
        if chain[i].get("type") != "assistant":
            out.append(chain[i])
            i += 1
            continue
        rid, group, found = reply_id(chain[i]), [], {}
        while i < len(chain):
            line = chain[i]
            if line.get("type") == "assistant" and reply_id(line) == rid:
                group.append(line)
            elif line.get("type") == "user" and result_ids(line) and set(result_ids(line)) <= set(_calls(group)):
                found[line.get("uuid")] = line  # a result written between the reply's lines (2.1.x)
            else:
                break
            i += 1
        calls = _calls(group)
        if len(calls) > 1:  # results parented to their own call's line (2.0.x): off the chain
            for g in group:
                found.update({o.get("uuid"): o for o in results_of(g.get("uuid"))
                              if set(result_ids(o)) <= set(calls)})
        order = {c: n for n, c in enumerate(calls)}
        out.extend(group)
        out.extend(sorted(found.values(), key=lambda o: min(order.get(r, len(order)) for r in result_ids(o))))
    return out


def with_preserved_segment(chain: list[dict], line_of: Callable[[str], dict | None]) -> list[dict]:
    """`chain` (from a compact boundary) with the boundary's preserved messages after its anchor."""
    if not chain or chain[0].get("subtype") != "compact_boundary":
        return chain
    segment = (chain[0].get("compactMetadata") or {}).get("preservedSegment")
    if not isinstance(segment, dict):
        return chain
    anchor = next((n for n, line in enumerate(chain) if line.get("uuid") == segment.get("anchorUuid")), None)
    kept: list[dict] = []
    uuid = segment.get("tailUuid")
    while isinstance(uuid, str) and len(kept) < 10_000:  # tail back to head along the old chain
        line = line_of(uuid)
        if line is None:
            return chain  # the segment is not all in the file: the chain as it is
        kept.append(line)
        if uuid == segment.get("headUuid"):
            break
        uuid = line.get("parentUuid")
    else:
        return chain
    if anchor is None:
        return chain
    return chain[: anchor + 1] + kept[::-1] + chain[anchor + 1 :]


def attachment_message(line: dict) -> dict | None:
    """The message Claude Code 2.1 sends for an `attachment` line of a file it read (seen on the wire:
    the Read tool's call and its numbered lines, as a `system` message); None for any other line."""
    attachment = line.get("attachment") if line.get("type") == "attachment" else None
    content = attachment.get("content") if isinstance(attachment, dict) and attachment.get("type") == "file" else None
    file = content.get("file") if isinstance(content, dict) and content.get("type") == "text" else None
    if not isinstance(file, dict) or not isinstance(file.get("content"), str):
        return None
    start = file.get("startLine") if isinstance(file.get("startLine"), int) else 1
    numbered = "\n".join(f"{start + n}\t{text}" for n, text in enumerate(file["content"].split("\n")))
    call = json.dumps({"file_path": attachment.get("filename")}, separators=(",", ":"), ensure_ascii=False)
    return {"role": "system", "content": f"Called the Read tool with the following input: {call}\n"
                                         f"Result of calling the Read tool:\n{numbered}"}

