"""A synthetic recording shaped like the field report (seeds/001): agent
sessions whose prompts grow by tool calls and file reads, interleaved in time.

Shared by the analyzer speed benchmark, the recorder's storage-size benchmark,
the redaction benchmark's ordinary body and tests/test_analyzer.py, so its shape
is a contract:

    generate_records(n_requests=1260, n_sessions=8, seed=0, ...) -> Iterator[dict]
    write_jsonl(path, **kwargs) -> Path

Each record is a wrapped JSONL turn, `{"id", "session", "ts", "request",
"response", "usage"}` (docs/FORMATS.md). Defaults give ~1,260 requests with a
median prompt near 107k tokens and a p90 near 168k (o200k_base), one
orchestrator and seven subagents, and about a dozen prefix breaks of mixed
causes placed at fixed points, so the analyzer has something to find:
volatile todo counters and a directive in the system prompt, a folded
mid-conversation system message, user-role notices (thinking strip under a
Qwen-style template), tool reorders/additions, an old tool output truncated,
compactions, a dropped empty assistant turn, a request-local reminder, a
chat_template_kwargs change (preserve_thinking) and a re-serialised
tool call.

Requests of one session share their message dicts, so generating is cheap in
memory; only serialisation materialises the ~0.5 GB of JSON.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# One o200k token is about this many chars of the text generated below
# (common short words separated by spaces, code-ish lines): measured once,
# only used to size messages and to fake the server's usage numbers.
CHARS_PER_TOKEN = 4.6

_WORDS = (
    "the of and to in is for on with that by this be are from or as at it an was not data file "
    "value return self def class import if else elif while for in range len list dict str int none "
    "true false error config model cache prefix token request session server client agent tool call "
    "result output input message system user assistant render template block hash index offset "
    "length buffer queue thread lock event state update check test assert build install verify "
    "loading page wiki capture screenshot browser window document section table row column field "
    "window process record export import report analyze summary note todo list pending done step"
).split()

TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool. " + desc,
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                     "arg": {"type": "string"}}, "required": ["path"]}}}
    for name, desc in [
        ("read", "Read a file from the workspace."), ("write", "Write a file."), ("edit", "Edit a file in place."),
        ("bash", "Run a shell command."), ("grep", "Search files."), ("ls", "List a directory."),
        ("todo", "Update the todo list."), ("agent_browser", "Drive the browser."),
        ("screenshot", "Take a screenshot."), ("subagent", "Start a subagent."),
    ]
]


def _text(rng: random.Random, n_tokens: int, code: bool = False) -> str:
    n_words = max(1, int(n_tokens * CHARS_PER_TOKEN / 6.0))
    words = rng.choices(_WORDS, k=n_words)
    if not code:
        return " ".join(words)
    lines = [" ".join(words[i : i + 10]) for i in range(0, len(words), 10)]
    return "\n".join(f"{i + 1:5d}\t{line}" for i, line in enumerate(lines))


class _Session:
    """One agent conversation; `step()` returns the next request body."""

    def __init__(self, rng: random.Random, sid: str, n_requests: int, parent: bool, start_tokens: int,
                 cap_tokens: int):
        self.rng, self.sid, self.parent = rng, sid, parent
        self.n = n_requests
        self.i = 0
        self.base_system = _text(rng, start_tokens - 2000)
        self.todo_stale: int | None = None
        self.directive = ""
        self.system = {"role": "system", "content": self._system_text()}
        self.tools = list(TOOLS) if parent else [t for t in TOOLS if t["function"]["name"] != "subagent"]
        self.messages: list[dict] = [self.system, {"role": "user", "content": f"Task for {sid}: " + _text(rng, 300)}]
        self.tokens = start_tokens + 300
        self.start_tokens, self.cap = start_tokens, cap_tokens
        # Mean growth per request so that one cycle start->cap spans the session.
        self.mean_growth = (cap_tokens - start_tokens) / max(1, n_requests)
        self.params: dict[str, Any] = {"reasoning_effort": "medium"}
        self.tail: dict | None = None  # a request-local message, sent once

    def _system_text(self) -> str:
        parts = [self.base_system]
        if self.todo_stale is not None:
            stale = f" (stale: {self.todo_stale} turns without an update — bring the list up to date now)"
            parts.append(f"## Todo list\n- pending: install dependencies and verify loading.{stale}")
        if self.directive:
            parts.append(self.directive)
        parts.append("## Environment\n" + "cwd: /work/wiki")
        return "\n\n".join(parts)

    def _rewrite_system(self) -> None:
        self.system = {"role": "system", "content": self._system_text()}
        self.messages = [self.system, *self.messages[1:]]

    def _turn(self) -> None:
        """Appends one assistant tool call with reasoning and its tool result."""
        rng = self.rng
        call_id = f"call_{self.sid}_{self.i}"
        args = json.dumps({"path": f"src/{rng.choice(_WORDS)}_{self.i}.py", "arg": rng.choice(_WORDS)})
        self.messages.append({
            "role": "assistant", "content": "", "reasoning_content": _text(rng, rng.randint(40, 200)),
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": rng.choice(self.tools)["function"]["name"], "arguments": args}}],
        })
        size = max(50, int(rng.lognormvariate(0, 0.9) * self.mean_growth * 0.6))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, size, code=True)})
        self.tokens += size + 150

    def event(self, kind: str) -> None:
        rng = self.rng
        if kind == "todo_tick":
            self.todo_stale = 2 if self.todo_stale is None else self.todo_stale + 1
            self._rewrite_system()
        elif kind == "directive":
            self.directive = "## YOLO mode\nAct without asking for confirmation."
            self._rewrite_system()
        elif kind == "fold":
            self.messages.append({"role": "system", "content": "Updated system prompt section: " + _text(rng, 80)})
        elif kind == "notice":
            self.messages.append({"role": "user", "content": "[notice] subagent finished: " + _text(rng, 60)})
        elif kind == "tools_reorder":
            self.tools = self.tools[1:] + self.tools[:1]
        elif kind == "tools_add":
            self.tools = [*self.tools, {"type": "function", "function": {
                "name": "memory", "description": "Engram memory.", "parameters": {"type": "object", "properties": {}}}}]
        elif kind == "truncate":
            for j, m in enumerate(self.messages[2:], start=2):
                if m["role"] == "tool" and len(m["content"]) > 2000:
                    self.messages[j] = {**m, "content": m["content"][:1000] + "\n[output truncated]"}
                    break
        elif kind == "compact":
            summary = {"role": "user", "content": "Summary of the conversation so far: " + _text(rng, 3000)}
            self.messages = [self.system, summary]
            self.tokens = self.start_tokens + 3000
        elif kind == "abort":
            # An aborted turn: an empty assistant message sent once, then dropped.
            self.messages.append({"role": "assistant", "content": ""})
            self._aborted = (len(self.messages) - 1, self.i)
        elif kind == "reminder":
            self.tail = {"role": "user", "content": "<reminder>Keep the todo list current.</reminder>"}
        elif kind == "effort":
            # Keeping all past reasoning re-renders earlier assistant turns.
            self.params = {**self.params, "chat_template_kwargs": {"preserve_thinking": True}}
        elif kind == "reserialize":
            # The newest tool call has not been sent yet (see `step`): re-serialise the one before it.
            seen = 0
            for j in range(len(self.messages) - 1, 1, -1):
                m = self.messages[j]
                if m["role"] == "assistant" and m.get("tool_calls") and (seen := seen + 1) == 2:
                    calls = copy.deepcopy(m["tool_calls"])
                    fn = calls[0]["function"]
                    fn["arguments"] = json.dumps(json.loads(fn["arguments"]), indent=1)
                    self.messages[j] = {**m, "tool_calls": calls}
                    break

    def step(self) -> tuple[dict, int]:
        """The next request body and its (faked) prompt token count."""
        aborted = getattr(self, "_aborted", None)
        if aborted is not None and self.i > aborted[1] + 1:  # sent twice, then dropped from history
            del self.messages[aborted[0]]
            self._aborted = None
        if self.tokens > self.cap * 1.1:
            self.event("compact")
        messages = list(self.messages)
        if self.tail is not None:
            messages.append(self.tail)
            self.tail = None
        body = {"model": "qwen3.5-27b", "messages": messages, "tools": list(self.tools), "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": 8192, **self.params}
        prompt_tokens = self.tokens
        self.i += 1
        self._turn()
        return body, prompt_tokens


# (session index, request index within the session, event): about a dozen
# breaks of mixed causes. Indices past a session's length are skipped.
DEFAULT_EVENTS = [
    (0, 20, "todo_tick"), (0, 45, "todo_tick"), (0, 70, "todo_tick"), (0, 100, "directive"),
    (0, 130, "fold"), (1, 30, "notice"), (2, 40, "tools_reorder"), (3, 50, "truncate"),
    (4, 60, "abort"), (5, 70, "reminder"), (1, 60, "effort"), (7, 90, "reserialize"), (2, 100, "tools_add"),
    (3, 125, "compact"),
]


def generate_records(
    n_requests: int = 1260,
    n_sessions: int = 8,
    seed: int = 0,
    *,
    start_tokens: int = 46_000,
    cap_tokens: int = 172_000,
    events: list[tuple[int, int, str]] | None = None,
    t0: float = 1_760_000_000.0,
) -> Iterator[dict]:
    """Yields wrapped records in time order, sessions interleaved.

    Args:
        n_requests: total requests over all sessions.
        n_sessions: session 0 is the orchestrator (larger system prompt,
            more requests); the others are subagents.
        seed: everything is deterministic given the arguments.
        start_tokens / cap_tokens: a session grows from about `start_tokens`
            to about `cap_tokens` over its requests (compacting back if it
            overshoots by 10%).
        events: (session, request index, kind) breaks to inject; see
            `DEFAULT_EVENTS` for the kinds.
    """
    rng = random.Random(seed)
    weights = [2.0] + [1.0] * (n_sessions - 1)
    counts = [int(n_requests * w / sum(weights)) for w in weights]
    counts[0] += n_requests - sum(counts)
    sessions = [
        _Session(random.Random(seed * 1000 + k), "orchestrator" if k == 0 else f"subagent-{k}", counts[k], k == 0,
                 start_tokens + (10_000 if k == 0 else 0), cap_tokens)
        for k in range(n_sessions)
    ]
    plan: dict[tuple[int, int], list[str]] = {}
    for s, i, kind in DEFAULT_EVENTS if events is None else events:
        plan.setdefault((s, i), []).append(kind)

    # Interleave: each request goes to a random session that still has some,
    # weighted by what it has left, so all sessions run for the whole window.
    left = list(counts)
    ts = t0
    for n in range(n_requests):
        k = rng.choices(range(n_sessions), weights=left)[0]
        left[k] -= 1
        sess = sessions[k]
        for kind in plan.get((k, sess.i), []):
            sess.event(kind)
        body, prompt_tokens = sess.step()
        ts += rng.uniform(2.0, 40.0)
        cached = None if n % 97 == 5 else int(prompt_tokens * 0.97) // 256 * 256
        text = _text(rng, 30)
        yield {
            "id": f"synthetic-{n:05d}",
            "session": sess.sid,
            "ts": round(ts, 3),
            "request": body,
            "response": {"status": 200, "error": None, "text": text, "reasoning": "", "tool_calls": None,
                         "finish_reason": "tool_calls"},
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 250, "total_tokens": prompt_tokens + 250,
                      "prompt_tokens_details": {"cached_tokens": cached}},
        }


def write_jsonl(path: str | Path, **kwargs: Any) -> Path:
    """Writes `generate_records(**kwargs)` to `path`, one record a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in generate_records(**kwargs):
            fh.write(json.dumps(record, ensure_ascii=False))
            fh.write("\n")
    return path


if __name__ == "__main__":
    import sys

    out = write_jsonl(sys.argv[1] if len(sys.argv) > 1 else "synthetic.jsonl")
    print(out, out.stat().st_size)
