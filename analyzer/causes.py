"""Naming the cause of a prefix break. The names are fixed (docs/ANALYZER.md):

    append_only         no break
    system_rewrite      the system/developer head changed (subtype `volatile:KIND`
                        when only volatile values changed, see `volatile_change`)
    system_fold         payload append-only, but a later system/developer
                        message lands in the rendered head
    thinking_strip      an earlier assistant turn's reasoning was rendered
                        before and is gone now (subtype `template`, `template_empty`
                        for an empty <think></think> block, or `client`)
    tools_change        tools added / removed / reordered / edited
    history_edit        an earlier message's content changed (e.g. truncated;
                        `volatile:KIND` when only volatile values changed)
    compaction          history replaced by a summary / shrink
    dropped_message     an earlier message disappeared
    request_local_tail  the previous request's trailing one-shot message is gone
    param_change        model, chat_template_kwargs, reasoning settings
    serialization       same meaning, different bytes (JSON re-serialised,
                        key order, whitespace; subtype `template` when only
                        the rendering differs)
    lookback            Anthropic: the breakpoint lies more than 20 blocks past the
                        session's newest cache write (analyzer/lookback.py)
    concurrent          sent before the session's previous request's first token
                        (analyzer/race.py)
    server_miss         the prompt only grew, but the server cached less of it
                        than predicted (subtype eviction, routing, ttl, unknown;
                        see the end of this module)

The payload level says *what* the client changed; the rendered level says
*whether and where* the prompt broke. A break is named from the payload when
the client changed something at or before the rendered break, else from the
template effect seen only in the rendering.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any

from analyzer.canon import REASONING_KEYS, Payload, canonical_message, first_changed

CAUSES = (
    "append_only", "system_rewrite", "system_fold", "thinking_strip", "tools_change", "history_edit",
    "compaction", "dropped_message", "request_local_tail", "param_change", "serialization", "server_miss",
    "lookback", "concurrent",  # analyzer/lookback.py, analyzer/race.py: the cache's rules, not a payload change
)
HEAD_ROLES = ("system", "developer")
COMPACTION_SHRINK = 0.7  # next payload at most this fraction of prev's
# Tokens that make a change "volatile": numbers with separators, percentages,
# units of time, month/day names, am/pm.
_VOLATILE_TOKEN = re.compile(
    r"[\d.,:/+\-%]+|T|Z|ms|s|m|h|d|sec|secs|min|mins|hours?|days?|minutes?|seconds?|ago|am|pm|AM|PM|UTC"
    r"|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec|Mon|Tue|Wed|Thu|Fri|Sat|Sun"
)
_WORDS = re.compile(r"\d+(?:[.,:/\-]\d+)*%?|\w+|\S")


@dataclass
class Cause:
    cause: str
    subtype: str | None = None
    message_index: int | None = None
    path: str | None = None  # payload-level JSON path of the first change (deepdiff)
    tool_index: int | None = None  # tools_change / serialization of tools: the first tool that differs
    tool_name: str | None = None
    volatile: dict | None = None  # {"kind", "before", "after"}: the volatile value that changed (`volatile_change`)


def is_volatile(a: str, b: str) -> bool:
    """True when every changed word between `a` and `b` is a number, date,
    time, duration or percentage (a ticking counter, not a real edit)."""
    aw, bw = _WORDS.findall(a), _WORDS.findall(b)
    changed = False
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, aw, bw, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        changed = True
        if not all(_VOLATILE_TOKEN.fullmatch(w) for w in aw[i1:i2] + bw[j1:j2]):
            return False
    return changed


_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_WEEKDAY = r"(?:Mon|Tue|Tues|Wed|Thu|Thur|Thurs|Fri|Sat|Sun)(?:day|sday|nesday|rsday|urday)?"
# Values that change between requests without the text meaning anything else, in priority order at one
# position (a UUID before the hex runs inside it, a date before the numbers inside it).
VOLATILE_KINDS = {
    "email": r"(?<![\w.+-])[\w.+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})+",
    "url_query": r"(?<=\?)[^\s\"'<>#?]*=[^\s\"'<>#]*",
    "uuid": r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
    "timestamp": r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
                 r"|\b\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[AaPp][Mm])?(?:\s?(?:UTC|GMT|Z))?"
                 r"|\b\d{1,4}/\d{1,2}/\d{1,4}\b"
                 rf"|\b{_WEEKDAY},?\s+(?:{_MONTH}\s+\d{{1,2}}|\d{{1,2}}\s+{_MONTH})(?:,?\s+\d{{4}})?"
                 rf"|\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?\b|\b\d{{1,2}}\s+{_MONTH}(?:\s+\d{{4}})?\b"
                 rf"|\b{_WEEKDAY}\b|\b1[5-9]\d{{8}}(?:\d{{3}})?(?:\.\d+)?\b",
    "hex_id": r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,}\b"
              r"|\b(?=[0-9A-F]*\d)(?=[0-9A-F]*[A-F])[0-9A-F]{7,}\b",
    "high_entropy": r"(?<![\w+/=-])(?=[\w+/=-]*\d)(?=[\w+/=-]*[A-Za-z])[\w+/=-]{16,}(?![\w+/=-])",
    "counter": r"\b\d+(?:[.,]\d+)*%?",
}
VOLATILE_REGION_MAX = 4096  # chars: the changed region (with its context) a volatile change fits in
_VOLATILE_RE = re.compile("|".join(f"(?P<{k}>{v})" for k, v in VOLATILE_KINDS.items()))
_TIME_WORDS = re.compile(r"T|Z|UTC|am|pm|AM|PM|" + _MONTH + "|" + _WEEKDAY)


def _entropy(s: str) -> float:
    import math
    from collections import Counter

    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _masked(text: str) -> tuple[str, list[tuple[str, str]]]:
    """`text` with every volatile value replaced by a placeholder naming its kind, and the values."""
    values: list[tuple[str, str]] = []

    def sub(m: re.Match) -> str:
        kind = m.lastgroup or "counter"
        if kind == "high_entropy" and _entropy(m.group()) < 3.5:
            return m.group()  # a long identifier (snake_case_name_2), not a random token
        values.append((kind, m.group()))
        return f"\x00{kind}\x00"

    return _VOLATILE_RE.sub(sub, text), values


def volatile_change(a: str, b: str) -> dict | None:
    """{"kind", "before", "after"} when the only change from `a` to `b` is volatile values: e-mail
    addresses, URL query strings, UUIDs, timestamps (dates, times, weekdays, epoch seconds), hex ids,
    high-entropy tokens (nonces, request ids, signatures) or counters (numbers, percentages, durations);
    `kind` names the first value that changed. None when anything else changed (or nothing did)."""
    if a == b:
        return None
    ra, rb = _changed_region(a, b, pad=64)
    if max(len(ra), len(rb)) > VOLATILE_REGION_MAX:
        return None  # a change this long is an edit, not a ticking value (and the scan stays linear)
    ma, va = _masked(ra)
    mb, vb = _masked(rb)
    if ma == mb:
        for (kind, x), (_, y) in zip(va, vb):
            if x != y:
                return {"kind": kind, "before": x, "after": y}
        return None
    if is_volatile(ra, rb):  # durations, "(stale: 3 turns)", month and day names
        aw, bw = _WORDS.findall(ra), _WORDS.findall(rb)
        sm = difflib.SequenceMatcher(None, aw, bw, autojunk=False)
        op = next(o for o in sm.get_opcodes() if o[0] != "equal")
        x, y = " ".join(aw[op[1]:op[2]]), " ".join(bw[op[3]:op[4]])
        words = aw[op[1]:op[2]] + bw[op[3]:op[4]]
        kind = "timestamp" if any(_TIME_WORDS.fullmatch(w) for w in words) else "counter"
        return {"kind": kind, "before": x, "after": y}
    return None


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, value)]


def volatile_between(a: Any, b: Any) -> dict | None:
    """`volatile_change` for two JSON values (messages, tool definitions): the same structure, and every
    leaf that differs differs only by volatile values (compared as text, so JSON escaping never hides a
    word boundary)."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb) or any(pa != pb for (pa, _), (pb, _) in zip(la, lb)):
        return None
    first = None
    for (_, x), (_, y) in zip(la, lb):
        if x == y and type(x) is type(y):
            continue
        v = volatile_change(str(x), str(y)) if not isinstance(x, bool) and not isinstance(y, bool) else None
        if v is None:
            return None
        first = first or v
    return first


