"""The soak: load with faults of every kind against real processes, checked after each phase, and the
report that proves the service's promises (`make soak`; a short version runs in `make test`).

    python -m tests.soak [--scale 1.0] [--report bench/results/soak.md]

Phases: concurrent sessions with client faults (disconnects mid-Step, expired deadlines, a slow event
watcher, message floods up to the size limit); allocator SIGKILLs; Redis SIGKILLs; a full disk under
Redis; Redis SIGKILLs under --require-persistence; allocator SIGKILLs around Redis outages (during one,
during the resync, just after); the tenant timing probe. After every phase: the
the core's block invariants hold, every acknowledged allocation is still held with the same block ids, and
freeing everything drains the pool.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # we spawn processes after using gRPC

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvservice.core import FullAttentionSpec, KVCacheConfig  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp  # noqa: E402
from tests import faults  # noqa: E402
from tests.load_helpers import LoadClient, Supervisor, pool_stats, run_clients  # noqa: E402
from tests.redis_helpers import RedisServer  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402

POOL = "soak"
CONFIG = KVCacheConfig(1025, [FullAttentionSpec(16)])
MAX_MESSAGE_MB = 1


@dataclass
class Report:
    ops: int = 0
    faults: Counter = field(default_factory=Counter)
    checks: int = 0
    checks_passed: int = 0
    lost: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    probe: dict = field(default_factory=dict)
    phases: list[tuple[str, float]] = field(default_factory=list)

    def p99_ms(self) -> float:
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3 if s else float("nan")

    def table(self) -> str:
        rows = [("operations run", f"{self.ops:,}")]
        rows += [(f"faults injected: {kind}", str(n)) for kind, n in sorted(self.faults.items())]
        rows += [("invariant checks passed", f"{self.checks_passed}/{self.checks}"),
                 ("acknowledged allocations lost", str(len(self.lost))),
                 ("Step p99 under load", f"{self.p99_ms():.1f} ms ({len(self.latencies):,} steps)")]
        if self.probe:
            rows.append(("tenant timing probe (Lookup of a prompt another tenant cached - of an uncached one)",
                         f"{self.probe['diff_us']:+.1f} us on medians of {self.probe['median_us']:.0f} us "
                         f"({self.probe['samples']:,} samples each)"))
        width = max(len(r[0]) for r in rows)
        lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {a.ljust(width)} | {b} |" for a, b in rows]
        return "\n".join(lines)


def check(report: Report, supervisor: Supervisor, clients: list[LoadClient], phase: str) -> None:
    """After a phase: invariants, every acknowledged table, and a full drain."""
    admin = supervisor.proc.client(retries=5)
    for c in clients:
        report.lost += [f"{phase}: {x}" for x in c.lost()]
        report.ops += c.ops
        report.latencies += c.latencies
        c.ops, c.latencies = 0, []
    free, total, violation, _ = pool_stats(admin, POOL)
    report.checks += 1
    report.checks_passed += violation == ""
    faults.free_everything_drains(admin, POOL, clients)
    report.checks += 1
    report.checks_passed += 1
    admin.close()
    assert not report.lost, report.lost[:3]
    assert violation == "", violation


def phase_client_faults(report: Report, sup: Supervisor, scale: float) -> None:
    clients = [LoadClient(sup, POOL, seed=i) for i in range(8)]
    watcher = faults.SlowWatcher(sup.target)

    def chaos(done) -> None:
        for n in range(1, max(3, int(30 * scale)) + 1):
            kind = ("disconnect", "deadline", "flood")[n % 3]  # every kind, in turn
            if kind == "disconnect":
                faults.disconnect_mid_step(sup.target, POOL, f"chaos-d{n}")
                report.faults["client disconnect mid-Step"] += 1
            elif kind == "deadline":
                faults.deadline_expiry(sup.target, POOL, f"chaos-t{n}")
                report.faults["deadline expiry"] += 1
            else:
                faults.flood(sup.target, POOL, MAX_MESSAGE_MB << 20, threads=3)
                report.faults["message flood to the size limit"] += 1
            time.sleep(0.1)

    run_clients(clients, int(150 * scale), chaos)
    watcher.close()
    report.faults["slow event watcher"] += 1
    report.faults["concurrent sessions on one pool"] += len(clients)
    check(report, sup, clients, "client faults")
    for c in clients:
        c.close()


def phase_allocator_kills(report: Report, sup: Supervisor, scale: float) -> None:
    clients = [LoadClient(sup, POOL, seed=100 + i) for i in range(4)]
    rng = random.Random(2)
    kills = max(2, int(8 * scale))

    def chaos(done) -> None:
        for _ in range(kills):
            if done.wait(rng.uniform(0.3, 1.0)):
                return
            faults.kill_allocator(sup)
            report.faults["allocator SIGKILL"] += 1

    run_clients(clients, int(200 * scale), chaos)
    check(report, sup, clients, "allocator kills")
    for c in clients:
        c.close()


def phase_redis_faults(report: Report, sup: Supervisor, redis: RedisServer, scale: float, kind: str,
                       tmpfs: faults.TmpfsDir | None = None) -> None:
    clients = [LoadClient(sup, POOL, seed=200 + i) for i in range(3)]
    admin = sup.proc.client(retries=5)
    for _ in range(max(1, int(2 * scale))):
        run_clients(clients, 20)

        def during() -> None:
            run_clients(clients, 15)  # under --require-persistence these wait for Redis (UNAVAILABLE)

        if kind == "kill":
            faults.kill_redis(redis, admin, POOL, during)
            report.faults["redis SIGKILL" + (" (--require-persistence)" if "strict" in sup.args else "")] += 1
        else:
            faults.disk_full(tmpfs, admin, POOL, during)
            report.faults["disk full on the Redis data dir"] += 1
        # Every acknowledgement must survive a crash right after the outage.
        faults.kill_allocator(sup)
        report.faults["allocator SIGKILL"] += 1
    admin.close()
    check(report, sup, clients, f"redis {kind}")
    for c in clients:
        c.close()


def phase_kills_around_outages(report: Report, sup: Supervisor, redis: RedisServer, scale: float) -> None:
    """Under --require-persistence: the allocator SIGKILLed during Redis outages, during the resync that
    follows, and just after it, with clients running; nothing acknowledged may be lost."""
    clients = [LoadClient(sup, POOL, seed=300 + i) for i in range(3)]
    admin = sup.proc.client(retries=5)
    rng = random.Random(4)
    moments = list(faults.AROUND_OUTAGES) * max(1, int(2 * scale))

    def chaos(done) -> None:
        for moment in moments:
            if done.wait(rng.uniform(0.2, 0.6)):
                return
            report.faults[faults.kill_around_outage(sup, redis, admin, POOL, rng, moment)] += 1

    run_clients(clients, 30, chaos)
    admin.close()
    check(report, sup, clients, "kills around outages")
    for c in clients:
        c.close()


def tenant_probe(report: Report, tmp: Path, samples: int) -> None:
    (tmp / "tokens").write_text("tok-a tenant-a\ntok-b tenant-b\n")
    proc = start_server("--token-file", str(tmp / "tokens"), log_dir=tmp)
    try:
        a, b = proc.client("tok-a"), proc.client("tok-b")
        a.register_pool("probe", KVCacheConfig(4097, [FullAttentionSpec(16)]), max_model_len=4096)
        # b cannot name a's pool; it probes through its own, of the same layout (its Lookup covers both only
        # if the server leaked a's pools to it).
        b.register_pool("probe-b", KVCacheConfig(4097, [FullAttentionSpec(16)]), max_model_len=4096)
        rng = random.Random(3)
        cached = [rng.randrange(32000) for _ in range(2048)]
        a.step("probe", [AddRequestOp("secret", token_ids=cached), AllocateOp("secret", num_new_tokens=2048),
                         FreeOp("secret")])
        assert a.lookup(cached + [1], pool_ids=["probe"]).tokens("probe") == 2048  # cached for tenant a
        uncached = [rng.randrange(32000) for _ in range(2048)]
        hashes = {"cached": b.hash_prompt(cached), "uncached": b.hash_prompt(uncached)}
        times: dict[str, list[float]] = {"cached": [], "uncached": []}
        for i in range(samples):
            for kind in (("cached", "uncached") if i % 2 else ("uncached", "cached")):
                t0 = time.perf_counter()
                found = b.lookup(block_hashes=hashes[kind], num_tokens=2048)
                times[kind].append(time.perf_counter() - t0)
                assert [(h.pool_id, h.num_cached_tokens) for h in found.hits] == [("probe-b", 0)]  # never a's
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        report.probe = {"diff_us": med["cached"] - med["uncached"], "median_us": med["uncached"],
                        "samples": samples, "cached_median_us": med["cached"]}
        a.close()
        b.close()
    finally:
        proc.stop()


def run(scale: float = 1.0, tmp: Path | None = None, progress=print) -> Report:
    tmp = tmp or Path(tempfile.mkdtemp(prefix="kvservice-soak-"))
    report = Report()
    redis = RedisServer(tmp / "redis", appendfsync="always")
    redis.start()
    sups: list[Supervisor] = []
    try:
        args = ("--redis-url", redis.url, "--redis-namespace", "soak", "--snapshot-every", "200",
                "--max-message-mb", str(MAX_MESSAGE_MB), "--session-ttl", "60")
        sup = Supervisor(args, tmp)
        sups.append(sup)
        admin = sup.proc.client()
        admin.register_pool(POOL, CONFIG, max_model_len=2048)
        admin.close()
        for name, fn in [("client faults + concurrency", lambda: phase_client_faults(report, sup, scale)),
                         ("allocator SIGKILL", lambda: phase_allocator_kills(report, sup, scale)),
                         ("redis SIGKILL", lambda: phase_redis_faults(report, sup, redis, scale, "kill"))]:
            t0 = time.monotonic()
            progress(f"soak: {name} ...")
            fn()
            report.phases.append((name, time.monotonic() - t0))
        if faults.TmpfsDir.available():
            t0 = time.monotonic()
            progress("soak: disk full on the Redis data dir ...")
            tmpfs = faults.TmpfsDir(tmp / "tmpfs", size="8m")
            # everysec: with "always" Redis exits on an AOF write error; with everysec it refuses writes
            # (MISCONF) until the disk has room again.
            small = RedisServer(tmpfs.path, appendfsync="everysec")
            small.start()
            try:
                disk_sup = Supervisor(("--redis-url", small.url, "--redis-namespace", "disk", "--snapshot-every",
                                       "100000", "--session-ttl", "60"), tmp)
                sups.append(disk_sup)
                c = disk_sup.proc.client()
                c.register_pool(POOL, CONFIG, max_model_len=2048)
                c.close()
                phase_redis_faults(report, disk_sup, small, scale, "disk", tmpfs)
            finally:
                small.stop()
                tmpfs.close()
            report.phases.append(("disk full", time.monotonic() - t0))
        else:
            progress("soak: disk-full phase skipped (needs root to mount a tmpfs)")
        t0 = time.monotonic()
        progress("soak: Redis SIGKILL under --require-persistence ...")
        strict = Supervisor(("--redis-url", redis.url, "--redis-namespace", "strict", "--require-persistence",
                             "--session-ttl", "60"), tmp)
        sups.append(strict)
        c = strict.proc.client()
        c.register_pool(POOL, CONFIG, max_model_len=2048)
        c.close()
        phase_redis_faults(report, strict, redis, scale, "kill")
        report.phases.append(("require-persistence", time.monotonic() - t0))
        t0 = time.monotonic()
        progress("soak: allocator SIGKILLs around Redis outages (--require-persistence) ...")
        phase_kills_around_outages(report, strict, redis, scale)
        report.phases.append(("kills around outages", time.monotonic() - t0))
        progress("soak: tenant timing probe ...")
        tenant_probe(report, tmp, samples=max(200, int(2000 * scale)))
    finally:
        for s in sups:
            s.stop()
        redis.stop()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="load and fault counts (1.0: about 5 minutes)")
    parser.add_argument("--report", default=str(Path(__file__).resolve().parent.parent / "bench" / "results" /
                                                "soak.md"))
    args = parser.parse_args()
    start = time.monotonic()
    report = run(args.scale)
    text = report.table()
    elapsed = time.monotonic() - start
    print()
    print(text)
    print(f"soak finished in {elapsed:.0f} s: " + ", ".join(f"{n} {t:.0f} s" for n, t in report.phases))
    Path(args.report).write_text(f"{text}\n\n`python -m tests.soak --scale {args.scale}` in {elapsed:.0f} s\n")
    return 0 if not report.lost and report.checks == report.checks_passed else 1


if __name__ == "__main__":
    sys.exit(main())
