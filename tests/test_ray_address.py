"""Joining a Ray cluster never hangs: `live_ray_address` resolves an address as Ray does ($RAY_ADDRESS, else the
record the last cluster started on this machine left in Ray's temp dir) and probes its GCS, because ray.init
alone waits forever for a GCS that is gone. The connector's Ray path and `kvservice deploy` join through it.
(Its module has no Ray cluster of its own: Ray's "auto" joins any cluster running on the machine.)"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray._private.services")
from kvservice.blockstore.actor import RAY_PROBE_TIMEOUT_S, live_ray_address  # noqa: E402
from tests.ray_helpers import skip_if_a_ray_cluster_runs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    """Ray's temp dir for this test, with no record of a cluster, and no $RAY_ADDRESS."""
    skip_if_a_ray_cluster_runs()
    (tmp_path / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


@pytest.fixture
def gone_port():
    """A port where a socket is bound but never listens: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_no_cluster_known_is_an_error_saying_so(ray_tmp):
    with pytest.raises(ConnectionError, match="Could not find any running Ray instance"):
        live_ray_address(None)


def test_a_stale_record_fails_at_once_naming_the_address_and_where_it_came_from(ray_tmp, gone_port):
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{gone_port}\n")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no Ray cluster answers at .*:{gone_port} \(from the last cluster "
                                              rf"started on this machine\)"):
        live_ray_address("auto")
    assert time.monotonic() - start < RAY_PROBE_TIMEOUT_S + 1


def test_an_address_from_the_environment_or_the_caller_is_probed_too(ray_tmp, gone_port, monkeypatch):
    with pytest.raises(ConnectionError, match=rf":{gone_port} \(from 127.0.0.1:{gone_port}\)"):
        live_ray_address(f"127.0.0.1:{gone_port}")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{gone_port}")
    with pytest.raises(ConnectionError, match=r"\(from \$RAY_ADDRESS\)"):
        live_ray_address(None)


def test_a_live_gcs_port_passes_the_probe(ray_tmp, monkeypatch):
    # Ray's single-machine mode, as worker.ray_local's clusters run: 127.0.0.1 stays 127.0.0.1 (else Ray swaps
    # in the machine's routable address, where this socket does not listen).
    from ray._private import ray_constants
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    with socket.socket() as listening:  # anything that accepts: the probe only says "something answers"
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
        assert live_ray_address("auto") == f"127.0.0.1:{port}"


def test_local_and_ray_client_addresses_pass_as_they_are(ray_tmp, gone_port):
    assert live_ray_address("local") == "local"
    assert live_ray_address(f"ray://127.0.0.1:{gone_port}") == f"ray://127.0.0.1:{gone_port}"


@pytest.mark.parametrize("stale", [False, True], ids=["no-cluster", "stale-cluster-record"])
def test_deploy_without_a_live_cluster_says_so_at_once(ray_tmp, gone_port, stale):
    """`kvservice deploy` (--address auto) exits 2 naming the cause, where ray.init alone would hang."""
    if stale:
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{gone_port}\n")
    out = subprocess.run([sys.executable, "-m", "worker.deploy", "--pools", "1"], cwd=REPO, env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    why = "no Ray cluster answers at" if stale else "Could not find any running Ray instance"
    assert "kvservice deploy: no Ray cluster at --address auto" in out.stderr and why in out.stderr, out.stderr