def _volatile_subtype(v: dict | None, otherwise: str | None) -> str | None:
    return f"volatile:{v['kind']}" if v else otherwise


def _changed_region(a: str, b: str, pad: int = 40) -> tuple[str, str]:
    """The differing middles of two strings, widened to whole words."""
    from analyzer.divergence import common_prefix_len

    p = common_prefix_len(a, b)
    s = min(common_prefix_len(a[::-1], b[::-1]), min(len(a), len(b)) - p)
    lo = max(0, p - pad)
    return a[lo : len(a) - s + pad], b[lo : len(b) - s + pad]


def _without_reasoning(msg: Any) -> Any:
    if not isinstance(msg, dict):
        return msg
    out = {k: v for k, v in msg.items() if k not in REASONING_KEYS}
    content = out.get("content")
    if isinstance(content, str) and "</think>" in content:
        out["content"] = content.split("</think>")[-1].lstrip("\n")
    return out


def _has_reasoning(msg: Any) -> bool:
    return isinstance(msg, dict) and (any(msg.get(k) for k in REASONING_KEYS) or "</think>" in str(msg.get("content")))


def normalize(value: Any) -> Any:
    """Meaning, not bytes: sorted keys, JSON strings parsed, whitespace collapsed."""
    if isinstance(value, dict):
        return {k: normalize(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str):
        s = value.strip()
        if s[:1] in "{[":
            try:
                return normalize(json.loads(s))
            except ValueError:
                pass
        return " ".join(value.split())
    return value


def _leading_head(messages: list) -> int:
    """Number of leading system/developer messages."""
    n = 0
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in HEAD_ROLES):
            break
        n += 1
    return n


