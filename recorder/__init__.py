"""The recorder: stores every proxied turn in SQLite, and reads it back."""

from recorder.jsonl import export_jsonl, import_jsonl, read_jsonl
from recorder.reader import db_info, iter_turns
from recorder.redact import DEFAULT_PATTERNS, DROPPED_HEADERS, REDACTED, Redactor
from recorder.schema import MIGRATIONS, SCHEMA_VERSION
from recorder.store import Recorder
from recorder.turn import Turn

__all__ = sorted(
    [
        "DEFAULT_PATTERNS",
        "DROPPED_HEADERS",
        "MIGRATIONS",
        "REDACTED",
        "Recorder",
        "Redactor",
        "SCHEMA_VERSION",
        "Turn",
        "db_info",
        "export_jsonl",
        "import_jsonl",
        "iter_turns",
        "read_jsonl",
    ]
)
