"""Checks `kvservice serve` makes before it starts anything (so a refused start touches nothing):

- one allocator per data dir: an exclusive lock (flock) on DATA_DIR/kvservice.lock, held for the life of
  the process, released by the kernel however it dies;
- the port is free (a one-line error instead of a gRPC traceback after Redis was started);
- the configuration itself (`check_config`): the token file readable and well-formed, the TLS files
  readable and the key matching the certificate, flags that contradict each other; checked before the
  data dir is locked, so a refused start writes nothing and bumps no leader epoch;
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


def check_config(config: ServerSettings) -> None:
    """Raises StartupError (naming the flag and its value) for a configuration `serve` could not run with."""
    from kvservice.server.auth import load_token_file
    if config.token_file:
        try:
            load_token_file(config.token_file)
        except OSError as exc:
            raise StartupError(f"--token-file {config.token_file}: cannot read it ({exc.strerror})") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise StartupError(f"--token-file {config.token_file}: {exc}") from None
    check_tls(config)
    if config.private and not is_loopback(config.host):
        raise StartupError(f"--private (a private child on loopback) contradicts --host {config.host}")
    if config.require_persistence and not config.persistence:
        raise StartupError("--require-persistence contradicts --no-persistence: give one of them")
    if config.metrics_port and config.metrics_port == config.port:
        raise StartupError(f"--metrics-port {config.metrics_port} is the gRPC --port too: give it another port")
    for name, value in (("--snapshot-every", config.snapshot_every), ("--max-message-mb", config.max_message_mb)):
        if value < 1:
            raise StartupError(f"{name} {value}: must be at least 1")


def check_tls(config: ServerSettings) -> None:
    """The TLS flags: both of --tls-cert/--tls-key or neither, each file readable PEM, the key the
    certificate's; --tls-ca only with them."""
    import ssl
    if bool(config.tls_cert) != bool(config.tls_key):
        given, missing = ("--tls-cert", "--tls-key") if config.tls_cert else ("--tls-key", "--tls-cert")
        raise StartupError(f"TLS needs both --tls-cert and --tls-key: {given} "
                           f"{config.tls_cert or config.tls_key} is given, {missing} is not")
    if config.tls_ca and not config.tls_cert:
        raise StartupError(f"--tls-ca {config.tls_ca} (mutual TLS) needs --tls-cert and --tls-key too")
    for name, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key), ("--tls-ca", config.tls_ca)):
        if path:
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise StartupError(f"{name} {path}: cannot read it ({exc.strerror})") from None
    if not config.tls_cert:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise StartupError(f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: not a matching PEM "
                           f"certificate and private key ({exc.reason or exc})") from None
    if config.tls_ca:
        try:
            context.load_verify_locations(config.tls_ca)
        except ssl.SSLError as exc:
            raise StartupError(f"--tls-ca {config.tls_ca}: not a PEM CA certificate ({exc.reason or exc})") from None


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
