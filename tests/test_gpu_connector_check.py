"""`make gpu-check`'s connector step, run here in its CPU smoke mode (tiny sizes, the CpuMover, the decode kernel
under Triton's interpreter): the script works before a GPU is lent, every layout's bytes are checked, and it
imports nothing but torch, triton and the project's worker and connector code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFUSED = {"ray", "redis", "grpc", "vllm", "xxhash", "pytest"}


def test_the_connector_gpu_check_runs_in_cpu_smoke_mode(tmp_path):
    out = tmp_path / "smoke.json"
    probe = ("import runpy, sys; sys.argv = ['gpu_connector_check.py', '--cpu-smoke', '--json', sys.argv[1]]\n"
             "try:\n    runpy.run_path('worker/gpu_connector_check.py', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('MODULES', sorted({m.split('.')[0] for m in sys.modules}))\nsys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bytes right in every layout" in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert result["correct"] and [r["layout"] for r in result["layouts"]] == ["NHD", "HND", "MLA"]
    for r in result["layouts"]:
        assert r["correct"] and r["save_gbs"] > 0 and r["load_gbs"] > 0 and r["step"]["step_ms"] > 0, r
    modules = set(json.loads(done.stdout.split("MODULES ", 1)[1].splitlines()[0].replace("'", '"')))
    assert not modules & REFUSED, modules & REFUSED
    assert {"torch", "triton", "worker", "kvservice"} <= modules
