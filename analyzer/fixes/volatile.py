"""`volatile` (cause: system_rewrite / history_edit of subtype `volatile:KIND`): a ticking value in the
system prompt or an early message moves to the end of the newest user-side message.

The value is replaced where it stood by a placeholder that names it (`<<timestamp_1>>`), and the end
of the newest user-side message (a user message, or the tool result that ends a tool loop) gains one
line giving each placeholder its current value: the model still reads the current value, and the
prefix stops changing. Which values tick is learnt from the session: a value that differs from the
same slot's value in the session's previous request (the analyzer's volatile detector,
`analyzer/causes._masked`) is moved from then on, on every later request too, so the head never
flips back; a time of day in the system head is moved from the first request (it changes with
every request by nature). An earlier message that was given such a line keeps it on later requests
(the memo records it), so the history the server sees is what it saw before.
"""

from __future__ import annotations

import copy
import re

from analyzer.causes import _masked
from analyzer.fixes import shape
from analyzer.fixes.base import Outcome, SessionRecord, digest, stands_aside

NAME = "volatile"
EARLY_MESSAGES = 4  # besides the system head, the first messages scanned for ticking values
MEMO_MAX = 512  # slots and value lines remembered per session
_PLACEHOLDER = re.compile("\x00(\\w+)\x00")
_TIME_OF_DAY = re.compile(r"\d{1,2}:\d{2}")


def _slots(body: dict, protocol: str) -> list[tuple[tuple, dict, str, object, bool]]:
    """(key, holder, field, piece index, in the head) for the system head and the early messages
    before the newest one."""
    found = [(key, holder, fld, index, True) for key, holder, fld, index in shape.head_slots(body, protocol)]
    items = shape.conversation(body, protocol) or []
    first = 0
    while first < len(items) and isinstance(items[first], dict) and items[first].get("role") in shape.HEAD_ROLES \
            and protocol in ("chat", "responses"):
        first += 1
    for m in range(first, min(first + EARLY_MESSAGES, len(items) - 1)):
        item = items[m]
        if isinstance(item, dict):
            for index, _ in shape.text_parts(item.get("content")):
                found.append((("message", m, index), item, "content", index, False))
    return found


def _piece(holder: dict, fld: str, index) -> str:
    value = holder[fld]
    return value if index is None else value[index]["text"]


def _rebuilt(masked: str, values: list[tuple[str, str]], moved: dict[int, str]) -> str:
    """`masked` with its placeholders filled: the label for a moved value, the value itself otherwise."""
    pieces = _PLACEHOLDER.split(masked)
    out, n = [pieces[0]], 0
    for i in range(1, len(pieces), 2):
        out.append(f"<<{moved[n]}>>" if n in moved else values[n][1])
        out.append(pieces[i + 1])
        n += 1
    return "".join(out)


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    if protocol == "completions":
        return stands_aside("a legacy completion is one prompt string: no message to move a value to")
    items = shape.conversation(body, protocol)
    if protocol == "responses" and isinstance(body.get("input"), str):
        return stands_aside("the Responses input is one string: no earlier message to move a value from")
    if not items or not shape.is_user_side(items[-1]):
        return stands_aside("the request does not end with a user message or tool result to move a value to")
    memo = record.memos.get(NAME) or {"slots": {}, "notes": {}}
    new = copy.deepcopy(body)
    slots_memo: dict = dict(memo["slots"])  # other requests of the session (side requests) keep theirs
    moved_lines: list[str] = []
    kinds: set[str] = set()
    rewrites: list[tuple[tuple, dict, str, object, str]] = []
    for key, holder, fld, index, in_head in _slots(body, protocol):
        text = _piece(holder, fld, index)
        masked, values = _masked(text)
        # Keyed by the slot and its text around the values: a side request with another system prompt
        # (a title, a summary) neither resets nor borrows the main loop's learning.
        slot = f"{key!r}|{digest(masked)}"
        prev = memo["slots"].get(slot)
        sticky: set[int] = set()
        if prev is not None:
            sticky = set(prev["sticky"]) | {i for i, (v, p) in enumerate(zip(values, prev["values"])) if v[1] != p}
        if in_head:
            sticky |= {i for i, (kind, v) in enumerate(values) if kind == "timestamp" and _TIME_OF_DAY.search(v)}
        slots_memo.pop(slot, None)  # re-inserted last: the least recently seen go first
        slots_memo[slot] = {"values": [v for _, v in values], "sticky": sorted(sticky)}
        if not sticky:
            continue
        labels = {}
        for i in sorted(sticky):
            kind, value = values[i]
            labels[i] = f"{kind}_{len(moved_lines) + 1}"
            kinds.add(kind)
            moved_lines.append(f"<<{labels[i]}>> = {value}")
        rewrites.append((key, holder, fld, index, _rebuilt(masked, values, labels)))
    while len(slots_memo) > MEMO_MAX:
        slots_memo.pop(next(iter(slots_memo)))
    # Write the rewrites into the copy (the same path, found again in `new`), then give earlier messages
    # back the value lines they were sent with, so the history stays as the server saw it.
    for key, holder, fld, index, text in rewrites:
        shape.set_text(_same_holder(body, new, protocol, holder), fld, index, text)
    restored = 0
    new_items = shape.conversation(new, protocol)
    for m, item in enumerate(items[:-1]):
        note = memo["notes"].get(digest(item)) if isinstance(item, dict) else None
        if note:
            shape.append_text(new_items[m], note, protocol)
            restored += 1
    notes = dict(memo["notes"])
    if not moved_lines:
        return Outcome(new if restored else None,
                       f"{restored} earlier value line(s) kept" if restored else "no ticking value in the system head "
                       "or the early messages", {"slots": slots_memo, "notes": notes})
    note = "\n\n[Current values of the placeholders above: " + "; ".join(moved_lines) + "]"
    if not shape.append_text(new_items[-1], note, protocol):
        return Outcome(None, "the newest message has no text to append the values to", {"slots": slots_memo,
                                                                                          "notes": notes})
    notes[digest(items[-1])] = note  # found again by its content, wherever the message stands later
    while len(notes) > MEMO_MAX:
        notes.pop(next(iter(notes)))
    return Outcome(new, f"volatile {', '.join(sorted(kinds))} moved ({len(moved_lines)} value(s))",
                   {"slots": slots_memo, "notes": notes})


def _same_holder(old: dict, new: dict, protocol: str, holder: dict) -> dict:
    """The dict in `new` that stands where `holder` stands in `old` (the body, or one message)."""
    if holder is old:
        return new
    items = shape.conversation(old, protocol) or []
    for m, item in enumerate(items):
        if item is holder:
            return shape.conversation(new, protocol)[m]
    raise ValueError("slot holder not found in the body")
