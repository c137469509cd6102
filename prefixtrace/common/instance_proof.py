"""How a running `prefixtrace serve` proves it is the user's own: the answer to a nonce.

`serve` keeps a random secret in a file only its user can read (prefixtrace/instance_key.py)
and answers `GET /prefixtrace/instance?nonce=N` with HMAC-SHA256(secret, nonce + database path)
and that path. `prefixtrace run` reads the same file and checks the answer before it hands a
harness's credentials to the proxy, so another process answering /health on the port gets none.
"""

from __future__ import annotations

import hashlib
import hmac

PROOF_PATH = "/prefixtrace/instance"


def proof(secret: bytes, nonce: str, db: str) -> str:
    return hmac.new(secret, f"{nonce}\n{db}".encode(), hashlib.sha256).hexdigest()


def verify(secret: bytes, nonce: str, db: str, answer: str) -> bool:
    return hmac.compare_digest(proof(secret, nonce, db), answer)
