"""Parity of vLLM 0.33.0's scheduler on kvservice with the stock one: >= 200 random workloads in each of
vLLM's default configuration (async scheduling, the full-sequence gate), async scheduling off, the gate
off, and a sliding-window group (window 40) with async scheduling on and off, and (`--modes features`) a KV
connector with synchronous and asynchronous external hits, ngram speculative decoding with random
acceptance, SWA bounded prefix replay, a hybrid model with a Mamba group (align mode, async scheduling on and
off; with prefill checkpoints; with speculative blocks under ngram), and R-SWA and circular-buffer groups;
every step's SchedulerOutput
and the prefix-cache stats identical, and the pool equal to the replica (tests/vllm/scheduler_harness.py;
the smaller version is tests/vllm/test_vllm_scheduler.py in make test-vllm).

Runs in the project's vLLM environment:
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python bench/vllm_scheduler_parity.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table, write_json  # noqa: E402
from bench.rpc_bench import start  # noqa: E402
from tests.vllm import scheduler_harness as h  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=200, help="per configuration")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--modes", choices=("base", "features", "all"), default="all",
                        help="base: vLLM's defaults and their variants; features: KV connectors (sync, async), "
                             "ngram speculative decoding, bounded prefix replay, hybrid Mamba groups, R-SWA and "
                             "circular buffers")
    args = parser.parse_args()
    server, target = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port", "0",
                            "--no-persistence"], "kvservice serving on")
    model = h.write_model_dir(Path(tempfile.mkdtemp()) / "model")
    rows, data = [], {}
    try:
        modes = {"base": h.MODES, "features": h.FEATURE_MODES, "all": h.MODES + h.FEATURE_MODES}[args.modes]
        for mode in modes:
            config = h.make_vllm_config(model, mode)
            t0 = time.monotonic()
            totals, failures = h.Outcome(), []
            for seed in range(args.workloads):
                workload = h.Workload.random(seed, num_steps=args.steps)
                try:
                    out = h.run_pair(workload, mode, config, target, f"parity-{modes.index(mode)}-{seed}")
                except Exception as exc:  # a differing output, or PoolDiverged
                    failures.append(str(exc)[:300])
                    continue
                for name in ("steps", "preemptions", "hits", "chunked", "n_gt_1", "rpcs"):
                    setattr(totals, name, getattr(totals, name) + getattr(out, name))
            identical = args.workloads - len(failures)
            data[mode.name] = {"workloads": args.workloads, "identical": identical, "steps": totals.steps,
                               "preemptions": totals.preemptions, "prefix_hits": totals.hits,
                               "prefill_chunks": totals.chunked, "n_gt_1_requests": totals.n_gt_1,
                               "step_rpcs": totals.rpcs, "failures": failures[:5],
                               "seconds": time.monotonic() - t0}
            rows.append([mode.name, f"{identical}/{args.workloads}", totals.steps, totals.preemptions, totals.hits,
                         totals.chunked, totals.n_gt_1, f"{totals.rpcs / max(totals.steps, 1):.2f}"])
            print(f"{mode.name}: {identical}/{args.workloads} identical, {time.monotonic() - t0:.0f} s", flush=True)
            for f in failures[:3]:
                print("  DIVERGED:", f)
    finally:
        server.kill()
    print(table(["configuration", "identical", "steps", "preemptions", "prefix hits", "prefill chunks",
                 "n>1 requests", "RPCs/step"], rows))
    # A features run keeps its own file: the base configurations' results stay as they were.
    name = "vllm_scheduler_parity_features" if args.modes == "features" else "vllm_scheduler_parity"
    print(f"wrote {write_json(name, data)}")
    return 0 if all(d["identical"] == d["workloads"] for d in data.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
