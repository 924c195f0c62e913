"""Workers of one pool: a Ray actor per DCP rank (KV caches for every layer + block tables), the ranks
joined in a torch.distributed group (gloo on CPU, NCCL on GPU) that merges partial attention per
layer. `LocalWorkers` runs the same ranks in this process (threads) for tests and tools.

    Engine -> RayWorkers | LocalWorkers (execute, transfer_to) -> RankWorker per rank -> ModelRunner
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

import torch

from worker.batch import StepBatch
from worker.hf.arch import ModelSpec
from worker.model import ModelConfig
from worker.paged import PagedRunner
from worker.runner import ModelRunner


@dataclass(slots=True, frozen=True)
class PoolLayout:
    """Everything a rank needs to build its model and caches; pools with equal layouts can exchange blocks.

    `model` is the tiny transformer's config or a Hugging Face checkpoint's `ModelSpec` (each rank loads
    its weights from `spec.path`)."""

    model: ModelConfig | ModelSpec
    num_blocks: int
    block_size: int  # per rank
    max_num_reqs: int
    max_num_blocks_per_req: int
    max_num_batched_tokens: int
    dcp_world_size: int = 1
    interleave: int = 1
    backend: str = "torch"

    def runner(self, dcp_rank: int, all_gather=None, num_threads: int | None = 1) -> PagedRunner:
        if isinstance(self.model, ModelConfig):
            runner_cls = ModelRunner
        else:
            from worker.hf.runner import HFModelRunner  # transformers loads only for checkpoints
            runner_cls = HFModelRunner
        return runner_cls(self.model, self.num_blocks, self.block_size, self.max_num_reqs,
                          self.max_num_blocks_per_req, self.max_num_batched_tokens, self.dcp_world_size, dcp_rank,
                          self.interleave, self.backend, all_gather, num_threads=num_threads)

    @property
    def kv_layout(self) -> str:
        m = self.model
        groups = "" if isinstance(m, ModelConfig) else f";groups={m.sliding_windows};{m.model_type}"
        return (f"block={self.block_size};dcp={self.dcp_world_size};interleave={self.interleave};"
                f"layers={m.num_layers};kv_heads={m.num_kv_heads};head={m.head_size};dtype={m.dtype}{groups}")


def default_backend() -> str:
    """Triton where CUDA exists; the torch twin on CPU (the interpreter is for correctness)."""
    return "triton" if torch.cuda.is_available() else "torch"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- in-process ranks ------------------------------------------------------------------------------
class _ThreadGather:
    """all_gather across W threads of one process (a barrier and a shared slot per rank)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world)

    def for_rank(self, rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            out = torch.stack(list(self.slots))
            self.barrier.wait()
            return out
        return all_gather


class LocalWorkers:
    """The DCP ranks of a pool in this process, one thread each (torch backend for W > 1: the Triton
    interpreter is not thread-safe)."""

    def __init__(self, layout: PoolLayout) -> None:
        w = layout.dcp_world_size
        if w > 1 and layout.backend != "torch":
            raise ValueError("in-process DCP ranks need the torch backend; use RayWorkers for Triton")
        gather = _ThreadGather(w) if w > 1 else None
        self.layout = layout
        self.runners = [layout.runner(r, gather.for_rank(r) if gather else None) for r in range(w)]

    @property
    def backend(self) -> str:
        return self.layout.backend

    def execute(self, batch: StepBatch) -> torch.Tensor:
        if len(self.runners) == 1:
            return self.runners[0].execute(batch)
        results: list = [None] * len(self.runners)

        def run(rank: int) -> None:
            try:
                results[rank] = self.runners[rank].execute(batch)
            except BaseException as exc:  # surfaced below
                results[rank] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(1, len(self.runners))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    def read_blocks(self, block_ids: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        return [r.read_blocks(block_ids) for r in self.runners]

    def write_blocks(self, block_ids: list[int], data) -> None:
        for r, d in zip(self.runners, data):
            r.write_blocks(block_ids, d)

    def transfer_to(self, dst, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copies blocks of this pool into `dst` (same layout), rank r to rank r."""
        dst.write_blocks(dst_block_ids, self.read_blocks(src_block_ids))


# ---- Ray actors ------------------------------------------------------------------------------------
class RankWorker:
    """One DCP rank (wrapped by `ray.remote` in `RayWorkers`)."""

    def __init__(self, layout: PoolLayout, rank: int, master_port: int, group_name: str) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        gather = None
        if layout.dcp_world_size > 1:
            import torch.distributed as dist
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share a node; stay off routable NICs
            self.group = dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{master_port}",
                                                 world_size=layout.dcp_world_size, rank=rank)

            def gather(t: torch.Tensor) -> torch.Tensor:
                out = [torch.empty_like(t) for _ in range(layout.dcp_world_size)]
                dist.all_gather(out, t.contiguous())
                return torch.stack(out)
        self.runner = layout.runner(rank, gather)
        self.node = os.uname().nodename

    def execute(self, batch: StepBatch) -> torch.Tensor | None:
        logits = self.runner.execute(batch)
        return logits if self.rank == 0 else None

    def backend(self) -> str:
        return self.runner.backend

    def where(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def read_blocks(self, block_ids: list[int]):
        return self.runner.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data) -> None:
        self.runner.write_blocks(block_ids, data)


class RayWorkers:
    """A pool's ranks as Ray actors (`num_gpus=1` each where GPUs exist, fractional CPUs otherwise).

    Args:
        resources: custom Ray resources each rank requires (e.g. {"node_a": 0.1} to pin a pool to a node).
    """

    def __init__(self, layout: PoolLayout, num_cpus: float = 0.5, resources: dict | None = None,
                 name: str = "pool") -> None:
        import ray
        self.layout = layout
        options = {"num_gpus": 1} if torch.cuda.is_available() else {"num_cpus": num_cpus}
        if resources:
            options["resources"] = resources
        actor_cls = ray.remote(RankWorker).options(**options)
        port = free_port()
        self.actors = [actor_cls.remote(layout, rank, port, name) for rank in range(layout.dcp_world_size)]
        ray.get([a.backend.remote() for a in self.actors])  # wait until every rank is up

    @classmethod
    def attach(cls, layout: PoolLayout, actors: list) -> RayWorkers:
        """A handle on ranks that already run (another pool's, e.g. as a transfer source)."""
        workers = cls.__new__(cls)
        workers.layout, workers.actors = layout, list(actors)
        return workers

    @property
    def backend(self) -> str:
        return self.layout.backend

    def execute(self, batch: StepBatch) -> torch.Tensor:
        import ray
        # Every rank must run the step: they meet in the per-layer all_gather.
        return ray.get([a.execute.remote(batch) for a in self.actors])[0]

    def read_blocks(self, block_ids: list[int]):
        import ray
        return ray.get([a.read_blocks.remote(block_ids) for a in self.actors])

    def write_blocks(self, block_ids: list[int], data) -> None:
        import ray
        ray.get([a.write_blocks.remote(block_ids, d) for a, d in zip(self.actors, data)])

    def transfer_to(self, dst, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copies blocks into `dst` rank to rank through the Ray object store: each source rank's payload
        goes straight to the matching destination rank (never through the driver)."""
        import ray
        if not isinstance(dst, RayWorkers):
            dst.write_blocks(dst_block_ids, self.read_blocks(src_block_ids))
            return
        refs = [a.read_blocks.remote(src_block_ids) for a in self.actors]
        ray.get([b.write_blocks.remote(dst_block_ids, ref) for b, ref in zip(dst.actors, refs)])

    def shutdown(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)
