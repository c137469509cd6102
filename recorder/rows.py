"""Turn <-> `turn_log` row, with request bodies stored content-addressed.

A body is stored as `head + sep.join(messages) + tail` (see `recorder.bodies`).
Each distinct message text is one `messages` row, and the ordered message list
is a chain in `prefixes`: (parent prefix, message). An agent session that
appends a few messages per turn therefore adds a few `prefixes` rows per turn,
not a copy of the conversation, and the whole body is still rebuilt byte for
byte. Head and tail (model, tools, sampling parameters: the same every turn of
a session, and kilobytes once tools are declared) are content-addressed too,
in `body_parts`.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import fields
from typing import Any, Mapping

import sqlite_utils

from prefixtrace.common.errors import RecorderError
from recorder import numbers
from recorder.bodies import SplitBody, message_hash, split_body
from recorder.item_texts import SharedItemTexts
from recorder.redact import DEFAULT_REDACTOR, Redactor
from recorder.renderers import RendererInfo, ensure_stored
from recorder.turn import Turn

JSON_COLUMNS = ("request_headers", "tool_calls", "usage", "chunk_times", "render")
# Writer-side id caches are dropped past this many entries; a miss only costs a lookup.
_CACHE_LIMIT = 500_000
# Read bounds (docs/CONFIG.md "Reading recordings"): one rebuilt body (twice the largest request
# `serve --max-request-mb` takes by default), the messages of one chain, and all bodies one read rebuilds.
MAX_BODY_CHARS = 64 << 20
MAX_CHAIN_MESSAGES = 100_000
MAX_READ_CHARS = 2 << 30


_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(text: str) -> str:
    """`text` as SQLite can store it: UTF-16 surrogates (JSON escapes such as
    `\\ud83d`, or a pair split across two stream chunks) are joined into their
    character where they pair up and replaced by U+FFFD where they do not,
    instead of failing the whole write."""
    if text.isascii() or not _SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _dumps(value: Any) -> str:
    # Strict JSON: an upstream's NaN or Infinity (Python's json reads them) is stored as the
    # string it is spelled with, so every reader of the column can parse it (recorder/numbers.py).
    return numbers.dumps(value, ensure_ascii=False)



_UNPARSED = object()


def body_text(turn: Turn, redactor: Redactor = DEFAULT_REDACTOR) -> tuple[str, bool]:
    """The redacted body text to store and whether it is JSON.

    The exact text the client sent (`turn.request_raw`) is kept when, after
    redaction, it still parses to the redacted body; otherwise (no raw text, or
    a secret spelled with JSON escapes the text regexes cannot see) the
    redacted body is serialised, which never lets a secret through.
    """
    body = turn.request_body
    if isinstance(body, str):  # the body did not parse: keep its text
        return redactor.text(body), False
    if turn.request_raw is None:
        return _dumps(redactor.value(body)), True
    # The raw text first: where nothing in it is redacted and the body is its own parse, the body's
    # strings need no scan for a literal the raw text lacks (`Redactor.json_text`).
    candidate, skip = redactor.json_text(turn.request_raw)
    try:  # strictly: raw text spelling `Infinity` would store non-strict JSON
        parsed = numbers.loads_strict(candidate)
    except ValueError:
        parsed, skip = _UNPARSED, frozenset()
    if skip and parsed != body:  # changed since it was parsed: every string is scanned
        skip = frozenset()
    redacted = redactor.value(body, skip)
    if parsed == redacted:
        return candidate, True
    return _dumps(redactor.value(body) if skip else redacted), True


class BodyStore:
    """Stores and rebuilds request bodies in one database connection.

    The id caches make a long session's turns cost one lookup per *new*
    message; they describe committed and in-transaction rows, so after a
    rolled-back transaction call `reset()`.
    """

    def __init__(self, db: sqlite_utils.Database):
        self.db = db
        self._message_ids: dict[bytes, int] = {}
        self._part_ids: dict[bytes, int] = {}
        self._part_texts: dict[int, str] = {}
        self._prefix_ids: dict[tuple[int, int], int] = {}
        self._prefix_rows: dict[int, tuple[int, int]] = {}
        self._message_bodies: dict[int, str] = {}
        self.renderer_ids: set[str] = set()  # `renderers` rows known to be stored
        self.read_chars = 0  # characters of the bodies rebuilt so far (bounded: MAX_READ_CHARS)
        self.cache_limit = _CACHE_LIMIT  # entries per id cache (a streamed import sets fewer)
        # The previous body's message hashes and the prefix id after each: the next turn of a session
        # repeats them, so only its new messages are looked up (a long session's turns cost their new
        # messages, not their whole history).
        self._last_hashes: list[bytes] = []
        self._last_prefixes: list[int] = []

    def reset(self) -> None:
        self._message_ids.clear()
        self._part_ids.clear()
        self._part_texts.clear()
        self._prefix_ids.clear()
        self._prefix_rows.clear()
        self._message_bodies.clear()
        self.renderer_ids.clear()
        self._last_hashes, self._last_prefixes = [], []

    # -- write ----------------------------------------------------------------

    def put(self, text: str | SplitBody, *, is_json: bool) -> dict[str, Any]:
        """Stores the messages of `text` (or of a body already split); returns the turn's body columns."""
        split = text if isinstance(text, SplitBody) else split_body(text) if is_json else None
        if split is None:
            return {"body_json": int(is_json), "body_head": self._text_id("body_parts", self._part_ids, text),
                    "body_sep": None, "body_tail": None, "body_prefix": None}
        hashes = split.hashes or [message_hash(m) for m in split.messages]
        last = self._last_hashes
        if len(hashes) >= len(last) and hashes[: len(last)] == last:
            k = len(last)  # the common case, compared in C
        else:
            k = next((i for i, (a, b) in enumerate(zip(hashes, last)) if a != b), min(len(hashes), len(last)))
        prefixes = self._last_prefixes[:k]
        prefix = prefixes[-1] if prefixes else 0
        for message, digest in zip(split.messages[k:], hashes[k:]):
            prefix = self._prefix_id(prefix, self._text_id("messages", self._message_ids, message, digest))
            prefixes.append(prefix)
        self._last_hashes, self._last_prefixes = hashes, prefixes
        return {"body_json": 1, "body_head": self._text_id("body_parts", self._part_ids, split.head),
                "body_sep": split.sep, "body_tail": self._text_id("body_parts", self._part_ids, split.tail),
                "body_prefix": prefix}

    def _text_id(self, table: str, cache: dict[bytes, int], text: str, digest: bytes | None = None) -> int:
        """Id of `text` in a content-addressed table (`messages` or `body_parts`), stored if new."""
        digest = digest or message_hash(text)
        found = cache.get(digest)
        if found is None:
            row = self.db.execute(f"SELECT id FROM {table} WHERE hash = ?", [digest]).fetchone()
            if row is None:
                found = self.db.execute(f"INSERT INTO {table} (hash, body) VALUES (?, ?)", [digest, text]).lastrowid
            else:
                found = row[0]
            if len(cache) > self.cache_limit:
                cache.clear()
            cache[digest] = found
        return found

    def _part(self, part_id: int) -> str:
        text = self._part_texts.get(part_id)
        if text is None:
            row = self.db.execute("SELECT body FROM body_parts WHERE id = ?", [part_id]).fetchone()
            if row is None:
                raise RecorderError(f"database is inconsistent: body part {part_id} is missing")
            if len(self._part_texts) > 1024:
                self._part_texts.clear()
            text = self._part_texts[part_id] = row[0]
        return text

    def _prefix_id(self, parent: int, message_id: int) -> int:
        key = (parent, message_id)
        found = self._prefix_ids.get(key)
        if found is None:
            row = self.db.execute("SELECT id FROM prefixes WHERE parent = ? AND message_id = ?", key).fetchone()
            if row is None:
                found = self.db.execute("INSERT INTO prefixes (parent, message_id) VALUES (?, ?)", key).lastrowid
            else:
                found = row[0]
            if len(self._prefix_ids) > self.cache_limit:
                self._prefix_ids.clear()
            self._prefix_ids[key] = found
        return found

    # -- read -----------------------------------------------------------------

    def text(self, row: dict[str, Any]) -> str:
        """The stored body text of a `turn_log` row. A body that would rebuild past MAX_BODY_CHARS,
        or bodies past MAX_READ_CHARS in all, raise RecorderError: a crafted file can name one big
        message thousands of times in a chain (a few KB of rows that rebuild gigabytes)."""
        head = self._part(row["body_head"])
        if row["body_prefix"] is None:
            return self._counted(head, row)
        sep, tail = row["body_sep"] or "", self._part(row["body_tail"])
        messages = self._messages(row["body_prefix"])
        size = len(head) + len(tail) + sum(map(len, messages)) + len(sep) * max(len(messages) - 1, 0)
        if size > MAX_BODY_CHARS:
            raise RecorderError(f"turn {row.get('request_id')!r}: its body would rebuild to {size:,} characters, "
                                f"over the {MAX_BODY_CHARS:,} a recorded body can have (the file is damaged or crafted)")
        return self._counted(head + sep.join(messages) + tail, row)

    def _counted(self, text: str, row: dict[str, Any]) -> str:
        self.read_chars += len(text)
        if self.read_chars > MAX_READ_CHARS:
            raise RecorderError(f"the bodies read pass {MAX_READ_CHARS:,} characters in all at turn "
                                f"{row.get('request_id')!r}: read one session at a time (--session)")
        return text

    def _messages(self, prefix: int) -> list[str]:
        ids = []
        seen = set()
        while prefix:
            if prefix in seen or len(ids) >= MAX_CHAIN_MESSAGES:
                what = "loops back on itself" if prefix in seen else f"is over {MAX_CHAIN_MESSAGES:,} messages long"
                raise RecorderError(f"database is inconsistent: message prefix chain {prefix} {what}")
            seen.add(prefix)
            if prefix not in self._prefix_rows:
                self._load_prefix_chain(prefix)
            prefix, message_id = self._prefix_rows[prefix]
            ids.append(message_id)
        ids.reverse()
        missing = [i for i in set(ids) if i not in self._message_bodies]
        for chunk in range(0, len(missing), 500):
            part = missing[chunk : chunk + 500]
            marks = ",".join("?" * len(part))
            for mid, body in self.db.execute(f"SELECT id, body FROM messages WHERE id IN ({marks})", part):
                self._message_bodies[mid] = body
        try:
            return [self._message_bodies[i] for i in ids]
        finally:
            if len(self._message_bodies) > 4096:  # bound memory; a session's messages fit easily
                self._message_bodies.clear()

    def _load_prefix_chain(self, prefix: int) -> None:
        rows = self.db.execute(
            # UNION, not UNION ALL: a chain that loops (a crafted file) ends the walk at the repeat.
            "WITH RECURSIVE walk(id) AS (SELECT ? UNION SELECT p.parent FROM walk JOIN prefixes p"
            " ON p.id = walk.id WHERE p.parent != 0) SELECT p.id, p.parent, p.message_id FROM walk"
            " JOIN prefixes p ON p.id = walk.id",
            [prefix],
        ).fetchall()
        if not rows:
            raise RecorderError(f"database is inconsistent: message prefix {prefix} is missing")
        for pid, parent, message_id in rows:
            self._prefix_rows[pid] = (parent, message_id)


