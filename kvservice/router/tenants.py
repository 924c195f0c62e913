"""Which kvservice tenant a request looks up as: one allocator token for all (`--token`), the client's bearer
token mapped to an allocator token (`--tenant-tokens FILE`), or the client's token itself (`--pass-token`).
One asyncio client per allocator token, so a Lookup sees only that tenant's pools."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict

from kvservice.client import AsyncKVServiceClient
from kvservice.router.backends import load_mapping_file
from kvservice.router.settings import RouterSettings

logger = logging.getLogger(__name__)
MAX_CLIENTS = 64  # --pass-token: allocator connections kept, least recently used closed first


class Unauthorized(Exception):
    pass


def bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return None


def read_token_file(path: str) -> str:
    """The first token of a token file (its first word of the first line that is not a comment)."""
    for line in open(path).read().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0]
    raise ValueError(f"token file {path} holds no token")


class Tenants:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.token = settings.token or (read_token_file(settings.token_file) if settings.token_file else None)
        self.mapping: dict[str, str] = {}
        self._stamp: tuple | None = None
        self._clients: OrderedDict[str | None, AsyncKVServiceClient] = OrderedDict()
        self._closing: list[asyncio.Task] = []
        if settings.tenant_tokens:
            self.reload()

    def reload(self) -> None:
        """Re-reads --tenant-tokens when it changed; a file that does not parse keeps the last mapping."""
        path = self.settings.tenant_tokens
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            data = load_mapping_file(path)
            if isinstance(data, dict) and isinstance(data.get("tokens"), dict):
                data = data["tokens"]
            if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in data.items()):
                raise ValueError("it must map client tokens to allocator tokens (strings)")
        except (OSError, ValueError) as exc:
            if self._stamp is None:
                raise ValueError(f"--tenant-tokens {path}: {exc}") from exc
            logger.error("kvservice route: --tenant-tokens %s: %s; the last mapping stays", path, exc)
            return
        self._stamp, self.mapping = stamp, dict(data)

    def allocator_token(self, authorization: str | None) -> str | None:
        """The allocator token of a request (its Authorization header). Raises Unauthorized."""
        if self.settings.pass_token:
            token = bearer(authorization)
            if token is None:
                raise Unauthorized()
            return token
        if self.settings.tenant_tokens:
            self.reload()
            token = self.mapping.get(bearer(authorization) or "")
            if token is None:
                raise Unauthorized()
            return token
        return self.token

    def client(self, token: str | None) -> AsyncKVServiceClient:
        client = self._clients.get(token)
        if client is None:
            client = AsyncKVServiceClient(self.settings.allocator, token, tls_ca=self.settings.tls_ca,
                                          client_name="kvservice-route", timeout_s=self.settings.lookup_timeout_s,
                                          retries=0, hash_block_size=self.settings.block_size, heartbeat=False)
            self._clients[token] = client
            while len(self._clients) > MAX_CLIENTS:
                _, old = self._clients.popitem(last=False)
                self._closing.append(asyncio.get_running_loop().create_task(old.close()))
        else:
            self._clients.move_to_end(token)
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
        for task in self._closing:
            with contextlib.suppress(Exception):
                await task
