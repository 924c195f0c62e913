"""`kvservice demo` (what `make run` runs) on a small workload: a random-init Llama checkpoint, real allocator,
Redis, Ray, kernels, every output checked against transformers.generate."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_and_matches_transformers():
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "demo", "--requests", "8", "--num-blocks", "24"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "transformers.generate    9/9 outputs identical" in out.stdout  # 8 requests, one with n=2
    assert "invariants ok" in out.stdout and "attention backend        torch" in out.stdout
    # Progress on stderr, and no noise there: the private allocator's auth warning, Ray's banner.
    assert "8/8 prompts finished" in out.stderr, out.stderr[-2000:]
    noise = ("auth is OFF", "Started a local Ray instance", "Token authentication is")
    assert not [n for n in noise if n in out.stderr], out.stderr[-3000:]
