"""Crash-exact recovery of vLLM pools with Mamba groups, against a real Redis and real server processes: the
states cached in the scheduler step under way, and a running request's Mamba bookkeeping (vLLM's Mamba2
layout: a prefill checkpoint block, speculative blocks), come back from a snapshot."""

import time

from kvservice.commands import VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, MambaSpec, Request
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, NewStepOp, OpStatus
from tests.test_persistence import _stop_started_servers, allocator, digest, kill  # noqa: F401 (an autouse fixture)
from tests.test_vllm_group_kinds_wire import decode_steps
from tests.test_vllm_mamba_wire import Pair


def test_a_mamba_pools_step_under_way_survives_a_restart(redis_server, tmp_path):
    """A vLLM pool with a Mamba group, restarted from a snapshot taken in the middle of a scheduler step: the
    states cached in that step are still no hit until the next step starts (NewStepOp)."""
    proc = allocator(redis_server, "mamba", tmp_path, "--snapshot-every", "1", "--hash-block-size", "4")
    client = proc.client(hash_block_size=4)
    spec = HashSpec("sha256", None, 4)
    client.register_pool("m", KVCacheConfig(40, [FullAttentionSpec(4), MambaSpec(4)]), max_model_len=256,
                         hash_spec=spec, vllm=VllmOptions())
    prompt = list(range(12))

    def add(rid, tokens):
        return AddRequestOp(rid, block_hashes=list(Request(rid, tokens, 4, hash_spec=spec).block_hashes),
                            num_tokens=len(tokens))

    (_, _, r) = client.step("m", [NewStepOp(), add("a", prompt), AllocateOp("a", num_new_tokens=12, waiting=True)])
    assert r.status == OpStatus.OK
    redis = redis_server.client()
    deadline = time.monotonic() + 20
    last = redis.xrevrange("mamba:wal", count=1)[0][0]
    while redis.get("mamba:snapshot:wal_id") != last and time.monotonic() < deadline:
        time.sleep(0.1)
    assert redis.get("mamba:snapshot:wal_id") == last  # the snapshot holds everything: nothing is replayed
    before = digest(client)
    kill(proc)
    proc = allocator(redis_server, "mamba", tmp_path, "--hash-block-size", "4")
    client = proc.client(hash_block_size=4)
    assert digest(client) == before
    admit_b = AllocateOp("b", num_new_tokens=1, lookup=True, num_new_computed_tokens=12, waiting=True)
    (_, r) = client.step("m", [add("b", prompt + [7]), admit_b])
    assert r.status == OpStatus.NO_SPACE  # the states `a` cached are written by this step's forward
    (_, r) = client.step("m", [NewStepOp(), admit_b])
    assert r.status == OpStatus.OK, r
    proc.stop()


def wait_for_snapshot(redis_server, name: str) -> None:
    """Until the snapshot holds every WAL entry (nothing is replayed at the restart)."""
    redis = redis_server.client()
    deadline = time.monotonic() + 20
    last = redis.xrevrange(f"{name}:wal", count=1)[0][0]
    while redis.get(f"{name}:snapshot:wal_id") != last and time.monotonic() < deadline:
        time.sleep(0.1)
    assert redis.get(f"{name}:snapshot:wal_id") == last


def test_a_running_mamba_request_with_speculative_and_checkpoint_blocks_survives_a_restart(redis_server, tmp_path):
    """vLLM's Mamba2 layout (align mode, a prefill checkpoint block, two speculative blocks), restarted from a
    snapshot in the middle of a decode: the group's per-request bookkeeping (where the running state is, what
    was retired, who is past their speculative blocks) comes back, so the blocks freed and handed out after
    the restart are still those of vLLM's core driven without one."""
    proc = allocator(redis_server, "mamba2", tmp_path, "--snapshot-every", "1", "--hash-block-size", "4")
    config = KVCacheConfig(80, [FullAttentionSpec(4), MambaSpec(4, "align", 2, 1, 1)])
    p = Pair(proc.client(hash_block_size=4), "m2", config)
    prompt = list(range(100, 122))  # 5.5 blocks, prefilled in two chunks
    p.core.new_step_starts()
    p.step([NewStepOp(), p.add("a", prompt), p.admit("a", 12)])
    p.core.new_step_starts()
    p.step([NewStepOp(), p.run("a", 10)])
    mamba = p.core.coordinator.managers[1]

    def restart():
        nonlocal proc
        wait_for_snapshot(redis_server, "mamba2")
        before = digest(p.client)
        kill(proc)
        proc = allocator(redis_server, "mamba2", tmp_path, "--snapshot-every", "1", "--hash-block-size", "4")
        p.client = proc.client(hash_block_size=4)
        assert digest(p.client) == before

    assert mamba._checkpoints and mamba.last_state_block_idx  # the last chunk reserved a checkpoint block
    restart()
    decode_steps(p, "a", 5, new_steps=True)  # each step's blocks checked against the core
    assert mamba._allocated_block_reqs and mamba._num_retired_blocks
    restart()
    decode_steps(p, "a", 12, new_steps=True)
    p.core.free(p.requests["a"])
    p.step([FreeOp("a")])
    p.check()
    proc.stop()
