"""What an operator declares about one stock vLLM engine (`--vllm-events`, `RegisterExternalPool`), and the
check that the declared hash spec reproduces the hashes the engine publishes.

The index never depends on the declaration being right (it keys blocks by their tokens, see `index`); the
check exists so that a wrong one is reported (metric, log, GetStats) instead of becoming a silent 0% hit
rate for routers that compute vLLM's hashes themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from kvservice.external import vllm_hashes
from kvservice.external.frames import Stored

DEFAULT_BLOCK_SIZE = 16  # vLLM's default --block-size
DEFAULT_HASH = "sha256"  # vLLM's default --prefix-caching-hash-algo
DEFAULT_MAX_BLOCKS = 1_000_000
MAX_BLOCK_SIZE = 65_536
SPEC_CHECK_BLOCKS = 64  # blocks verified per epoch before the spec is declared ok
_ENDPOINT = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5})$|^ipc://.+$")
_POOL_ID = re.compile(r"^[\x21-\x7e]{1,256}$")
FLAG_HELP = ("index a stock vLLM engine from its KV events (its --kv-events-config endpoint and replay_endpoint): "
             "POOL=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,block-size=N][,hash=sha256|sha256_cbor|xxhash|"
             "xxhash_cbor][,hash-seed=S][,bind][,topic=T][,max-blocks=N][,tenant=T]; repeatable, none by default")


class SpecError(ValueError):
    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"{field} = {value!r}: {why}")
        self.field = field
        self.value = value
        self.why = why


@dataclass(slots=True, frozen=True)
class ExternalSpec:
    """One engine's event stream and its settings. `bind`: kvservice binds `endpoint` and the engine's PUB
    socket connects to it (vLLM connects when its endpoint names a host, binds when it has `*`)."""

    pool_id: str
    endpoint: str
    replay_endpoint: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: str = DEFAULT_HASH
    hash_seed: str | None = None  # the engine's PYTHONHASHSEED (None: unset)
    bind: bool = False
    topic: str = ""
    max_blocks: int = DEFAULT_MAX_BLOCKS

    def validated(self) -> ExternalSpec:
        """Raises SpecError naming the first bad field."""
        if not _POOL_ID.match(self.pool_id):
            raise SpecError("pool_id", self.pool_id, "1-256 printable ASCII characters without spaces")
        _check_endpoint("endpoint", self.endpoint, self.bind)
        if self.replay_endpoint:
            _check_endpoint("replay", self.replay_endpoint, False)
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise SpecError("block-size", self.block_size, f"must be in 1..{MAX_BLOCK_SIZE}")
        if self.hash_algo not in vllm_hashes.ALGORITHMS:
            raise SpecError("hash", self.hash_algo, f"must be one of {', '.join(vllm_hashes.ALGORITHMS)} "
                            "(vLLM's --prefix-caching-hash-algo)")
        if not 1 <= self.max_blocks <= 1 << 26:
            raise SpecError("max-blocks", self.max_blocks, "must be in 1..67108864")
        if len(self.topic.encode()) > 256:
            raise SpecError("topic", self.topic, "at most 256 bytes")
        return self


def _check_endpoint(field: str, value: str, bind: bool) -> None:
    m = _ENDPOINT.match(value)
    if not m:
        raise SpecError(field, value, "expected tcp://HOST:PORT (or ipc://PATH)")
    if value.startswith("tcp://"):
        if not 1 <= int(m.group(2)) <= 65535:
            raise SpecError(field, value, "port must be in 1..65535")
        if "*" in m.group(1) and not bind:
            raise SpecError(field, value, "connect to the engine's host (a wildcard is only for bind)")


def parse_flag(text: str) -> tuple[ExternalSpec, str]:
    """`--vllm-events` -> (spec, owning tenant). Raises SpecError."""
    head, *options = text.split(",")
    pool_id, sep, endpoint = head.partition("=")
    if not sep:
        raise SpecError("--vllm-events", text, "expected POOL=tcp://HOST:PORT[,option=value...]")
    values: dict = {"pool_id": pool_id, "endpoint": endpoint}
    tenant = ""
    for option in options:
        key, sep, value = option.partition("=")
        if key == "bind" and not sep:
            values["bind"] = True
        elif key == "replay":
            values["replay_endpoint"] = value
        elif key in ("block-size", "max-blocks"):
            if not value.isdigit():
                raise SpecError(key, value, "must be a positive integer")
            values[key.replace("-", "_")] = int(value)
        elif key == "hash":
            values["hash_algo"] = value
        elif key == "hash-seed":
            values["hash_seed"] = value
        elif key == "topic":
            values["topic"] = value
        elif key == "tenant":
            tenant = value
        else:
            raise SpecError("--vllm-events", option, "unknown option; known: replay, block-size, hash, hash-seed, "
                            "bind, topic, max-blocks, tenant")
    return ExternalSpec(**values).validated(), tenant


class SpecStatus(Enum):
    UNCHECKED = "unchecked"  # no verifiable block seen yet this epoch
    OK = "ok"  # a root block (or SPEC_CHECK_BLOCKS chained ones) reproduced; checking goes on to SPEC_CHECK_BLOCKS
    MISMATCH = "mismatch"  # a block's hash is not what the declared spec gives


@dataclass(slots=True)
class SpecCheck:
    """Verifies the first SPEC_CHECK_BLOCKS verifiable blocks of an epoch against the declared spec. One root
    block reproduced (its hash chains from the root, which the seed sets) proves every declared field, so the
    status is `ok` from then on: an engine that caches fewer than SPEC_CHECK_BLOCKS blocks still concludes."""

    status: SpecStatus = SpecStatus.UNCHECKED
    message: str = ""
    checked: int = 0
    mismatches: int = 0
    # Full hashes of the blocks verified so far, by their 64-bit event form (vLLM publishes ints by default,
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a later block names its parent by those 64 bits only.
    full: dict[int, bytes] = field(default_factory=dict)

    def done(self) -> bool:
        return self.status is SpecStatus.MISMATCH or self.checked >= SPEC_CHECK_BLOCKS

    def check(self, spec: ExternalSpec, event: Stored) -> bool:
        """Checks what it can of one BlockStored; returns False when it found the first mismatch."""
        if event.block_size != spec.block_size:
            return self._mismatch(f"declared block-size {spec.block_size}, but the engine's events have "
                                  f"{event.block_size}-token blocks (vLLM --block-size); the index uses the "
                                  f"events' size")
        n, size = len(event.block_hashes), event.block_size
        if event.lookahead or event.lora_name or len(event.token_ids) != n * size:
            return True  # lookahead tokens and LoRA adapter paths are in the hash but not in the event
        parent = event.parent
        if parent is None:
            parent = vllm_hashes.none_hash(spec.hash_algo, spec.hash_seed)
        elif not isinstance(parent, bytes):
            parent = self.full.get(parent)  # 64 of the parent's bits: checkable when we verified the parent
        for i, published in enumerate(event.block_hashes):
            extra = _tagged_extra_keys(event.extra_keys[i] if event.extra_keys else None)
            if parent is None or extra is False:
                return True
            tokens = event.token_ids[i * size:(i + 1) * size]
            full = vllm_hashes.block_hash(spec.hash_algo, parent, tokens, extra)
            if vllm_hashes.external_form(full, isinstance(published, int)) != published:
                return self._mismatch(self._explain(spec, event, i, extra))
            self.checked += 1
            if i == 0 and event.parent is None:
                self.status = SpecStatus.OK
            if self.checked >= SPEC_CHECK_BLOCKS:
                self.status = SpecStatus.OK
                self.full.clear()
                return True
            if isinstance(published, int):
                self.full[published] = full
            parent = full
        return True

    def _mismatch(self, message: str) -> bool:
        self.mismatches += 1
        if self.status is not SpecStatus.MISMATCH:
            self.status, self.message = SpecStatus.MISMATCH, message
        self.full.clear()
        return False

    @staticmethod
    def _explain(spec: ExternalSpec, event: Stored, i: int, extra) -> str:
        declared = f"hash={spec.hash_algo}" + (f", hash-seed={spec.hash_seed!r}" if spec.hash_seed else "")
        text = (f"block hashes do not match the declared {declared} (vLLM --prefix-caching-hash-algo, and "
                f"PYTHONHASHSEED for the root)")
        if i > 0 or event.parent is not None:
            return text  # a chained block: the seed plays no part, only the algorithm could be tried
        size = event.block_size
        tokens = event.token_ids[:size]
        for algo in vllm_hashes.ALGORITHMS:
            for seed in {spec.hash_seed, None}:
                root = vllm_hashes.none_hash(algo, seed)
                if root is None:
                    continue
                full = vllm_hashes.block_hash(algo, root, tokens, extra)
                if vllm_hashes.external_form(full, isinstance(event.block_hashes[0], int)) == event.block_hashes[0]:
                    return text + f"; they match hash={algo}" + (f", hash-seed={seed!r}" if seed else "")
        return text


def _tagged_extra_keys(published):
    """vLLM's tagged extra keys for one block from the untagged published entry; False when not checkable
    (multimodal items, prompt embeddings: positions and digests this check does not reproduce)."""
    if published is None:
        return None
    tagged = []
    for key in published:
        if isinstance(key, str):
            tagged.append(("cache_salt", key))
        else:
            return False
    return tuple(tagged) or None

