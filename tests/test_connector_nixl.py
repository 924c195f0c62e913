"""Pages to another node through NIXL, with the connector's two sides (no vLLM): a `kvservice store` exports its
segment through a NIXL agent and publishes the endpoint with its pool; an engine whose shm_dir holds no store
(another node) pins a prefix, gets the endpoint from the allocator and loads the pages in one NIXL READ, under
UCX's default transports and under UCX_TLS=tcp; a store restarted between the pin and the READ fails the load
(recomputed), as does a store with NIXL off and no Ray. The reader runs in a process of its own
(tests/nixl_reader.py), so UCX never loads into pytest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.service_helpers import REPO, start_server
from tests.test_connector_sides import BS, HEAD, NUM_BLOCKS, PAGE, kv, request, scheduled
from tests.test_nixl_transport import nixl_here  # noqa: F401 - the fixture: skips, saying why, without NIXL

pytestmark = pytest.mark.usefixtures("nixl_here")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("nixl"))
    yield proc
    proc.stop()


class Store:
    """`kvservice store` (NIXL on where it is installed), with its own UCX_TLS."""

    def __init__(self, server, shm, env: dict[str, str]) -> None:
        self.args = [sys.executable, "-m", "kvservice.cli", "store", "--name", "n1", "--target", server.target,
                     "--pages", "16", "--page-bytes", str(PAGE), "--block-size", str(BS), "--dir", str(shm)]
        self.env, self.shm = {**os.environ, **env}, shm
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env)
        line = self.proc.stdout.readline()
        assert "kvservice store n1: pool kvstore:n1" in line, line + self.proc.stderr.read()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)


def write(server, shm, seed: int, prompt: list[int], blocks: list[int]) -> None:
    """An engine on the store's node saves the prompt (through shared memory) and reports it."""
    from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
    from kvservice.integrations.vllm.connector.settings import ConnectorSettings
    from kvservice.integrations.vllm.connector.worker_side import WorkerSide
    settings = ConnectorSettings(address=server.target, store="n1", shm_dir=str(shm), index=False, transport="ray")
    sched = SchedulerSide(settings, BS, "writer", loads=False, saves=True)
    worker = WorkerSide(settings, BS, "writer", head_size=HEAD)
    worker.register(kv(seed), NUM_BLOCKS)
    sched.on_new_request(request("w", prompt))
    _, saves = sched.build(scheduled("w", prompt, blocks, 0, len(prompt)))
    worker.save(saves)
    worker.flush()
    sched.workers_done(worker.take_done())
    sched.teller.flush()
    worker.close()
    sched.close()


def reader(server, tmp_path, env: dict[str, str], **job):
    job = {"address": server.target, "shm_dir": str(tmp_path / "elsewhere"), **job}
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "tests.nixl_reader"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env}), job


def next_line(proc) -> str:
    """The reader's next line of its own (UCX writes its errors to stdout too)."""
    while True:
        line = proc.stdout.readline()
        if not line or line.startswith(("pinned", "{")):
            return line.strip()


def run(proc, job, between=None) -> dict:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    line = next_line(proc)
    if line == "pinned":
        if between is not None:
            between()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        line = next_line(proc)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and line, err[-3000:]
    return json.loads(line)


@pytest.mark.parametrize("ucx", [{}, {"UCX_TLS": "tcp"}], ids=["ucx-default", "ucx-tcp"])
def test_another_node_loads_the_pages_in_one_nixl_read(server, tmp_path, ucx):
    (tmp_path / "shm").mkdir()
    store = Store(server, tmp_path / "shm", ucx)
    try:
        prompt = list(range(500, 513))
        write(server, tmp_path / "shm", 1, prompt, [3, 4, 5, 6])
        proc, job = reader(server, tmp_path, ucx, prompt=prompt, block_ids=[7, 8, 9, 10], seed=1,
                           writer_blocks=[3, 4, 5, 6])
        out = run(proc, job)
        assert out["found"] == 12 and out["transport"].startswith("nixl"), out
        assert out["nixl_reads"] == 1 and out["remote_reads"] == 1 and out["failed"] == [] and out["equal"], out
    finally:
        store.stop()


def test_a_store_restarted_between_the_pin_and_the_read_fails_the_load(server, tmp_path):
    (tmp_path / "shm").mkdir()
    store = Store(server, tmp_path / "shm", {})
    try:
        prompt = list(range(600, 613))
        write(server, tmp_path / "shm", 2, prompt, [3, 4, 5, 6])
        proc, job = reader(server, tmp_path, {}, prompt=prompt, block_ids=[7, 8, 9, 10], seed=2,
                           writer_blocks=[3, 4, 5, 6], pause=True)

        def restart() -> None:
            store.stop(signal.SIGKILL)
            store.start()  # a new segment, agent and epoch

        out = run(proc, job, between=restart)
        assert out["found"] == 12 and out["failed"] == [7, 8, 9] and out["nixl_reads"] == 0, out
        assert sum(out["failures"].values()) == 3, out
    finally:
        store.stop()


def test_without_nixl_or_ray_another_nodes_load_fails_and_says_why(server, tmp_path):
    (tmp_path / "shm").mkdir()
    store = Store(server, tmp_path / "shm", {})
    try:
        prompt = list(range(700, 713))
        write(server, tmp_path / "shm", 3, prompt, [3, 4, 5, 6])
        proc, job = reader(server, tmp_path, {}, prompt=prompt, block_ids=[7, 8, 9, 10],
                           seed=3, writer_blocks=[3, 4, 5, 6], transport="ray")
        out = run(proc, job)
        assert out["found"] == 12 and out["failed"] == [7, 8, 9] and out["nixl_reads"] == 0, out
    finally:
        store.stop()