def turn_to_row(turn: Turn, bodies: BodyStore, redactor: Redactor = DEFAULT_REDACTOR) -> dict[str, Any]:
    """The `turn_log` row for `turn`, redacted, its messages (and its renderer's row) stored."""
    return store_row(redacted_row(turn, redactor), bodies, renderers_of([turn]))


def redacted_row(turn: Turn, redactor: Redactor = DEFAULT_REDACTOR,
                 shared: SharedItemTexts | None = None) -> dict[str, Any]:
    """`turn`'s row, redacted, with its body still as text (`_body`, `_body_json`):
    no database access, so the writer does this before its transaction begins.
    Everything stored passes through here, so this is the one place secrets are stopped.
    `shared`: turns whose bodies share item objects (an import) redact each item once."""
    split = shared.split(turn.request_body, _utf8) if shared is not None and turn.request_raw is None else None
    text, is_json = (split, True) if split is not None else body_text(turn, redactor)
    body = turn.request_body
    model = redactor.value(body.get("model")) if isinstance(body, dict) else None
    row = {
        "request_id": turn.request_id,
        "started_at": float(turn.started_at),
        # The session id comes from X-Session-Id, `user` or `prompt_cache_key`, all redacted where they sit.
        "session_id": redactor.text(turn.session_id) if turn.session_id is not None else None,
        "endpoint": turn.endpoint,
        "upstream": turn.upstream,
        "client_addr": turn.client_addr,
        "stream": int(bool(turn.stream)),
        "status": turn.status,
        "error": redactor.text(turn.error) if turn.error is not None else None,
        "model": model if isinstance(model, str) else None,
        "request_headers": _dumps(redactor.headers(turn.request_headers)),
        "response_text": redactor.text(turn.response_text or ""),
        "reasoning_text": redactor.text(turn.reasoning_text or ""),
        "tool_calls": None if turn.tool_calls is None else _dumps(redactor.value(turn.tool_calls)),
        "finish_reason": turn.finish_reason,
        # A count that is none (NaN, 1e29, a 30-digit integer) is unknown: NULL; `usage` keeps what was sent.
        "prompt_tokens": numbers.count(turn.prompt_tokens),
        "completion_tokens": numbers.count(turn.completion_tokens),
        "cached_tokens": numbers.count(turn.cached_tokens),
        "usage": None if turn.usage is None else _dumps(turn.usage),
        "ttft_s": numbers.seconds(turn.ttft_s),
        "total_s": numbers.seconds(turn.total_s),
        "chunk_times": _dumps(list(turn.chunk_times or [])),
        "render": None if turn.render is None and not turn.fixes else _dumps(
            {**(turn.render or {}), **({"fixes": turn.fixes} if turn.fixes else {})}),  # serve --fix entries
        "renderer_id": turn.renderer_id,
        "served_by": turn.served_by,
    }
    row = {k: _utf8(v) if isinstance(v, str) else v for k, v in row.items()}
    row["_body"], row["_body_json"] = (text if isinstance(text, SplitBody) else _utf8(text)), is_json
    return row


