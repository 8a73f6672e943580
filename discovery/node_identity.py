"""This machine's node id: created once, kept in the state directory, guarded by a lock file."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import IO

from errors import ConfigError

logger = logging.getLogger(__name__)

NODE_ID_FILE = "node-id"
LOCK_FILE = "agent.lock"
# A node id is also the zeroconf instance name and a DNS label: keep it short and plain.
NODE_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
HOSTNAME_PREFIX_CHARS = 40


def new_node_id(hostname: str | None = None) -> str:
    """'<short hostname>-<8 hex>': readable in `tandem peers`, unique across clones."""
    host = (hostname or socket.gethostname()).split(".")[0].lower()
    host = re.sub(r"[^a-z0-9-]+", "-", host).strip("-")[:HOSTNAME_PREFIX_CHARS] or "node"
    return f"{host}-{secrets.token_hex(4)}"


def load_or_create_node_id(state_dir: Path) -> tuple[str, bool]:
    """(node id, created): read state_dir/node-id, or create it on first use."""
    path = state_dir / NODE_ID_FILE
    try:
        node_id = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        node_id = ""
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read node id file {path}: {error}") from error
    if node_id:
        if not NODE_ID_PATTERN.match(node_id):
            raise ConfigError(
                f"node id file {path} holds {node_id!r}, which is not a valid node id "
                "(lowercase letters, digits, '-', at most 63): fix or delete the file"
            )
        return node_id, False
    node_id = new_node_id()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(node_id + "\n", encoding="ascii")
        os.replace(temporary, path)
    except OSError as error:
        raise ConfigError(f"cannot write node id file {path}: {error}") from error
    logger.info("created node id %s in %s", node_id, path)
    return node_id, True


class StateDirLock:
    """An exclusive lock on the state directory: one running agent per node id on a machine."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self, node_id: str) -> None:
        """Take the lock or raise ConfigError naming the agent that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_file = open(self.path, "a+", encoding="ascii")  # noqa: SIM115 - held open
        except OSError as error:
            raise ConfigError(f"cannot open lock file {self.path}: {error}") from error
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown pid"
            lock_file.close()
            raise ConfigError(
                f"duplicate node id {node_id}: another tandem agent ({holder}) is already "
                f"running with state dir {self.path.parent}; stop it or give this agent its "
                "own --state-dir"
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"pid {os.getpid()}\n")
        lock_file.flush()
        self._file = lock_file

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
