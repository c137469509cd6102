"""opencode: placeholder until the format is recorded."""
from __future__ import annotations
from pathlib import Path
HARNESS = "opencode"
def looks_like_dir(p: Path) -> bool: return False
def looks_like_file(p: Path) -> bool: return False
def find_storage(p: Path): return None
def read(p: Path): return []
