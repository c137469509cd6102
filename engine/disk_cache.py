"""The disk tier: one checksummed file per block, an LRU index rebuilt by scanning.

File layout (little-endian), `<dir>/<key[:2]>/<key hex>.blk`:

    magic  b"PTBLK\\x00\\x01\\x00"     8 bytes (format version 1)
    hlen   uint32                     length of the header
    header JSON, utf-8                {"format", "cache_format", "key", "parent", "tokens",
                                       "arrays": [{"name", "dtype", "np", "shape", "offset", "nbytes"}],
                                       "payload_bytes"}
    payload                           the arrays back to back, at their offsets
    crc    uint32                     zlib.crc32 of header + payload

`format` is "dense" today ("<layer>.k"/"<layer>.v" arrays); a codec (TurboQuant)
writes its own format name and arrays under the same layout, and its cache
format is part of the key chain, so the two never answer for each other.

The index is the directory: on start every header is read back (not the
payload) and a file whose header or size is wrong is deleted with one log
line. The payload's checksum is verified on every read; a mismatch, a short
file or a vanished file is a miss, never an exception and never wrong KV.

Writes run on a writer thread: the engine thread hands over host (numpy)
arrays or evaluated device arrays private to the disk path (on CUDA one flat
payload array the writer copies with the driver: engine/host_copy.py), and the
writer frames, checksums, writes (temp file + rename, so a
reader never sees half a block) and evicts least-recently-used unpinned files
past the byte budget. The index is shared with the engine thread under a lock.

Reads of a chain go ahead on a few reader threads (`get_many`): each reads
one whole file with one `preadv` into a fresh numpy buffer and checks its CRC
there (both release the GIL), a bounded window ahead of the engine thread,
which takes the verified arrays in chain order. The index is only touched
(LRU order, a damaged file dropped) as the engine thread takes a block, so a
walk that stops early leaves the blocks it did not use exactly as they were.
Reader threads never touch MLX or the index.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import stat
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.block_hash import chain_hash
from engine.cache_blocks import FlatBlock, host_view
from engine.private_files import open_private, private_dir
from prefixtrace.common.errors import EngineError

log = logging.getLogger("prefixtrace.cache")

MAGIC = b"PTBLK\x00\x01\x00"
_PREFIX = len(MAGIC) + 4
_CRC = 4
# Reader threads (their work is mostly waiting on the disk and CRC-32; 2 keep a
# single-queue virtual disk busy, more help an SSD's queue), and how far a chain
# read runs ahead of the engine thread: the files in flight (read or waiting to
# be taken) stay under READ_AHEAD_BYTES (at least one), which bounds the host
# memory a restore holds beyond its blocks.
READ_THREADS = max(2, min(4, os.cpu_count() or 2))
READ_AHEAD_BYTES = 128 << 20
# A real header is the token ids of one block plus a few array specs: tens of KB
# even for 65,536-token blocks. Anything longer is not ours.
MAX_HEADER_BYTES = 4 << 20
# Opening a block file never waits (a FIFO planted as *.blk would block forever
# without O_NONBLOCK) and never follows a symlink out of the cache directory.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class CacheDirUnusable(EngineError):
    """`--cache-dir` names something that cannot be the cache's directory (a file, no permission)."""


class CorruptBlock(Exception):
    """A block file that cannot be trusted (internal: always turned into a miss)."""


@dataclass(slots=True)
class _Entry:
    parent: bytes
    tokens: tuple[int, ...]
    size: int


def encode_header(*, fmt: str, cache_format: str, key: bytes, parent: bytes, tokens, arrays) -> tuple[bytes, list]:
    """The header bytes and the payload buffers, in order. `arrays`: {name: (array, dtype)}, or
    a `FlatBlock` (engine/cache_blocks.py) whose one payload is already laid out; the same bytes."""
    specs, buffers, offset = [], [], 0
    if isinstance(arrays, FlatBlock):
        specs = [{"name": name, "dtype": dtype, "np": np_dtype, "shape": shape, "offset": off, "nbytes": n}
                 for name, dtype, np_dtype, shape, off, n in arrays.specs]
        payload = arrays.payload()  # the device-to-host copy, on the writer thread
        buffers.append(memoryview(payload).cast("B"))
        offset = payload.nbytes
    for name, (a, dtype) in ({} if isinstance(arrays, FlatBlock) else arrays).items():
        a = np.ascontiguousarray(host_view(a))  # an evaluated MLX array is read here, on the writer thread
        specs.append({"name": name, "dtype": dtype, "np": a.dtype.str, "shape": list(a.shape),
                      "offset": offset, "nbytes": a.nbytes})
        buffers.append(memoryview(a).cast("B"))
        offset += a.nbytes
    header = {"format": fmt, "cache_format": cache_format, "key": key.hex(), "parent": parent.hex(),
              "tokens": list(tokens), "arrays": specs, "payload_bytes": offset}
    return json.dumps(header, separators=(",", ":")).encode(), buffers


