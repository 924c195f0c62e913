"""Bearer-token auth: `--token-file` lines `token tenant [admin]`. Without a token file auth
is off (every caller is the empty tenant, an admin) and the server logs a warning."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvservice.errors import PermissionDenied, Unauthenticated

logger = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MISSING_TOKEN = ("no bearer token: this server requires one (its --token-file); pass it: KVServiceClient(target, "
                 "token=...) in Python, --token TOKEN or --token-file FILE on the command line (kvservice status, "
                 "shards), or gRPC metadata 'authorization: Bearer TOKEN'")


@dataclass(slots=True, frozen=True)
class Principal:
    tenant: str
    admin: bool


ANONYMOUS = Principal("", True)


def load_token_file(path: str | Path) -> dict[str, Principal]:
    """Parses `token tenant [admin]` lines; '#' starts a comment."""
    tokens: dict[str, Principal] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ValueError(f"{path}:{lineno}: expected 'token tenant [admin]', got {line!r}")
        if not parts[1].isprintable() or "\x1f" in parts[1]:
            raise ValueError(f"{path}:{lineno}: tenant {parts[1]!r} has control characters")
        if parts[0] in tokens:
            raise ValueError(f"{path}:{lineno}: token listed twice")
        tokens[parts[0]] = Principal(parts[1], len(parts) == 3)
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


class Authenticator:
    def __init__(self, tokens: dict[str, Principal] | None, private: bool = False) -> None:
        """`private`: the server is one process's private child on loopback (`serve --private`): auth off is
        its normal state, not worth a warning in its parent's output."""
        self.tokens = tokens
        if tokens is None:
            logger.log(logging.INFO if private else logging.WARNING,
                       "auth is OFF: no --token-file given, every caller is an admin of the default tenant")

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def principal(self, metadata) -> Principal:
        if self.tokens is None:
            return ANONYMOUS
        token = None
        for key, value in metadata or ():
            if key == "authorization":
                token = value[7:].strip() if value[:7].lower() == "bearer " else None
                break
        if token is None:
            raise Unauthenticated(MISSING_TOKEN)
        principal = self.tokens.get(token)
        if principal is None:
            raise Unauthenticated("unknown bearer token")
        return principal

    def of(self, context: grpc.aio.ServicerContext) -> Principal:
        if self.tokens is None:
            return ANONYMOUS  # without reading the metadata: every call asks
        return self.principal(context.invocation_metadata())

    def require_admin(self, context: grpc.aio.ServicerContext) -> Principal:
        principal = self.of(context)
        if not principal.admin:
            raise PermissionDenied(f"tenant {principal.tenant!r} is not an admin; this RPC needs an admin token")
        return principal


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid token before they reach the servicer (health and reflection
    are exempt)."""

    def __init__(self, auth: Authenticator, on_reject: Callable[[str, str], None] | None = None) -> None:
        self.auth = auth
        self.on_reject = on_reject

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.auth.enabled or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        try:
            self.auth.principal(details.invocation_metadata)
        except Unauthenticated as exc:
            if self.on_reject is not None:
                self.on_reject(details.method, "UNAUTHENTICATED")
            return _rejecting(handler, exc.message)
        return handler


def _rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
