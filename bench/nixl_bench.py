"""READ bandwidth of the store tier's NIXL data plane between two processes, next to a memcpy of the same bytes.

For each page size, a store process exports a segment of `--total-mib` of pages (kvservice.blockstore.transports
NixlExport) and an engine-side process READs all of them, in a shuffled order (scattered: about one descriptor
per page) with their metadata rows, into a registered torch tensor: one NIXL READ, timed from `read()` to the
end of `Ticket.wait()`; connection set-up is not timed (a one-page READ first). Under UCX's default transports
(one host: cma) and UCX_TLS=tcp (what UCX does between hosts without RDMA). The memcpy is a torch
`index_select` of the same pages in the same order in this process. Medians of `--runs`; every READ's bytes are
checked (crc32 against the store's). Processes: tests/nixl_peers.py.

    python bench/nixl_bench.py [--total-mib 256] [--page-kib 1024 256 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import table, write_json  # noqa: E402
from tests.nixl_peers import Peer  # noqa: E402

CONFIGS = ["default", "tcp"]


def memcpy_gbps(num_pages: int, page_bytes: int, ids: np.ndarray, runs: int) -> list[float]:
    src = torch.randint(0, 256, (num_pages + 1, page_bytes), dtype=torch.uint8)
    dst = torch.empty((len(ids), page_bytes), dtype=torch.uint8)
    index = torch.from_numpy(ids)
    torch.index_select(src, 0, index, out=dst)  # first touch of dst out of the timing
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        torch.index_select(src, 0, index, out=dst)
        out.append(dst.numel() / (time.perf_counter() - start) / 1e9)
    return out


def nixl_gbps(tls: str, num_pages: int, page_bytes: int, ids: np.ndarray, runs: int, workdir: Path) -> dict:
    logs = Path(tempfile.mkdtemp(prefix=f"nixl-{tls}-", dir=workdir))
    store = Peer(["store", "--dir", str(workdir), "--num-blocks", str(num_pages + 1), "--page-bytes",
                  str(page_bytes)], tls, logs / "store.log")
    reader = Peer(["reader"], tls, logs / "reader.log")
    try:
        info = store.reply(120)["info"]
        reader.reply(120)
        r = reader.ask("bench", within=600, info=info, ids=ids.tolist(), runs=runs)
        if "error" in r:
            return {"error": r["error"]}
        want = store.ask("crc", within=120, ids=ids.tolist())["crc"]
        nbytes = len(ids) * page_bytes
        return {"gbps": [nbytes / s / 1e9 for s in r["secs"]], "bytes_ok": all(c == want for c in r["crcs"])}
    finally:
        reader.stop()
        store.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--page-kib", type=int, nargs="+", default=[1024, 256, 64])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="nixl-bench-", dir="/dev/shm") as workdir:
        for page_kib in args.page_kib:
            page_bytes = page_kib << 10
            num_pages = (args.total_mib << 20) // page_bytes
            ids = np.random.default_rng(0).permutation(np.arange(1, num_pages + 1))
            entry = {"page_kib": page_kib, "num_pages": num_pages,
                     "memcpy_gbps": memcpy_gbps(num_pages, page_bytes, ids, args.runs)}
            for tls in CONFIGS:
                entry[f"nixl_{tls}"] = nixl_gbps(tls, num_pages, page_bytes, ids, args.runs, Path(workdir))
            results.append(entry)
            mem = statistics.median(entry["memcpy_gbps"])
            row = [f"{page_kib} KiB x {num_pages}", mem]
            for tls in CONFIGS:
                r = entry[f"nixl_{tls}"]
                if "error" in r:
                    row += ["failed", r["error"][:40]]
                else:
                    med = statistics.median(r["gbps"])
                    row += [med if r["bytes_ok"] else "BAD BYTES", f"{med / mem:.2f}x"]
            rows.append(row)
            print(f"{page_kib} KiB pages done", flush=True)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"\nREAD of {args.total_mib} MiB of scattered pages (and their metadata), GB/s, median of {args.runs} "
          f"(load average {load[0]} before, {load[1]} after, on {os.cpu_count()} cores)")
    print(table(["pages", "memcpy (torch index_select)", "NIXL, UCX default", "x memcpy", "NIXL, UCX_TLS=tcp",
                 "x memcpy"], rows))
    path = write_json("nixl", {"total_mib": args.total_mib, "runs": args.runs, "load_average": load,
                               "cpus": os.cpu_count(), "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
