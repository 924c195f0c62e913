"""How the allocator names things inside the core: a request's key is the client's id namespaced by its
tenant, and a block hash the core sees is the client's (tenant-free) hash with the tenant appended, so
two tenants never share a request id, a prefix, or a timing difference between hit and miss."""

from __future__ import annotations

from kvservice.hashing import HASH_BYTES

SEP = "\x1f"  # request ids may not contain control characters, so this never collides


def request_key(tenant: str, request_id: str) -> str:
    """The core's request id: the client's, namespaced by tenant."""
    return f"{tenant}{SEP}{request_id}" if tenant else request_id


def client_request_id(key: str) -> str:
    return key.rsplit(SEP, 1)[-1]


def tenant_of(key: str) -> str:
    return key.split(SEP, 1)[0] if SEP in key else ""


def namespace(tenant: str) -> bytes:
    return tenant.encode()


def raw_hash(core_hash: bytes, hash_bytes: int = HASH_BYTES) -> bytes:
    """The tenant-free hash a client computed, from the core's namespaced one (`hash_bytes`: the length of
    the pool's hash spec: with one length per pool, `hash || tenant` never collides across tenants)."""
    return core_hash[:hash_bytes]
