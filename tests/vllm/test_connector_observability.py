"""What an operator sees of the connector. Its log lines go where vLLM's own go: in a process whose logging
vLLM configured (its `vllm` logger's handler and format, as its engine and worker processes do at start-up),
the worker's start-up line naming its copy path and transport is printed once, in vLLM's format; where the
user configured logging (a root handler), once, in the user's format. Its metric series, registered through
vLLM's own KVConnectorProm, are the ones the docs name, with the labels they name.

Runs in the project's vLLM environment only (make vllm-env; `make test-vllm` runs it):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_connector_logging.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

from tests.metric_docs import is_connectors, named_series, unexported  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STARTUP = "kvservice connector: rank 0 of 1, pages of"

# A worker process of an engine: vLLM's logging configured first (USER_LOGGING: the user's root handler before
# that), then the connector created in the worker role and handed the engine's KV tensors.
ENGINE_WORKER = """
import logging, sys, tempfile
from pathlib import Path
if sys.argv[1] == "user":
    logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s", stream=sys.stdout)
import torch
import vllm.logger
if hasattr(vllm.logger, "configure_logging"):  # 0.33: each engine and worker process applies its LoggingConfig
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from tests.vllm import scheduler_harness as h
from kvservice.integrations.vllm.connector.connector import KVServiceConnector

d = Path(tempfile.mkdtemp())
config = h.make_vllm_config(h.write_model_dir(d / "model"), h.DEFAULT)
config.kv_transfer_config = KVTransferConfig(
    kv_connector="KVServiceConnector", kv_role="kv_both",
    kv_connector_module_path="kvservice.integrations.vllm.connector",
    kv_connector_extra_config={"address": "127.0.0.1:1", "store": "n1", "shm_dir": str(d)})
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0,
                                 backend="gloo")
    initialize_model_parallel(1, 1)
    connector = KVServiceConnector(config, KVConnectorRole.WORKER)
    heads, head = 4, 16  # the harness's model: hidden 64 over 4 heads
    connector.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(8, heads, h.BLOCK, 2 * head)
                                  for i in range(2)})
    logging.getLogger("vllm.kvservice_test").info("vllm's own line")
    connector.shutdown()
"""


def run_worker(how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    return subprocess.run([sys.executable, "-c", ENGINE_WORKER, how], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_workers_startup_line_is_printed_in_vllms_format():
    out = run_worker("vllm")
    assert out.returncode == 0, out.stdout + out.stderr
    ours = [line for line in (out.stdout + out.stderr).splitlines() if STARTUP in line]
    vllms = [line for line in out.stdout.splitlines() if "vllm's own line" in line]
    assert len(ours) == 1 and len(vllms) == 1, out.stdout + out.stderr
    assert ours[0] in out.stdout  # vLLM's stream
    stamp = re.compile(r"INFO \d\d-\d\d \d\d:\d\d:\d\d ")  # vLLM's level and date format
    assert stamp.search(ours[0]) and stamp.search(vllms[0]), (ours, vllms)


def test_logging_the_user_configured_is_left_alone():
    out = run_worker("user")
    assert out.returncode == 0, out.stdout + out.stderr
    ours = [line for line in (out.stdout + out.stderr).splitlines() if STARTUP in line]
    assert len(ours) == 1 and ours[0].startswith("USER kvservice.integrations.vllm.connector.worker_side: "), \
        out.stdout + out.stderr


def test_the_connectors_series_are_the_ones_the_docs_name(tmp_path):
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from kvservice.integrations.vllm.connector.counters import KINDS
    from tests.vllm import scheduler_harness as h

    config = h.make_vllm_config(h.write_model_dir(tmp_path / "model"), h.DEFAULT)
    config.kv_transfer_config = KVTransferConfig(kv_connector="KVServiceConnector", kv_role="kv_both",
                                                 kv_connector_module_path="kvservice.integrations.vllm.connector")
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
    # One count of every kind, labelled as the worker and scheduler sides label them.
    prom.observe({kind: {"ram" if kind == "checksum_failures" else "n1|checksum" if kind == "failed" else "n1": 1}
                  for kind in KINDS})
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    documented = {n: p for n, p in named_series().items() if is_connectors(n)}
    assert len(documented) >= 10
    assert unexported(documented, exported) == []
