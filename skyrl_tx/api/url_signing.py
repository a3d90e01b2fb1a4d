"""Download URL signatures (checkpoint files, session traces): HMAC-SHA256 under the server's signing secret,
and where that secret lives.

The secret is --url-signing-secret (or its file / environment variable, see cli.py); by default a random one kept in
the data directory (mode 0600), so the URLs a server issued still work after it restarts. Servers behind one
address (replicas) must share one secret: set it on each.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import uuid
from pathlib import Path

from skyrl_tx.errors import InvalidArgumentError

log = logging.getLogger("skyrl_tx.api")

SECRET_FILE = "url_signing_secret"  # in the data directory
MIN_SECRET_CHARS = 16


def sign(secret: bytes, message: str) -> str:
    """HMAC-SHA256 of `message` under the server's secret: every signed URL (checkpoint files, session traces) names
    what it opens, its expiry and the API key it was issued to in `message`, each kind with a shape of its own."""
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def sign_matches(secret: bytes, message: str, sig: str) -> bool:
    # compare_digest takes ASCII strings only: any other character cannot be part of a hex signature anyway
    return sig.isascii() and hmac.compare_digest(sign(secret, message), sig)


def signature(secret: bytes, checkpoint: int, file: str, expires: int, key_id: str) -> str:
    """Signs the file, the expiry and the API key the URL was issued to ("" without keys): the download checks that
    key is still valid, so a revoked key's URLs stop working at once rather than when they expire."""
    return sign(secret, f"{checkpoint}/{file}/{expires}/{key_id}")


def signature_matches(secret: bytes, checkpoint: int, file: str, expires: int, key_id: str, sig: str) -> bool:
    return sign_matches(secret, f"{checkpoint}/{file}/{expires}/{key_id}", sig)


def check_secret(secret: str, source: str) -> None:
    if len(secret) < MIN_SECRET_CHARS:
        raise InvalidArgumentError(f"{source}: the URL signing secret must be at least {MIN_SECRET_CHARS} characters "
                                   f"(got {len(secret)}); e.g. python -c 'import secrets; print(secrets.token_hex(32))'")


def signing_secret(configured: str | None, data_dir: Path) -> bytes:
    """The configured secret, else the one persisted in `data_dir` (created on first use, mode 0600)."""
    if configured:
        check_secret(configured, "--url-signing-secret")
        return configured.encode()
    return _persisted_secret(data_dir)


def _persisted_secret(data_dir: Path) -> bytes:
    path = data_dir / SECRET_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        # Written whole under a private name, then linked into place: a server starting at the same moment either
        # wins the link or reads the winner's complete file, never a half-written one.
        partial = data_dir / f".{SECRET_FILE}.{uuid.uuid4().hex[:12]}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
            try:
                os.link(partial, path)
                log.info("created the URL signing secret %s (mode 0600; keep it: issued download URLs depend on it)",
                         path)
            except FileExistsError:
                pass
        finally:
            partial.unlink()
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("%s is readable by other users (mode %o): run chmod 600 %s", path, mode, path)
    secret = path.read_text().strip()
    check_secret(secret, str(path))
    return secret.encode()