def _role(msg: Any) -> str | None:
    """A message's role as a subtype (a string: it is printed after a '/')."""
    role = msg.get("role") if isinstance(msg, dict) else None
    return None if role is None else str(role)


def _tool_name(t: Any) -> str:
    f = t.get("function", t) if isinstance(t, dict) else t
    return json.dumps(f.get("name") if isinstance(f, dict) else f)


def tools_subtype(prev: list, next: list) -> str:
    pn, nn = [_tool_name(t) for t in prev], [_tool_name(t) for t in next]
    if set(pn) == set(nn):
        return "reordered" if pn != nn else "edited"
    if set(pn) < set(nn):
        return "added"
    if set(nn) < set(pn):
        return "removed"
    return "edited"


def _tool_meaning(t: Any) -> Any:
    """A tool as what it means: keys sorted (by `normalize`), a `strict: false` (the default) dropped."""
    if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict") is False:
        t = {**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}}
    return normalize(t)


def _first_tool(prev: list, next: list) -> tuple[int | None, str | None]:
    """Index and name of the first tool that differs (in next; in prev when next has fewer)."""
    for i in range(max(len(prev), len(next))):
        a = prev[i] if i < len(prev) else None
        b = next[i] if i < len(next) else None
        if a is None or b is None or json.dumps(a) != json.dumps(b):  # bytes: key order counts
            t = b if b is not None else a
            return i, json.loads(_tool_name(t)) if t is not None else None
    return None, None


def _dropped(prev: list[str], next: list[str], k: int) -> list[int] | None:
    """Indices (in prev) of messages that disappeared from k on while the rest kept their order: a
    resume that drops synthetic messages (Claude Code's "Output token limit hit" notices) is that, not
    an edit. None when nothing after the first missing message was kept (an edit or a rewrite)."""
    i, j, dropped, kept = k, k, [], 0
    while i < len(prev) and j < len(next):
        if prev[i] == next[j]:
            i, j, kept = i + 1, j + 1, kept + 1
        else:
            dropped.append(i)
            i += 1
    dropped.extend(range(i, len(prev)))
    return dropped if kept and dropped and dropped[0] == k else None


def is_compaction(prev_keys: list[str], next_keys: list[str], prev_head: int, next_head: int) -> bool:
    """History replaced by a summary: at least two messages fewer, and the conversation (past the
    system head, which a long system prompt would otherwise dominate) at most COMPACTION_SHRINK of
    what it was."""
    if len(next_keys) >= len(prev_keys) - 1:
        return False
    before = sum(map(len, prev_keys[prev_head:]))
    after = sum(map(len, next_keys[next_head:]))
    return after <= COMPACTION_SHRINK * before