def store_row(row: dict[str, Any], bodies: BodyStore,
              renderers: Mapping[str, RendererInfo] | None = None) -> dict[str, Any]:
    """A `redacted_row` made a `turn_log` row: its body's messages stored (in the open transaction), and
    the row of the renderer it names when `renderers` (what the turns carried, by id) holds it."""
    row = dict(row)
    text, is_json = row.pop("_body"), row.pop("_body_json")
    row.update(bodies.put(text, is_json=is_json))
    if renderers and row.get("renderer_id") is not None:
        ensure_stored(bodies.db, renderers.get(row["renderer_id"]), bodies.renderer_ids)
    return row


def renderers_of(turns) -> dict[str, RendererInfo]:
    """The renderers `turns` carry, by id (recorder/renderers.py)."""
    return {turn.renderer.id: turn.renderer for turn in turns if turn.renderer is not None}


_TURN_FIELDS = {f.name for f in fields(Turn)}


def row_to_turn(row: dict[str, Any], bodies: BodyStore) -> Turn:
    data = dict(row)
    for col in JSON_COLUMNS:
        if data.get(col) is not None:
            data[col] = json.loads(data[col])
    text = bodies.text(row)
    if row["body_json"]:
        data["request_body"], data["request_raw"] = json.loads(text), text
    else:
        data["request_body"] = text
    data["stream"] = bool(data.get("stream"))
    for col in numbers.COUNT_FIELDS:  # a database written before counts were checked may hold anything
        data[col] = numbers.count(data.get(col))
    for col in numbers.SECONDS_FIELDS:
        data[col] = numbers.seconds(data.get(col))
    data["request_headers"] = data.get("request_headers") or {}
    data["chunk_times"] = data.get("chunk_times") or []
    data["response_text"] = data.get("response_text") or ""
    data["reasoning_text"] = data.get("reasoning_text") or ""
    # Columns without a Turn field (`model`, the body parts) are storage only.
    return Turn(**{k: v for k, v in data.items() if k in _TURN_FIELDS})


