"""`kvservice route`: an OpenAI-compatible router in front of stock vLLM servers (docs/integrations/routing.md).

    app (Router: HTTP) -> decide (one Lookup, scoring, policy) -> proxy (retries, pass-through) | pd (P/D)
    fleet (membership, health, load) . tenants (allocator tokens) . prompts (tokens) . metrics

The names below load on first use, so `kvservice.router.scoring` (shared with worker/deploy) stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Router": "app", "Backend": "backends", "parse_backend": "backends", "read_backends_file": "backends",
    "main": "cli", "run": "cli", "Estimate": "scoring", "Load": "scoring", "Reuse": "scoring",
    "ScoringWeights": "scoring", "estimate": "scoring", "rank": "scoring", "POLICIES": "settings",
    "RouterSettings": "settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvservice.router' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvservice.router.{_EXPORTS[name]}"), name)
