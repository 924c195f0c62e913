"""A kv_consumer engine with no `store`, in a plain process (no Ray): it generates the prompts given as JSON on
stdin and prints its tokens and what its connector loaded, as JSON (tests/vllm_engine/test_connector.py)."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def in_ray() -> bool:
    """Whether this process joined a Ray cluster (vLLM may import ray's modules; it never connects here)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    from tests.vllm_engine import engines as e
    llm = e.make_llm(job["model"], kv_transfer_config=job["kv_transfer_config"])
    tokens = e.generate(llm, job["prompts"], SamplingParams(max_tokens=job["max_tokens"], temperature=0)).tokens
    worker = get_kv_transfer_group().worker_side
    side = e.scheduler_of(llm).connector.scheduler_side
    print(json.dumps({"tokens": tokens, "loaded": dict(side.loaded), "local_reads": worker.stores.num_local_reads,
                      "remote_reads": worker.stores.num_remote_reads, "failed": worker.num_failed_loads,
                      "ray": in_ray()}), flush=True)
    e.close(llm)


if __name__ == "__main__":
    main()
