"""The server secret that tenant salts are keyed with: 32 random bytes, hex, in one file.

It persists (default ``$KVLAB_HOME/tenants/secret``, or a path the operator gives) so a tenant's
salt is the same after a restart and a disk tier still serves it. It is created atomically: the
bytes go to a private temporary sibling that is hard-linked onto the name, which fails if another
process created it first (then that one's secret is read: two servers started at once agree). The
file is created ``0600``; a file that does not hold 64 hex digits is a TenantError, never replaced
(replacing it would silently orphan every salted entry on disk).

Why keyed: a salt enters block hashes, which ``--record`` traces and KV events publish. With a
salt anyone could compute from a tenant's name, those hashes would let a reader test guesses of
that tenant's prompts offline; keyed with a secret they cannot.

Example:
    >>> secret = load_secret(tmp / "secret")      # created on first use
    >>> secret == load_secret(tmp / "secret")     # and the same ever after
    True
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..errors import TenantError

SECRET_BYTES = 32


def default_path() -> Path:
    """``$KVLAB_HOME/tenants/secret`` (KVLAB_HOME defaults to ~/.cache/kvlab)."""
    from ..models.folders import kvlab_home

    return kvlab_home() / "tenants" / "secret"


def load_secret(path=None) -> bytes:
    """The secret at ``path`` (default :func:`default_path`), created first if missing.

    Example:
        >>> len(load_secret(tmp / "s"))
        32
    """
    path = Path(path) if path is not None else default_path()
    if not path.exists():
        _create(path)
    try:
        text = path.read_text(encoding="ascii").strip()
        value = bytes.fromhex(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TenantError(f"the tenant secret {path} is not {2 * SECRET_BYTES} hex digits ({e}); "
                          "restore it from a backup, or delete it to start over (salted entries "
                          "on disk are then unreachable)") from e
    if len(value) != SECRET_BYTES:
        raise TenantError(f"the tenant secret {path} holds {len(value)} bytes, not {SECRET_BYTES}; "
                          "restore it, or delete it to start over")
    return value


def _create(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise TenantError(f"cannot create the tenant secret {path}: {e.strerror}; pass a writable "
                          "path (--tenant-secret)") from e
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if it exists: the first creator's secret wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: exclusive create, then write
            _create_exclusive(path, tmp.read_text(encoding="ascii"))
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path: Path, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
