"""Triton kernels of the GPU worker, each with a pure-torch twin in `reference.py`.

Without CUDA the same kernels run under the Triton interpreter: `TRITON_INTERPRET` must be set before the
kernels are defined (triton decides at `@triton.jit` time), so this package sets it first, unless it is set
explicitly (`TRITON_INTERPRET=0` on a CPU machine: compile the kernels for a GPU target without running them).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels.cache_write import reshape_and_cache, reshape_and_cache_kernel  # noqa: E402
from worker.kernels.copy_blocks import copy_blocks, copy_blocks_kernel  # noqa: E402
from worker.kernels.dcp import dcp_global_positions, dcp_local_seq_lens  # noqa: E402
from worker.kernels.merge_attn_states import merge_attn_states, merge_attn_states_kernel  # noqa: E402
from worker.kernels.paged_attention import paged_attention, paged_attention_kernel  # noqa: E402
from worker.kernels.slot_mapping import PAD_SLOT_ID, compute_slot_mapping, slot_mapping_kernel  # noqa: E402

__all__ = [
    "PAD_SLOT_ID",
    "compute_slot_mapping",
    "copy_blocks",
    "copy_blocks_kernel",
    "dcp_global_positions",
    "dcp_local_seq_lens",
    "merge_attn_states",
    "merge_attn_states_kernel",
    "paged_attention",
    "paged_attention_kernel",
    "reshape_and_cache",
    "reshape_and_cache_kernel",
    "slot_mapping_kernel",
]