def payload_cause(prev: Payload, next: Payload) -> Cause | None:
    """What the client changed first, or None when the payload is append-only."""
    from analyzer.canon import first_path

    changed = [k for k in set(prev.params) | set(next.params) if prev.params.get(k) != next.params.get(k)]
    if changed:
        return Cause("param_change", ",".join(sorted(changed)), None, "$." + sorted(changed)[0])
    if prev.tools_key != next.tools_key:
        index, name = _first_tool(prev.tools, next.tools)
        path = first_path(prev.tools, next.tools, "$.tools")
        if len(prev.tools) == len(next.tools):
            meant = None  # (`next` is the payload here, not the builtin)
            for i, (a, b) in enumerate(zip(prev.tools, next.tools)):
                if _tool_meaning(a) != _tool_meaning(b):
                    meant = i
                    break
            if meant is None:
                # Same tools, other bytes (key order of a schema, `strict: false`): one harness's tools
                # serialised differently, e.g. by its chat and its Messages client.
                return Cause("serialization", "tools", None, path, index, name)
            if meant != index:  # name the tool whose meaning changed, not a re-serialised one before it
                index, name = meant, json.loads(_tool_name(next.tools[meant]))
                path = first_path(_tool_meaning(prev.tools[meant]), _tool_meaning(next.tools[meant]),
                                  f"$.tools[{meant}]")
        subtype, v = tools_subtype(prev.tools, next.tools), None
        if subtype == "edited" and index is not None and index < min(len(prev.tools), len(next.tools)):
            v = volatile_between(prev.tools[index], next.tools[index])
        return Cause("tools_change", _volatile_subtype(v, subtype), None, path, index, name, volatile=v)
    k = first_changed(prev.keys, next.keys)
    if k == len(prev.keys):
        return None
    pm = canonical_message(prev.messages[k])
    nm = canonical_message(next.messages[k]) if k < len(next.messages) else None
    path = first_path(pm, nm, f"$.messages[{k}]") if nm is not None else f"$.messages[{k}]"
    head = _leading_head(prev.messages)
    # Compaction first: a harness that compacts may rewrite or drop its developer/system messages with
    # the history (Codex's remote compaction does); the summary is the cause, not the system head.
    if is_compaction(prev.keys, next.keys, head, _leading_head(next.messages)):
        return Cause("compaction", None, k, path)
    if k < head or (k == head and isinstance(nm, dict) and nm.get("role") in HEAD_ROLES):
        a = str(pm.get("content", "")) if isinstance(pm, dict) else ""
        b = str(nm.get("content", "")) if isinstance(nm, dict) else ""
        v = volatile_change(a, b) if a != b else (volatile_between(pm, nm) if nm is not None else None)
        return Cause("system_rewrite", _volatile_subtype(v, "content"), k, path, volatile=v)
    rest = prev.keys[k + 1 :]
    if (rest and next.keys[k : k + len(rest)] == rest) or _dropped(prev.keys, next.keys, k):
        role = _role(pm)
        empty = isinstance(pm, dict) and not pm.get("content") and not pm.get("tool_calls")
        return Cause("dropped_message", f"empty_{role}" if empty else role, k, f"$.messages[{k}]")
    if nm is not None and normalize(pm) == normalize(nm):
        return Cause("serialization", None, k, path)
    if nm is not None and _has_reasoning(pm) and _without_reasoning(pm) == _without_reasoning(nm):
        return Cause("thinking_strip", "client", k, path)
    # The previous request's one-shot tail is gone from its slot; it may come back at the very end
    # (a side request that re-appends its instruction to the grown conversation).
    if k == len(prev.keys) - 1 and (prev.keys[k] not in next.keys or next.keys[-1] == prev.keys[k]):
        same_slot = isinstance(nm, dict) and isinstance(pm, dict) and nm.get("role") == pm.get("role") and (
            nm.get("tool_call_id") is not None and nm.get("tool_call_id") == pm.get("tool_call_id"))
        if not same_slot:
            return Cause("request_local_tail", _role(pm), k, path)
    subtype = None
    v = volatile_between(pm, nm) if nm is not None else None
    if isinstance(pm, dict) and isinstance(nm, dict):
        a, b = pm.get("content"), nm.get("content")
        if isinstance(a, str) and isinstance(b, str) and len(b) < len(a):
            subtype = "truncated"
    return Cause("history_edit", _volatile_subtype(v, subtype), k, path, volatile=v)


# How a harness's compaction summary opens the conversation it replaced (the first user message): a
# request that opens with a new one follows a compaction, whatever else changed (Claude Code also
# rewrites a fingerprint in its system prompt then).
SUMMARY_OPENERS = ("This session is being continued from a previous conversation",  # Claude Code
                   "The conversation history before this point was compacted")  # pi


