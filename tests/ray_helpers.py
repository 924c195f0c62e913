"""For tests of joining Ray with no cluster to join: Ray's "auto" joins any cluster running on the machine,
whatever its record in Ray's temp dir says, so they need a machine without one."""

from __future__ import annotations

import pytest


def skip_if_a_ray_cluster_runs() -> None:
    """Skips the test (saying which cluster) when a Ray cluster runs on this machine; Ray must be installed."""
    services = pytest.importorskip("ray._private.services")
    services.find_gcs_addresses.cache_clear()  # Ray keeps what it found: clusters of earlier modules, now gone
    found = services.find_gcs_addresses()
    if found:
        pytest.skip(f"a Ray cluster runs on this machine ({', '.join(found)}): Ray's auto joins it")
