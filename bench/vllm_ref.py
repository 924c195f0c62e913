"""Optional access to vLLM 0.33.0's own KV-cache core, for side-by-side benchmarks and parity checks.

vLLM's package pins a CUDA torch and ~80 dependencies, but its v1 core is pure Python: it lives in
its own venv (see bench/README.md). `reexec_under_vllm()` restarts the calling script under that
venv's python with vLLM and this checkout on PYTHONPATH, so both cores run in one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_REF = Path(os.environ.get("VLLM_REF", Path.home() / ".cache/kvservice/vllm-0.33.0"))
_MARK = "KVSERVICE_UNDER_VLLM"


def reexec_under_vllm() -> str | None:
    """Re-executes this script under the vLLM venv when it exists and we are not there yet.

    Returns:
        None when vLLM is importable in this process, else the reason it is not.
    """
    if os.environ.get(_MARK):
        try:
            import vllm.v1.core.kv_cache_manager  # noqa: F401
        except Exception as exc:  # any import failure just disables the comparison
            return f"vLLM import failed under {VLLM_REF}: {exc!r}"
        return None
    python = VLLM_REF / "venv" / "bin" / "python"
    src = VLLM_REF / "src"
    if not (python.exists() and (src / "vllm").is_dir()):
        return (f"vLLM 0.33.0 reference env not found at {VLLM_REF} "
                f"(build it with `make vllm-env` (tools/vllm_env.sh); see bench/README.md)")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{src}", **{_MARK: "1"})
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.execve(str(python), [str(python), *sys.argv], env)
    return None  # unreachable


class VllmCore:
    """Builds vLLM's BlockPool / KVCacheManager / Request with full attention (or hybrid) groups."""

    def __init__(self) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256, xxhash
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        kv_cache_utils.init_none_hash(sha256)
        self.torch = torch
        self.SamplingParams = SamplingParams
        self.hash_fns = {"sha256": sha256, "xxhash": xxhash}
        self.kv_cache_utils = kv_cache_utils
        self.BlockPool = BlockPool
        self.KVCacheManager = KVCacheManager
        self.FullAttentionSpec = FullAttentionSpec
        self.SlidingWindowSpec = SlidingWindowSpec
        self.ChunkedLocalAttentionSpec = ChunkedLocalAttentionSpec
        self.KVCacheConfig = KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec
        self.Request = Request

    def spec(self, kind: str, block_size: int, window: int | None = None):
        common = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=self.torch.float32)
        if kind == "full":
            return self.FullAttentionSpec(**common)
        if kind == "chunked":
            return self.ChunkedLocalAttentionSpec(attention_chunk_size=window, **common)
        if kind == "mamba":
            from vllm.v1.kv_cache_interface import MambaSpec
            return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(self.torch.float32,),
                             mamba_cache_mode="align")
        return self.SlidingWindowSpec(sliding_window=window, **common)

    def manager(self, num_blocks: int, specs: list, max_model_len: int, hash_block_size: int,
                enable_caching: bool = True):
        import math
        groups = [self.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
        config = self.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        lcm = math.lcm(*(s.block_size for s in specs))
        return self.KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=lcm,
                                   hash_block_size=hash_block_size, enable_caching=enable_caching)

    def hasher(self, block_size: int, algo: str = "sha256"):
        return self.kv_cache_utils.get_request_block_hasher(block_size, self.hash_fns[algo])

    def request(self, request_id: str, token_ids: list[int], hasher):
        return self.Request(request_id, token_ids, self.SamplingParams(max_tokens=1 << 20), None,
                            block_hasher=hasher)


class DropinCore(VllmCore):
    """The same builders with vLLM's names replaced by kvservice's drop-in
    (kvservice.integrations.vllm.core): vLLM's API and types, kvservice's core."""

    def __init__(self) -> None:
        super().__init__()
        from kvservice.integrations.vllm import core
        self.dropin = core
        self.BlockPool = core.BlockPool
        self.KVCacheManager = core.KVCacheManager

    def hasher(self, block_size: int, algo: str = "sha256"):
        return self.dropin.get_request_block_hasher(block_size, self.hash_fns[algo])
