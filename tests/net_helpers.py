"""A TCP proxy on loopback that can lose replies: what the network does when a reply never arrives."""

from __future__ import annotations

import contextlib
import socket
import threading


class LossyProxy:
    """Forwards 127.0.0.1:port <-> target. `lose_replies()` arms it: from then on the bytes the server sends
    are dropped and, once `close_after` bytes of them went nowhere, every connection is cut (the client
    sees UNAVAILABLE for a call the server has applied); then the proxy forwards normally again."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._losing = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.lost_bytes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_replies(self) -> None:
        self.lost_bytes = 0
        self._losing.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_server and self._losing.is_set():
                    self.lost_bytes += len(data)
                    self._cut()
                    return
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        self._losing.clear()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()
        self._cut()
