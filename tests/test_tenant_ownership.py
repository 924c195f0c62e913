"""A pool belongs to the tenant that registered it (issue 13, points 6 and 7), over real server processes:
another tenant can neither use nor see it, and only admins run invariant checks."""

import pytest

from kvservice.errors import NotFound, PermissionDenied
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, FreeOp, OpStatus
from tests.service_helpers import small_config, start_server

TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("owners")
    (d / "tokens").write_text(TOKENS)
    proc = start_server("--token-file", str(d / "tokens"), log_dir=d)
    yield proc
    proc.stop()


def test_another_tenant_cannot_take_or_read_a_pool(server):
    a, b = server.client("tok-a"), server.client("tok-b")
    a.register_pool("a-pool", small_config(33, 16), max_model_len=512)
    prompt = list(range(64))
    a.step("a-pool", [AddRequestOp("cached", token_ids=prompt), AllocateOp("cached", num_new_tokens=64),
                      FreeOp("cached")])
    before = a.get_stats().pools["a-pool"]
    # Every RPC that names the pool answers as if it did not exist.
    for attempt in (lambda: b.step("a-pool", [AddRequestOp("grab", token_ids=[1] * 500),
                                              AllocateOp("grab", num_new_tokens=500)]),
                    lambda: b.allocate("a-pool", AllocateOp("grab", num_new_tokens=1),
                                       AddRequestOp("grab", token_ids=[1])),
                    lambda: b.free("a-pool", "cached"),
                    lambda: b.fork("a-pool", "cached", "child"),
                    lambda: b.commit_transfer("a-pool", "xfer-1"),
                    lambda: b.get_request("a-pool", "cached"),
                    lambda: b.lookup(prompt, pool_ids=["a-pool"]),
                    lambda: next(iter(b.watch_events(["a-pool"], timeout_s=5)))):
        with pytest.raises(NotFound, match="'a-pool' is not registered"):
            attempt()
    assert "a-pool" not in b.get_stats().pools
    assert [h.pool_id for h in b.lookup(prompt).hits] == []
    # The owner lost nothing: same free blocks, its prefix still cached.
    after = a.get_stats().pools["a-pool"]
    assert after.num_free_blocks == before.num_free_blocks == 32 and after.num_cached_blocks == 4
    r = a.step("a-pool", [AddRequestOp("again", token_ids=prompt + [9]), AllocateOp("again", num_new_tokens=65)])
    assert r[1].status == OpStatus.OK and r[1].num_computed_tokens == 64
    a.step("a-pool", [DecodeBatchOp(["again"], [65], [3]), FreeOp("again")])
    a.close()
    b.close()


def test_stats_are_per_tenant_and_invariant_checks_need_an_admin(server):
    a, b, admin = server.client("tok-a"), server.client("tok-b"), server.client("tok-admin")
    a.register_pool("stats-a", small_config(16, 16), max_model_len=256)
    b.register_pool("stats-b", small_config(16, 16), max_model_len=256)
    assert "stats-b" not in a.get_stats().pools and "stats-a" not in b.get_stats().pools
    assert {"stats-a", "stats-b"} <= set(admin.get_stats().pools)
    for user in (a, b):
        with pytest.raises(PermissionDenied, match="not an admin"):
            user.get_stats(check_invariants=True)
        with pytest.raises(PermissionDenied, match="not an admin"):
            user.get_stats(include_state_digest=True)
    checked = admin.get_stats(check_invariants=True)
    assert checked.pools["stats-a"].invariant_violation == "" and checked.pools["stats-b"].invariant_violation == ""
    # pool_ids narrows the answer; a pool the caller does not see stays out of it, named or not.
    assert set(admin.get_stats(check_invariants=True, pool_ids=["stats-b"]).pools) == {"stats-b"}
    assert set(a.get_stats(pool_ids=["stats-a", "stats-b", "no-such-pool"]).pools) == {"stats-a"}
    assert set(b.get_stats(pool_ids=["stats-a"]).pools) == set()
    # A tenant counts only its own sessions.
    counts = [c.get_stats().num_sessions for c in (a, b, admin)]
    assert counts[0] >= 1 and counts[1] >= 1 and counts[2] >= counts[0] + counts[1]  # get_stats opens none
    for c in (a, b, admin):
        c.close()
