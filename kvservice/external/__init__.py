"""External pools: stock vLLM engines that kvservice does not allocate for, indexed from their KV events.

    feeds -> subscriber (ZMQ SUB + replay DEALER, per engine) --IngestEvents--> Allocator.apply --> registry
    registry -> pool (epoch, last sequence, spec check) -> index (blocks keyed by token content)
    frames (vLLM's msgpack batches), spec (declared settings, vllm_hashes to check them), wire, snapshot

Everything below the subscriber is deterministic and journaled like the rest of the state (WAL +
snapshot); the subscriber and feeds (which runs one per pool) are the only parts with sockets and clocks.
"""
