"""`tool-order` (cause: tools_change of subtype reorder / serialization of tools): the tool definitions go
upstream in the order and spelling the session first sent them.

The session's first request sets the order and each definition's exact spelling (key order). A later
request whose tools are the same definitions (equal as JSON values) in another order or another key
order is sent in the first order and spelling; a definition whose content changed goes as the client
sent it, and a new tool goes after the known ones, so nothing the model reads is lost. A request whose
tools already match is left alone: the fix rewrites no byte it need not. Anthropic `cache_control`
marks stay at the positions the client put them.
"""

from __future__ import annotations

import copy
import json

from analyzer.fixes import shape
from analyzer.fixes.base import Outcome, SessionRecord, stands_aside

NAME = "tool-order"


def _bare(tool: dict) -> dict:
    return {k: v for k, v in tool.items() if k != "cache_control"}


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    tools = shape.tools_of(body)
    if not tools:
        return stands_aside("the request has no tools")
    names = [shape.tool_name(t) for t in tools]
    if None in names:
        return stands_aside("a tool definition without a name")
    if len(set(names)) != len(names):
        return stands_aside("two tools share a name; reordering could make an invalid request")
    memo = record.memos.get(NAME)
    if memo is None:
        return Outcome(None, "the session's first tools: their order is the one kept", {"order": names,
                                                                                        "tools": {n: _bare(t) for n, t in zip(names, tools)}})
    known: dict[str, dict] = memo["tools"]
    order = [n for n in memo["order"] if n in names] + sorted(n for n in names if n not in memo["order"])
    by_name = dict(zip(names, tools))
    fixed = []
    for n in order:
        sent = _bare(by_name[n])
        fixed.append(known[n] if n in known and known[n] == sent else sent)
    marks = [t.get("cache_control") for t in tools]
    for i, mark in enumerate(marks):  # the client's breakpoints stay where it put them
        if mark is not None:
            fixed[i] = {**fixed[i], "cache_control": mark}
    new_memo = {"order": memo["order"] + [n for n in order if n not in memo["order"]],
                "tools": {**known, **{n: _bare(by_name[n]) for n in names if n not in known or known[n] != _bare(by_name[n])}}}
    if json.dumps(fixed, ensure_ascii=False) == json.dumps(tools, ensure_ascii=False):
        return Outcome(None, "the tools are already in the session's order and spelling", new_memo)
    moved = sum(a != b for a, b in zip(order, names))
    respelled = sum(1 for n in names if n in known and known[n] == _bare(by_name[n])
                    and json.dumps(known[n]) != json.dumps(_bare(by_name[n])))
    new = copy.copy(body)
    new["tools"] = fixed
    return Outcome(new, f"tool order kept ({moved} moved, {respelled} re-spelled)", new_memo)
