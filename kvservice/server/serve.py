"""`kvservice serve`, the process: checks before start-up, the leader or the hot standby, the ready line,
signals, and why it exits (logged, always)."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import time

from kvservice.external.spec import SpecError, parse_flag
from kvservice.launch import READY_PREFIX
from kvservice.server.app import AllocatorServer, attach_sharding, build_server, connect_store
from kvservice.server.servicer import freeze_long_lived
from kvservice.server.startup import (
    DataDirLock,
    StartupError,
    check_config,
    check_port_free,
    is_loopback,
    token_file_for,
)
from kvservice.settings import ServerSettings

logger = logging.getLogger(__name__)


async def _serve_standby(config: ServerSettings, ready_line: bool) -> tuple[int, str]:
    """A hot standby: follows the leader's WAL, answers only GetShardMap (and health: NOT_SERVING), and takes
    over (a new epoch, the old leader fenced) once the leader's lease has lapsed for a whole lease."""
    from kvservice.store.follower import Follower
    from kvservice.store.recovery import close_gap
    store, _, url = await connect_store(config)
    follower = Follower(store, config.allocator)
    await follower.load()
    server = AllocatorServer(config, follower.allocator)
    server.follower = follower
    attach_sharding(server, url)
    who = f"shard {config.shard_id}" if config.shard_id else "the allocator"
    server.servicer.standby = (f"this is the hot standby of {who} (Redis namespace {config.store_namespace}); it "
                               f"serves once the leader's lease lapses: retry, or ask GetShardMap for the leader")
    try:
        stop_on_signals(server)  # before the ready line: a signal right after it must stop it in order, and log
        port = await server.start()
        await server.set_serving(False)
        if ready_line:
            print(f"{READY_PREFIX}{config.host}:{port}", flush=True)
        stopping = asyncio.create_task(server.stopped.wait())
        while True:
            following = asyncio.create_task(follower.follow_until_lapse(config.leader_lease_s))
            await asyncio.wait([following, stopping], return_when=asyncio.FIRST_COMPLETED)
            if server.stopped.is_set():
                following.cancel()
                return server.exit_code, server.stop_reason or "stopped"
            started = time.monotonic()
            epoch = await store.take_over()
            if epoch:
                break
        await follower.catch_up()  # what the old leader wrote before it was fenced
        if not follower.consistent and not await follower.load():  # a resync it never finished
            await close_gap(store, follower.allocator)  # recovered as a restart would, and made durable
        freeze_long_lived()
        server.lead(store)
        server.servicer.standby = ""
        server.follower = None
        server.journal.start()
        await server.set_serving(True)
        await server.start_external()  # the old leader's external pools (and --vllm-events): subscribe now
        if server.servicer.sharding is not None:
            await server.servicer.sharding.announce(advertised_address(config, port), epoch)
        logger.warning("took over as leader epoch %d, %.3f s after the lease lapsed (%d WAL entries followed)",
                       epoch, time.monotonic() - started, follower.applied)
        await server.stopped.wait()
    finally:
        await server.stop()
        await store.close()
    return server.exit_code, server.stop_reason or "stopped"


def advertised_address(config: ServerSettings, port: int) -> str:
    """Where clients reach this shard: --advertise (a port of 0 there: the bound one), else --host's address
    and the bound port."""
    if not config.advertise:
        return f"{advertised_host(config.host)}:{port}"
    host, _, advertised_port = config.advertise.rpartition(":")
    return f"{host}:{port}" if advertised_port == "0" else config.advertise


def advertised_host(host: str) -> str:
    """The address other processes reach a server bound to `host` at."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        import socket
        return socket.gethostbyname(socket.gethostname())
    return host


# A Step allocates thousands of container objects (decoded ops, results, events) that reference counting
# frees right after the reply. At CPython's default gen-0 threshold (700) the cyclic collector runs several
# times inside every admission, each time walking the step's objects still in flight: ~10% of the step.
# Every 10,000 instead, most of them are gone by then: ~30x fewer collections of ~1.5 ms each, half the
# collector's time in rpc_bench (the pools themselves are frozen out of its reach: freeze_long_lived).
GC_THRESHOLDS = (10_000, 10, 10)


def preflight(config: ServerSettings) -> DataDirLock | None:
    """What `serve` checks before starting anything (kvservice.server.startup); raises StartupError. Returns
    the data dir's lock when this allocator uses the directory (its embedded Redis, a generated token)."""
    for text in config.vllm_events or []:
        try:
            parse_flag(text)
        except SpecError as exc:
            raise ValueError(f"--vllm-events: {exc}") from None
    check_config(config)
    generates_token = not config.token_file and not is_loopback(config.host) and not config.insecure
    if config.shard_id and not (config.persistence and config.redis_url):
        raise StartupError(f"--shard {config.shard_id} needs --redis-url: every shard reads the shard map and writes "
                           f"its state in the same Redis (or Redis Cluster)")
    if config.standby and not (config.persistence and config.redis_url):
        raise StartupError("--standby needs --redis-url: it follows the leader's WAL in a Redis both reach")
    lock = None
    if (config.persistence and not config.redis_url and not config.standby) or generates_token:
        lock = DataDirLock(config.data_dir).acquire()
    try:
        check_port_free(config.host, config.port)
        config.token_file = token_file_for(config)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


async def serve(config: ServerSettings, ready_line: bool = True) -> int:
    """Runs until SIGINT/SIGTERM (exit 0) or until fenced by a newer allocator (exit 3)."""
    gc.set_threshold(*GC_THRESHOLDS)
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT, ...) leaves the stacks in the log
    lock = preflight(config)
    code, reason = 1, "an error (its traceback follows)"
    try:
        code, reason = await _serve(config, ready_line)
        return code
    except asyncio.CancelledError:
        reason = "cancelled"
        raise
    finally:
        if lock is not None:
            lock.release()
        logger.warning("kvservice serve (pid %d) exits with code %d: %s", os.getpid(), code, reason)


# Signals that end the server, each logged with its name: a server must never vanish without a word (only
# SIGKILL is beyond its reach; whoever started it sees -9 as its exit status).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def stop_on_signals(server: AllocatorServer) -> None:
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if not server.stop_reason:
            server.stop_reason = f"received {sig.name}"
        logger.warning("kvservice serve (pid %d): %s; stopping", os.getpid(), sig.name)
        server.stopped.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)


async def _serve(config: ServerSettings, ready_line: bool) -> tuple[int, str]:
    if config.standby:
        return await _serve_standby(config, ready_line)
    server = await build_server(config)
    try:
        stop_on_signals(server)  # before the ready line: a signal right after it must stop it in order, and log
        port = await server.start()
        server.journal.start()
        if server.servicer.sharding is not None:
            await server.servicer.sharding.announce(advertised_address(config, port), server.journal.leader_epoch)
        await server.start_external()
        if ready_line:
            print(f"{READY_PREFIX}{config.host}:{port}", flush=True)
        await server.stopped.wait()
    finally:
        await server.stop()
    return server.exit_code, server.stop_reason or "stopped"
