"""The cluster key: 32 random bytes every member holds, its text form, its file, its public id."""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from errors import ConfigError

KEY_BYTES = 32
KEY_PREFIX = "tandem-"
KEY_TEXT_CHARS = 43  # urlsafe base64 of 32 bytes, without padding
CLUSTER_ID_LABEL = b"tandem cluster id v1"
KEY_FILE_MODE = 0o600
KEY_DIR_MODE = 0o700

_KEY_BODY = re.compile(rf"[A-Za-z0-9_-]{{{KEY_TEXT_CHARS}}}")


def generate_key() -> bytes:
    """A fresh cluster key from the operating system's CSPRNG."""
    return secrets.token_bytes(KEY_BYTES)


def format_key(key: bytes) -> str:
    """The text form: 'tandem-' + urlsafe base64 without padding."""
    _check_length(key)
    return KEY_PREFIX + base64.urlsafe_b64encode(key).decode("ascii").rstrip("=")


def parse_key(text: str) -> bytes:
    """Bytes of a key in text form; the error never repeats the (secret) input."""
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise ConfigError(
            f"a cluster key starts with {KEY_PREFIX!r}; this one does not "
            f"(copy it whole from the coordinator's key file)"
        )
    body = text[len(KEY_PREFIX) :]
    if not _KEY_BODY.fullmatch(body):
        raise ConfigError(
            f"a cluster key is {KEY_PREFIX!r} followed by {KEY_TEXT_CHARS} URL-safe base64 "
            f"characters (A-Z a-z 0-9 - _); this one has {len(body)} characters after the prefix"
            + ("" if len(body) != KEY_TEXT_CHARS else " but contains other characters")
        )
    try:
        key = base64.urlsafe_b64decode(body + "=")
    except (binascii.Error, ValueError) as error:
        raise ConfigError(f"the cluster key is not valid base64: {error}") from None
    if format_key(key) != KEY_PREFIX + body:
        # The last character carries 2 unused bits; only the canonical spelling is accepted.
        raise ConfigError("the cluster key's last character is not canonical; was it edited?")
    return key


def cluster_id(key: bytes) -> str:
    """16 hex characters naming the cluster publicly; one-way, so it reveals nothing of the key."""
    _check_length(key)
    derived = HKDF(algorithm=hashes.SHA256(), length=8, salt=None, info=CLUSTER_ID_LABEL).derive(
        key
    )
    return derived.hex()


def load_key_file(path: Path) -> bytes:
    """Read a key file, refusing one that anyone but its owner can read."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"no cluster key file at {path}") from None
    except OSError as error:
        raise ConfigError(f"cannot read the cluster key file {path}: {error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"the cluster key file {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"the cluster key file {path} has permissions {mode:#o}, so group or others can read "
            f"it; run `chmod 600 {path}` (and consider the key leaked if others had access)"
        )
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the cluster key file {path}: {error}") from None
    try:
        return parse_key(text)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def load_or_create_key(path: Path) -> tuple[bytes, bool]:
    """The key stored at `path`, creating it (0o600, parent 0o700) when absent: (key, created)."""
    path = Path(path)
    if path.exists():
        return load_key_file(path), False
    parent = path.parent
    if not parent.exists():
        try:
            parent.mkdir(mode=KEY_DIR_MODE, parents=True, exist_ok=True)
            os.chmod(parent, KEY_DIR_MODE)  # mkdir's mode is filtered by the umask
        except OSError as error:
            raise ConfigError(f"cannot create the key directory {parent}: {error}") from None
    key = generate_key()
    temporary = parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(format_key(key) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, KEY_FILE_MODE)
        try:
            # link fails if another process created the key meanwhile: then theirs wins.
            os.link(temporary, path)
        except FileExistsError:
            return load_key_file(path), False
    except OSError as error:
        raise ConfigError(f"cannot write the cluster key file {path}: {error}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return key, True


def _check_length(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ConfigError(f"a cluster key is {KEY_BYTES} bytes, got {len(key)}")
