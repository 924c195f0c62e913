"""The tables, ratios and plot of bench/connector_bench.py, from its results (the JSON it writes). Standard
library and bench.common only, so the plot step runs in a venv without vLLM (`--plot`)."""

from __future__ import annotations

import statistics
from pathlib import Path

FLOOR = "the engine's own prefix cache (floor)"  # the same prompt again on the writer: no connector can beat it
WRITER = "kvservice writer (computes and saves)"
WRITER_DISK = "kvservice writer with a disk tier (computes, saves, writes through)"
RATIO_KEYS = {"same": "same_node", "nixl": "across_nodes", "tcp": "across_nodes_tcp", "ray": "across_nodes_ray",
              "disk": "disk_tier"}
NAN = float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else NAN


def summarize(results: dict) -> None:
    """Medians per side and length, the ratios, and the loads' GB/s, into `results`."""
    lengths, page, block = [str(n) for n in results["lengths"]], results["page_bytes"], results["block_size"]

    def medians(per_name: dict) -> dict:
        return {name: {n: med(per.get(n, [])) for n in lengths} for name, per in per_name.items()}
    results["median_ttft_s"], results["median_writer_s"] = medians(results["ttft_s"]), medians(results["writer"])
    m, w, keys = results["median_ttft_s"], results["median_writer_s"], results["side_keys"]
    results["writer_s"], results["floor_s"] = results["ttft_s"][WRITER], results["ttft_s"][FLOOR]
    results["save_copy_s"] = results["writer"]["save copy, a"]
    example = keys.get("example")
    ratios: dict = {n: {} for n in lengths}
    for n in lengths:
        for key, label in RATIO_KEYS.items():
            if key in keys:
                ratios[n][f"{label}_vs_recompute"] = m[keys[key]][n] / m[keys["recompute"]][n]
                if example:
                    ratios[n][f"{label}_vs_example"] = m[keys[key]][n] / m[example][n]
        peers = [k for k in ("lmcache", "lmcache-shm") if k in keys]  # LMCache's modes (connector_bench_lmcache)
        if peers and "same" in keys:
            for k in peers:
                ratios[n][f"same_node_vs_{k.replace('-', '_')}"] = m[keys["same"]][n] / m[keys[k]][n]
            ratios[n]["same_node_vs_lmcache_best"] = m[keys["same"]][n] / min(m[keys[k]][n] for k in peers)
        if WRITER_DISK in m:
            ratios[n]["writer_disk_vs_writer"] = m[WRITER_DISK][n] / m[WRITER][n]
            ratios[n]["next_step_disk_vs_without"] = w["next step, d"][n] / w["next step, a"][n]
    results["ratios"] = ratios

    def rates(deltas: list[dict], n: str) -> dict:
        nbytes = int(n) // block * page
        fetch, copy = med([d["fetch_s"] for d in deltas]), med([d["copy_in_s"] for d in deltas])
        return {"fetch_ms": fetch * 1e3, "copy_in_ms": copy * 1e3,
                "fetch_GBps": nbytes / fetch / 1e9 if fetch > 1e-4 else NAN, "copy_in_GBps": nbytes / copy / 1e9}
    results["loads"] = {side: {n: rates(per[n], n) for n in per} for side, per in results["loaded"].items()}
    results["load_parts_ms"] = {side: {n: {part: med([d["parts_s"][part] for d in per[n]]) * 1e3
                                           for part in per[n][0]["parts_s"]}
                                       for n in per if per[n] and "parts_s" in per[n][0]}
                                for side, per in results["loaded"].items()}
    for row in results["loads"].get(keys.get("same"), {}).values():
        row["fetch_GBps"] = NAN  # on the same node the fetch checks the segment's header: no bytes move


def report(results: dict) -> None:
    from bench.common import table
    lengths = [str(n) for n in results["lengths"]]
    m, w = results["median_ttft_s"], results["median_writer_s"]
    cols = [f"{n} tokens" for n in lengths]
    print(f"\nTTFT, median of {results['trials']} trial(s), ms (disk tier: {results['cold']}):")
    names = [*results["sides"], FLOOR, *(s for s in results["writers"] if s in m)]
    print(table(["side", *cols], [[s] + [m[s][n] * 1e3 for n in lengths] for s in names]))
    ratios = results["ratios"]
    print("\nratios (of the medians):")
    print(table(["ratio", *cols], [[k] + [ratios[n][k] for n in lengths] for k in ratios[lengths[0]]]))
    print("\nthe loads' own timings (the connector's fetch_s and copy_in_s; medians; GB/s of the L tokens' pages):")
    rows = [[f"{s}: {part} {unit}"] + [results["loads"][s][n][f"{part}_{key}"] for n in lengths]
            for s in results["loads"] for part in ("fetch", "copy_in") for unit, key in (("ms", "ms"),
                                                                                           ("GB/s", "GBps"))]
    print(table(["side", *cols], rows))
    parts = results.get("load_parts_ms", {})
    if any(parts.values()):
        print("\nwhere a load's time goes (connector/timing.py; medians, ms; commit is off the step):")
        rows = [[f"{s}: {part}"] + [parts[s].get(n, {}).get(part, NAN) for n in lengths]
                for s in parts for part in next(iter(parts[s].values()), {})]
        print(table(["side: part", *cols], rows))
    if "next step, d" in w:
        print("\nwhat write-through costs the writer (median ms):")
        both = {**m, **w}
        rows = [[label] + [both[key][n] * 1e3 for n in lengths] for label, key in (
            ("TTFT, no disk tier", WRITER), ("TTFT, disk tier", WRITER_DISK),
            (f"next step ({results['next_tokens']}-token prompt) right after, no disk tier", "next step, a"),
            (f"next step ({results['next_tokens']}-token prompt) right after, write-through running",
             "next step, d"),
            ("then waiting for the saves, no disk tier", "flush, a"),
            ("then waiting for the saves and the write-through", "flush, d"),
            ("the save's copy on the step, no disk tier", "save copy, a"),
            ("the save's copy on the step, disk tier", "save copy, d"))]
        print(table(["writer", *cols], rows))
    bandwidth(results)
    r = results.get("restart")
    if r:
        print(f"\nrestart of store d: {r['prefixes_hit_after_restart']} of {r['prefixes_on_disk_before']} prefixes "
              f"on its disk tier hit again ({r['percent']:.0f}%; {r['pages']} pages; {r['prefixes_saved']} saved), "
              f"the store up again in {r['restart_s']:.1f} s (every page file verified first)")
    cores = ", ".join(f"{name} {c:.2f}" for name, c in results.get("store_cpu_cores", {}).items())
    print(f"CPU of the store processes over the trials, in cores (of {results['cpus']}): {cores}")
    print(f"load average {results['load_average_before']:.2f} before, {results['load_average_after']:.2f} after, "
          f"{results['cpus']} CPUs")


