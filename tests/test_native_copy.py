"""The compiled page copies (kvservice/native, `make native`) against the torch runs they replace on CPU engines
and against the per-layer reference, on randomized layouts, dtypes, head sizes, block sizes and (block, row)
pairs: vLLM's CPU layout (K transposed within a block: the vector transpose where the sizes allow, the scalar
one where not), the CUDA layouts on CPU tensors, and opaque pages; pages misaligned (no streaming stores) and
in a larger buffer (rows as given)."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from kvservice import native
from tests.page_format_helpers import by_hand, fill, gather

needs_library = pytest.mark.skipif(native.library() is None, reason="kvservice/native is not built (make native)")


def test_the_library_is_built_where_a_compiler_is():
    """Where `make` could build it, the tests below must not skip: a stale or missing library fails here."""
    if not native.enabled() or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("KVSERVICE_NATIVE=0, or no C compiler: the torch path is what runs here")
    assert native.library() is not None, f"{native.LIBRARY} is missing or older than its source: run `make native`"

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64]


def formats(e, **kw):
    """The compiled path, the torch runs (KVSERVICE_NATIVE=0's) and the per-layer reference of one engine."""
    fast, runs, ref = e.format(**kw), e.format(**kw), e.format(fast=False, **kw)
    runs._copier._native = None  # noqa: SLF001 - the path the setting selects, on the same views
    assert fast._copier.native and not runs._copier.native  # noqa: SLF001
    return fast, runs, ref


def random_case(rng: random.Random):
    kind = rng.choice(["cpu", "cpu", "cpu", "LBNHC", "LBHNC", "BLNHC"])
    dtype = rng.choice(DTYPES)
    layers, heads, blocks = rng.randint(1, 4), rng.randint(1, 4), rng.randint(4, 24)
    block = rng.choice([8, 16, 32, 7, 12] if kind == "cpu" else [16, 32, 5])
    head = rng.choice([16, 32, 64, 8, 12, 20, 40])
    layout = "LBHNC" if kind == "cpu" else kind

    def build():
        return by_hand(layout, layers, blocks, heads, block, 2 * head, dtype)
    kw = dict(cpu_isa="vec", head_size=head) if kind == "cpu" else {}
    return build, kw, blocks


@needs_library
@pytest.mark.parametrize("seed", range(60))
def test_the_compiled_copies_equal_the_torch_runs_and_the_reference(seed):
    rng = random.Random(seed)
    build, kw, blocks = random_case(rng)
    e = build()
    fill(e, seed)
    fast, runs, ref = formats(e, **kw)
    n = rng.randint(1, blocks)
    ids = rng.sample(range(blocks), n)
    if rng.random() < 0.4:
        ids.sort()  # a run, as a fresh engine hands out
    spare = rng.randint(0, 3)
    rows = rng.sample(range(n + spare), n) if spare or rng.random() < 0.5 else None
    height = n + spare if rows is not None else n
    # misaligned pages: the copies fall back from 16-byte streaming stores to plain ones
    offset = rng.choice([0, 0, 1, 2, 8])
    buf = torch.zeros(height * fast.page_bytes + offset, dtype=torch.uint8)
    pages = buf[offset:].view(height, fast.page_bytes)
    want = torch.zeros(height, fast.page_bytes, dtype=torch.uint8)
    by_runs = torch.zeros_like(want)
    fast.gather(ids, pages, rows)
    ref.gather(ids, want, rows)
    runs.gather(ids, by_runs, rows)
    assert torch.equal(pages, want), f"save differs from the reference ({e.raw.dtype}, {kw}, ids {ids}, rows {rows})"
    assert not buf[:offset].any(), "a byte before the pages was written"
    assert torch.equal(by_runs, want)
    # load into other blocks of a second engine: every byte it should change, and none other
    target = rng.sample(range(blocks), n)
    dst_fast, dst_ref = build(), build()
    fill(dst_fast, seed + 1)
    fill(dst_ref, seed + 1)
    fast_dst, _, _ = formats(dst_fast, **kw)
    ref_dst = dst_ref.format(fast=False, **kw)
    fast_dst.scatter(pages, target, rows)
    ref_dst.scatter(want, target, rows)
    assert torch.equal(dst_fast.raw, dst_ref.raw), f"load differs from the reference ({e.raw.dtype}, {kw})"


@needs_library
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_whose_k_is_larger_than_the_transpose_buffer(dtype):
    """Block 128 x head 128: K is 32 or 64 KiB per (block, head), over the 16 KiB tile buffer: strips."""
    build = lambda: by_hand("LBHNC", 2, 6, 2, 128, 256, dtype)  # noqa: E731
    e = build()
    fill(e, 7)
    fast, runs, ref = formats(e, cpu_isa="vec", head_size=128)
    ids, rows = [4, 1, 5], [2, 0, 1]
    got, want = torch.zeros(3, fast.page_bytes, dtype=torch.uint8), torch.zeros(3, fast.page_bytes, dtype=torch.uint8)
    fast.gather(ids, got, rows)
    ref.gather(ids, want, rows)
    assert torch.equal(got, want)
    dst_fast, dst_ref = build(), build()
    formats(dst_fast, cpu_isa="vec", head_size=128)[0].scatter(want, [0, 3, 2], rows)
    dst_ref.format(fast=False, cpu_isa="vec", head_size=128).scatter(want, [0, 3, 2], rows)
    assert torch.equal(dst_fast.raw, dst_ref.raw)


@needs_library
def test_threads_split_the_job_and_cover_every_item():
    """A job of many pairs on several threads (forced past the cores): the same bytes as one thread."""
    e = by_hand("LBHNC", 3, 40, 2, 32, 128, torch.bfloat16)
    fill(e, 3)
    fmt = e.format(cpu_isa="vec", head_size=64)
    ids = list(range(0, 40, 2)) + list(range(39, 0, -2))
    one = torch.zeros(len(ids), fmt.page_bytes, dtype=torch.uint8)
    many = torch.zeros_like(one)
    copier = fmt._copier  # noqa: SLF001
    copier.threads = 1
    fmt.gather(ids, one)
    copier.threads = 7
    copier.page_bytes = 1 << 20  # past the size below which one thread copies
    try:
        fmt.gather(ids, many)
    finally:
        copier.page_bytes = fmt.page_bytes
    assert copier.threads == 7
    assert torch.equal(one, many)


@needs_library
def test_the_setting_selects_the_torch_path(monkeypatch):
    monkeypatch.setenv("KVSERVICE_NATIVE", "0")
    e = by_hand("LBHNC", 1, 4, 1, 16, 32, torch.float32)
    assert not e.format(cpu_isa="vec", head_size=16)._copier.native  # noqa: SLF001
    monkeypatch.setenv("KVSERVICE_NATIVE", "1")
    assert e.format(cpu_isa="vec", head_size=16)._copier.native  # noqa: SLF001


def test_without_the_library_the_torch_path_runs_and_says_so_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "libkvcopy.so")
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    e = by_hand("LBHNC", 1, 4, 1, 16, 32, torch.float32)
    fill(e, 1)
    with caplog.at_level("WARNING", logger="kvservice.native"):
        fmts = [e.format(cpu_isa="vec", head_size=16) for _ in range(3)]
    assert not any(f._copier.native for f in fmts)  # noqa: SLF001
    said = [r for r in caplog.records if "make native" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert torch.equal(gather(fmts[0], [2, 0]), gather(e.format(cpu_isa="vec", head_size=16, fast=False), [2, 0]))
