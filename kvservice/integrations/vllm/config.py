"""Where vLLM's scheduler finds its allocator, and what it refuses to run with.

Settings come from `vllm_config.additional_config["kvservice"]` (keys `address`, `token`, `pool_id`,
`timeout_s`, `pipeline`, `step_interval_ms`), else from the environment (`KVSERVICE_ADDRESS`,
`KVSERVICE_TOKEN`, `KVSERVICE_POOL_ID`, `KVSERVICE_PIPELINE`, `KVSERVICE_STEP_INTERVAL_MS`). `pipeline`
(default on): a step's Step RPC is answered and checked while the scheduler goes on, and a divergence raises
at the next schedule(); off: schedule() waits for it and checks it before its output leaves. Pipelined, a
step's output (and the KV its workers write) may leave before the pool confirmed it: that is sound because
the pool is this scheduler's alone and the scheduler's replica decided it; the check guards what the rest of
the fleet reads from the pool. `step_interval_ms` (default 0: every step that changed a block sends its
Step): the least time between two Step RPCs; the steps in between send nothing and their ops travel in the
next Step, so the pool (and what Lookup and its KV events show) lags the engine by up to that long, and a
divergence raises up to that much later. Pipelined only.
`unsupported()` lists every setting the kvservice-backed scheduler cannot honour exactly; the scheduler
refuses to start while any is set, so a schedule is never silently wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.v1 import kv_cache_interface as vi

ENV = {"address": "KVSERVICE_ADDRESS", "token": "KVSERVICE_TOKEN", "pool_id": "KVSERVICE_POOL_ID",
       "pipeline": "KVSERVICE_PIPELINE", "step_interval_ms": "KVSERVICE_STEP_INTERVAL_MS"}
KEYS = ("address", "token", "pool_id", "timeout_s", "pipeline", "step_interval_ms")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_POOL_ID = "vllm-0"


class UnsupportedConfig(ValueError):
    """A vLLM setting the kvservice-backed scheduler cannot follow exactly (named in the message)."""


@dataclass(slots=True)
class KVServiceSettings:
    address: str = DEFAULT_ADDRESS
    token: str | None = None
    pool_id: str = DEFAULT_POOL_ID
    timeout_s: float = 10.0
    pipeline: bool = True
    step_interval_ms: float = 0.0

    @classmethod
    def from_vllm_config(cls, vllm_config) -> KVServiceSettings:
        extra = (getattr(vllm_config, "additional_config", None) or {}).get("kvservice", {})
        if not isinstance(extra, dict):
            raise UnsupportedConfig(f"additional_config['kvservice'] must be a dict with keys {', '.join(KEYS)}, "
                                    f"got {extra!r}")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise UnsupportedConfig(f"additional_config['kvservice'] has unknown keys {unknown}; known: "
                                    f"{', '.join(KEYS)}")
        env = {key: os.environ[name] for key, name in ENV.items() if os.environ.get(name)}
        values = {**env, **extra}
        # Data-parallel engines of one vLLM deployment get a pool each by default (vllm-0, vllm-1, ...).
        rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0) or 0
        settings = cls(str(values.get("address", DEFAULT_ADDRESS)), values.get("token") or None,
                       str(values.get("pool_id", f"vllm-{rank}")), float(values.get("timeout_s", 10.0)),
                       _bool("pipeline", values.get("pipeline", True)),
                       _interval_ms(values.get("step_interval_ms", 0.0)))
        if not settings.address:
            raise UnsupportedConfig("additional_config['kvservice']['address'] (or KVSERVICE_ADDRESS) is empty")
        if settings.step_interval_ms and not settings.pipeline:
            raise UnsupportedConfig(f"additional_config['kvservice']['step_interval_ms'] = "
                                    f"{settings.step_interval_ms} needs pipeline on: unpipelined, every step's "
                                    f"Step is checked before its output leaves")
        return settings


def _bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() not in _BOOLS:
        raise UnsupportedConfig(f"additional_config['kvservice'][{key!r}] (or {ENV[key]}) must be a boolean "
                                f"(true/false, 1/0, on/off), got {value!r}")
    return _BOOLS[str(value).strip().lower()]


def _interval_ms(value) -> float:
    try:
        interval = float(value)
    except (TypeError, ValueError):
        interval = -1.0
    if not 0.0 <= interval <= 60_000.0:  # (NaN fails both)
        raise UnsupportedConfig(f"additional_config['kvservice']['step_interval_ms'] (or "
                                f"{ENV['step_interval_ms']}) must be a number of milliseconds from 0 to 60000, "
                                f"got {value!r}")
    return interval


# vLLM's KV-cache specs whose semantics the allocator's pools carry exactly (RegisterPool's groups; attention
# sinks, R-SWA and circular buffers where this vLLM has them).
_CARRIED = (vi.FullAttentionSpec, vi.SlidingWindowSpec, vi.ChunkedLocalAttentionSpec, vi.CrossAttentionSpec,
            vi.MambaSpec) + tuple(getattr(vi, name) for name in ("CircularBufferSpec",) if hasattr(vi, name))


def unsupported(scheduler, kv_cache_config) -> list[str]:
    """Every setting of this scheduler the kvservice-backed one cannot honour, each as 'setting = value: why'.
    (Prefill context parallelism needs nothing: vLLM's scheduler gives its KV-cache manager pcp_world_size 1,
    and so does this one. Decode context parallelism's sharded and replicated groups are carried.)"""
    out = []
    # Not a KVCacheConfig field in 0.32.
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        out.append(f"hisparse_host_num_blocks = {kv_cache_config.hisparse_host_num_blocks}: the HiSparse tier")
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        inner = next(iter(spec.kv_cache_specs.values())) if isinstance(spec, vi.UniformTypeKVCacheSpecs) else spec
        name = f"kv_cache_groups[{i}] ({type(inner).__name__})"
        if not isinstance(inner, _CARRIED):
            out.append(f"{name}: the allocator's pools carry full attention (with sinks, R-SWA), sliding window, "
                       f"chunked local, cross attention, circular buffer and Mamba only")
    return out


def check_supported(scheduler, kv_cache_config) -> None:
    problems = unsupported(scheduler, kv_cache_config)
    if problems:
        raise UnsupportedConfig("kvservice.integrations.vllm cannot schedule this configuration exactly; unset:\n  "
                                + "\n  ".join(problems))
