"""The connector tests' engine without vLLM: KV tensors laid out as vLLM's CPU attention lays them out, the
scheduler side fed what vLLM's scheduler gives it, the worker sides' reports added up as vLLM adds them, and a
server and store for a test module (its fixtures, imported by the modules that use them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvservice.blockstore import BlockStore
from kvservice.integrations.vllm.connector.plan import Load
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.service_helpers import start_server

BS = 4
LAYERS, HEADS, HEAD = 2, 2, 3
NUM_BLOCKS = 16
PAGE = LAYERS * HEADS * BS * 2 * HEAD * 4


def kv(seed: int, num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    """Each layer's KV as vLLM's CPU attention lays it out ([blocks, heads, block size, K and V]), random."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(num_blocks, HEADS, BS, 2 * HEAD, generator=g) for i in range(LAYERS)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("sides"))
    yield proc
    proc.stop()


@pytest.fixture
def store(server, tmp_path):
    s = BlockStore("n1", server.target, 32, PAGE, BS, directory=str(tmp_path))
    yield s
    s.close()


def settings(server, block_store, **kw) -> ConnectorSettings:
    kw.setdefault("store", "n1")
    return ConnectorSettings(address=server.target, shm_dir=block_store.directory, **kw)


def worker(server, block_store, name: str, seed: int, rank: int = 0, world_size: int = 1, **kw) -> WorkerSide:
    side = WorkerSide(settings(server, block_store, **kw), BS, name, rank=rank, world_size=world_size,
                      head_size=HEAD)
    side.register(kv(seed), NUM_BLOCKS)
    return side


def request(req_id: str, prompt: list[int], params: dict | None = None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, mm_features=[], lora_request=None,
                           cache_salt=None, kv_transfer_params=params)


def scheduled(req_id: str, prompt: list[int], block_ids: list[int], num_computed: int, num_scheduled: int):
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(block_ids,),
                          num_computed_tokens=num_computed)
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=idle().scheduled_cached_reqs,
                           num_scheduled_tokens={req_id: num_scheduled})


def idle():
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


def report(sched: SchedulerSide, *workers: WorkerSide) -> None:
    """What vLLM does after a step: each rank's Done, added up, to the scheduler side; then its teller sends."""
    done = None
    for w in workers:
        w.flush()
        mine = w.take_done()
        if mine is not None:
            done = mine if done is None else done.merge(mine)
    if done is not None:
        sched.workers_done(done)
    sched.teller.flush()


def save_prompt(server, store, sched: SchedulerSide, workers: list[WorkerSide], req_id: str, prompt: list[int],
                block_ids: list[int]):
    sched.on_new_request(request(req_id, prompt))
    _, saves = sched.build(scheduled(req_id, prompt, block_ids, 0, len(prompt)))
    for w in workers:
        w.save(saves)
    return saves


def sealed_page(server, store, seed: int = 40) -> tuple[WorkerSide, list[int], Load]:
    """A prompt saved and committed by an engine, and a reader's load of its 3 pages."""
    a = worker(server, store, "a", seed)
    sched = SchedulerSide(settings(server, store, index=False), BS, "a", loads=True, saves=True)
    prompt = list(range(300, 313))
    (save,) = save_prompt(server, store, sched, [a], "r", prompt, [1, 2, 3, 4])
    report(sched, a)
    reader = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    reader.on_new_request(request("x", prompt))
    assert reader.num_new_matched_tokens(request("x", prompt), 0) == (12, False)
    reader.after_alloc(request("x", prompt), [5, 6, 7, 8], 12)
    (load,), _ = reader.build(scheduled("x", prompt, [5, 6, 7, 8], 12, 1))
    sched.close()
    reader.close()
    return a, save.store_block_ids, load
