"""The recorder: stores every proxied turn in SQLite, and reads it back."""

from recorder.jsonl import export_jsonl, import_jsonl, read_jsonl
from recorder.reader import db_info, iter_turns
from recorder.redact import DEFAULT_PATTERNS, DROPPED_HEADERS, REDACTED, Redactor
from recorder.schema import MIGRATIONS, SCHEMA_VERSION
from recorder.sources import export, import_file, load_turns
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
        "export",
        "export_jsonl",
        "import_file",
        "import_jsonl",
        "iter_turns",
        "load_turns",
        "read_jsonl",
    ]
)
