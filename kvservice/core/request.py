"""A request as the KV-cache core sees it: its tokens (or only their hashes) and its block hashes."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from kvservice.hashing import (
    DEFAULT_HASH_SEED,
    HASH_BYTES,
    MAX_TOKEN_ID,
    BlockHash,
    HashSpec,
    MultiModalItem,
    TokenIdError,
    hash_packed_blocks,
    le_bytes,
    root_hash,
    token_array,
    vllm_spec,
)


class Request:
    """Hashes its own tokens at `block_size` (the manager's hash block size) as they arrive, with
    kvservice's chain (README, "Hash specs"; seeded by `hash_seed`) or the pool's `hash_spec` (e.g. vLLM's).

    `namespace` (e.g. a tenant id) is appended to every block hash the core sees, so requests in
    different namespaces never share a prefix; the chain itself stays namespace-free so that clients
    compute the same hashes.
    """

    # vLLM Request attributes the core reads, at their defaults (class level, so a request restored
    # field by field has them too): a scheduler may set them.
    skip_reading_prefix_cache = False
    shared_prefix_boundary = 0  # a junction to keep cached under sparse retention
    num_in_flight_tokens = 0  # scheduled tokens whose forward has not finished (async scheduling)
    session_id: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    hash_spec: HashSpec | None = None  # None: kvservice's chain with `hash_seed`
    unhashed: bool = False  # added by hashes, of which its client computes none (a pool without prefix caching)
    # Added by hashes that may trail its full blocks: vLLM's hasher with lookahead (num_hash_lookahead_tokens)
    # hashes a block only once the tokens after it that the hash covers exist. Never more than one per block.
    hashes_may_lag: bool = False

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        hash_seed: str = DEFAULT_HASH_SEED,
        *,
        mm_items: Sequence[MultiModalItem] = (),
        namespace: bytes = b"",
        lora_path: str | None = None,
        hash_spec: HashSpec | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if hash_spec is not None and hash_spec.block_size != block_size:
            raise ValueError(f"request {request_id!r}: hash_spec hashes {hash_spec.block_size}-token blocks, "
                             f"the request {block_size}")
        tokens = token_array(prompt_token_ids, "prompt_token_ids")
        self.request_id = request_id
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hash_seed = hash_seed
        self.mm_items = tuple(mm_items)
        self.namespace = namespace
        if lora_path is not None:
            self.lora_path = lora_path
        if hash_spec is not None and not hash_spec.is_kvservice:
            self.hash_spec = hash_spec
        self.num_prompt_tokens = len(tokens)
        self._token_ids: array | None = tokens  # compact: 4 bytes a token
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self._chain_tip: bytes = self._root()
        self.block_hashes: list[BlockHash] = []
        self.hash_full_blocks()

    @classmethod
    def from_block_hashes(
        cls,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        block_size: int,
        *,
        lora_name: str | None = None,
        namespace: bytes = b"",
        hash_spec: HashSpec | None = None,
        unhashed: bool = False,
        hashes_may_lag: bool = False,
    ) -> Request:
        """A request whose client hashed its tokens (with `hash_spec`, kvservice's by default): one
        hash per full block of `num_tokens`. `unhashed`: the client hashes nothing (a pool without prefix
        caching, whose hashes nothing reads: vLLM then computes none); appends then carry no hashes either.
        `hashes_may_lag`: fewer hashes than full blocks are taken, here and at appends (see the attribute)."""
        req = cls.__new__(cls)
        if unhashed:
            req.unhashed = True
        if hashes_may_lag:
            req.hashes_may_lag = True
        if hash_spec is not None and not hash_spec.is_kvservice:
            req.hash_spec = hash_spec
        req.request_id = request_id
        req.block_size = block_size
        req.cache_salt = None
        req.lora_name = lora_name
        req.hash_seed = DEFAULT_HASH_SEED
        req.mm_items = ()
        req.namespace = namespace
        req.num_prompt_tokens = num_tokens
        req._token_ids = None
        req.num_tokens = 0
        req.num_computed_tokens = 0
        req.num_preemptions = 0
        req._chain_tip = b""
        req.block_hashes = []
        req.append_block_hashes(block_hashes, num_tokens)
        return req

    @property
    def has_token_ids(self) -> bool:
        return self._token_ids is not None

    @property
    def all_token_ids(self) -> array:
        if self._token_ids is None:
            raise ValueError(f"request {self.request_id!r} was added by block hashes; its token ids are unknown")
        return self._token_ids

    def token_ids_between(self, start: int, end: int) -> array:
        """Tokens start..end as uint32 (empty when added by hashes): compact, no int object per token,
        since the service keeps a window of events that carry them."""
        return array("I") if self._token_ids is None else self._token_ids[start:end]

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Appends generated tokens and hashes any block they complete."""
        if self._token_ids is None:
            raise ValueError(f"request {self.request_id!r} was added by block hashes: append hashes, not tokens")
        if isinstance(token_ids, int):
            if not 0 <= token_ids <= MAX_TOKEN_ID:
                raise TokenIdError(f"output token id {token_ids} is not a token id in [0, 2**32)")
            self._token_ids.append(token_ids)
        elif type(token_ids) is array and token_ids.typecode == "I":
            self._token_ids.extend(token_ids)  # already uint32: nothing to validate
        else:
            self._token_ids.extend(token_array(token_ids, "output_token_ids"))  # validated first
        self.num_tokens = len(self._token_ids)
        self.hash_full_blocks()

    def append_token_id(self, token_id: int) -> None:
        """Appends one generated token (a decode step's common case, no list built) and hashes the block
        it completes."""
        tokens = self._token_ids
        if tokens is None:
            raise ValueError(f"request {self.request_id!r} was added by block hashes: append hashes, not tokens")
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise TokenIdError(f"output token id {token_id} is not a token id in [0, 2**32)")
        tokens.append(token_id)
        self.num_tokens += 1
        if self.num_tokens % self.block_size == 0:
            self.hash_full_blocks()

    def hash_full_blocks(self) -> None:
        """Hashes every full block of tokens not hashed yet."""
        num_full = self.num_tokens // self.block_size
        first = len(self.block_hashes)
        if num_full > first:
            bs = self.block_size
            if self.hash_spec is None:
                self._extend_hashes(le_bytes(self._token_ids[first * bs:num_full * bs]), first)
            else:
                self._extend_vllm_hashes(first, num_full)

    @property
    def hash_bytes(self) -> int:
        """The length of this request's (client-computed, namespace-free) block hashes."""
        return HASH_BYTES if self.hash_spec is None else self.hash_spec.hash_bytes

    def _root(self) -> bytes:
        return root_hash(self.hash_seed) if self.hash_spec is None else self.hash_spec.root

    def _extend_vllm_hashes(self, first: int, num_full: int) -> None:
        """vLLM's chain (hash_spec): extra keys tagged as vLLM's (LoRA name and path, items, salt)."""
        spec, bs, tokens = self.hash_spec, self.block_size, self._token_ids
        fn = spec.hash_function()
        lora = (self.lora_name, self.lora_path or "") if self.lora_name is not None else None
        mm_idx = vllm_spec.first_item_in_window(self.mm_items, first * bs) if self.mm_items else 0
        parent = self._chain_tip
        new = []
        for i in range(first, num_full):
            start = i * bs
            extra, mm_idx = vllm_spec.block_extra_keys(start, start + bs, mm_idx, lora=lora, mm_items=self.mm_items,
                                                       cache_salt=self.cache_salt)
            parent = fn((parent, tuple(tokens[start:start + bs]), extra))
            new.append(parent)
        self._append_hashes(new)

    def append_block_hashes(self, block_hashes: Sequence[bytes], num_new_tokens: int) -> None:
        """For requests added by hashes: `num_new_tokens` more tokens whose newly full blocks have
        these hashes (exactly one per block completed; with `hashes_may_lag`, at most one per full block
        not hashed yet)."""
        if self._token_ids is not None:
            raise ValueError(f"request {self.request_id!r} was added with token ids: append tokens, not hashes")
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        num_tokens = self.num_tokens + num_new_tokens
        if self.unhashed:
            if block_hashes:
                raise ValueError(f"request {self.request_id!r} was added without block hashes (its pool does not "
                                 f"cache prefixes): append none")
            self.num_tokens = num_tokens
            return
        expected = num_tokens // self.block_size - len(self.block_hashes)
        if len(block_hashes) != expected and not (self.hashes_may_lag and len(block_hashes) <= expected):
            raise ValueError(f"request {self.request_id!r}: {num_tokens} tokens need "
                             f"{'at most ' if self.hashes_may_lag else ''}{expected} new block hashes at block size "
                             f"{self.block_size}, got {len(block_hashes)}")
        size = self.hash_bytes
        for i, h in enumerate(block_hashes):
            if not isinstance(h, bytes) or len(h) != size:
                raise ValueError(f"block_hashes[{i}] must be {size} bytes, got {h!r:.40}")
        self.num_tokens = num_tokens
        ns = self.namespace
        self.block_hashes.extend(BlockHash(h + ns) for h in block_hashes)

    def truncate(self, num_tokens: int) -> None:
        """Drops tokens (and the hashes of blocks they completed) past `num_tokens`: the undo of an
        append whose allocation did not happen."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate request {self.request_id!r} of {self.num_tokens} tokens "
                             f"to {num_tokens}")
        if self._token_ids is not None:
            del self._token_ids[num_tokens:]
        self.num_tokens = num_tokens
        del self.block_hashes[num_tokens // self.block_size:]
        if self._token_ids is not None:
            self._chain_tip = self.block_hashes[-1][:self.hash_bytes] if self.block_hashes else self._root()

    def fork(self, child_request_id: str) -> Request:
        """A copy under a new id: same tokens, hashes and computed count."""
        child = Request.__new__(Request)
        for name in ("block_size", "cache_salt", "lora_name", "hash_seed", "mm_items", "namespace",
                     "num_prompt_tokens", "num_tokens", "num_computed_tokens", "_chain_tip"):
            setattr(child, name, getattr(self, name))
        for name in ("lora_path", "hash_spec", "lora_id", "session_id", "unhashed", "hashes_may_lag"):  # class defaults
            if name in self.__dict__:
                setattr(child, name, getattr(self, name))
        child.request_id = child_request_id
        child.num_preemptions = 0
        child._token_ids = None if self._token_ids is None else array("I", self._token_ids)
        child.block_hashes = list(self.block_hashes)
        return child

    def _extend_hashes(self, packed: bytes, first_block: int) -> None:
        self._append_hashes(hash_packed_blocks(packed, self.block_size, self._chain_tip, first_block,
                                               self.cache_salt, self.lora_name, self.mm_items, self.lora_path))

    def _append_hashes(self, new: list[BlockHash]) -> None:
        if not new:
            return
        self._chain_tip = new[-1]
        if self.namespace:
            ns = self.namespace
            self.block_hashes.extend(BlockHash(h + ns) for h in new)
        else:
            self.block_hashes.extend(new)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, blocks_hashed={len(self.block_hashes)})")
