"""The exactly-once contract of a session's sequence numbers, seen from the clients, on a real allocator with a
real Redis: a mutation the allocator applied but whose reply never came back (a deadline, a cancellation), and
an allocator whose recovered state lacks mutations the client saw acknowledged. In each case the next mutation
either resends the unacknowledged one (the same body: answered from the stored reply, applied once) or learns
from the allocator where the session stands; it never skips a sequence, and no later call is refused forever.

The reply is held back deterministically: Redis pauses writes (CLIENT PAUSE WRITE), so the allocator applies
the step and waits for its WAL append while the client's deadline passes (or its task is cancelled).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kvservice.client import AsyncKVServiceClient
from kvservice.errors import Code, KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, OpStatus
from tests.external_helpers import wait_for
from tests.service_helpers import small_config, start_server

PAUSE_MS = 1500


@pytest.fixture
def allocator(redis_server, tmp_path):
    proc = start_server("--redis-url", redis_server.url, "--redis-namespace", uuid.uuid4().hex[:12],
                        persistence=True, log_dir=tmp_path)
    yield proc
    proc.stop()


def add(rid: str) -> list:
    return [AddRequestOp(rid, token_ids=list(range(40))), AllocateOp(rid, num_new_tokens=40)]


def held_back(redis_server, observer, rid: str):
    """Pauses Redis's writes; returns a function that waits until the allocator has applied the step adding
    `rid` (seen by `observer`, another session) and then until the pause is over."""
    with redis_server.client() as r:
        r.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "WRITE")
    ends = time.monotonic() + PAUSE_MS / 1000

    def applied_and_over() -> None:
        wait_for(lambda: _exists(observer, rid), what=f"{rid} applied")
        time.sleep(max(0.0, ends - time.monotonic()) + 0.05)  # (a pause has no end to wait on but its clock)

    return applied_and_over


def _exists(client, rid: str) -> bool:
    try:
        client.get_request("p", rid)
        return True
    except KVServiceError as exc:
        assert exc.code is Code.NOT_FOUND, exc
        return False


@pytest.mark.parametrize("then", ["another call", "the same call"])
def test_a_step_applied_past_its_deadline(allocator, redis_server, then):
    """The step is applied, its reply held back past the client's deadline. Next, another step applies at the
    next sequence (before the fix: 'sequence N was applied to a different request', for every later call), or
    the same step again is answered from the stored reply (applied once: never ALREADY_EXISTS)."""
    with allocator.client(retries=0) as observer, allocator.client(retries=0, timeout_s=0.5) as c:
        c.register_pool("p", small_config(64, 16), max_model_len=512)
        c.step("p", add("first"))
        wait = held_back(redis_server, observer, "late")
        with pytest.raises(KVServiceError) as caught:
            c.step("p", add("late"))
        assert caught.value.code is Code.DEADLINE_EXCEEDED
        wait()
        if then == "another call":
            assert [r.status for r in c.step("p", add("next"))] == [OpStatus.OK, OpStatus.OK]
        else:
            assert [r.status for r in c.step("p", add("late"))] == [OpStatus.OK, OpStatus.OK]
        assert [r.status for r in c.step("p", add("after"))] == [OpStatus.OK, OpStatus.OK]
        for rid in ("first", "late", "after"):
            assert c.get_request("p", rid).num_tokens == 40
        assert observer.get_stats(check_invariants=True).pools["p"].invariant_violation == ""


@pytest.mark.parametrize("then", ["another call", "the same call"])
def test_an_async_step_cancelled_after_it_was_applied(allocator, redis_server, then):
    """The asyncio client's caller cancels the step once the allocator has applied it (its reply held back):
    the next step, another one or the same one again, goes through as above."""
    with allocator.client(retries=0) as observer:
        async def run() -> None:
            c = AsyncKVServiceClient(allocator.target, retries=0)
            try:
                await c.register_pool("p", small_config(64, 16), max_model_len=512)
                await c.step("p", add("first"))
                wait = held_back(redis_server, observer, "late")
                task = asyncio.create_task(c.step("p", add("late")))
                await asyncio.to_thread(wait_for, lambda: _exists(observer, "late"), what="late applied")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.to_thread(wait)
                rid = "next" if then == "another call" else "late"
                assert [r.status for r in await c.step("p", add(rid))] == [OpStatus.OK, OpStatus.OK]
                assert [r.status for r in await c.step("p", add("after"))] == [OpStatus.OK, OpStatus.OK]
            finally:
                await c.close()

        asyncio.run(run())
        for rid in ("first", "late", "after"):
            assert observer.get_request("p", rid).num_tokens == 40


def test_a_client_ahead_of_the_recovered_state_resumes_instead_of_wedging(redis_server, tmp_path):
    """Redis lost the WAL's last entries, acknowledged to the client (the allocator then crashed): the restarted
    allocator's session is two sequences behind the client's. The client's next step is refused as out of
    order; the client resumes the session, which tells the allocator it is behind (the session's pools start
    a new epoch: the lost requests fail, never served from blocks handed out again), and sends the step again
    at the sequence the allocator expects. Before: every later call was refused ("sequence 181 out of order")."""
    ns = "ahead"
    proc = start_server("--redis-url", redis_server.url, "--redis-namespace", ns, persistence=True,
                        log_dir=tmp_path)
    try:
        c = proc.client(retries=5)
        c.register_pool("p", small_config(64, 16), max_model_len=512)
        c.step("p", add("kept"))
        with redis_server.client() as r:
            length = r.xlen(f"{ns}:wal")
        c.step("p", add("lost-1"))
        c.step("p", add("lost-2"))
        with redis_server.client() as r:  # what Redis lost: the last two entries it acknowledged
            ids = [entry_id for entry_id, _ in r.xrange(f"{ns}:wal")][length:]
            assert len(ids) == 2
            r.xdel(f"{ns}:wal", *ids)
        port = int(proc.target.rsplit(":", 1)[1])
        proc.proc.kill()
        proc.proc.wait(10)
        proc = start_server("--redis-url", redis_server.url, "--redis-namespace", ns, persistence=True,
                            log_dir=tmp_path, port=port)
        result = c.step("p", add("next"))
        assert [r.status for r in result] == [OpStatus.OK, OpStatus.OK]
        assert c.step("p", add("after"))[0].status == OpStatus.OK
        for rid in ("kept", "lost-1", "lost-2"):  # the old epoch's requests are gone with it
            with pytest.raises(KVServiceError) as caught:
                c.get_request("p", rid)
            assert caught.value.code is Code.NOT_FOUND
        assert "ahead of the recovered" in proc.log.read_text()
        c.close()
    finally:
        proc.stop()
