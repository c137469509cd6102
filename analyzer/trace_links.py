"""Which earlier request each exported request waits for, and how long (the parent/wait links of
`export --format mooncake|agentic-mooncake`, docs/FORMATS.md "Block-hash traces").

A request's parent is the request whose output it continues: the previous request of its session
(`sequence`), or, for a side request's first request (title generation, summaries, sub-agents: the
analysis' forks), the newest request of its main chain sent before it (`spawn`). Its wait is the time
between the parent's end and its own start (the harness's think and tool time), as Dynamo's replay
reads it: trigger `completion`, `delay_ms` after the parent finished. A request sent before its parent
finished (a parallel tool loop, a sub-agent started mid-stream) or one whose parent's end was not
recorded (transcripts keep no durations) waits on the parent's dispatch instead: trigger `dispatch`,
`delay_ms` after the parent was sent. These are Dynamo's rules when it lowers Weka/AgentX traces into
its agentic Mooncake graph (ai-dynamo/dynamo lib/data-gen, `AgenticDependency`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    parent: str  # the parent's request id
    relation: str  # "sequence" (the previous request of the session) or "spawn" (a side request's origin)
    trigger: str  # "completion": wait counts from the parent's end; "dispatch": from its start
    delay_ms: float

    def to_dict(self) -> dict:
        return {"request_id": self.parent, "trigger": self.trigger, "delay_ms": self.delay_ms,
                "relation": self.relation}


def _link(row: dict, parent: dict, relation: str) -> Link:
    end = parent["end"]
    if end is not None and row["ts"] >= end:
        return Link(parent["id"], relation, "completion", round((row["ts"] - end) * 1000, 3))
    return Link(parent["id"], relation, "dispatch", round(max(0.0, row["ts"] - parent["ts"]) * 1000, 3))


def links(rows: list[dict]) -> dict[str, Link]:
    """Request id -> its link, for `block_traces.turns` rows in time order; roots have none."""
    out: dict[str, Link] = {}
    latest: dict[str, dict] = {}  # session -> its newest row so far
    for row in rows:
        previous = latest.get(row["session"])
        if previous is not None:
            out[row["id"]] = _link(row, previous, "sequence")
        elif row["parent_session"] is not None and row["parent_session"] in latest:
            out[row["id"]] = _link(row, latest[row["parent_session"]], "spawn")
        latest[row["session"]] = row
    return out