def write_turns(
    db: sqlite_utils.Database,
    turns: list[Turn],
    redactor: Redactor = DEFAULT_REDACTOR,
    bodies: BodyStore | None = None,
) -> None:
    """Writes `turns` in one transaction (all or nothing). A request_id that is
    already stored is replaced, so re-importing a file is idempotent. Items the
    turns' bodies share (a rebuilt transcript's history) are redacted and
    serialised once."""
    shared = SharedItemTexts(redactor)
    # The CPU work, outside the transaction.
    write_rows(db, [redacted_row(t, redactor, shared) for t in turns], bodies, renderers_of(turns))


def write_rows(db: sqlite_utils.Database, prepared: list[dict[str, Any]], bodies: BodyStore | None = None,
               renderers: Mapping[str, RendererInfo] | None = None) -> None:
    """Writes `redacted_row`s in one transaction (all or nothing), replacing rows of the same request id;
    `renderers`: the renderers their turns carried, by id, stored with the first row that names one."""
    bodies = bodies or BodyStore(db)
    try:
        with db.atomic():
            rows = [store_row(r, bodies, renderers) for r in prepared]
            db["turn_log"].insert_all(rows, pk="request_id", replace=True)
    except sqlite3.DatabaseError as exc:
        bodies.reset()
        raise RecorderError(f"writing turns failed: {exc}") from exc
    except BaseException:
        bodies.reset()
        raise
