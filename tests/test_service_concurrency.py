"""8 concurrent clients x 500 mixed ops on one pool; invariants through GetStats at the end."""

import random
import threading

from kvservice.ops import AddRequestOp, AllocateOp, ForkOp, FreeOp, OpStatus
from tests.service_helpers import small_config

NUM_CLIENTS, NUM_OPS = 8, 500


def worker(server, pid, index, errors, counts):
    rng = random.Random(index)
    client = server.client(client_name=f"load-{index}")
    live: dict[str, int] = {}  # request id -> computed tokens
    next_id = 0
    try:
        for _ in range(NUM_OPS):
            kind = rng.choices(["add", "decode", "fork", "free"], [3, 6, 1, 2])[0]
            if kind == "add" or not live:
                rid = f"c{index}-{next_id}"
                next_id += 1
                prompt = [rng.randrange(4)] * 16 + [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
                r = client.step(pid, [AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=len(prompt))])
                if r[1].status == OpStatus.OK:
                    live[rid] = len(prompt)
                else:
                    client.free(pid, rid)
            elif kind == "decode":
                rid = rng.choice(sorted(live))
                r = client.step(pid, [AllocateOp(rid, num_computed_tokens=live[rid], num_new_tokens=1,
                                                 append_token_ids=[rng.randrange(1000)])])
                if r[0].status == OpStatus.OK:
                    live[rid] += 1
                else:
                    assert r[0].status == OpStatus.NO_SPACE, r[0]
                    client.free(pid, rid)  # preempt
                    del live[rid]
            elif kind == "fork":
                parent = rng.choice(sorted(live))
                child = f"c{index}-{next_id}"
                next_id += 1
                r = client.step(pid, [ForkOp(parent, child)])
                assert r[0].status == OpStatus.OK, r[0]
                live[child] = live[parent]
            else:
                rid = rng.choice(sorted(live))
                assert client.step(pid, [FreeOp(rid)])[0].status == OpStatus.OK
                del live[rid]
            counts[index] += 1
        if live:
            client.free(pid, *sorted(live))
    except Exception as exc:  # surfaced by the main thread
        errors.append(repr(exc))
    finally:
        client.close()


def test_concurrent_clients_then_pool_drains(server):
    pid = "concurrency"
    admin = server.client()
    admin.register_pool(pid, small_config(num_blocks=257, block_size=16), max_model_len=512)
    errors: list[str] = []
    counts = [0] * NUM_CLIENTS
    threads = [threading.Thread(target=worker, args=(server, pid, i, errors, counts)) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert sum(counts) == NUM_CLIENTS * NUM_OPS
    stats = admin.get_stats(check_invariants=True).pools[pid]
    assert stats.invariant_violation == ""
    assert stats.num_requests == 0 and stats.num_free_blocks == 256
    assert stats.prefix_hits > 0  # the shared 16-token prefixes hit
    admin.close()
