"""What rendered and counted a recorded prompt: one `renderers` row per model, shared by its turns.

The analyzer must count a prompt the way the server did, or its numbers disagree with the server's
own (`usage.prompt_tokens`, `cached_tokens`). So the proxy records, per turn, the id of the renderer
that built the prompt, and the database keeps each renderer once:

    id                 sha256 of the template, the special tokens and the tokenizer's sha256 (hex, 16 chars)
    source             "embedded" (the engine's own model) or "upstream" (a template the upstream publishes)
    model              the served model's name
    chat_template      the Jinja chat template text
    special            JSON: bos_token, eos_token, pad_token, unk_token (what templates read besides messages)
    tokenizer          the model's tokenizer.json, zlib-compressed; NULL when unknown or past MAX_TOKENIZER_BYTES
    tokenizer_sha256   sha256 of tokenizer.json as it was when recorded (NULL when unknown)
    tokenizer_path     where it was (the model directory's tokenizer.json), for a copy too big to store
    created_at         unix seconds of the first turn that used it

Why the tokenizer's content and not only its path: the database is what people copy to another machine
to analyse, and a model cache may be gone by then. A tokenizer.json is 2-11 MB (SmolLM2 2.1 MB, Qwen3
11 MB) and compresses to about a quarter; once per model that is small next to a day's traffic. Past
MAX_TOKENIZER_BYTES only the path and hash are kept, for a person to read: the analyzer never opens a
recorded path (a database may come from anyone, and the path could name a FIFO or /dev/zero).

The backend that renders a prompt owns its renderer (the engine backend its model's, an upstream backend
the template its upstream published) and hands it to each turn it answers (`TurnBuilder.on_renderer`);
an imported file's turns get the renderer lines the file carries. The recorder stores the row the first
time a turn carries it (`ensure_stored`, in the turn's transaction); the turn's row keeps only the id.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MAX_TOKENIZER_BYTES = 64 << 20
# A chat template is a few KB (the largest published ones ~100 KB); past this it is not stored or used.
MAX_TEMPLATE_CHARS = 1 << 20


@dataclass
class RendererInfo:
    source: str  # "embedded" | "upstream"
    model: str
    chat_template: str | None
    special: dict[str, str] = field(default_factory=dict)
    tokenizer_json: str | None = None  # the file's text; None when unknown or too big to store
    tokenizer_sha256: str | None = None
    tokenizer_path: str | None = None
    id: str = ""
    tokenizer_problem: str | None = None  # why a stored tokenizer could not be read back (load_all)

    def __post_init__(self) -> None:
        if not self.id:
            key = json.dumps([self.chat_template, self.special, self.tokenizer_sha256], sort_keys=True)
            self.id = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def from_model_dir(model: str, model_dir: str | Path, chat_template: str | None, special: dict[str, Any]) -> RendererInfo:
    """The renderer of an engine's model: its template as the tokenizer holds it and its tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    text = digest = None
    try:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) <= MAX_TOKENIZER_BYTES:
            text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    specials = {k: v for k, v in special.items() if isinstance(v, str)}
    return RendererInfo("embedded", model, chat_template, specials, text, digest, str(path) if digest else None)


def with_renderer(turn, renderers: dict[str, RendererInfo]):
    """`turn` carrying the renderer it names, from `renderers` (an imported file's renderer lines, by id)."""
    if turn.renderer_id is None or turn.renderer_id not in renderers:
        return turn
    return replace(turn, renderer=renderers[turn.renderer_id])


def create_table(db) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS renderers (id TEXT PRIMARY KEY NOT NULL, source TEXT, model TEXT,"
        " chat_template TEXT, special TEXT, tokenizer BLOB, tokenizer_sha256 TEXT, tokenizer_path TEXT,"
        " created_at REAL)"
    )