def _parse_header(raw: bytes) -> tuple[dict, int]:
    """The header's JSON, checked for the shape the reader relies on, and its payload size.

    A block file is input like any other (docs/SECURITY.md): `payload_bytes: 1e999`,
    a header nested thousands deep or a list where a number belongs is a CorruptBlock,
    never an OverflowError or RecursionError that would stop start-up."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the interpreter's limit
        raise CorruptBlock(f"unreadable header: {type(exc).__name__}") from exc
    if not isinstance(header, dict):
        raise CorruptBlock("unreadable header: not an object")
    payload = header.get("payload_bytes")
    tokens, arrays = header.get("tokens"), header.get("arrays")
    if not (type(payload) is int and payload >= 0 and isinstance(tokens, list) and isinstance(arrays, list)
            and all(type(t) is int for t in tokens) and isinstance(header.get("key"), str)
            and isinstance(header.get("parent"), str) and all(_array_spec_ok(a) for a in arrays)):
        raise CorruptBlock("unreadable header: fields of the wrong type")
    return header, payload


def _array_spec_ok(spec) -> bool:
    return (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("np"), str)
            and isinstance(spec.get("shape"), list) and all(type(d) is int and d >= 0 for d in spec["shape"])
            and type(spec.get("offset")) is int and spec["offset"] >= 0)


def read_header(f) -> tuple[dict, int]:
    """The parsed header and the file's expected total size; raises CorruptBlock."""
    prefix = f.read(_PREFIX)
    if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptBlock("bad magic or short file")
    hlen = int.from_bytes(prefix[len(MAGIC):], "little")
    if hlen > MAX_HEADER_BYTES:
        raise CorruptBlock(f"header of {hlen:,} bytes (the most a block's header can be is {MAX_HEADER_BYTES:,})")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise CorruptBlock("truncated header")
    header, payload = _parse_header(raw)
    return header, _PREFIX + hlen + payload + _CRC


def decode(data) -> tuple[dict, dict]:
    """Verify a whole file's bytes (any buffer); the header and {name: (array view, dtype)}."""
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX or data[: len(MAGIC)] != MAGIC:
        raise CorruptBlock("bad magic or short file")
    hlen = int.from_bytes(data[len(MAGIC) : _PREFIX], "little")
    if hlen > MAX_HEADER_BYTES:
        raise CorruptBlock(f"header of {hlen:,} bytes")
    header, payload_bytes = _parse_header(bytes(data[_PREFIX : _PREFIX + hlen]))
    total = _PREFIX + hlen + payload_bytes + _CRC
    if len(data) != total:
        raise CorruptBlock(f"size {len(data)} != {total}")
    if zlib.crc32(data[_PREFIX : total - _CRC]) != int.from_bytes(data[total - _CRC :], "little"):
        raise CorruptBlock("checksum mismatch")
    payload = data[_PREFIX + hlen : total - _CRC]
    arrays = {}
    for spec in header["arrays"]:
        a = np.frombuffer(payload, dtype=np.dtype(spec["np"]), count=int(np.prod(spec["shape"])), offset=spec["offset"])
        arrays[spec["name"]] = (a.reshape(spec["shape"]), spec["dtype"])
    return header, arrays


def check_key(header: dict, key: bytes) -> None:
    """Raise CorruptBlock unless the header's key is `key` and is the hash of its parent and tokens.

    The key names the block's exact prefix; a header that passes the CRC but
    whose parent or tokens disagree with its key would otherwise answer for
    another prefix (wrong KV), so this is checked on every read and scan.
    """
    try:
        ok = (header["key"] == key.hex() and isinstance(header["tokens"], list)
              and chain_hash(bytes.fromhex(header["parent"]), header["tokens"]) == key)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from exc
    if not ok:
        raise CorruptBlock("header key, parent and tokens do not match the file's key")


