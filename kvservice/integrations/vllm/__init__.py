"""vLLM 0.33.0 integration: `core` is a drop-in for vLLM's v1 KV-cache core backed by kvservice.core;
`Scheduler` / `AsyncScheduler` (scheduler.py) are vLLM's schedulers allocating from a kvservice pool
(`scheduler_cls="kvservice.integrations.vllm.Scheduler"`). Imported lazily: only they import vLLM."""

_SCHEDULERS = ("Scheduler", "AsyncScheduler")


def __getattr__(name: str):
    if name in _SCHEDULERS:
        from kvservice.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_SCHEDULERS)
