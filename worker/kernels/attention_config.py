"""Launch configurations of the paged-attention kernel on a GPU: tile sizes, warps and pipeline stages.

Policy only (no kernels here). A decode-shaped launch (a few query rows per sequence) gets a tile of one
GQA group's rows and 64 keys, as before; a prefill-shaped launch gets a 64-128-row tile from a table keyed
by device family, head size and dtype. The interpreter never reads this module's tables: its tiles are
chosen in `paged_attention._tile_sizes`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from worker.kernels._common import next_pow2


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One launch's tile and schedule: `block_m` rows (query tokens x GQA group), `block_n` keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# Query rows a sequence must bring on average before the prefill table is used: below it most rows of a
# 128-row tile would be padding (a decode costs 128 rows of tensor-core work for one row of output).
PREFILL_MIN_ROWS = 64

# (device family, head size bucket) -> prefill config for fp16/bf16. Families: "sm90" Hopper and "sm100"
# Blackwell datacenter parts (228 KiB shared memory per SM), "sm80" A100 (164 KiB), "small" every part with
# ~100 KiB (sm86, sm89, sm120) and the fallback.
# Not timed (no GPU was available when they were written): chosen among FlashAttention-2-like shapes as the
# largest that compile (triton 3.9, `cuobjdump -res-usage`) without register spills and within shared memory
# for that family; 8 warps keep the 128 x head fp32 accumulator in registers. `bench/gpu_attention_bench.py
# --tune` times the alternatives on the machine it runs on.
_PREFILL: dict[tuple[str, int], LaunchConfig] = {
    ("sm90", 64): LaunchConfig(128, 64, 8, 3),
    ("sm90", 128): LaunchConfig(128, 64, 8, 2),
    ("sm90", 256): LaunchConfig(64, 32, 8, 3),
    ("sm80", 64): LaunchConfig(128, 64, 8, 3),
    ("sm80", 128): LaunchConfig(128, 32, 8, 3),
    ("sm80", 256): LaunchConfig(64, 32, 8, 2),
    ("small", 64): LaunchConfig(128, 64, 8, 3),
    ("small", 128): LaunchConfig(128, 32, 8, 3),
    ("small", 256): LaunchConfig(64, 32, 8, 2),
}


@functools.cache
def device_family(device_index: int) -> str:
    """The prefill table's family of a CUDA device, from its compute capability."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major in (9, 10):
        return "sm90"
    if (major, minor) == (8, 0):
        return "sm80"
    return "small"


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query costs microseconds)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gpu_launch_config(
    num_queries_per_kv: int, head_pad: int, dtype: torch.dtype, avg_query_len: int, family: str
) -> LaunchConfig:
    """The launch of one paged-attention call on a GPU of `family`.

    Args:
        avg_query_len: query tokens per sequence in this launch, known on the host without a device sync
            (`ceil(num_tokens / num_seqs)`); a mixed batch with a long prefill among many decodes stays on
            the decode tiles unless the prefill dominates the token count.
    """
    group = next_pow2(num_queries_per_kv)
    # fp32 keeps the decode tile for prefill too: every larger fp32 tile spills registers on sm90.
    if avg_query_len * num_queries_per_kv < PREFILL_MIN_ROWS or dtype == torch.float32:
        return LaunchConfig(max(16, group), 64 if head_pad <= 128 else 32)
    bucket = 64 if head_pad <= 64 else 128 if head_pad <= 128 else 256
    config = _PREFILL[(family, bucket)]
    # A tile must hold at least one query token's whole group.
    return LaunchConfig(max(config.block_m, group), config.block_n, config.num_warps, config.num_stages)
