"""Protobuf <-> domain translation, by direction:

    limits    what one call may carry          fields   each field rule, once (ids, names, u32 arrays, hashes)
    decode    server: requests -> commands     encode   client: ops and records -> requests
    replies   replies both ways (and a session's stored reply in snapshots)
    framing   the client's Step serializer
"""
