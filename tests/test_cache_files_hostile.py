"""Issue 14, findings 8 and 10: the disk cache's files are owner-only, and start-up survives
anything in the cache directory.

Driven through a real server on the tiny engine with a disk tier (finding 8: a prompt with a
secret, then the files' modes and the token ids decoded back), and `prefixtrace serve` as a
subprocess on a cache directory planted with hostile files (finding 10).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from engine.engine import Engine
from engine.spill import SpillStore
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import TINY_MODEL, running_server

SECRET = "AKIAIOSFODNN7EXAMPLE wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def open_umask():
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_cache_files_are_owner_only_and_hold_the_prompt(tmp_path, recorder, open_umask):
    cache_dir = tmp_path / "cache"
    stale = cache_dir / "ab" / ("ab" + "0" * 62 + ".blk")  # a file an older version left world-readable
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not a block")
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", cache_dir=cache_dir, block_size=16).start()
    engine.wait_ready(60)
    try:
        with running_server(create_app(EngineBackend(engine), recorder)) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"my keys are {SECRET}; keep them safe " * 4}],
                "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        engine.prefix_cache.flush()
        tokenizer = engine.tokenizer
    finally:
        engine.shutdown()
    blocks = list(cache_dir.rglob("*.blk"))
    assert blocks
    modes = _modes(cache_dir)
    for name, mode in modes.items():
        is_dir = (cache_dir / name).is_dir() if name != "." else True
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))
    # What the files hold is the prompt: token ids decode straight back to it (docs/CACHE.md).
    from engine.disk_cache import read_header

    headers = []
    for path in blocks:
        with open(path, "rb") as f:
            headers.append(read_header(f)[0])
    by_parent = {h["parent"]: h for h in headers}
    block = next(h for h in headers if h["parent"] not in {h["key"] for h in headers})
    chain = []
    while block is not None:  # the chain from its first block: the prompt in order
        chain += block["tokens"]
        block = by_parent.get(block["key"])
    assert SECRET in tokenizer.decode(chain)


def test_spill_files_are_owner_only(tmp_path, open_umask):
    store = SpillStore(tmp_path / "spill")
    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4)))
    path = store.spill("req-1", [layer])
    assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    default = SpillStore()  # a private temporary directory
    assert stat.S_IMODE(default.dir.stat().st_mode) == 0o700


def test_an_old_world_readable_cache_is_tightened_at_start(tmp_path, open_umask):
    from engine.disk_cache import DiskCache

    from engine.block_hash import chain_hash

    disk = DiskCache(tmp_path / "c", max_bytes=1 << 20)
    disk.put(chain_hash(b"\x00" * 16, [1, 2]), b"\x00" * 16, [1, 2], {"x": (_np_ones(), "float32")},
             fmt="dense", cache_format="t")
    disk.close()
    (path,) = (tmp_path / "c").rglob("*.blk")
    path.chmod(0o644)
    path.parent.chmod(0o755)
    DiskCache(tmp_path / "c", max_bytes=1 << 20).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def _np_ones():
    import numpy as np

    return np.ones((2,), np.float32)


# --- finding 10: start-up survives any content of the cache directory ------------------


def _block(header: bytes | str, hlen: int | None = None) -> bytes:
    from engine.disk_cache import MAGIC

    raw = header.encode() if isinstance(header, str) else header
    return MAGIC + (len(raw) if hlen is None else hlen).to_bytes(4, "little") + raw + b"\0" * 8


def _planted_name(i: int) -> str:
    return f"{i:02x}" + "ab" * 31 + f"{i:02x}.blk"


def _plant(cache: Path) -> int:
    """Hostile entries the probe planted (and a few more); returns how many are block-named."""
    name = _planted_name
    files = {
        1: _block('{"format":"dense","key":"00","parent":"00","tokens":[1],"arrays":[],"payload_bytes":1e999}'),
        2: _block("[" * 200_000 + "]" * 200_000),
        3: _block("{}", hlen=0xFFFFFFFF),
        4: _block('{"format":"dense","key":"00","parent":"00","tokens":[1],"arrays":[],"payload_bytes":-5}'),
        5: _block('{"format":"dense","key":"00","parent":"00","tokens":[[1]],"arrays":[{}],"payload_bytes":3}'),
        6: b"\xff" * 3,
    }
    for i, data in files.items():
        d = cache / f"{i:02x}"
        d.mkdir(parents=True, exist_ok=True)
        (d / name(i)).write_bytes(data)
    (cache / "07").mkdir()
    os.mkfifo(cache / "07" / name(7))  # opened without O_NONBLOCK, start-up waits forever
    (cache / "08").mkdir()
    (cache / "08" / name(8)).symlink_to("/dev/zero")
    (cache / "09" / name(9)).mkdir(parents=True)
    (cache / "0a").symlink_to("/")  # a directory link is never walked
    os.mkfifo(cache / "top-level-fifo")
    return 9


@pytest.mark.slow
def test_serve_starts_whatever_the_cache_directory_holds(tmp_path):
    from tests.test_cli_serve import serve_process

    cache = tmp_path / "cache"
    planted = _plant(cache)
    with serve_process(["--model", str(TINY_MODEL), "--cache-dir", str(cache), "--block-size", "16"], cwd=tmp_path,
                       ready_timeout=90) as (url, proc):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hello there, a prompt of a few blocks " * 3}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    log = proc.stdout.read()
    assert log.count("dropping corrupt block file") == planted, log  # one line each (a .blk directory is kept)
    assert "could not load model" not in log and "Traceback" not in log
    assert (cache / "0a").is_symlink() and (cache / "09").is_dir()
    for i in (1, 7, 8):
        # bad files are deleted, FIFO and symlink included (only the planted names: the request's own
        # blocks may land in any directory, as their keys hash the model's files, mtimes included)
        assert not os.path.lexists(cache / f"{i:02x}" / _planted_name(i))


def test_a_fifo_swapped_in_at_runtime_is_a_miss_not_a_hang(tmp_path):
    from engine.disk_cache import DiskCache

    disk = DiskCache(tmp_path / "c", max_bytes=1 << 20)
    key = b"\x22" * 16
    disk.put(key, b"\x00" * 16, [1, 2], {"x": (_np_ones(), "float32")}, fmt="dense", cache_format="t")
    disk.flush()
    path = disk._path(key)
    path.unlink()
    os.mkfifo(path)
    assert disk.get(key) is None and disk.num_corrupt == 1
    disk.close()


@pytest.mark.slow
def test_an_unusable_cache_directory_is_named_not_blamed_on_the_model(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port

    (tmp_path / "file").write_text("a file where a directory should be")
    not_a_dir = tmp_path / "file" / "cache"
    done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "serve", "--model", str(TINY_MODEL),
                           "--cache-dir", str(not_a_dir), "--port", str(free_port()), "--db", str(tmp_path / "t.db")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert "could not load model" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert f"the prefix cache directory {not_a_dir} cannot be used" in done.stderr
