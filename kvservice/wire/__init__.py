"""Protobuf <-> domain translation, by direction:

    limits    what one call may carry          fields   each field rule, once (ids, names, u32 arrays, hashes)
    decode    server: requests -> commands     encode   client: ops and records -> requests
    replies   replies both ways (and a session's stored reply in snapshots)
    framing   the client's Step serializer     batches  server: packed ops (decode, allocate, admit)
    pool_spec server: RegisterPool's spec      vllm_ops server: ops only vLLM-semantics pools take
    status    domain errors <-> gRPC statuses (the bad field in the rich error details)
"""