def bandwidth(results: dict) -> None:
    from bench.common import table
    bw, nixl, disk = results["bandwidth"], results["nixl"], results["disk"]
    direct = disk["o_direct"]
    print(f"\nbandwidth, GB/s (median of {bw['reps']}; {bw['bytes'] >> 20} MiB of {results['page_bytes'] >> 20} MiB "
          f"pages), next to the physical limit:")
    rows = [["connector load: RAM pages -> engine KV (CpuMover)", bw["load_same_node_GBps"], "torch copy_",
             bw["memcpy_GBps"], bw["load_vs_memcpy"]],
            ["connector save: engine KV -> RAM pages (CpuMover)", bw["save_same_node_GBps"], "torch copy_",
             bw["memcpy_GBps"], bw["save_vs_memcpy"]]]
    for tls in ("default", "tcp"):
        r = nixl[tls]
        rows.append([f"NIXL READ, UCX {tls} (pages shuffled)", r.get("GBps", r.get("error", "")[:40]),
                     "index_select", nixl["memcpy_GBps"], r.get("vs_memcpy", NAN)])
    rows += [["disk tier write (write_slices: one fdatasync a file)", disk["tier_write_GBps"], "O_DIRECT write",
              direct.get("write_GBps", NAN), disk.get("write_vs_o_direct", NAN)],
             ["disk tier read, cold (read_slice)", disk["tier_read_cold_GBps"], "O_DIRECT read",
              direct.get("read_GBps", NAN), disk.get("read_vs_o_direct", NAN)],
             ["xxh3_64 of the same pages (verify_checksums)", bw["checksum_GBps"], "the load's copy",
              bw["load_same_node_GBps"], bw["checksum_GBps"] / bw["load_same_node_GBps"]]]
    print(table(["path", "GB/s", "limit", "limit GB/s", "x limit"], rows))
    print(f"checksum time / the load's copy time: {bw['checksum_vs_load_copy']:.2f}; O_DIRECT: "
          f"{direct.get('how', direct.get('error'))}; page format {bw['format']}")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = results["lengths"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for side in (*results["sides"], FLOOR):
        ax.plot(lengths, [results["median_ttft_s"][side][str(n)] * 1e3 for n in lengths], marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("tokens another engine computed (shared prefix)")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title("TTFT on an engine that did not compute the prefix")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def runs_table(runs: list[dict]) -> None:
    """The per-run medians side by side (TTFT per side and length, and the bandwidths), for results of several
    invocations: `connector_bench.py --runs A.json,B.json,C.json`."""
    from bench.common import table
    lengths = [str(n) for n in runs[0]["lengths"]]
    names = [*runs[0]["sides"], FLOOR, *(s for s in runs[0]["writers"] if s in runs[0]["median_ttft_s"])]
    fmt = lambda xs: " / ".join(f"{x * 1e3:,.3g}" if x < 1 else f"{x * 1e3:,.0f}" for x in xs)  # noqa: E731
    rows = [[name, *(fmt([r["median_ttft_s"][name][n] for r in runs]) for n in lengths)] for name in names]
    print(f"\nTTFT, ms, the median of each run's trials, runs {' / '.join(str(i + 1) for i in range(len(runs)))}:")
    print(table(["side", *(f"{n} tokens" for n in lengths)], rows))
    bw = [("NIXL READ, UCX default", lambda r: r["nixl"]["default"]["GBps"]),
          ("NIXL READ, UCX_TLS=tcp", lambda r: r["nixl"]["tcp"]["GBps"]),
          ("memcpy (index_select)", lambda r: r["nixl"]["memcpy_GBps"]),
          ("disk tier write", lambda r: r["disk"]["tier_write_GBps"]),
          ("O_DIRECT write", lambda r: r["disk"]["o_direct"]["write_GBps"]),
          ("disk tier read, cold", lambda r: r["disk"]["tier_read_cold_GBps"]),
          ("O_DIRECT read", lambda r: r["disk"]["o_direct"]["read_GBps"]),
          ("restart: prefixes hit again, %", lambda r: r["restart"]["percent"])]
    def cell(get, r) -> str:
        try:
            return f"{get(r):.3g}"
        except (KeyError, TypeError):  # a run without that side (LMCache's runs: no NIXL, no disk tier)
            return "n/a"
    print(table(["GB/s (the last row: %)", *(f"run {i + 1}" for i in range(len(runs)))],
                [[name, *(cell(get, r) for r in runs)] for name, get in bw]))