def ensure_stored(db, info: RendererInfo | None, known: set[str]) -> None:
    """Stores renderer `info` unless the database has it (`known`: ids seen in this connection). A
    turn whose renderer is not at hand (a spool replayed by another process after a restart) leaves
    none: its turns then read as "renderer not recorded", never as another renderer."""
    if info is None or info.id in known:
        return
    renderer_id = info.id
    if db.execute("SELECT 1 FROM renderers WHERE id = ?", [renderer_id]).fetchone() is None:
        blob = zlib.compress(info.tokenizer_json.encode("utf-8"), 6) if info.tokenizer_json is not None else None
        db.execute("INSERT INTO renderers (id, source, model, chat_template, special, tokenizer, tokenizer_sha256,"
                   " tokenizer_path, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   [info.id, info.source, info.model, info.chat_template, json.dumps(info.special), blob,
                    info.tokenizer_sha256, info.tokenizer_path, time.time()])
    known.add(renderer_id)


def load_all(db) -> dict[str, RendererInfo]:
    """Every stored renderer by id (an old database without the table: none)."""
    if "renderers" not in db.table_names():
        return {}
    out = {}
    for row in db.execute("SELECT id, source, model, chat_template, special, tokenizer, tokenizer_sha256,"
                          " tokenizer_path FROM renderers").fetchall():
        rid, source, model, template, special, blob, digest, path = row
        text, problem = _tokenizer_text(blob)
        try:
            specials = json.loads(special or "{}")
        except (ValueError, RecursionError):
            specials = None
        if not isinstance(specials, dict):
            specials = {}
        specials = {k: v for k, v in specials.items() if isinstance(k, str) and isinstance(v, str)}
        if template is not None and (not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS):
            template = None  # a template past the bound is not one a server renders with: "no chat template"
        out[rid] = RendererInfo(str(source), str(model), template, specials, text, digest, path, str(rid), problem)
    return out


def _tokenizer_text(blob: Any) -> tuple[str | None, str | None]:
    """A stored tokenizer's text, inflated to at most MAX_TOKENIZER_BYTES (a small blob can inflate to
    gigabytes); (None, why) when it is past that or not zlib-compressed UTF-8."""
    if blob is None:
        return None, None
    if not isinstance(blob, bytes):
        return None, "the stored tokenizer is not a compressed file"
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(blob, MAX_TOKENIZER_BYTES + 1)
    except zlib.error:
        return None, "the stored tokenizer is damaged"
    if len(data) > MAX_TOKENIZER_BYTES or inflater.unconsumed_tail:
        return None, f"the stored tokenizer inflates past {MAX_TOKENIZER_BYTES >> 20} MiB"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "the stored tokenizer is not UTF-8 text"


RECORD_KEY = "renderer"  # a JSONL line {"renderer": {...}}, and HAR's log._prefixtrace_renderers list


def to_record(info: RendererInfo) -> dict[str, Any]:
    """A renderer as exports carry it (docs/FORMATS.md): what `analyze` needs to count an exported file
    as it counts the database, the tokenizer.json as text (null when too big to store)."""
    return {"id": info.id, "source": info.source, "model": info.model, "chat_template": info.chat_template,
            "special": info.special, "tokenizer_json": info.tokenizer_json, "tokenizer_sha256": info.tokenizer_sha256}


def from_record(obj: Any) -> RendererInfo | None:
    """An exported renderer, None when it is not one. The path of a tokenizer too big to store is not
    taken from a file: a file is not to name what the reader's machine opens."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(obj.get("model"), str):
        return None
    template, tok = obj.get("chat_template"), obj.get("tokenizer_json")
    special = obj.get("special") if isinstance(obj.get("special"), dict) else {}
    digest = obj.get("tokenizer_sha256")
    return RendererInfo(str(obj.get("source") or "embedded"), obj["model"],
                        template if isinstance(template, str) else None,
                        {k: v for k, v in special.items() if isinstance(k, str) and isinstance(v, str)},
                        tok if isinstance(tok, str) else None, digest if isinstance(digest, str) else None,
                        None, obj["id"])
