"""pytest plugin for `make test-vllm`: runs vLLM 0.33.0's own core tests with vLLM's names replaced by
kvservice's drop-in (KVSERVICE_VLLM_SIDE=dropin, the default) or on vLLM itself (=vllm, the baseline).

The names are replaced in the vLLM modules that define them and in every loaded vLLM module that
imported them, once before collection (so the test modules import ours) and again before each test
(some tests reload `kv_cache_utils`, which would bring vLLM's back). Loaded by tests/vllm/run.py with
`-p vllm_dropin_conftest`.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

SIDE = os.environ.get("KVSERVICE_VLLM_SIDE", "dropin")
_originals: dict[int, tuple[object, object]] = {}  # id(vLLM's object) -> (it, kept alive; ours)


def _replace() -> None:
    from kvservice.integrations.vllm import core

    for module_name, names in core.REPLACES.items():
        module = importlib.import_module(module_name)
        for name in names:
            ours = getattr(core, name)
            theirs = getattr(module, name, None)
            if theirs is not None and theirs is not ours:
                _originals[id(theirs)] = (theirs, ours)
            setattr(module, name, ours)
    for name, module in list(sys.modules.items()):
        if not name.startswith(("vllm.", "tests.")) or module is None:
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            pair = _originals.get(id(value))
            if pair is not None and pair[0] is value:
                namespace[attr] = pair[1]


def pytest_configure(config: pytest.Config) -> None:
    if SIDE == "dropin":
        _replace()


@pytest.fixture(autouse=True)
def _kvservice_dropin():
    if SIDE == "dropin":
        _replace()
    yield