def _unlink(path: Path) -> None:
    """Delete a file if possible: a read-only cache directory keeps it (still a miss)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("prefix cache: could not delete %s (%s)", path, exc)


def open_regular(path: Path) -> int:
    """An fd on `path` for reading, only if it is a regular file (not a FIFO, device,
    directory or symlink); raises CorruptBlock otherwise, OSError if it cannot be opened."""
    fd = os.open(path, _OPEN_FLAGS)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptBlock("not a regular file")
    return fd


def read_file(path: Path) -> np.ndarray:
    """A whole file in one fresh buffer: one open, one fstat, one `preadv` (more only for a short read)."""
    fd = open_regular(path)
    try:
        buf = np.empty(os.fstat(fd).st_size, np.uint8)
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:  # the file shrank under us: decode() reports the short size
                return buf[:done]
            done += n
        return buf
    finally:
        os.close(fd)


class BlockReads:
    """Blocks of a chain read ahead on the reader threads; `take` them in order.

    A context manager: leaving it cancels the reads not yet started (the
    running ones finish and are dropped, with no effect on the index).
    """

    def __init__(self, disk: DiskCache, keys: list[bytes]):
        self._disk, self._keys, self._next = disk, list(keys), 0
        self._ahead: dict[bytes, tuple[Future, int]] = {}
        self._bytes = 0
        self._fill()

    def _fill(self) -> None:
        while self._next < len(self._keys):
            key = self._keys[self._next]
            size = self._disk._size(key)
            if self._ahead and self._bytes + size > READ_AHEAD_BYTES:
                return
            self._next += 1
            if key not in self._ahead:
                self._ahead[key] = (self._disk._pool().submit(self._disk._read, key), size)
                self._bytes += size

    def take(self, key: bytes) -> tuple[dict, dict] | None:
        """What `DiskCache.get(key)` gives, from the read ahead when there is one."""
        future, size = self._ahead.pop(key, (None, 0))
        self._bytes -= size
        self._fill()
        if future is None:
            return self._disk.get(key)
        return self._disk._settle(key, future.result)

    def close(self) -> None:
        for future, _ in self._ahead.values():
            future.cancel()
        self._ahead.clear()
        self._bytes, self._next = 0, len(self._keys)

    def __enter__(self) -> BlockReads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiskCache:
    def __init__(self, root: str | Path, *, max_bytes: int):
        try:
            self.root = private_dir(Path(root))  # files hold prompt token ids: owner-only (engine/private_files.py)
        except OSError as exc:
            raise CacheDirUnusable(f"the prefix cache directory {root} cannot be used: {exc.strerror or exc}") from exc
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._children: dict[bytes, set[bytes]] = {}
        self._pins: dict[bytes, int] = {}
        self._pending: set[bytes] = set()
        self.nbytes = 0
        self.num_corrupt = 0
        self.evictions = 0  # files dropped for room: read by the recorder (a server-side miss's cause)
        self.bytes_written = 0
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="prefixtrace-cache-writer", daemon=True)
        self._writer.start()
        self._readers: ThreadPoolExecutor | None = None  # started by the first chain read

    # --- asking (engine thread) -----------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def children(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        with self._lock:
            return [(k, self._index[k].tokens) for k in self._children.get(parent, ())]

    def get(self, key: bytes) -> tuple[dict, dict] | None:
        """The block's header and arrays, verified; None (a miss) for anything wrong."""
        return self._settle(key, lambda: self._read(key))

    def get_many(self, keys: list[bytes]) -> BlockReads:
        """Read these blocks ahead (in order, a bounded window at a time) for `take`-ing in that order:

            with disk.get_many(keys) as reads:
                for key in keys:
                    found = reads.take(key)   # as get(key)
        """
        return BlockReads(self, keys)

    def _read(self, key: bytes) -> tuple[dict, dict]:
        """Read and verify one file (any thread: no index, no MLX); raises on anything wrong."""
        header, arrays = decode(read_file(self._path(key)))
        check_key(header, key)
        return header, arrays

    def _settle(self, key: bytes, read) -> tuple[dict, dict] | None:
        """The engine thread takes one read (`read()` gives it or raises why not): the index
        learns of a hit or of a damaged file."""
        path = self._path(key)
        try:
            header, arrays = read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except (CorruptBlock, OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError) as exc:
            self.num_corrupt += 1
            log.warning("prefix cache: dropping corrupt block file %s (%s); treated as a miss", path, exc)
            self._forget(key, unlink=True)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # the LRU order survives a restart through mtimes
        except OSError:
            pass
        return header, arrays

    def _size(self, key: bytes) -> int:
        with self._lock:
            entry = self._index.get(key)
        return entry.size if entry is not None else 0

    def _pool(self) -> ThreadPoolExecutor:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="prefixtrace-cache-reader")
        return self._readers

    # --- acting ---------------------------------------------------------------

    def put(self, key: bytes, parent: bytes, tokens, arrays: dict, *, fmt: str, cache_format: str) -> None:
        """Queue one block for writing; `arrays` ({name: (array, dtype)}) are numpy arrays or
        evaluated MLX arrays nothing else writes to, which the writer may keep."""
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending.add(key)
        self._queue.put((key, parent, tuple(tokens), arrays, fmt, cache_format))

    def discard(self, key: bytes) -> None:
        self._forget(key, unlink=True)

    def pin(self, key: bytes) -> None:
        with self._lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pins

    def unpin(self, key: bytes) -> None:
        with self._lock:
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def flush(self) -> None:
        """Wait until every queued block is on disk (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(10)
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
            self._readers = None

    # --- the writer thread ----------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full or read-only disk must not kill the writer
                log.exception("prefix cache: could not write a block")
                with self._lock:
                    self._pending.discard(item[0])
            finally:
                self._queue.task_done()

    def _write(self, key, parent, tokens, arrays, fmt, cache_format) -> None:
        header, buffers = encode_header(fmt=fmt, cache_format=cache_format, key=key, parent=parent,
                                        tokens=tokens, arrays=arrays)
        size = _PREFIX + len(header) + sum(b.nbytes for b in buffers) + _CRC
        if not self._make_room(size, parent):
            with self._lock:
                self._pending.discard(key)
            return
        path = self._path(key)
        private_dir(path.parent)  # made on first use, or again if it was removed under us
        tmp = path.with_name(f".{path.name}.tmp")
        crc = zlib.crc32(header)
        with os.fdopen(open_private(tmp), "wb") as f:
            f.write(MAGIC + len(header).to_bytes(4, "little"))
            f.write(header)
            for b in buffers:
                f.write(b)
                crc = zlib.crc32(b, crc)
            f.write(crc.to_bytes(4, "little"))
        os.replace(tmp, path)
        with self._lock:
            self._pending.discard(key)
            self._add(key, _Entry(parent, tokens, size))
        self.bytes_written += size

    def _make_room(self, size: int, parent: bytes) -> bool:
        if size > self.max_bytes:
            return False
        victims = []
        with self._lock:
            keep, p = set(), parent
            while p in self._index and p not in keep:
                keep.add(p)
                p = self._index[p].parent
            while self.nbytes + size > self.max_bytes:
                # Leaves first, least recently used first, never the new block's
                # own ancestors (see memory_cache.py); none left: skip the write.
                victim = next((k for k in self._index
                               if k not in self._pins and k not in self._children and k not in keep), None)
                if victim is None:
                    break
                victims.append(victim)
                self._remove(victim)
                self.evictions += 1
            fits = self.nbytes + size <= self.max_bytes
        for key in victims:
            _unlink(self._path(key))
        return fits

    # --- index ----------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}.blk"

    def _add(self, key: bytes, entry: _Entry) -> None:
        self._index[key] = entry
        self._children.setdefault(entry.parent, set()).add(key)
        self.nbytes += entry.size

    def _remove(self, key: bytes) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.size
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.parent]

    def _forget(self, key: bytes, *, unlink: bool = False) -> None:
        with self._lock:
            self._remove(key)
        if unlink:
            _unlink(self._path(key))

    def _files(self):
        """(path, lstat) of every entry one level below the root's real subdirectories: symlinks are
        never followed and a directory that cannot be listed is skipped, with a log line."""
        try:
            subdirs = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("prefix cache: cannot list %s (%s); starting empty", self.root, exc)
            return
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
                if stat.S_IMODE(sub.stat(follow_symlinks=False).st_mode) & 0o077:
                    os.chmod(sub.path, 0o700)  # left by an older version: owner-only, like new ones
            except OSError as exc:
                log.warning("prefix cache: cannot list %s (%s); its blocks are misses", sub.path, exc)
                continue
            for entry in entries:
                try:
                    yield Path(entry.path), entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished while listing

    def _scan(self) -> None:
        """Rebuild the index from the files' headers; LRU order from their mtimes. Whatever the
        directory holds, a bad file is one log line and a miss (deleted when it is ours to delete:
        special files, symlinks, damaged blocks); start-up never fails or waits on one."""
        found = []
        for path, st in self._files():
            if path.name.endswith(".tmp"):  # a write cut short by a crash
                _unlink(path)
                continue
            if not path.name.endswith(".blk"):
                continue
            try:
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptBlock("not a regular file")
                if stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(path, 0o600)  # prompt content: owner-only (engine/private_files.py)
                with os.fdopen(open_regular(path), "rb") as f:
                    header, total = read_header(f)
                if st.st_size != total:
                    raise CorruptBlock(f"size {st.st_size} != {total}")
                key = bytes.fromhex(header["key"])
                if path.name != f"{key.hex()}.blk":
                    raise CorruptBlock("file name does not match its key")
                check_key(header, key)
                entry = _Entry(bytes.fromhex(header["parent"]), tuple(header["tokens"]), total)
            except (CorruptBlock, OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError) as exc:
                self.num_corrupt += 1
                log.warning("prefix cache: dropping corrupt block file %s (%s)", path, exc)
                if not stat.S_ISDIR(st.st_mode):
                    _unlink(path)
                continue
            found.append((st.st_mtime_ns, key, entry))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._add(key, entry)
        if found:
            log.info("prefix cache: %d blocks (%.1f MB) on disk in %s", len(self._index), self.nbytes / 1e6, self.root)
