"""GPU check of the worker kernels: correctness on CUDA against the torch twins, then a decode benchmark.

Run by `make gpu-check` as `PYTHONPATH=. python3 worker/gpu_check.py` with the machine's own python (no venv,
no pytest): plain asserts, and imports of torch, triton and the worker kernels only. Without CUDA it says so
and runs a tiny interpreted smoke check instead.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker import kernels as K  # sets TRITON_INTERPRET before triton loads when there is no CUDA
from worker.block_table import BlockTable
from worker.kernels import reference as ref

TOL = {
    torch.float32: dict(atol=1e-3, rtol=1e-3),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def make_paged(
    seqs: list[tuple[int, int]], heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype,
    device: str, world: int = 1, seed: int = 0,
) -> dict:
    """Random varlen batch: q, whole-sequence K/V, a shuffled block table (allocation blocks of bs * world)."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    per_seq = [max(1, math.ceil((c + n) / (block_size * world))) for c, n in seqs]
    num_blocks = sum(per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seqs), max(per_seq) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = pool[start : start + n]
        start += n
    total = sum(c + n for c, n in seqs)
    keys = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    q = torch.randn(sum(n for _, n in seqs), num_q_heads, head_size, generator=gen).to(dtype)
    q_lens = torch.tensor([0] + [n for _, n in seqs])
    seq_lens = torch.tensor([c + n for c, n in seqs])
    return dict(
        q=q.to(device), keys=keys.to(device), values=values.to(device), block_table=table.to(device),
        query_start_loc=q_lens.cumsum(0).int().to(device), seq_lens=seq_lens.int().to(device),
        kv_start_loc=torch.cat([torch.zeros(1), seq_lens.cumsum(0)]).int().to(device),
        positions=torch.cat([torch.arange(c + n) for c, n in seqs]).to(device), num_blocks=num_blocks,
        scale=1.0 / math.sqrt(head_size),
    )


def shard_attention(b: dict, block_size: int, world: int, interleave: int, window: int | None, attention: Callable):
    """Each DCP rank writes its shard (slot mapping + cache write) and attends; returns the merged result."""
    num_kv_heads, head_size = b["keys"].shape[1:]
    shape = (b["num_blocks"], block_size, num_kv_heads, head_size)
    outs, lses = [], []
    for rank in range(world):
        dcp = dict(dcp_world_size=world, dcp_rank=rank, interleave=interleave)
        slots = K.compute_slot_mapping(b["block_table"], b["kv_start_loc"], b["positions"], block_size, **dcp)
        key_cache = torch.full(shape, float("nan"), dtype=b["keys"].dtype, device=b["keys"].device)
        value_cache = torch.full_like(key_cache, float("nan"))
        K.reshape_and_cache(b["keys"], b["values"], key_cache, value_cache, slots)
        out, lse = attention(
            b["q"], key_cache, value_cache, b["block_table"], b["query_start_loc"], b["seq_lens"], b["scale"],
            sliding_window=window, return_lse=True, **dcp,
        )
        outs.append(out)
        lses.append(lse)
    if world == 1:
        return outs[0], lses[0]
    return K.merge_attn_states(torch.stack(outs), torch.stack(lses))


def check_slot_mapping(device: str) -> None:
    row = torch.tensor([[7, 3]], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 16], dtype=torch.int32, device=device)
    pos = torch.arange(16, device=device)
    got = K.compute_slot_mapping(row, qsl, pos, 4, dcp_world_size=2, dcp_rank=0, interleave=1)
    assert got.tolist() == [28, -1, 29, -1, 30, -1, 31, -1, 12, -1, 13, -1, 14, -1, 15, -1], got.tolist()
    got = K.compute_slot_mapping(row, qsl, pos, 4, dcp_world_size=2, dcp_rank=1, interleave=2)
    assert got.tolist() == [-1, -1, 28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15], got.tolist()
    assert K.dcp_local_seq_lens(13, 2, 1).tolist() == [7, 6]
    big = torch.tensor([[2**27 + 1, 2**28 + 3]], dtype=torch.int32, device=device)
    got = K.compute_slot_mapping(big, torch.tensor([0, 2], dtype=torch.int32, device=device),
                                 torch.tensor([5, 40], device=device), 32)
    assert got.tolist() == [(2**27 + 1) * 32 + 5, (2**28 + 3) * 32 + 8], got.tolist()
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 10**6, (8, 40), generator=gen, dtype=torch.int32).to(device)
    lens = [1, 300, 7, 1000, 64]
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(3 * i, 3 * i + n) for i, n in enumerate(lens)]).to(device)
    for world, interleave in [(1, 1), (2, 1), (4, 16)]:
        for rank in range(world):
            kw = dict(dcp_world_size=world, dcp_rank=rank, interleave=interleave)
            out = torch.zeros(2000, dtype=torch.int64, device=device)
            got = K.compute_slot_mapping(table, qsl, pos, 32, out=out, **kw)
            assert torch.equal(got, ref.compute_slot_mapping(table, qsl, pos, 32, **kw)), kw
            assert (out[pos.shape[0]:] == -1).all()


