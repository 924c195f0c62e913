"""Stable names of a deployment's Ray actors and placement groups (the `kvservice` namespace), so that
running deploy again finds what is up.

    names (here) <- config, actors, placement, router, cli
"""

from __future__ import annotations

import re

NAMESPACE = "kvservice"
ALLOCATOR_NAME = "kvservice-allocator"
HEAD_RESOURCE = "node:__internal_head__"
_ENGINE_NAME = re.compile(r"^kvservice-pool-(.+)-engine$")


ALLOCATORS_GROUP = "kvservice-allocators"  # the placement group spreading shards (and standbys) over nodes


def shard_actor_name(shard_id: str, standby: bool = False) -> str:
    return f"{ALLOCATOR_NAME}-{shard_id}" + ("-standby" if standby else "")


def is_allocator(actor_name: str) -> bool:
    return actor_name == ALLOCATOR_NAME or actor_name.startswith(ALLOCATOR_NAME + "-")


def rank_name(pool_id: str, rank: int) -> str:
    return f"kvservice-pool-{pool_id}-rank-{rank}"


def engine_name(pool_id: str) -> str:
    return f"kvservice-pool-{pool_id}-engine"


def group_name(pool_id: str) -> str:
    return f"kvservice-pool-{pool_id}"


def engine_pool_id(actor_name: str) -> str | None:
    """The pool id an engine actor's name carries, or None for another actor."""
    m = _ENGINE_NAME.match(actor_name)
    return m.group(1) if m else None


def pool_index(pool_id: str) -> int:
    """k of a pool named `pk` (deploy's own pools); -1 for other names."""
    return int(pool_id[1:]) if pool_id[:1] == "p" and pool_id[1:].isdigit() else -1


def named_actors() -> list[str]:
    """Names of the live kvservice actors."""
    import ray
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and e["name"].startswith("kvservice-")]
