"""Checks `kvservice serve` makes before it starts anything (so a refused start touches nothing):

- one allocator per data dir: an exclusive lock (flock) on DATA_DIR/kvservice.lock, held for the life of
  the process, released by the kernel however it dies;
- the port is free (a one-line error instead of a gRPC traceback after Redis was started);
- beyond loopback, auth is on: without --token-file a token is generated into DATA_DIR/token (mode 0600)
  and required, unless --insecure opts out (loudly).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
from pathlib import Path

from kvservice.settings import ServerSettings

logger = logging.getLogger(__name__)
LOCK_NAME, TOKEN_NAME = "kvservice.lock", "token"
GENERATED_TENANT = "kvservice"  # the tenant of a generated token (an admin)


class StartupError(ValueError):
    """`kvservice serve` refuses to start: the message says why and what to do."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DataDirLock:
    """Holds DATA_DIR/kvservice.lock exclusively until `release()` or the process's end."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StartupError(f"another kvservice serve (pid {holder}) is using --data-dir {self.path.parent}; "
                               f"stop it, or give this one its own --data-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.set_inheritable(fd, False)  # children (redis-server, the standby) must not keep it held
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def check_port_free(host: str, port: int) -> None:
    """Raises StartupError when something already listens on host:port (port 0: nothing to check)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r} does not resolve: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise StartupError(f"port {port} on {host} is in use ({exc.strerror}); stop what listens there or "
                               f"choose another --port") from None


def token_file_for(config: ServerSettings) -> str | None:
    """The token file the server uses: --token-file; or, beyond loopback without one, a generated one (kept
    across restarts) unless --insecure; or None (auth off on loopback)."""
    if config.token_file:
        return config.token_file
    if is_loopback(config.host):
        return None
    if config.insecure:
        logger.warning("INSECURE: listening on %s with auth off (--insecure): anyone who reaches port %d can free "
                       "every engine's blocks", config.host, config.port)
        return None
    path = Path(config.data_dir) / TOKEN_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{secrets.token_urlsafe(32)} {GENERATED_TENANT} admin\n")
        logger.warning("listening on %s without --token-file: generated a token into %s (mode 0600); clients "
                       "send it as their bearer token (kvservice status --token-file %s)", config.host, path, path)
    elif path.stat().st_mode & 0o077:
        raise StartupError(f"{path} is readable by others (mode {path.stat().st_mode & 0o777:o}); chmod 600 it")
    return str(path)


def read_token(path: str | Path) -> str:
    """The first token of a token file (what a client of a generated token sends)."""
    return Path(path).read_text().split()[0]