def check_cache_write(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype, (bs, hkv, d) in itertools.product(TOL, [(16, 8, 128), (32, 2, 64), (16, 3, 80)]):
        key = torch.randn(300, hkv, d, generator=gen).to(dtype).to(device)
        value = torch.randn(300, hkv, d, generator=gen).to(dtype).to(device)
        slots = torch.randperm(40 * bs, generator=gen)[:300]
        slots[::5] = -1
        slots = slots.to(device)
        caches = [torch.zeros(40, bs, hkv, d, dtype=dtype, device=device) for _ in range(4)]
        K.reshape_and_cache(key, value, caches[0], caches[1], slots)
        ref.reshape_and_cache(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), (dtype, bs, hkv, d)


def check_paged_attention(device: str) -> None:
    mixed = [(0, 45), (100, 17), (300, 1), (33, 1), (0, 1), (1000, 1)]
    configs = [
        # block_size, head_size, (Hq, Hkv), dtype, window
        (16, 128, (32, 8), torch.bfloat16, None),
        (16, 64, (8, 8), torch.float16, None),
        (32, 128, (16, 8), torch.float16, None),
        (32, 64, (8, 1), torch.bfloat16, None),
        (16, 128, (8, 2), torch.float32, None),
        (16, 64, (4, 2), torch.bfloat16, 64),
        (32, 128, (12, 4), torch.float16, 37),
        (16, 80, (4, 1), torch.float16, None),
    ]
    for bs, d, heads, dtype, window in configs:
        b = make_paged(mixed, heads, d, bs, dtype, device, seed=bs + d)
        what = f"bs={bs} D={d} heads={heads} {dtype} window={window}"
        out, lse = shard_attention(b, bs, 1, 1, window, K.paged_attention)
        twin_out, twin_lse = shard_attention(b, bs, 1, 1, window, ref.paged_attention)
        close(out, twin_out, dtype, what)
        torch.testing.assert_close(lse, twin_lse, atol=2e-3, rtol=1e-4)
        assert not out.isnan().any(), what


def check_dcp(device: str) -> None:
    mixed = [(0, 30), (200, 9), (517, 1), (3, 1)]
    for world, interleave, dtype in [(2, 1, torch.bfloat16), (4, 16, torch.float16), (4, 2, torch.float32)]:
        b = make_paged(mixed, (8, 2), 128, 16, dtype, device, world=world, seed=world)
        merged, merged_lse = shard_attention(b, 16, world, interleave, None, K.paged_attention)
        # The same blocks read as one rank with blocks of 16 * W tokens, through the twin: the whole context.
        full, full_lse = shard_attention(b, 16 * world, 1, 1, None, ref.paged_attention)
        close(merged, full, dtype, f"DCP W={world} I={interleave}")
        torch.testing.assert_close(merged_lse, full_lse, atol=2e-3, rtol=1e-4)


def check_merge_and_copy(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    outs = torch.randn(4, 50, 8, 128, generator=gen).to(device)
    lses = torch.randn(4, 50, 8, generator=gen).to(device)
    lses[3] = float("-inf")
    lses[:, 7] = float("-inf")
    outs[3] = float("nan")
    out, lse = K.merge_attn_states(outs, lses)
    twin_out, twin_lse = ref.merge_attn_states(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, twin_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, twin_lse)
    assert (out[7] == 0).all() and torch.isneginf(lse[7]).all()

    caches = [torch.randn(64, 16, 8, 128, generator=gen).to(torch.bfloat16).to(device) for _ in range(4)]
    expected = [c.clone() for c in caches]
    pairs = torch.tensor([[3, 40], [17, 2], [63, 0]], dtype=torch.int64, device=device)
    K.copy_blocks(caches[:2], caches[2:], pairs)
    ref.copy_blocks(expected[:2], expected[2:], pairs)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))


def check_int64_offsets(device: str) -> None:
    # block id * block stride > 2**31 elements: 4 GiB per cache.
    high, bs, d = 2**23 + 5, 16, 16
    key_cache = torch.zeros(high + 1, bs, 1, d, dtype=torch.float16, device=device)
    value_cache = torch.zeros_like(key_cache)
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(20, 1, d, generator=gen).half().to(device)
    value = torch.randn(20, 1, d, generator=gen).half().to(device)
    slots = torch.cat([high * bs + torch.arange(16), 5 * bs + torch.arange(4)]).to(device)
    K.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[high, :, 0], key[:16, 0]) and torch.equal(value_cache[5, :4, 0], value[16:, 0])
    q = torch.randn(1, 2, d, generator=gen).half().to(device)
    args = (q, key_cache, value_cache, torch.tensor([[high, 5]], dtype=torch.int32, device=device),
            torch.tensor([0, 1], dtype=torch.int32, device=device),
            torch.tensor([20], dtype=torch.int32, device=device), 0.25)
    close(K.paged_attention(*args), ref.paged_attention(*args), torch.float16, "int64 offsets")
    del key_cache, value_cache
    torch.cuda.empty_cache()


