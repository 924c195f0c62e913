"""Page copies as jobs (kvservice/integrations/vllm/connector/movers.py): the CPU mover here; the CUDA mover where
a GPU is (skipped otherwise; worker/gpu_connector_check.py measures it)."""

from __future__ import annotations

import pytest
import torch

from kvservice.integrations.vllm.connector.movers import CpuMover, CudaMover, make_mover, row_runs
from tests.page_format_helpers import by_hand, fill, reference_page

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CONTENT = 3, 10, 2, 16, 64


def engine(layout="LBNHC", device="cpu"):
    e = by_hand(layout, LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CONTENT, torch.bfloat16)
    if device != "cpu":
        e = by_hand(layout, LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CONTENT, torch.bfloat16, raw=e.raw.to(device))
    return e


def test_row_runs():
    assert row_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert row_runs([]) == []


@pytest.mark.parametrize("rows", [[2, 3, 4, 5], [7, 0, 3, 4]])
def test_cpu_mover_saves_and_loads_at_once(rows):
    src, dst = engine("LBNHC"), engine("BLHNC")
    fill(src, 0)
    save, load = make_mover(src.format()), make_mover(dst.format())
    assert isinstance(save, CpuMover)
    host = torch.zeros(8, save.fmt.page_bytes, dtype=torch.uint8)
    save.submit_save("s1", [9, 1, 4, 5], host, rows)
    assert save.finished() == [("s1", True)] and save.finished() == []
    for row, b in zip(rows, [9, 1, 4, 5]):
        assert torch.equal(host[row], reference_page(src, b))
    load.submit_load("l1", host, rows, [0, 8, 2, 3])
    load.wait(["l1"])
    assert load.finished() == [("l1", True)]
    for a, b in zip([9, 1, 4, 5], [0, 8, 2, 3]):
        assert torch.equal(reference_page(dst, b), reference_page(src, a))
    assert load.num_loaded_pages == 4 and save.num_saved_pages == 4


def test_bad_jobs_are_refused_before_any_copy():
    e = engine()
    mover = CpuMover(e.format())
    host = torch.zeros(4, mover.fmt.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 blocks but 1 host rows"):
        mover.submit_save(1, [1, 2], host, [0])
    with pytest.raises(ValueError, match="host row 4 is outside the 4 host pages"):
        mover.submit_save(1, [1], host, [4])
    with pytest.raises(ValueError, match="host row is repeated"):
        mover.submit_save(1, [1, 2], host, [0, 0])
    with pytest.raises(ValueError, match="block id is repeated"):
        mover.submit_load(1, host, [0, 1], [3, 3])
    with pytest.raises(ValueError, match=f"host pages must be \\[rows, {mover.fmt.page_bytes}\\] uint8"):
        mover.submit_save(1, [1], torch.zeros(4, 100, dtype=torch.uint8), [0])
    assert mover.finished() == []


def test_a_copy_that_fails_is_reported_failed(monkeypatch):
    mover = CpuMover(engine().format())
    host = torch.zeros(4, mover.fmt.page_bytes, dtype=torch.uint8)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(mover.fmt, "gather", broken)
    mover.submit_save("s", [1], host, [0])
    assert mover.finished() == [("s", False)]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("pin,direct", [(True, True), (True, False), (False, True)])
def test_cuda_mover_round_trip_in_chunks(pin, direct):
    """NHD saved staged (chunks of 2 pages), HND loaded by the copy engines alone (page-locked host, direct)
    or staged (chunks of 3 pages); host memory that is not page-locked goes through the bounce buffer."""
    src, dst = engine("LBNHC", "cuda"), engine("LBHNC", "cuda")
    src.raw.random_(-128, 127)
    save = CudaMover(src.format(), staging_bytes=2 * src.format().page_bytes)  # chunks of 2 pages
    load = CudaMover(dst.format(), staging_bytes=3 * dst.format().page_bytes, direct=direct)
    assert save._dma is None and (load._dma is not None) == direct  # noqa: SLF001
    host = torch.zeros(9, save.fmt.page_bytes, dtype=torch.uint8)
    if pin:  # else the copies go through the pinned bounce buffer
        assert save.pin(host) and load.pin(host)
    rows, blocks = [8, 0, 1, 2, 5], [9, 1, 4, 5, 7]
    save.submit_save("s", blocks, host, rows)
    save.wait(["s"])
    assert save.finished() == [("s", True)]
    load.submit_load("l", host, rows, [0, 8, 2, 3, 6])
    load.wait_for_loads_on()
    expected = torch.stack([reference_page(src, b).cpu() for b in blocks])
    got = torch.stack([reference_page(dst, b) for b in [0, 8, 2, 3, 6]]).cpu()  # ordered after the loads
    assert torch.equal(got, expected) and torch.equal(host[rows], expected)
    load.wait(["l"])
    assert load.finished() == [("l", True)]
    save.close()
    load.close()


def test_head_major_formats_are_copied_by_the_copy_engines_alone():
    """Which formats a GPU copies with one cudaMemcpy2DAsync per block (cudadma.py): a block's piece must be
    evenly spaced runs of contiguous bytes on both sides. HND (its layers joined: one 2D copy of L rows), MLA,
    block-outer (one contiguous run), opaque pages: yes; NHD (heads inside tokens) and vLLM's CPU layout: no."""
    from kvservice.integrations.vllm.connector.cudadma import rows_of
    layer_bytes = HEADS * BLOCK_SIZE * CONTENT * 2

    def shapes(e, **kw):
        return [rows_of(p) for p in e.format(**kw).pieces]
    assert shapes(engine("LBHNC")) == [(LAYERS, layer_bytes, BLOCKS * layer_bytes, layer_bytes)]
    assert shapes(engine("BLHNC")) == [(1, LAYERS * layer_bytes, LAYERS * layer_bytes, LAYERS * layer_bytes)]
    assert shapes(engine("LBNHC")) == [None]
    mla = by_hand("LBNHC", LAYERS, BLOCKS, 1, BLOCK_SIZE, 576, torch.bfloat16)
    assert shapes(mla) == [(LAYERS, BLOCK_SIZE * 576 * 2, BLOCKS * BLOCK_SIZE * 576 * 2, BLOCK_SIZE * 576 * 2)]
    assert None not in shapes(engine("LBNHC"), cache_dtype="nvfp4")  # opaque: the block's own bytes
    cpu = by_hand("LBHNC", LAYERS, BLOCKS, HEADS, BLOCK_SIZE, CONTENT, torch.float32)
    assert None in shapes(cpu, cpu_isa="vec", head_size=CONTENT // 2)
