"""`tandem serve`'s HTTP address, taken before anything else runs.

The port is bound before the model loads and before any internal server (weight server, stage
and agent ports) opens: a port in use fails the serve at once, in one line naming its holder,
and no internal server can take the number. It listens from the start: a bound socket that is
not listening still lets another SO_REUSEADDR socket bind the same number (Linux), a listening
one never does. A client that connects while the model loads waits in the backlog and is
answered once uvicorn serves.
"""

from __future__ import annotations

import errno
import socket

import psutil

from errors import ConfigError

BACKLOG = 2048  # uvicorn's own


def bind_public_address(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn; ConfigError in one line when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot serve on {host}:{port}: the address is in use{holder_of(port)}; "
                f"choose another --port"
            ) from None
        raise ConfigError(f"cannot serve on {host}:{port}: {error.strerror}") from None
    sock.listen(BACKLOG)
    sock.set_inheritable(False)
    return sock


def holder_of(port: int) -> str:
    """' by PID (NAME)' for the process listening on `port`, when this user may see it."""
    try:
        for connection in psutil.net_connections(kind="tcp"):
            if connection.laddr and connection.laddr.port == port and connection.pid:
                if connection.status == psutil.CONN_LISTEN:
                    return f" by PID {connection.pid} ({psutil.Process(connection.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""