def check_block_table(device: str) -> None:
    table = BlockTable(4, 2, 4, 32, device=device, dcp_world_size=2, dcp_rank=1, interleave=2)
    table.add_row([7], 0)
    table.append_row([3], 0)
    table.commit(1)
    slots = table.compute_slot_mapping(1, torch.tensor([0, 16], dtype=torch.int32), torch.arange(16))
    assert slots.tolist() == [-1, -1, 28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15], slots.tolist()
    assert (table.slot_mapping[16:] == -1).all()


def bench_decode(
    batch: int = 64, context: int = 4096, heads: tuple[int, int] = (32, 8), head_size: int = 128,
    block_size: int = 16, dtype: torch.dtype = torch.bfloat16, reps: int = 30, device: str = "cuda",
) -> None:
    """One decode step: achieved K/V bandwidth of paged attention, and its time relative to SDPA on the
    same K/V gathered into dense tensors."""
    num_q_heads, num_kv_heads = heads
    num_blocks = batch * context // block_size
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(num_blocks, device=device).view(batch, -1).int()
    q = torch.randn(batch, num_q_heads, head_size, dtype=dtype, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(head_size)

    def paged() -> torch.Tensor:
        return K.paged_attention(q, key_cache, value_cache, table, qsl, seq_lens, scale)

    k_dense = key_cache[table.long()].reshape(batch, context, num_kv_heads, head_size).transpose(1, 2).contiguous()
    v_dense = value_cache[table.long()].reshape(batch, context, num_kv_heads, head_size).transpose(1, 2).contiguous()
    q_dense = q.view(batch, num_q_heads, 1, head_size)
    sdpa_kind = "enable_gqa"
    try:
        F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)
    except (TypeError, RuntimeError):
        sdpa_kind = "K/V repeated per query head"
        group = num_q_heads // num_kv_heads
        k_rep, v_rep = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q_dense, k_rep, v_rep, scale=scale)

    close(paged(), sdpa().view(batch, num_q_heads, head_size), dtype, "decode benchmark vs SDPA")

    def median_ms(fn: Callable[[], torch.Tensor]) -> float:
        for _ in range(5 if device == "cuda" else 1):
            fn()
        times = []
        for _ in range(reps):
            if device != "cuda":  # dry runs of this script on a CPU
                start_s = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start_s) * 1e3)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    paged_ms, sdpa_ms = median_ms(paged), median_ms(sdpa)
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * key_cache.element_size()
    print(f"\ndecode: batch {batch}, context {context}, Hq {num_q_heads}, Hkv {num_kv_heads}, D {head_size}, "
          f"{str(dtype).removeprefix('torch.')}, block size {block_size}; median of {reps}")
    print(f"  {'kernel':<34}{'ms':>9}{'K/V GB/s':>11}{'vs SDPA':>9}")
    print(f"  {'paged_attention (triton)':<34}{paged_ms:>9.3f}{kv_bytes / paged_ms / 1e6:>11.0f}"
          f"{paged_ms / sdpa_ms:>8.2f}x")
    print(f"  {'SDPA, dense K/V (' + sdpa_kind + ')':<34}{sdpa_ms:>9.3f}{kv_bytes / sdpa_ms / 1e6:>11.0f}"
          f"{1.0:>8.2f}x")


def smoke_interpreted() -> None:
    check_slot_mapping("cpu")
    b = make_paged([(20, 3), (7, 1)], (4, 2), 64, 16, torch.float16, "cpu")
    out, lse = shard_attention(b, 16, 1, 1, None, K.paged_attention)
    twin_out, twin_lse = shard_attention(b, 16, 1, 1, None, ref.paged_attention)
    close(out, twin_out, torch.float16, "interpreted smoke")
    torch.testing.assert_close(lse, twin_lse, atol=2e-3, rtol=1e-4)


def run(name: str, fn: Callable[[], None], failures: list[str]) -> None:
    start = time.perf_counter()
    try:
        fn()
    except Exception:  # report every check, then fail at the end
        failures.append(name)
        print(f"FAIL {name}")
        traceback.print_exc()
    else:
        print(f"ok   {name} ({time.perf_counter() - start:.1f} s)")


def main() -> int:
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    failures: list[str] = []
    if not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): running a tiny interpreted smoke check")
        run("interpreted smoke", smoke_interpreted, failures)
        return 1 if failures else 0
    print(f"device: {torch.cuda.get_device_name()}")
    for name, fn in [
        ("slot mapping", check_slot_mapping),
        ("cache write", check_cache_write),
        ("paged attention", check_paged_attention),
        ("DCP shards + merge", check_dcp),
        ("merge_attn_states + copy_blocks", check_merge_and_copy),
        ("int64 offsets (8 GiB caches)", check_int64_offsets),
        ("block table", check_block_table),
    ]:
        run(name, lambda fn=fn: fn("cuda"), failures)
    run("decode benchmark", bench_decode, failures)
    if failures:
        print(f"\n{len(failures)} check(s) failed: {', '.join(failures)}")
        return 1
    print("\nall GPU checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
