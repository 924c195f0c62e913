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

from tests.service_helpers import start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One plain allocator process per test module (auth off, default settings)."""
    proc = start_server(log_dir=tmp_path_factory.mktemp("server"))
    yield proc
    proc.stop()
