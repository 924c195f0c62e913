"""pytest plugin for `make test-vllm`: runs vLLM 0.33.0's own core tests with vLLM's names replaced by
kvservice's drop-in (KVSERVICE_VLLM_SIDE=dropin, the default) or on vLLM itself (=vllm, the baseline).

`kvservice.integrations.vllm.core.install()` replaces the names in the vLLM modules that define them and
in every loaded vLLM (and test) module that imported them: once before collection, so the test modules
import ours, and again before each test, since some tests reload `kv_cache_utils`. Loaded by
tests/vllm/run.py with `-p vllm_dropin_conftest`.
"""

from __future__ import annotations

import os

import pytest

SIDE = os.environ.get("KVSERVICE_VLLM_SIDE", "dropin")


def _install() -> None:
    if SIDE == "dropin":
        from kvservice.integrations.vllm import core
        core.install()


def pytest_configure(config: pytest.Config) -> None:
    _install()


@pytest.fixture(autouse=True)
def _kvservice_dropin():
    _install()
    yield
