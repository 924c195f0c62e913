"""An engine on "another node" for tests/test_connector_nixl.py, in a process of its own (so UCX never loads into
pytest, and UCX_TLS can differ per run): the connector's two sides with a shm_dir where no store lives, so every
store is remote and its pages come through NIXL (or Ray). Reads a job as JSON on stdin; prints "pinned" when the
prefix is pinned and, when the job asks, waits for a line on stdin before it loads; prints the outcome as JSON.
"""

import json
import sys
from types import SimpleNamespace


def main() -> None:
    job = json.loads(sys.stdin.readline())
    import torch

    from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
    from kvservice.integrations.vllm.connector.settings import ConnectorSettings
    from kvservice.integrations.vllm.connector.worker_side import WorkerSide
    from tests.connector_helpers import BS, HEAD, NUM_BLOCKS, kv
    settings = ConnectorSettings(address=job["address"], store=None, shm_dir=job["shm_dir"], index=False,
                                 transport=job.get("transport", "auto"))
    prompt, block_ids = job["prompt"], job["block_ids"]
    req = SimpleNamespace(request_id="x", prompt_token_ids=prompt, mm_features=[], lora_request=None,
                          cache_salt=None, kv_transfer_params=None)
    sched = SchedulerSide(settings, BS, "remote", loads=True, saves=False)
    worker = WorkerSide(settings, BS, "remote", head_size=HEAD)
    mine = kv(job["seed"] + 1000)
    worker.register(mine, NUM_BLOCKS)
    sched.on_new_request(req)
    found, _ = sched.num_new_matched_tokens(req, 0)
    out = {"found": found, "transport": worker.stores.transport_name()}
    if found:
        sched.after_alloc(req, block_ids, found)
        new = SimpleNamespace(req_id="x", prompt_token_ids=prompt, block_ids=(block_ids,), num_computed_tokens=found)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        loads, _ = sched.build(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                                               num_scheduled_tokens={"x": len(prompt) - found}))
        print("pinned", flush=True)
        if job.get("pause"):
            sys.stdin.readline()
        worker.load(loads, sched.endpoints_for(loads))
        n = found // BS
        theirs = kv(job["seed"])
        out.update(failed=sorted(worker.take_failed_blocks()), nixl_reads=worker.stores.num_nixl_reads,
                   remote_reads=worker.stores.num_remote_reads,
                   equal=all(torch.equal(mine[k][block_ids[:n]], theirs[k][job["writer_blocks"][:n]]) for k in mine),
                   failures=dict(worker.counters.totals.get("failed", {})))
    print(json.dumps(out), flush=True)
    worker.close()
    sched.close()


if __name__ == "__main__":
    main()
