"""Split-KV paged attention (key segments merged by LSE) under the interpreter, forced by NUM_SEGMENTS_OVERRIDE,
against the unsplit kernel (same public API), the torch twin and dense SDPA; the GPU heuristics as pure
functions; the new kernel variants compiled for sm_90."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_helpers import assert_close, dense_attention, empty_caches, fill_cache_by_indexing, make_batch
from worker.kernels import paged_attention
from worker.kernels import reference as ref
from worker.kernels.attention_config import LaunchConfig, gpu_launch_config
from worker.kernels.split_kv import SplitKVWorkspace, num_kv_segments

paged_attention_module = importlib.import_module("worker.kernels.paged_attention")

SKIP = 3  # exit status of the compile check: this triton cannot compile for CUDA here


def run_split_case(
    monkeypatch, seqs, heads, segments, tiles, dtype=torch.float32, sliding_window=None, head_size=64, seed=0
) -> None:
    """The split launch equals the unsplit one, the twin and SDPA on the same batch."""
    num_q_heads, num_kv_heads = heads
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_size, 16, dtype, seed=seed)
    key_cache, value_cache = empty_caches(batch, num_kv_heads, head_size, dtype)
    fill_cache_by_indexing(batch, key_cache, value_cache)
    args = (batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale)
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", tiles)
    monkeypatch.setattr(paged_attention_module, "NUM_SEGMENTS_OVERRIDE", segments)
    out, lse = paged_attention(*args, sliding_window=sliding_window, return_lse=True)
    plain = paged_attention(*args, sliding_window=sliding_window)
    monkeypatch.setattr(paged_attention_module, "NUM_SEGMENTS_OVERRIDE", 1)
    unsplit, unsplit_lse = paged_attention(*args, sliding_window=sliding_window, return_lse=True)

    what = f"seqs={seqs} heads={heads} S={segments} tiles={tiles} {dtype} w={sliding_window}"
    assert not out.isnan().any() and not lse.isnan().any(), what
    assert torch.equal(plain, out), what  # return_lse changes nothing else
    assert_close(out, unsplit, dtype, f"split vs unsplit, {what}")
    torch.testing.assert_close(lse, unsplit_lse, atol=1e-5, rtol=1e-5)
    twin_out, twin_lse = ref.paged_attention(*args, sliding_window=sliding_window, return_lse=True)
    assert_close(out, twin_out, dtype, f"vs twin, {what}")
    torch.testing.assert_close(lse, twin_lse, atol=1e-3, rtol=1e-4)
    dense_out, dense_lse = dense_attention(batch, sliding_window)
    assert_close(out, dense_out, dtype, f"vs SDPA, {what}")
    torch.testing.assert_close(lse.double(), dense_lse, atol=1e-3, rtol=1e-4)


# Decodes over 101, 38, 6 and 1 keys in 16-key tiles: 7, 3, 1 and 1 tiles, so with 4 or 8 segments the short
# sequences leave segments empty (and with 3, 101 keys split 3/3/1 tiles).
DECODES = [(100, 1), (37, 1), (5, 1), (0, 1)]


@pytest.mark.parametrize(
    "segments,dtype",
    [(3, torch.float32), (4, torch.bfloat16), (8, torch.float16)],
    ids=["S3-fp32", "S4-bf16", "S8-fp16"],
)
def test_split_decode_with_empty_segments(monkeypatch, segments, dtype):
    run_split_case(monkeypatch, DECODES, (8, 2), segments, (16, 16), dtype=dtype, seed=segments)


@pytest.mark.parametrize(
    "tiles,window",
    [
        # 8 query positions per block (GQA 2, 16 rows), window 45: each block reads 4 tiles, one per segment:
        # the window's edge cuts tile 0 (masked), tile 1 is whole (unmasked), tiles 2-3 hold the diagonal.
        ((16, 16), 45),
        # 32 positions per block (64 rows), window 20: the window of the block's last row starts 31 keys past
        # its first row's, in the second tile, so in the second segment; no tile is whole.
        ((64, 16), 20),
    ],
    ids=["edges-in-three-segments", "window-starts-in-segment-1"],
)
def test_split_sliding_window_starting_inside_a_segment(monkeypatch, tiles, window):
    run_split_case(monkeypatch, [(90, 40), (61, 1), (3, 9)], (4, 2), 4, tiles, dtype=torch.float32,
                   sliding_window=window, seed=window)


def test_split_prefill_with_interpreter_tiles(monkeypatch):
    # The interpreter's own large tiles (no TILE_OVERRIDE) and a group of 3 (padding rows in every tile).
    run_split_case(monkeypatch, [(300, 20), (517, 1), (0, 33)], (6, 2), 2, None, dtype=torch.float16, seed=7)


def test_split_rows_that_see_no_key_and_stale_scratch(monkeypatch):
    # DCP rank 1 of 2 (interleave 4) holds nothing of a 3-token sequence; tokens past query_start_loc[-1]
    # belong to no sequence. A workspace full of NaN must not leak into either: empty segments and foreign
    # rows are never read.
    monkeypatch.setattr(paged_attention_module, "NUM_SEGMENTS_OVERRIDE", 4)
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", (16, 16))
    batch = make_batch([(0, 3), (2, 3)], 4, 2, 64, 16, torch.float16, dcp_world_size=2)
    key_cache = torch.zeros(batch.num_blocks, 16, 2, 64, dtype=torch.float16)
    value_cache = torch.ones_like(key_cache)
    q = torch.cat([batch.q, torch.randn(2, 4, 64).half()])
    workspace = SplitKVWorkspace("cpu", num_row_segments=q.shape[0] * 4 * 4, head_size=64)
    partial_out, partial_lse = workspace.views(q.shape[0], 4, 4, 64)
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    out, lse = paged_attention(
        q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.1,
        return_lse=True, dcp_world_size=2, dcp_rank=1, interleave=4, workspace=workspace,
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:5], torch.zeros_like(out[:5])) and torch.isneginf(lse[:5]).all()
    torch.testing.assert_close(out[5].float(), torch.ones(4, 64))
    assert torch.isfinite(lse[5]).all()
    assert torch.equal(out[6:], torch.zeros_like(out[6:])) and torch.isneginf(lse[6:]).all()


def test_workspace_views_reuse_one_buffer_and_grow():
    workspace = SplitKVWorkspace("cpu")
    small_out, small_lse = workspace.views(3, 4, 2, 8)
    assert small_out.shape == (3, 4, 2, 8) and small_lse.shape == (3, 4, 2)
    big_out, big_lse = workspace.views(5, 4, 4, 8)  # grows
    again_out, again_lse = workspace.views(2, 4, 4, 8)  # fits: the same storage, nothing allocated
    assert again_out.data_ptr() == big_out.data_ptr() and again_lse.data_ptr() == big_lse.data_ptr()
    assert big_out.is_contiguous() and big_lse.stride() == (16, 4, 1)


H200_SMS = 132


@pytest.mark.parametrize(
    "batch,context,segments",
    [(1, 4096, 32), (1, 32768, 32), (4, 16384, 8), (8, 8192, 4), (16, 4096, 2), (32, 4096, 1), (256, 2048, 1),
     (1, 512, 4), (1, 64, 1), (1, None, 32)],
)
def test_num_kv_segments_on_an_h200(batch, context, segments):
    # 8 KV heads, one program per decode per KV head, 64-key tiles; None: the context is not known on the host.
    tiles = None if context is None else context // 64
    assert num_kv_segments(batch * 8, H200_SMS, tiles) == segments


def test_gpu_launch_config_decode_and_prefill_tiles():
    bf16 = torch.bfloat16
    assert gpu_launch_config(4, 128, bf16, 1, "sm90") == LaunchConfig(16, 64)  # decode: one group's rows
    assert gpu_launch_config(4, 128, bf16, 8, "sm90") == LaunchConfig(16, 64)  # 32 rows: still decode-shaped
    assert gpu_launch_config(4, 128, bf16, 2048, "sm90").block_m == 128
    assert gpu_launch_config(1, 256, bf16, 4096, "small").block_m == 64
    assert gpu_launch_config(32, 128, bf16, 1, "sm90").block_m == 32  # a tile holds one whole group
    assert gpu_launch_config(4, 128, torch.float32, 2048, "sm80") == LaunchConfig(16, 64)  # fp32: decode tile


def test_split_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == SKIP:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _compile_all() -> None:
    """The split variants, the prefill tiles of the sm90 table and the merge kernel, compiled for sm_90 with
    the alignment a launch specialises on (pointers and strides divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.test_kernels_compile import _signature
    from worker.kernels.attention_config import _PREFILL
    from worker.kernels.attention_kernel import paged_attention_kernel
    from worker.kernels.split_kv import merge_segments_kernel

    if not hasattr(paged_attention_kernel, "params"):
        print("the kernels are interpreted in this process (TRITON_INTERPRET is not 0)")
        sys.exit(SKIP)
    target = GPUTarget("cuda", 90, 32)

    def compile_one(kernel, pointers, constexprs, **options):
        sig = _signature(kernel, pointers, constexprs)
        names = list(sig)
        aligned = [n for n in names if n.endswith("_ptr") or ("stride" in n and n != "block_table_stride")]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        try:
            return triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs), target=target,
                                  options=options)
        except Exception as exc:
            raise AssertionError(f"{kernel.__name__} {constexprs} {options} failed to compile: {exc}") from exc

    pointers = {"block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                "lse_ptr": "*fp32", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    cases = [
        # dtype, group, head, BLOCK_M, BLOCK_N, window, world, split, warps, stages
        ("bf16", 4, 128, 16, 64, False, 1, True, 4, 3),  # split decode, the benchmark's shape
        ("fp16", 8, 64, 16, 64, True, 2, True, 4, 3),
        ("bf16", 3, 80, 16, 32, True, 4, True, 4, 3),
    ]
    for (family, head), config in _PREFILL.items():
        if family == "sm90":
            cases.append(("bf16", 4, head, config.block_m, config.block_n, True, 1, False, config.num_warps,
                          config.num_stages))
    for dtype, group, head, block_m, block_n, window, world, split, warps, stages in cases:
        kernel = compile_one(
            paged_attention_kernel,
            {"*": f"*{dtype}", **pointers},
            dict(
                NUM_QUERIES_PER_KV=group, HEAD_SIZE=head, HEAD_PAD=max(16, 1 << (head - 1).bit_length()),
                BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, SEQS_PAD=128,
                USE_WINDOW=window, RETURN_LSE=True, DCP_WORLD_SIZE=world, INTERLEAVE=1, DOT_FP32=False, SPLIT=split,
            ),
            num_warps=warps, num_stages=stages,
        )
        # Hopper has 228 KiB of shared memory per SM (227 usable by one block).
        assert kernel.metadata.shared <= 227 * 1024, (head, block_m, block_n, kernel.metadata.shared)
    compile_one(
        merge_segments_kernel,
        {"*": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "lse_ptr": "*fp32",
         "query_start_loc_ptr": "*i32"},
        dict(NUM_HEADS=32, HEAD_SIZE=128, HEAD_PAD=128, ROWS=1, RETURN_LSE=True),
    )


if __name__ == "__main__":
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        print(f"no CUDA backend in this triton: {exc}")
        sys.exit(SKIP)
    _compile_all()
    print("split-KV and prefill variants compiled for sm_90")