def summary_marks(body: Any) -> frozenset[str]:
    """The compaction summary a Messages or chat body's first user message holds (its text), if any."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return frozenset()
    first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
    content = first.get("content") if first is not None else None
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
    else:
        texts = []
    return frozenset(t for t in texts if t.lstrip().startswith(SUMMARY_OPENERS))


def marked_compaction(req: Any, prev_req: Any = None) -> bool:
    """The request is the first after a compaction its harness wrote down (a transcript's compact
    boundary, compaction entry or `compacted` line: recorder/transcripts), or, in recorded traffic, it
    carries a server's `compaction` item (OpenAI's remote compaction) or opens with a compaction
    summary (`summary_marks`) the request before did not: whatever the payload shows, the history
    was replaced by a summary."""
    origin = getattr(req, "transcript", None)
    if isinstance(origin, dict) and origin.get("compacted") is True:
        return True
    before = getattr(prev_req, "compactions", frozenset()) if prev_req is not None else frozenset()
    return bool(getattr(req, "compactions", frozenset()) - before)


def render_cause(prev_r, next_r, next: Payload, message_index: int | None) -> Cause:
    """A break the payload cannot explain: a template effect."""
    if message_index is not None and 0 <= message_index < len(next.messages):
        m = next.messages[message_index]
        if message_index > 0 and isinstance(m, dict) and m.get("role") in HEAD_ROLES:
            return Cause("system_fold", m.get("role"), message_index)
    # A later system message folded into the head shows up as a changed head.
    head = _leading_head(next.messages)
    later = [i for i, m in enumerate(next.messages) if i >= head and isinstance(m, dict) and m.get("role") in HEAD_ROLES]
    if later and (message_index is None or message_index < head or message_index < 0):
        return Cause("system_fold", next.messages[later[0]].get("role"), later[0])
    lost = prev_r.reasoning() - next_r.reasoning()
    if lost:
        return Cause("thinking_strip", "template", min(i for i, _ in lost))
    if dropped_empty_think(prev_r.text, next_r.text):
        # The block is the assistant turn's (its template text may be located with the next message).
        i = message_index if message_index is not None and 0 <= message_index < len(next.messages) else None
        while i is not None and i > 0 and not (isinstance(next.messages[i], dict) and
                                               next.messages[i].get("role") == "assistant"):
            i -= 1
        return Cause("thinking_strip", "template_empty", i if i else message_index)
    return Cause("serialization", "template", message_index)


_EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


def dropped_empty_think(prev_text: str, next_text: str) -> bool:
    """Whether the first difference is the template dropping an empty <think></think> block that it
    rendered in the previous prompt (Qwen3-style templates render one in the newest assistant turn
    only): with the block cut out, the previous prompt goes on as this one does."""
    from analyzer.divergence import common_prefix_len

    c = common_prefix_len(prev_text, next_text)
    start = prev_text.rfind("<think>", max(0, c - len("<think>")), c + len("<think>"))
    start = c if start < 0 or start > c else start
    m = _EMPTY_THINK.match(prev_text, start)
    if m is None:
        return False
    rest = prev_text[m.end() : m.end() + 64]
    return bool(rest) and next_text[start:].startswith(rest) or (not rest and len(next_text) >= start)


def classify(prev: Payload, next: Payload, prev_r, next_r, render_break_index: int | None) -> Cause:
    """The cause of a rendered break between prev and next."""
    pc = payload_cause(prev, next)
    if pc is None:
        return render_cause(prev_r, next_r, next, render_break_index)
    if pc.cause in ("param_change", "tools_change") or pc.subtype == "tools" and pc.message_index is None:
        return pc
    # The client changed message k, but the rendering broke earlier: a template effect came first.
    if render_break_index is not None and pc.message_index is not None and 0 <= render_break_index < pc.message_index:
        rc = render_cause(prev_r, next_r, next, render_break_index)
        if rc.cause != "serialization":
            return rc
    return pc


# --- server-side misses --------------------------------------------------------------------------------
#
# An append-only turn (the client changed nothing before the end of the previous prompt) whose reported
# cached tokens fall short of the predicted prefix lost it on the server: `server_miss`, with subtype
#   eviction  the embedded engine's prefix cache dropped blocks since the session's previous turn
#   routing   another upstream member served it than the previous turn
#   ttl       the gap since the previous turn ended is past the provider's cache lifetime (PROVIDER_TTLS)
#   unknown   none of these can be told from the recording
# (docs/ANALYZER.md "Server-side misses").

# Provider -> (seconds a cached prefix lives unused, as the provider documents it). The gap is measured
# from the end of the previous turn (a hit refreshes the lifetime) to the start of this one.
# Sources (docs/ANALYZER.md "Server-side misses" has the table): Anthropic
# https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching ("cache lifetime"), OpenAI
# https://platform.openai.com/docs/guides/prompt-caching ("prompt cache retention").
PROVIDER_TTLS: dict[str, tuple[int, str]] = {
    "anthropic": (300, "Anthropic prompt caching: 5 minutes, refreshed by each hit"),
    "anthropic-1h": (3600, "Anthropic prompt caching with cache_control ttl \"1h\": 1 hour"),
    "openai": (300, "OpenAI prompt caching: 5-10 minutes of inactivity (up to 1 hour off-peak); 5 min assumed"),
    "openai-24h": (86400, "OpenAI extended prompt cache retention (prompt_cache_retention \"24h\"): 24 hours"),
}
SERVER_MISS_SUBTYPES = ("eviction", "routing", "reasoning_drop", "ttl", "unknown")


def provider_of(upstream: str | None, model: str | None = None) -> str | None:
    """The cache provider whose lifetime applies to `upstream` (a URL, or the harness of a rebuilt
    transcript), None for servers without a TTL (the embedded engine, vLLM, llama.cpp: they evict for
    room, not for time)."""
    from analyzer.server_counts import transcript_provider

    if (by_transcript := transcript_provider(upstream, model)) is not None:
        return by_transcript
    u = (upstream or "").lower()
    if "anthropic.com" in u:
        return "anthropic"
    if "openai.com" in u or "openai.azure.com" in u:
        return "openai"
    return None


def server_facts(turn, req) -> None:
    """The provider's own cache figures of a request's usage, beside the analysis (TurnResult fields)."""
    usage = req.usage if isinstance(getattr(req, "usage", None), dict) else {}
    num = lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None  # noqa: E731
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    details = details if isinstance(details, dict) else {}
    read = num(usage.get("cache_read_input_tokens"))
    read = read if read is not None else num(usage.get("cached_input_tokens"))  # Codex's rollout usage
    turn.reported_cache_read_tokens = read if read is not None else num(details.get("cached_tokens"))
    write = num(usage.get("cache_creation_input_tokens"))
    turn.reported_cache_write_tokens = write if write is not None else num(details.get("cache_write_tokens"))
    turn.server_miss_reason = getattr(req, "cache_miss_reason", None)
    turn.served_by = getattr(req, "served_by", None) or getattr(req, "upstream", None)


def server_miss(prev_req, req, *, ttl_1h: bool = False) -> tuple[str, str]:
    """(subtype, why) of a server-side miss between the session's previous request and this one."""
    ev_prev, ev_now = getattr(prev_req, "cache_evictions", None), getattr(req, "cache_evictions", None)
    if ev_prev is not None and ev_now is not None and ev_now > ev_prev:
        return "eviction", (f"the server's prefix cache evicted {ev_now - ev_prev} block(s) for room between the "
                            f"previous turn's end and this one's")
    a = getattr(prev_req, "served_by", None) or getattr(prev_req, "upstream", None)
    b = getattr(req, "served_by", None) or getattr(req, "upstream", None)
    if a and b and a != b:
        return "routing", f"served by {b}, the previous turn by {a}"
    from analyzer.server_counts import gap_text

    model = req.body.get("model") if isinstance(getattr(req, "body", None), dict) else None
    provider = provider_of(b, model if isinstance(model, str) else None)
    if provider is not None and prev_req is not None:
        key = f"{provider}-1h" if provider == "anthropic" and ttl_1h else \
            f"{provider}-24h" if provider == "openai" and ttl_1h else provider
        ttl, source = PROVIDER_TTLS[key]
        gap = req.ts - (prev_req.ts + (getattr(prev_req, "total_s", None) or 0.0))
        if gap > ttl and getattr(req, "ts_given", True) and getattr(prev_req, "ts_given", True):
            return "ttl", (f"{gap:,.0f} s since the previous turn ended ({gap_text(gap)}), past the cache lifetime "
                           f"({source})")
    return "unknown", "the server kept less of the prefix than it was sent; the recording does not say why"
