"""`store: auto` outside Ray on a node with several live stores: real `kvservice store` processes of two tenants
(one with other pages) and a second deployment's store (another block size: its allocator's hash block size),
all in one shm dir, two real `kvservice serve` allocators on loopback. The engine's choice is its tenant's store
of its block size and page size; a choice still ambiguous is refused, naming the stores and the setting that
picks one."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from kvservice.blockstore.segment import live_descriptors, read_descriptor
from kvservice.integrations.vllm.connector.settings import ENV_RAY_NODE, ConnectorSettings
from tests.service_helpers import REPO, start_server

BS, PAGE = 4, 384
TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-a-admin tenant-a admin\n"
# name -> (its allocator: "one"/"two", its token, block size, page bytes)
STORES = {"a1": ("one", "tok-a", BS, PAGE), "a3": ("one", "tok-a", BS, 2 * PAGE), "b1": ("one", "tok-b", BS, PAGE),
          "d8": ("two", None, 2 * BS, 2 * PAGE)}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The two deployments' allocators and the four stores, live in one shm dir."""
    d = tmp_path_factory.mktemp("autostore")
    (d / "tokens").write_text(TOKENS)
    (d / "shm").mkdir()
    servers = {"one": start_server("--hash-block-size", str(BS), "--token-file", str(d / "tokens"), log_dir=d),
               "two": start_server("--hash-block-size", str(2 * BS), log_dir=d)}
    procs = []
    try:
        for name, (server, token, block_size, page_bytes) in STORES.items():
            args = [sys.executable, "-m", "kvservice.cli", "store", "--name", name, "--target",
                    servers[server].target, "--pages", "4", "--page-bytes", str(page_bytes), "--block-size",
                    str(block_size), "--dir", str(d / "shm"), *(["--token", token] if token else [])]
            procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for name, proc in zip(STORES, procs):
            line = proc.stdout.readline()
            assert f"kvservice store {name}: pool kvstore:{name}" in line, line + proc.stderr.read()
        yield servers, str(d / "shm")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
        for server in servers.values():
            server.stop()


@pytest.fixture(autouse=True)
def outside_ray(monkeypatch):
    monkeypatch.delenv(ENV_RAY_NODE, raising=False)


def auto(servers, shm, server="one", token=None, block_size=BS, page_bytes=PAGE, address=None) -> str:
    extra = {"address": address or servers[server].target, "store": "auto", "shm_dir": shm, "timeout_s": 2.0}
    if token:
        extra["token"] = token
    return ConnectorSettings.from_extra(extra, block_size=block_size, page_bytes=page_bytes).store


def test_each_store_records_its_tenant(node):
    _, shm = node
    assert sorted(d.name for d in live_descriptors(shm)) == sorted(STORES)
    assert {n: read_descriptor(n, shm).tenant for n in STORES} == {
        "a1": "tenant-a", "a3": "tenant-a", "b1": "tenant-b", "d8": ""}


def test_auto_is_the_store_of_the_engines_tenant_block_size_and_pages(node):
    servers, shm = node
    assert auto(servers, shm, token="tok-a") == "a1"
    assert auto(servers, shm, token="tok-b") == "b1"
    assert auto(servers, shm, token="tok-a", page_bytes=2 * PAGE) == "a3"
    # An admin token sees every tenant's pools: its own tenant still picks (a1, not b1).
    assert auto(servers, shm, token="tok-a-admin") == "a1"
    # The other deployment's engine (its allocator has no auth: every pool there is its tenant's; d8 only).
    assert auto(servers, shm, server="two", block_size=2 * BS, page_bytes=2 * PAGE) == "d8"


def test_a_choice_still_ambiguous_names_the_candidates_and_the_setting(node):
    servers, shm = node
    with pytest.raises(ValueError) as e:  # the page size not known: a1 and a3 both fit tenant-a
        auto(servers, shm, token="tok-a", page_bytes=None)
    message = str(e.value)
    assert "2 live stores" in message and "could use: a1, a3" in message and "store: <name>" in message
    assert "b1 (no pool of this engine's tenant" in message and "d8 (block size 8, not the engine's 4)" in message
    with pytest.raises(ValueError, match=r"none of the 4 live stores .* is this engine's: .*a1 \(block size 4, not "
                                         r"the engine's 8\).*d8 \(no pool of this engine's tenant on .*store: <name>"):
        auto(servers, shm, token="tok-a", block_size=2 * BS, page_bytes=2 * PAGE)
    # The other deployment's engine: this node's stores of its sizes are the first allocator's.
    with pytest.raises(ValueError, match=r"none of the 4 live stores .*a1 \(no pool of this engine's tenant on "):
        auto(servers, shm, server="two")
    with pytest.raises(ValueError, match="no live store in .*none.*store: <name>"):
        auto(servers, shm + "/none", token="tok-a")


def test_without_the_allocator_block_and_page_size_alone_decide(node, caplog):
    servers, shm = node
    with caplog.at_level(logging.WARNING, logger="kvservice.integrations.vllm.connector.autostore"):
        assert auto(servers, shm, address="127.0.0.1:1", block_size=2 * BS, page_bytes=2 * PAGE) == "d8"
    assert "by block and page size only" in caplog.text and "allocator at 127.0.0.1:1 failed" in caplog.text
    with pytest.raises(ValueError, match=r"could use: a1, b1 \(asking the allocator at 127.0.0.1:1 failed"):
        auto(servers, shm, address="127.0.0.1:1")


def test_in_ray_auto_is_the_deploy_store_of_the_node(node, monkeypatch):
    """A vLLM subprocess of a Ray actor: the actor's node, handed down (no store of that name need be here)."""
    servers, shm = node
    monkeypatch.setenv(ENV_RAY_NODE, "0123456789abcdef")
    assert auto(servers, shm, token="tok-a") == "node-0123456789ab"


def test_a_worker_leaves_auto_to_the_scheduler_side(node):
    servers, shm = node
    extra = {"address": servers["one"].target, "store": "auto", "shm_dir": shm + "/none"}
    assert ConnectorSettings.from_extra(extra, resolve_store=False).store == "auto"
