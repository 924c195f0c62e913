"""Every kernel compiles to a Hopper (sm_90) binary with the installed triton, checked without a GPU.

The interpreter runs the kernels' Python semantics; only the compiler rejects what a GPU cannot do (types
that do not unify across branches, unsupported ops, tile shapes tl.dot refuses). Runs in a subprocess with
TRITON_INTERPRET=0 so the kernels are real JIT functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SKIP = 3  # exit status: this triton cannot compile for CUDA here


def test_kernels_compile_for_sm90():
    import pytest

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == SKIP:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _signature(kernel, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    """Argument types: pointers as given, `tl.int64` annotations as i64, fp32 scale, other ints i32."""
    sig = {}
    for param in kernel.params:
        if param.name in constexprs:
            sig[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            sig[param.name] = pointers.get(param.name, pointers["*"])
        elif param.name == "qk_scale":
            sig[param.name] = "fp32"
        else:
            sig[param.name] = param.annotation or "i32"
    return sig


def _compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.kernels import (
        copy_blocks_kernel,
        merge_attn_states_kernel,
        paged_attention_kernel,
        reshape_and_cache_kernel,
        slot_mapping_kernel,
    )

    if not hasattr(paged_attention_kernel, "params"):
        print("the kernels are interpreted in this process (TRITON_INTERPRET is not 0)")
        sys.exit(SKIP)
    target = GPUTarget("cuda", 90, 32)

    def compile_one(kernel, pointers, constexprs):
        src = ASTSource(kernel, _signature(kernel, pointers, constexprs), constexprs=constexprs)
        try:
            triton.compile(src, target=target)
        except Exception as exc:
            raise AssertionError(f"{kernel.__name__} {constexprs} failed to compile: {exc}") from exc

    ints = {"block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "lse_ptr": "*fp32"}
    for dtype, qpk, head, bs, block_n, window, world, interleave, dot_fp32 in [
        ("bf16", 4, 128, 16, 64, False, 1, 1, False),  # the decode benchmark's shape
        ("fp16", 8, 64, 32, 64, True, 2, 2, False),
        ("fp32", 1, 128, 16, 64, False, 4, 16, True),
        ("bf16", 3, 80, 16, 64, True, 1, 1, False),  # padded head size, group not a power of two
        ("fp16", 4, 256, 16, 32, False, 1, 1, False),
    ]:
        head_pad = max(16, 1 << (head - 1).bit_length())
        compile_one(
            paged_attention_kernel,
            {"*": f"*{dtype}", **ints},
            dict(
                NUM_QUERIES_PER_KV=qpk, HEAD_SIZE=head, HEAD_PAD=head_pad, BLOCK_SIZE=bs, BLOCK_M=16,
                BLOCK_Q=16 // qpk, BLOCK_N=block_n, SEQS_PAD=128, USE_WINDOW=window, RETURN_LSE=True,
                DCP_WORLD_SIZE=world, INTERLEAVE=interleave, DOT_FP32=dot_fp32,
            ),
        )
    for world, interleave in [(1, 1), (2, 16)]:
        compile_one(
            slot_mapping_kernel,
            {"*": "*i32", "positions_ptr": "*i64", "slot_mapping_ptr": "*i64"},
            dict(BLOCK_SIZE=16, DCP_WORLD_SIZE=world, INTERLEAVE=interleave, TILE=1024),
        )
    compile_one(
        reshape_and_cache_kernel,
        {"*": "*bf16", "slot_mapping_ptr": "*i64"},
        dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, TOKENS=1, TILE=1024),
    )
    compile_one(
        merge_attn_states_kernel,
        {"*": "*bf16", "lses_ptr": "*fp32", "lse_ptr": "*fp32"},
        dict(NUM_PARTS=4, NUM_HEADS=32, HEAD_SIZE=128, HEAD_PAD=128, ROWS=32),
    )
    compile_one(copy_blocks_kernel, {"*": "*bf16", "pairs_ptr": "*i64"}, dict(BLOCK_NUMEL=16384, PAIRS=1, TILE=4096))


if __name__ == "__main__":
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        print(f"no CUDA backend in this triton: {exc}")
        sys.exit(SKIP)
    _compile_all()
    print("all kernels compiled for sm_90")
