"""Pages to another node through NIXL, with the connector's two sides (no vLLM): a `kvservice store` exports its
segment through a NIXL agent and publishes the endpoint with its pool; an engine whose shm_dir holds no store
(another node) pins a prefix, gets the endpoint from the allocator and loads the pages in one NIXL READ, under
UCX's default transports and under UCX_TLS=tcp; a store restarted between the pin and the READ fails the load
(recomputed), as does one with NIXL off and no Ray cluster, or only a stale record of one (which must fail at once:
ray.init alone waits forever for a GCS that is gone). The reader runs in a process of its own
(tests/nixl_reader.py), so UCX never loads into pytest."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.connector_helpers import BS, HEAD, NUM_BLOCKS, PAGE, kv, request, scheduled
from tests.ray_helpers import skip_if_a_ray_cluster_runs
from tests.service_helpers import REPO, start_server
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
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(REPO), **env}.items() if v is not None}
    return subprocess.Popen([sys.executable, "-m", "tests.nixl_reader"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), job


def next_line(proc, timeout_s: float = 120.0) -> str:
    """The reader's next line of its own (UCX writes its errors to stdout too); a reader that says nothing for
    `timeout_s` fails the test, with what it printed to stderr."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            proc.kill()
            pytest.fail(f"the reader said nothing for {timeout_s:.0f} s; stderr: {proc.stderr.read()[-3000:]}")
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
    return {**json.loads(line), "stderr": err}


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


@pytest.fixture
def no_ray_cluster(tmp_path):
    """The reader's Ray temp dir (RAY_TMPDIR; no RAY_ADDRESS), with no record of a cluster. Ray's "auto" joins
    any cluster running on the machine whatever its record says, so these cases need a machine without one."""
    skip_if_a_ray_cluster_runs()
    (tmp_path / "raytmp" / "ray").mkdir(parents=True)
    return {"RAY_TMPDIR": str(tmp_path / "raytmp"), "RAY_ADDRESS": None}


@pytest.fixture
def stale_ray_cluster(no_ray_cluster):
    """...with the record a killed cluster leaves: its GCS address, where a socket is bound but listens not."""
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        path = os.path.join(no_ray_cluster["RAY_TMPDIR"], "ray", "ray_current_cluster")
        with open(path, "w") as f:
            f.write(f"127.0.0.1:{gone.getsockname()[1]}\n")
        yield no_ray_cluster


@pytest.mark.parametrize("ray_env,why", [("no_ray_cluster", "Could not find any running Ray instance"),
                                         ("stale_ray_cluster", "no Ray cluster answers at")])
def test_without_nixl_or_ray_another_nodes_load_fails_and_says_why(server, tmp_path, ray_env, why, request):
    (tmp_path / "shm").mkdir()
    store = Store(server, tmp_path / "shm", {})
    try:
        prompt = list(range(700, 713))
        write(server, tmp_path / "shm", 3, prompt, [3, 4, 5, 6])
        proc, job = reader(server, tmp_path, request.getfixturevalue(ray_env), prompt=prompt,
                           block_ids=[7, 8, 9, 10], seed=3, writer_blocks=[3, 4, 5, 6], transport="ray")
        out = run(proc, job)
        assert out["found"] == 12 and out["failed"] == [7, 8, 9] and out["nixl_reads"] == 0, out
        assert why in out["stderr"] and "they are recomputed" in out["stderr"], out["stderr"][-3000:]
    finally:
        store.stop()
