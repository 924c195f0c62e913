"""vLLM integration (0.32.x and 0.33.x; version.py refuses any other): `core` is a drop-in for vLLM 0.33.0's v1
KV-cache core backed by kvservice.core; `Scheduler` / `AsyncScheduler` (scheduler.py) are vLLM's schedulers
allocating from a kvservice pool (`scheduler_cls="kvservice.integrations.vllm.Scheduler"`); `connector` is a KV
connector through which stock engines share prefixes via the store tier (kvservice.blockstore). Imported
lazily: only they import vLLM."""

_SCHEDULERS = ("Scheduler", "AsyncScheduler")


def __getattr__(name: str):
    if name in _SCHEDULERS:
        from kvservice.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_SCHEDULERS)
