"""`transport` where NIXL is not installed: each case runs an engine's worker side (the connector's, no vLLM) in a
real Python process of its own in which NIXL cannot be imported (its modules set to None in sys.modules before
anything imports them, as in an environment without the wheel). `nixl` refuses at start, naming the setting and
what to install; `auto` starts, reads other nodes through Ray, and says so."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.service_helpers import REPO

ENGINE = """
import json, logging, sys
for name in ("nixl", "nixl_cu12", "nixl_cu13"):
    sys.modules[name] = None  # import nixl -> ImportError, as where it is not installed
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.connector_helpers import BS, HEAD, NUM_BLOCKS, kv
settings = ConnectorSettings.from_extra({"address": "127.0.0.1:1", "transport": sys.argv[1], "shm_dir": sys.argv[2]})
try:
    side = WorkerSide(settings, BS, "w", head_size=HEAD)
except ValueError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
side.register(kv(1), NUM_BLOCKS)
print(json.dumps({"nixl_on": side.stores.nixl_on, "transport": side.stores.transport_name()}))
side.close()
"""


def engine(transport: str, shm_dir: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", ENGINE, transport, shm_dir], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_transport_nixl_without_nixl_refuses_to_start(tmp_path):
    out, _ = engine("nixl", str(tmp_path))
    refused = out["refused"]
    assert refused.startswith("kv_connector_extra_config.transport: 'nixl', but NIXL does not work")
    assert "NIXL is not importable" in refused and "pip install 'kvservice[nixl]'" in refused
    assert "'auto'" in refused and "'ray'" in refused


def test_transport_auto_without_nixl_falls_back_to_ray_and_says_so(tmp_path):
    out, log = engine("auto", str(tmp_path))
    assert out == {"nixl_on": False, "transport": out["transport"]}
    assert out["transport"].startswith("ray (transport auto, NIXL does not work here: NixlUnavailable")
    assert "WARNING kvservice connector: transport 'auto': NIXL does not work here" in log
    assert "through Ray" in log and "remote stores via ray (transport auto" in log


def test_transport_ray_never_asks_for_nixl(tmp_path):
    out, log = engine("ray", str(tmp_path))
    assert out == {"nixl_on": False, "transport": "ray"} and "NIXL" not in log
