"""Launcher helpers shared by the kernels: argument validation that names the argument, device knobs."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (set by `worker.kernels` without CUDA)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> dict[str, int]:
    """Block, slot and head strides of a `[num_blocks, block_size, Hkv, D]` cache pair, as kernel keywords."""
    return {
        f"{name}_stride_{dim}": cache.stride(i)
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache))
        for i, dim in enumerate("bsh")
    }


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Raise ValueError naming `name` unless `t` is a tensor of the given rank, dtype, shape and device.

    `shape` entries that are None are not checked.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")
    if shape is not None:
        for dim, (want, got) in enumerate(zip(shape, t.shape, strict=True)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} has size {got} in dimension {dim}, expected {want} (shape {tuple(t.shape)})"
                )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other arguments")
    return t


def check_kernel_device(name: str, t: torch.Tensor) -> torch.device:
    """Compiled kernels need CUDA tensors; the interpreter (no CUDA) reads host memory. Returns the device."""
    if not interpreting() and t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}, but the Triton kernels run on CUDA here; move the tensors to the GPU "
            "or use the torch twins in worker.kernels.reference"
        )
    return t.device


def check_same_dtype(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if t.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}; they must match")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels vectorise over the last dimension, so it must have stride 1."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}; "
            f"pass {name}.contiguous()"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_dcp(
    dcp_world_size: int, dcp_rank: int, interleave: int, block_size: int | None = None
) -> None:
    """Decode-context-parallel arguments: 0 <= rank < world size, interleave dividing the block size."""
    check_positive("dcp_world_size", dcp_world_size)
    check_positive("interleave", interleave)
    if not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_world_size:
        raise ValueError(f"dcp_rank must be an int in [0, {dcp_world_size}), got {dcp_rank!r}")
    if block_size is not None and block_size % interleave != 0:
        raise ValueError(f"interleave {interleave} must divide the per-rank block_size {block_size}")


def check_query_start_loc_on_host(query_start_loc: torch.Tensor, num_tokens: int) -> list[int]:
    """Value checks that would need a device sync on a GPU, so launchers run them only on CPU tensors.

    Returns `query_start_loc` as a list.
    """
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:], strict=False)) or qsl[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0, be non-decreasing and end at <= {num_tokens} (the number of "
            f"tokens), got {qsl}"
        )
    return qsl
