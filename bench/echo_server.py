"""A bare grpc.aio echo server: the floor an RPC of a given size costs on this machine.

The request is `le_u32(response_size) || le_u32(busy_us) || payload`; the server burns `busy_us` of CPU
(holding the GIL, as a handler doing real work would) and replies with `response_size` bytes.
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

METHOD = "/bench.Echo/Echo"


async def main(port: int) -> None:
    async def echo(request: bytes, context) -> bytes:
        size = int.from_bytes(request[:4], "little")
        busy_s = int.from_bytes(request[4:8], "little") / 1e6
        start = time.perf_counter()
        while time.perf_counter() - start < busy_s:
            pass
        return request[8:8 + size].ljust(size, b"\0")

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"echo serving on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
