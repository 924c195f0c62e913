"""A Step's transfer sources (`AllocateOp.external_source`), checked before the command is applied: each must
be a live pin of the caller's tenant (an admin: any tenant's) naming exactly its blocks and tokens. A pin on
a pool held here is read from the state; one on another shard's pool from what that shard published
(ShardRouter.publish_pins). Anything else refuses the whole call NOT_FOUND, with one message whatever was
wrong, before anything is applied: a tenant learns nothing about another tenant's pools or pins, and an
engine is never ordered to copy blocks no pin holds."""

from __future__ import annotations

from kvservice.allocator.pins import live_pin, no_such_pin
from kvservice.commands import StepRpc
from kvservice.errors import NotFound
from kvservice.ops import ExternalSource
from kvservice.wire.decode import decode_external

NO_LIMIT = 1 << 62  # num_tokens is bounded by the pool's max_model_len when the op itself is decoded


def external_sources(rpc: StepRpc, request) -> list[ExternalSource]:
    """The sources a Step or Allocate request names (validated as the op's decoder does)."""
    if rpc is StepRpc.STEP:
        found = [(i, op.allocate) for i, op in enumerate(request.ops) if op.WhichOneof("op") == "allocate"]
        field = "ops"
    elif rpc is StepRpc.ALLOCATE:
        found, field = ([(None, request.allocate)] if request.HasField("allocate") else []), "allocate"
    else:
        return []
    return [decode_external(a.external_source, NO_LIMIT, (field, i, "allocate", "external_source"))
            for i, a in found if a.HasField("external_source")]


async def check_sources(sources: list[ExternalSource], state, sharding, tenant: str, admin: bool) -> None:
    """Raises NotFound unless every source is a live pin the caller may copy from."""
    for source in sources:
        pool = state.pools.get(source.src_pool_id)
        if pool is not None:
            live = live_pin(pool, source, tenant, admin) is not None
        else:
            live = sharding is not None and await sharding.pin_is_live(source, tenant, admin)
        if not live:
            raise NotFound(no_such_pin(source))

