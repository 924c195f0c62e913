"""The two processes of the NIXL transport tests and benchmark, and `Peer`, which drives one of them: one JSON
object a line on stdin/stdout, so every configuration (UCX_TLS included) runs in fresh processes with its own
environment.

    python -m tests.nixl_peers store --dir D --num-blocks N --page-bytes B --seed S
        replies {"info", "pid", "mlock_refused", "memlock"}; commands: recreate, new_epoch, close_export,
        close_segment, crc {ids}, quit
    python -m tests.nixl_peers reader
        commands: read {info, ids, seed, timeout, kind: numpy|torch, pad, post_only}, wait {timeout},
        misuse {info}, bench {info, ids, runs}, quit

A store fills its pages and metadata from `seed` (`expected_pages`, `expected_meta`); a reader checks every
byte and metadata word of what it READ against the same functions.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import selectors
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from kvservice.blockstore.segment import MAX_SLOTS, META_FIELDS, Segment

ROOT = Path(__file__).resolve().parent.parent
STAGING_ROWS = 256
SENTINEL = 0xAB  # what staging holds before a READ: bytes a READ did not write never match a page


def expected_pages(seed: int, num_blocks: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, page_bytes), dtype=np.uint8)


def expected_meta(seed: int, num_blocks: int) -> np.ndarray:
    words = np.arange(num_blocks * MAX_SLOTS * META_FIELDS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words ^ np.uint64(seed)).reshape(num_blocks, MAX_SLOTS, META_FIELDS)


class Peer:
    """A store or reader process of this module: `ask(op, **fields)` sends a command and waits for its reply."""

    def __init__(self, args: list[str], tls: str, log: Path, prefix: list[str] = ()) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        if tls != "default":
            env["UCX_TLS"] = tls
        self.log = log
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "tests.nixl_peers", *args], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def reply(self, within: float = 60.0) -> dict:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.sel.select(deadline - time.monotonic()):
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
        raise AssertionError(f"no reply from {self.proc.args[-1:]} within {within} s (exit {self.proc.poll()}):"
                             f"\n{self.log.read_text()[-2000:]}")

    def ask(self, op: str, within: float = 60.0, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.reply(within)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.sel.close()


# -- the processes ------------------------------------------------------------------------------------------

_replies = sys.stdout  # main() moves it to a private fd: whatever else writes to stdout lands in the log


def _send(obj: dict) -> None:
    _replies.write(json.dumps(obj) + "\n")
    _replies.flush()


def _commands():
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def _mlock_refused(nbytes: int) -> bool:
    """Whether this process may not lock `nbytes` (the memlock limit applies to it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(nbytes)
    if libc.mlock(buf, ctypes.c_size_t(nbytes)) != 0:
        return True
    libc.munlock(buf, ctypes.c_size_t(nbytes))
    return False


def run_store(args) -> None:
    from kvservice.blockstore.transports import NixlExport

    seg = Segment(os.path.join(args.dir, f"segment-{os.getpid()}"), args.num_blocks, args.page_bytes, create=True,
                  generation=7)
    seg.pages[:] = expected_pages(args.seed, args.num_blocks, args.page_bytes)
    seg.meta[:] = expected_meta(args.seed, args.num_blocks)
    export = NixlExport(seg, "store-a", "tenant-a")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    _send({"info": export.info(), "pid": os.getpid(), "memlock": soft,
           "mlock_refused": _mlock_refused(seg.pages.nbytes)})
    for cmd in _commands():
        op = cmd["op"]
        if op == "recreate":
            export.close()
            export = NixlExport(seg, "store-a", "tenant-a")
            _send({"info": export.info()})
        elif op == "new_epoch":
            seg.header[0]["generation"] = seg.generation + 1  # as BlockStore does when it re-registers its pool
            _send({"info": export.info()})
        elif op == "close_export":
            export.close()
            _send({"ok": True})
        elif op == "close_segment":
            seg.mark_closed()
            _send({"ok": True})
        elif op == "crc":
            _send({"crc": zlib.crc32(seg.pages[np.asarray(cmd["ids"])])})
        elif op == "quit":
            break
    export.close()
    seg.close(unlink=True)


class Reader:
    def __init__(self) -> None:
        from kvservice.blockstore.transports import NixlImport

        self.imp = NixlImport("reader")
        self.staging: dict[str, tuple[object, np.ndarray]] = {}  # kind -> (pages, meta)
        self.ticket = self.pending = None

    def buffers(self, kind: str, n: int, page_bytes: int, pad: int):
        if kind not in self.staging:
            if kind == "torch":
                import torch
                pages = torch.empty((STAGING_ROWS, page_bytes + pad), dtype=torch.uint8)
            else:
                pages = np.empty((STAGING_ROWS, page_bytes + pad), dtype=np.uint8)
            meta = np.empty((STAGING_ROWS, MAX_SLOTS, META_FIELDS), dtype=np.uint64)
            self.imp.register(pages)  # an existing buffer, registered once
            self.imp.register(meta)
            self.staging[kind] = (pages, meta)
        pages, meta = self.staging[kind]
        pages[:] = SENTINEL
        meta[:] = SENTINEL
        return pages[:n, :page_bytes], meta[:n]

    def read(self, cmd: dict) -> dict:
        info, ids = cmd["info"], np.asarray(cmd["ids"], dtype=np.int64)
        into, meta_into = self.buffers(cmd.get("kind", "numpy"), len(ids), info["page_bytes"], cmd.get("pad", 0))
        start = time.monotonic()
        self.ticket = self.imp.read(info, ids, into, meta_into)
        self.pending = (cmd, into, meta_into, start)
        if cmd.get("post_only"):
            return {"state": self.ticket.poll().value, "error": self.ticket.error}
        return self.wait(cmd.get("timeout", 10.0))

    def wait(self, timeout: float) -> dict:
        cmd, into, meta_into, start = self.pending
        self.ticket.wait(timeout)
        secs = time.monotonic() - start
        info, ids = cmd["info"], np.asarray(cmd["ids"], dtype=np.int64)
        got = into.numpy() if hasattr(into, "numpy") else into
        want = expected_pages(cmd["seed"], info["num_blocks"], info["page_bytes"])[ids]
        bad_rows = [int(i) for i in np.flatnonzero((got != want).any(axis=1))]
        meta_ok = bool(np.array_equal(meta_into, expected_meta(cmd["seed"], info["num_blocks"])[ids]))
        return {"state": self.ticket.state.value, "error": self.ticket.error, "secs": secs,
                "bytes_ok": not bad_rows, "bad_rows": bad_rows[:8], "meta_ok": meta_ok,
                "buffers_free": self.ticket.buffers_free}

    def misuse(self, cmd: dict) -> dict:
        """Arguments that can never work: each must raise ValueError, naming the problem."""
        info = cmd["info"]
        pages, meta = self.buffers("numpy", 2, info["page_bytes"], 0)
        cases = {
            "unregistered": lambda: self.imp.read(info, [1, 2], np.empty((2, info["page_bytes"]), np.uint8), meta),
            "page 0": lambda: self.imp.read(info, [0, 1], pages, meta),
            "page past the end": lambda: self.imp.read(info, [1, info["num_blocks"]], pages, meta),
            "wrong shape": lambda: self.imp.read(info, [1, 2, 3], pages, meta),
            "wrong dtype": lambda: self.imp.read(info, [1, 2], pages.view(np.int8), meta),
            "not an info": lambda: self.imp.read({"store": "x"}, [1, 2], pages, meta),
        }
        out = {}
        for name, call in cases.items():
            try:
                call()
                out[name] = "no error"
            except ValueError as e:
                out[name] = f"ValueError: {e}"
        return out

    def bench(self, cmd: dict) -> dict:
        """Seconds per READ of `ids` (pages and metadata) into a torch staging tensor, after a one-page warm-up
        (connection set-up is not timed), and the crc32 of the pages each run landed."""
        import torch

        info, ids = cmd["info"], np.asarray(cmd["ids"], dtype=np.int64)
        pages = torch.empty((len(ids), info["page_bytes"]), dtype=torch.uint8)
        meta = np.empty((len(ids), MAX_SLOTS, META_FIELDS), dtype=np.uint64)
        self.imp.register(pages)
        self.imp.register(meta)
        try:
            warm = self.imp.read(info, ids[:1], pages[:1], meta[:1])
            if not warm.wait(60):
                return {"error": f"warm-up: {warm.error}"}
            secs, crcs = [], []
            for _ in range(cmd["runs"]):
                pages.fill_(SENTINEL)
                start = time.perf_counter()
                ticket = self.imp.read(info, ids, pages, meta)
                if not ticket.wait(120):
                    return {"error": ticket.error}
                secs.append(time.perf_counter() - start)
                crcs.append(zlib.crc32(pages.numpy()))
            return {"secs": secs, "crcs": crcs}
        finally:
            self.imp.deregister(pages)
            self.imp.deregister(meta)


def run_reader() -> None:
    reader = Reader()
    _send({"ready": True, "pid": os.getpid()})
    handlers = {"read": reader.read, "wait": lambda cmd: reader.wait(cmd["timeout"]), "misuse": reader.misuse,
                "bench": reader.bench}
    for cmd in _commands():
        if cmd["op"] == "quit":
            break
        _send(handlers[cmd["op"]](cmd))
    reader.imp.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["store", "reader"])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=64 << 10)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    global _replies
    _replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL, UCX and glog print to stdout and stderr: both go to the log
    run_store(args) if args.role == "store" else run_reader()


if __name__ == "__main__":
    main()
