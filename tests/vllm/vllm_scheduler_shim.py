"""pytest plugin for tests/vllm/run_scheduler.py: runs vLLM 0.33.0's own scheduler tests with vLLM's
`Scheduler` and `AsyncScheduler` replaced by kvservice's (KVSERVICE_VLLM_SIDE=kvservice), or on vLLM itself
(=vllm, the baseline: the plugin then does nothing).

The names are replaced in every loaded module of vLLM's test tree (test modules and helpers such as
`tests.v1.core.utils`) that holds vLLM's classes, once after collection and again before each test (for
modules a test imports late); never in `vllm.v1.core.sched.scheduler` / `.async_scheduler`, whose classes
kvservice's subclass. No test builds its scheduler through `SchedulerConfig.get_scheduler_cls()` (with
`scheduler_cls` unset it imports from the defining modules), so that stays vLLM's.

Every kvservice scheduler a test builds allocates from a real `kvservice serve` (tests/service_helpers.py)
whose `--hash-block-size` is the scheduler's (the scheduler refuses any other): one server per size,
started on first use and shared by the session, on a pool of its own (KVSERVICE_POOL_ID). After a test that
passed, each of its schedulers must have the pool equal to its replica (free and cached blocks, each
request's block table); then its Step thread and its client are closed so no thread outlives the test.
Loaded by run_scheduler.py with `-p vllm_scheduler_shim`.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

import pytest

SIDE = os.environ.get("KVSERVICE_VLLM_SIDE", "kvservice")
REPO = Path(__file__).resolve().parents[2]
# Where each server's stderr goes (unset: nowhere).
LOG_DIR = os.environ.get("KVSERVICE_SHIM_LOG_DIR")
_ENV_KEYS = ("KVSERVICE_ADDRESS", "KVSERVICE_POOL_ID")
_DEFINING = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler")


class PoolMismatch(AssertionError):
    """The allocator's pool differs from the scheduler's replica after a test."""


class _Shim:
    """The servers by hash block size, the schedulers the running test built, and the name swap."""

    def __init__(self, test_root: Path) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

        from kvservice.integrations.vllm import scheduler as ks

        self.test_root = test_root
        self.swaps = {VllmScheduler: ks.Scheduler, VllmAsyncScheduler: ks.AsyncScheduler}
        self.signature = inspect.signature(VllmScheduler.__init__)
        self.servers: dict[int, object] = {}
        self.created: list = []  # this test's kvservice schedulers, each once its __init__ began
        # each one's own manager once its __init__ returned (some tests replace scheduler.kv_cache_manager)
        self.managers: dict[int, object] = {}
        self.num_tests = 0
        self.num_schedulers = 0
        self.start_server = _load_service_helpers().start_server
        self._wrap(ks.KVServiceScheduling)

    def _wrap(self, scheduling: type) -> None:
        """Points each scheduler at the server of its hash block size and a fresh pool before kvservice's
        __init__ reads KVServiceSettings from the environment, and records it for the teardown."""
        original = scheduling.__init__
        shim = self

        def __init__(self, *args, **kwargs) -> None:
            size = shim.hash_block_size(self, args, kwargs)
            if size is not None:
                os.environ["KVSERVICE_ADDRESS"] = shim.server(size).target
            shim.num_schedulers += 1
            os.environ["KVSERVICE_POOL_ID"] = f"vllm-test-{shim.num_tests}-{shim.num_schedulers}"
            shim.created.append(self)
            original(self, *args, **kwargs)
            shim.managers[id(self)] = self.kv_cache_manager

        __init__.__wrapped__ = original
        scheduling.__init__ = __init__

    def hash_block_size(self, scheduler, args: tuple, kwargs: dict) -> int | None:
        """The hash block size vLLM's Scheduler.__init__ will choose (`hash_block_size`, else `block_size`);
        None when the arguments do not bind (vLLM's __init__ then raises its own TypeError)."""
        try:
            bound = self.signature.bind(scheduler, *args, **kwargs)
        except TypeError:
            return None
        size = bound.arguments.get("hash_block_size") or bound.arguments.get("block_size")
        return int(size) if size else None

    def server(self, hash_block_size: int):
        if hash_block_size not in self.servers:
            log_dir = Path(LOG_DIR) if LOG_DIR else None
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
            self.servers[hash_block_size] = self.start_server("--hash-block-size", str(hash_block_size),
                                                              log_dir=log_dir)
        return self.servers[hash_block_size]

    def swap_names(self) -> None:
        """Replaces vLLM's scheduler classes by kvservice's in every loaded module of the test tree."""
        root = str(self.test_root)
        for name, module in list(sys.modules.items()):
            if module is None or name in _DEFINING:
                continue
            file = getattr(module, "__file__", None) or ""
            if not (name == "tests" or name.startswith("tests.") or file.startswith(root)):
                continue
            namespace = getattr(module, "__dict__", {})
            for attr, value in list(namespace.items()):
                if isinstance(value, type) and value in self.swaps:
                    setattr(module, attr, self.swaps[value])

    def finish_test(self, check: bool) -> None:
        """Checks (when `check`) and closes every scheduler the test built; raises PoolMismatch naming the
        first pool that differs, after all are closed."""
        created, managers, self.created, self.managers = self.created, self.managers, [], {}
        problems = []
        for scheduler in created:
            manager = managers.get(id(scheduler))  # None: its __init__ raised
            client = scheduler.__dict__.get("kvservice_client")
            try:
                # A test that put another manager in place checks its own; the pool is not that one's.
                if check and manager is not None and scheduler.__dict__.get("kv_cache_manager") is manager:
                    check_pool(scheduler)
            except Exception as exc:  # reported below, after the others are closed
                problems.append(f"{type(exc).__name__}: {exc}")
            finally:
                _close(manager, client)
        if problems:
            raise PoolMismatch("kvservice pool check: " + "\n".join(problems))

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


def check_pool(scheduler) -> None:
    """The pool equals the scheduler's replica once its Steps are in, as tests/vllm/scheduler_harness.py's
    check_pool has it, for any block size and every KV cache group: the free and the cached blocks, and
    each live request's block tables (its token count may lag by up to a block: calls that changed no block
    are not sent)."""
    m = scheduler.kv_cache_manager
    if not hasattr(m, "pool_id"):  # the test put a KV-cache manager of vLLM's own in place: no pool to check
        return
    m.flush()  # what update_from_output recorded since the last schedule()
    m.wait()
    client, pool_id = scheduler.kvservice_client, m.pool_id
    stats = client.get_stats(check_invariants=True, pool_ids=[pool_id]).pools[pool_id]
    if stats.invariant_violation:
        raise PoolMismatch(f"pool {pool_id!r} breaks an invariant: {stats.invariant_violation}")
    replica = (m.block_pool.get_num_free_blocks(), len(m.block_pool.cached_block_hash_to_block))
    if (stats.num_free_blocks, stats.num_cached_blocks) != replica:
        raise PoolMismatch(f"pool {pool_id!r} has (free, cached) blocks ({stats.num_free_blocks}, "
                           f"{stats.num_cached_blocks}), the scheduler's replica {replica}")
    request_ids = {r for manager in m.coordinator.single_type_managers for r in manager.req_to_blocks}
    for request_id in sorted(request_ids):
        info = client.get_request(pool_id, request_id)
        expected = tuple(list(ids) for ids in m.get_block_ids(request_id))
        if tuple(list(ids) for ids in info.block_ids) != expected:
            raise PoolMismatch(f"pool {pool_id!r}, request {request_id!r}: blocks {info.block_ids} in the pool, "
                               f"{expected} in the replica")
        request = scheduler.requests.get(request_id)
        if request is not None and not 0 <= request.num_tokens - info.num_tokens <= scheduler.block_size:
            raise PoolMismatch(f"pool {pool_id!r}, request {request_id!r}: {info.num_tokens} tokens in the pool, "
                               f"{request.num_tokens} in the scheduler (block size {scheduler.block_size})")


def _close(manager, client) -> None:
    """Stops the manager's Step thread and the client's channels, whatever state they are in."""
    for close in (getattr(manager, "close", None), getattr(client, "close", None)):
        if close is not None:
            try:
                close()
            except Exception:  # a failed Step already failed its test
                pass


def _load_service_helpers():
    """tests/service_helpers.py, loaded by path: `tests` is vLLM's test package in this run."""
    spec = importlib.util.spec_from_file_location("kvservice_service_helpers", REPO / "tests/service_helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SHIM: _Shim | None = None
_CALL_FAILED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    global _SHIM
    if SIDE == "kvservice":
        _SHIM = _Shim(Path(config.rootpath))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SHIM is not None:
        _SHIM.stop()


def pytest_collection_modifyitems(session, config, items) -> None:
    if _SHIM is not None:
        _SHIM.swap_names()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when in ("setup", "call") and report.failed:
        item.stash[_CALL_FAILED] = True


@pytest.fixture(autouse=True)
def _kvservice_schedulers(request):
    if _SHIM is None:
        yield
        return
    saved = {key: os.environ.get(key) for key in _ENV_KEYS}
    _SHIM.num_tests += 1
    _SHIM.num_schedulers = 0
    _SHIM.created.clear()
    _SHIM.managers.clear()
    _SHIM.swap_names()
    yield  # runs on after a failed test too
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SHIM.finish_test(check=not request.node.stash.get(_CALL_FAILED, False))
