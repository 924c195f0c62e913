"""Shared test setup: a repeatable hypothesis profile."""

import os

# Tests fork servers (subprocess with a preexec_fn) from a process that uses gRPC clients. With gRPC's
# fork support on, the child restarts gRPC's poller before exec() and can abort on the epoll fd that
# close_fds just closed (grpc/grpc#43055). The child never uses gRPC, so the handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402

from tests.redis_helpers import RedisServer  # noqa: E402
from tests.service_helpers import SMALL_HASH_BLOCK, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One plain allocator process per test module (auth off, default settings)."""
    proc = start_server(log_dir=tmp_path_factory.mktemp("server"))
    yield proc
    ended = proc.exited()
    proc.stop()
    assert ended is None, f"the module's server ended before the module did: {ended}"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One Redis per test module that fsyncs every write (a module may define its own instead)."""
    with RedisServer(tmp_path_factory.mktemp("redis"), appendfsync="always") as server:
        yield server


@pytest.fixture(scope="module")
def small_hash_server(tmp_path_factory):
    """One allocator process per test module hashing SMALL_HASH_BLOCK-token blocks (the vLLM-semantics wire
    tests' pools)."""
    proc = start_server("--hash-block-size", str(SMALL_HASH_BLOCK), log_dir=tmp_path_factory.mktemp("small-hash"))
    yield proc
    ended = proc.exited()
    proc.stop()
    assert ended is None, f"the module's server ended before the module did: {ended}"


@pytest.fixture
def small_hash_client(small_hash_server, request):
    """A client of small_hash_server named after the test."""
    c = small_hash_server.client(client_name=request.node.name, hash_block_size=SMALL_HASH_BLOCK)
    yield c
    c.close()
