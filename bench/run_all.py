"""`make bench`: every benchmark in turn; each prints its table and writes bench/results/<name>.json."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["core_bench.py", "rpc_bench.py", "persist_bench.py", "engine_bench.py", "transfer_bench.py",
              "events_bench.py", "shard_bench.py"]


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        path = HERE / name
        if not path.exists():
            continue
        print(f"\n=== {name} ===", flush=True)
        start = time.time()
        rc = subprocess.call([sys.executable, str(path)])
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.time() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
